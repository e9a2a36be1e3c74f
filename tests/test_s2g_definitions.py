"""The S2G study's definitions (issue 29): hand-made state sets with known answers, an
independent implementation checked against ``s2g_judges.json`` on a recorded run, ties at the
threshold in the live loop, the replay and the sweep (issue 30), and the bench without searches.

The oracle below is written from the definitions in plain Python; it imports nothing from
``ragfast.methods.s2g.study``.
"""
from __future__ import annotations

import json
import math
import re
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from ragfast.judges.base import Judge
from ragfast.models.scripted import ScriptedGenerator
from ragfast.methods.s2g import study
from ragfast.methods.s2g.study import ThresholdError

TOL = 1e-9


# -- the oracle: the study's definitions, plainly --------------------------------------------
def o_prob(s):
    s = max(-40.0, min(40.0, s))
    return 1.0 / (1.0 + math.exp(-s))


def o_ap(pairs):
    """pairs = [(label, score)] in input order."""
    P = sum(y for y, _ in pairs)
    if P == 0:
        return 0.0
    ranked = sorted(pairs, key=lambda p: -p[1])  # sorted() is stable: ties keep input order
    tp, total = 0, 0.0
    for k, (y, _) in enumerate(ranked, 1):
        if y == 1:
            tp += 1
            total += tp / k
    return total / P


def o_brier(pairs):
    return sum((o_prob(s) - y) ** 2 for y, s in pairs) / len(pairs)


def o_ece(pairs):
    bins = [[] for _ in range(10)]
    for y, s in pairs:
        p = o_prob(s)
        for k in range(10):
            if k / 10 <= p < (k + 1) / 10 or (k == 9 and p == 1.0):
                bins[k].append((y, p))
                break
    n = len(pairs)
    return sum(len(b) / n * abs(sum(y for y, _ in b) / len(b) - sum(p for _, p in b) / len(b)) for b in bins if b)


def o_counts(pairs, th):
    stops = [y for y, s in pairs if s >= th]
    return len(stops), sum(stops)


def o_recall_at(pairs, p):
    P = sum(y for y, _ in pairs)
    best = None
    for c in sorted({s for _, s in pairs}):
        n, tp = o_counts(pairs, c)
        if tp / n >= p:
            key = (tp, tp / n, c)
            best = key if best is None or key > best else best
    if best is None or best[0] == 0:
        return (0.0 if P else float("nan")), math.inf
    return best[0] / P, best[2]


def o_frozen(pairs, p=0.90, min_stops=10):
    ys = [y for y, _ in pairs]
    if not pairs or sum(ys) in (0, len(ys)):
        return "error"
    best = None
    for c in sorted({s for _, s in pairs}):
        n, tp = o_counts(pairs, c)
        if n >= min_stops and tp / n >= p:
            key = (tp, tp / n, c)
            best = key if best is None or key > best else best
    if best is None:
        return max(s for _, s in pairs) + 1.0, 0
    return best[2], o_counts(pairs, best[2])[0]


def o_system(lines, judge, label, th):
    """Per question: first state 0..S-1 scoring >= th stops there with the probe's EM."""
    qs = {}
    for x in lines:
        qs.setdefault(x["question_id"], []).append(x)
    em, nat_em, saved, safe, unsafe, delays = [], [], [], 0, 0, []
    for q, xs in qs.items():
        S, nem = xs[0]["native_searches"], xs[0]["native_em"]
        nat_em.append(nem)
        first_safe = next((x["state"] for x in xs if x["state"] is not None and x["labels"].get(label) == 1), None)
        stop = next((x for x in xs if x["state"] is not None and x["scores"].get(judge) is not None
                     and x["scores"][judge] >= th), None)
        if stop is None:
            em.append(nem)
            saved.append(0)
            continue
        em.append(stop["probe_em"])
        saved.append(S - stop["state"])
        if stop["labels"].get(label) == 1:
            safe += 1
            delays.append(stop["state"] - first_safe)
        elif stop["labels"].get(label) == 0:
            unsafe += 1
    n = len(qs)
    return {"em": sum(em) / n, "native_em": sum(nat_em) / n, "searches_saved": sum(saved) / n,
            "safe_early_stops": safe, "unsafe_early_stops": unsafe, "early_stops": sum(1 for s in saved if s > 0),
            "first_safe_stop_delay": sum(delays) / len(delays) if delays else None}


def _pairs(lines, judge, label, split):
    return [(x["labels"][label], x["scores"][judge]) for x in lines
            if x["split"] == split and x["state"] is not None and x["scores"].get(judge) is not None
            and x["labels"].get(label) is not None]


def _close(a, b):
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return a is None
    if isinstance(b, float) and math.isinf(b):
        return a == "inf"
    return a is not None and abs(float(a) - float(b)) <= TOL


# -- hand-made state sets with known answers -------------------------------------------------
def test_stop_ap_keeps_ties_in_input_order():
    # a positive first in a tied block ranks first; last in it, third
    assert study.stop_ap([1, 0, 0, 1], [1, 1, 1, 0]) == pytest.approx((1 / 1 + 2 / 4) / 2, abs=TOL)
    assert study.stop_ap([0, 0, 1, 1], [1, 1, 1, 0]) == pytest.approx((1 / 3 + 2 / 4) / 2, abs=TOL)
    # sklearn merges the block (the extra view): precision 1/3 at recall 1/2 whatever the order
    r = study.ranking_metrics([1, 0, 0, 1], [1.0, 1.0, 1.0, 0.0])
    assert r["extra_ap_merged_ties_sklearn"] == pytest.approx(0.5 * 1 / 3 + 0.5 * 2 / 4, abs=TOL)
    assert study.stop_ap([0, 0], [0.3, 0.1]) == 0.0  # no positive: 0
    assert study.stop_ap([], []) == 0.0


def test_probabilities_clip_and_ece_bin_edges():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # clipping: no overflow on a huge negative score
        p = study.probabilities([-1000.0, 0.0, 1000.0])
    assert p[0] == pytest.approx(1.0 / (1.0 + math.exp(40.0)), rel=1e-12) and p[1] == 0.5 and p[2] == 1.0
    logit = lambda q: math.log(q / (1 - q))  # noqa: E731
    # p = 0.5 opens bin [0.5, 0.6): with p = 0.55 there, mean p 0.525, frac right 0.5
    ece, bins = study.ece10([1, 0], [0.0, logit(0.55)])
    assert ece == pytest.approx(0.025, abs=TOL) and bins[5]["count"] == 2 and bins[4]["count"] == 0
    # p = 1.0 falls in the closed last bin [0.9, 1.0]
    ece, bins = study.ece10([1, 1, 0], [1000.0, logit(0.95), logit(0.05)])
    assert bins[9]["count"] == 2 and bins[0]["count"] == 1
    assert ece == pytest.approx(2 / 3 * abs(1 - (1.0 + 0.95) / 2) + 1 / 3 * 0.05, abs=TOL)
    assert study.brier_score([1, 0], [0.0, 0.0]) == pytest.approx(0.25, abs=TOL)


def test_recall_at_precision_candidates_and_tie_break():
    y, s = [1, 1, 0, 0], [0.9, 0.8, 0.8, 0.3]
    assert study.recall_at_precision(y, s, 0.90) == (0.5, 0.9)  # 0.8 stops 3 at precision 2/3
    assert study.recall_at_precision(y, s, 0.60) == (1.0, 0.8)
    # equal recall at 0.9 and 0.7: the higher precision (and threshold) wins
    assert study.recall_at_precision([1, 0, 0], [0.9, 0.7, 0.1], 0.5) == (1.0, 0.9)
    # nothing reaches the precision: only "never stop"
    assert study.recall_at_precision([0, 1], [0.9, 0.1], 0.9) == (0.0, math.inf)


def test_frozen_threshold_feasible_infeasible_one_class():
    # 12 states: the 10 highest all right -> threshold at the 10th, precision 1, 10 STOP states
    s = list(np.arange(12, dtype=float))
    y = [0, 0] + [1] * 10
    ft = study.frozen_threshold(y, s)
    assert (ft.threshold, ft.feasible, ft.precision, ft.stops, ft.recall) == (2.0, True, 1.0, 10, 1.0)
    # precision 1 but only 5 STOP states reach it: no feasible candidate -> highest score + 1
    y2 = [0] * 7 + [1] * 5
    ft2 = study.frozen_threshold(y2, s)
    assert ft2.threshold == 12.0 and not ft2.feasible and ft2.stops == 0
    assert o_frozen(list(zip(y2, s))) == (12.0, 0)
    # 10 stops at precision exactly 0.9 is feasible (>=)
    y3 = [0, 0, 0] + [1] * 9  # threshold 2: 9 of 10 right; threshold 3: only 9 STOP states
    ft3 = study.frozen_threshold(y3, s)
    assert (ft3.threshold, ft3.stops, ft3.precision) == (2.0, 10, 0.9) and o_frozen(list(zip(y3, s))) == (2.0, 10)
    with pytest.raises(ThresholdError, match="one label class"):
        study.frozen_threshold([0, 0, 0], [1.0, 2.0, 3.0])
    with pytest.raises(ThresholdError, match="one label class"):
        study.frozen_threshold([1, 1], [1.0, 2.0])
    with pytest.raises(ThresholdError, match="no validation state"):
        study.frozen_threshold([], [])


def _line(q, split, state, S, score, label, em, nem=0.0):
    return {"question_id": q, "split": split, "state": state, "native_searches": S, "native_em": nem,
            "native_answer": "n", "scores": {} if state is None else {"j": score},
            "labels": {} if state is None else {"probe": label}, "probe_answer": "a", "probe_em": em}


def test_system_level_on_a_hand_made_set():
    lines = [  # q0: safe from state 1, stops at 2 (delay 1); q1: unsafe stop at 0; q2: never; q3: no search
        _line("q0", "test", 0, 3, 0.1, 0, 0.0), _line("q0", "test", 1, 3, 0.4, 1, 1.0),
        _line("q0", "test", 2, 3, 0.5, 1, 1.0),
        _line("q1", "test", 0, 2, 0.5, 0, 0.0, nem=1.0), _line("q1", "test", 1, 2, 0.9, 1, 1.0, nem=1.0),
        _line("q2", "test", 0, 1, 0.2, 1, 1.0),
        _line("q3", "test", None, 0, None, None, None, nem=1.0)]
    a = study.state_arrays(lines)
    r = study.system_metrics(a, "j", "probe", 0.5, n_resamples=200)
    assert (r["early_stops"], r["safe_early_stops"], r["unsafe_early_stops"]) == (2, 1, 1)
    assert r["searches_saved"] == pytest.approx((1 + 2 + 0 + 0) / 4, abs=TOL)
    assert r["first_safe_stop_delay"] == 1.0  # over the one safe stop only
    assert r["em"] == pytest.approx((1 + 0 + 0 + 1) / 4, abs=TOL) and r["native_em"] == 0.5
    assert r["correct_to_wrong"] == 1 and r["wrong_to_correct"] == 1
    ci = r["searches_saved_ci"]
    assert ci["low"] <= r["searches_saved"] <= ci["high"]
    o = o_system(lines, "j", "probe", 0.5)
    for k in ("em", "native_em", "searches_saved", "safe_early_stops", "unsafe_early_stops", "early_stops",
              "first_safe_stop_delay"):
        assert r[k] == pytest.approx(o[k], abs=TOL), k



def test_per_question_first_crossing_precision_by_hand():
    # the judges file's extra view: right first crossings / questions that cross, each question's
    # first state with score >= threshold (a tie stops, as the study defines it) counted once.
    # At 0.5: q0 first crosses at state 2 (a tie, right), q1 at state 0 (a tie, wrong; its later
    # right state is not counted again), q2 never, q3 has no state, q4 at state 0 (right) -> 2/3
    lines = [_line("q0", "test", 0, 3, 0.1, 0, 0.0), _line("q0", "test", 1, 3, 0.4, 1, 1.0),
             _line("q0", "test", 2, 3, 0.5, 1, 1.0),
             _line("q1", "test", 0, 2, 0.5, 0, 0.0), _line("q1", "test", 1, 2, 0.9, 1, 1.0),
             _line("q2", "test", 0, 1, 0.2, 1, 1.0), _line("q3", "test", None, 0, None, None, None),
             _line("q4", "test", 0, 1, 0.7, 1, 1.0)]
    out = study.evaluate_lines(lines, given_threshold=0.5, n_resamples=20)
    assert (out["min_precision"], out["min_stops"]) == (0.90, 10)  # the study's default bar
    assert out["questions"] == {"test": 5} and out["states"] == {"test": 7}  # q3 has no state
    e = out["judges"]["j"]["probe"]
    assert e["test"]["extra_first_crossing_precision_per_question"] == pytest.approx(2 / 3)
    # above every score: no question crosses, the view is undefined
    e = study.evaluate_lines(lines, given_threshold=1.0, n_resamples=20)["judges"]["j"]["probe"]
    assert math.isnan(e["test"]["extra_first_crossing_precision_per_question"])

# -- a recorded run: every figure of s2g_judges.json against the oracle ----------------------
class _Judge(Judge):
    """Lexical overlap of question and evidence, 0 for state 0: deterministic, no model."""

    name, meaningful = "overlap (test)", False

    def __init__(self, step=None):
        self.step = step

    def stop_scores(self, states, *, ledger=None, question_ids=None):
        out = []
        for s in states:
            q = set(re.findall(r"[a-z]{4,}", s.question.lower()))
            ev = set(re.findall(r"[a-z]{4,}", " ".join(s.evidence).lower()))
            x = len(q & ev) / max(1, len(q)) + 0.05 * len(s.evidence) if s.evidence else 0.0
            out.append(round(x / self.step) * self.step if self.step else x)  # step: many ties
        return np.array(out)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, monkeypatch_module):
    import ragfast.runner.slots as slots_mod
    from ragfast.commands.s2g import run_s2g_command
    from ragfast.methods.s2g.judges import compare_judges

    monkeypatch_module.setattr(slots_mod, "judge", lambda spec, **kw: _Judge())
    out = tmp_path_factory.mktemp("s2g") / "run"
    # validation questions 40..55: with seed 2 the scripted reasoner's state-0 probe of question 46
    # is right, the one positive before a native stop (see tests/test_s2g.py)
    run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(out), retriever="bm25", val_data="hotpotqa-dev",
                    val_offset=40, val_limit=16, offset=56, limit=24, batch_size=16, live=False, n_resamples=200,
                    progress=False, seed=2)
    # a low precision bar so that the frozen thresholds stop early on test (system level exercised)
    compare_judges(out, ["recorded", ("coarse", _Judge(step=0.25)), ("hash", _HashJudge())], labels="gold",
                   min_precision=0.02, min_stops=2, n_resamples=50)
    return out


class _HashJudge(Judge):
    """Deterministic pseudo-random scores per (question, state), rounded: ties across states."""

    name, meaningful = "hash (test)", False

    def stop_scores(self, states, *, ledger=None, question_ids=None):
        import zlib

        return np.array([round((zlib.crc32(f"{s.question}|{len(s.evidence)}".encode()) % 1000) / 100 - 5, 1)
                         for s in states])


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_judges_file_equals_the_oracle_on_the_states_file(recorded_run):
    lines = [json.loads(x) for x in (recorded_run / "s2g_states.jsonl").read_text().splitlines()]
    js = json.loads((recorded_run / "s2g_judges.json").read_text())
    thr = json.loads((recorded_run / "s2g_threshold.json").read_text())
    # the export: states 0..S-1 in question then state order, a null line for S = 0
    by_q = {}
    for x in lines:
        by_q.setdefault(x["question_id"], []).append(x["state"])
    for x in lines:
        assert set(x) >= {"question_id", "split", "state", "native_searches", "scores", "labels", "probe_answer",
                          "probe_em"}
    for q, st in by_q.items():
        S = next(x["native_searches"] for x in lines if x["question_id"] == q)
        assert st == (list(range(S)) if S else [None])
    assert {x["split"] for x in lines} == {"val", "test"}
    assert set(js["judges"]) == {"encoder", "coarse", "hash"} and {"probe", "gold"} <= set(js["judges"]["encoder"])
    mp, ms = js["min_precision"], js["min_stops"]
    checked, stopped = 0, 0
    for judge, per in js["judges"].items():
        for label, e in per.items():
            for split in ("val", "test"):
                pairs = _pairs(lines, judge, label, split)
                r = e[split]
                assert r["states"] == len(pairs)
                assert _close(r["ap"], o_ap(pairs)), (judge, label, split)
                assert _close(r["brier"], o_brier(pairs)) and _close(r["ece10"], o_ece(pairs))
                for p, k in ((0.90, "90"), (0.95, "95")):
                    rec, th = o_recall_at(pairs, p)
                    assert _close(r[f"recall_at_p{k}"], rec) and _close(r[f"threshold_at_p{k}"], th)
                checked += 1
            fz = o_frozen(_pairs(lines, judge, label, "val"), mp, ms)
            if fz == "error":
                assert "one label class" in e["error"] and "system" not in e["test"]
                continue
            th, stops = fz
            assert _close(e["threshold"]["threshold"], th) and e["threshold"]["val_stops"] == stops
            o = o_system([x for x in lines if x["split"] == "test"], judge, label, th)
            sy = e["test"]["system"]
            for k, v in o.items():
                assert _close(sy[k], v), (judge, label, k)
            stopped += sy["early_stops"]
            if judge == "encoder" and label == "probe" and thr["min_precision"] == mp:
                assert _close(thr["threshold"], th)  # run s2g froze the same threshold
    assert checked == 12 and stopped > 0


def test_report_s2g_gives_the_run_s_threshold(recorded_run, tmp_path):
    """bench, run s2g and report s2g: one definition, one threshold on the same validation states."""
    import shutil

    from ragfast.commands.report import report_s2g
    from ragfast.methods.s2g.study import choose_threshold

    d = tmp_path / "copy"
    shutil.copytree(recorded_run, d)
    thr = json.loads((d / "s2g_threshold.json").read_text())
    ev = report_s2g(d, n_resamples=100)
    lines = study.read_state_lines(d / "s2g_states.jsonl")
    assert _close(thr["threshold"], choose_threshold(lines, "encoder").threshold)
    assert _close(ev["study"]["judges"]["encoder"]["probe"]["threshold"]["threshold"], float(thr["threshold"]))
    assert "as the study defines them" in (d / "s2g_report.md").read_text()


def test_bench_freezes_the_run_s_threshold_on_the_same_validation_states(recorded_run, tmp_path):
    import ragfast.runner.slots as slots_mod
    from ragfast.comparison.pipeline import make_config, select_s2g_threshold
    from ragfast.data import load_qa, sample

    qs = load_qa(sample("hotpotqa-dev"))
    ret = slots_mod.retriever_over("bm25", qs, progress=False)  # what run s2g built over the same file
    cfg = make_config(data=str(sample("hotpotqa-dev")), val_data=str(sample("hotpotqa-dev")), corpus=["contexts"],
                      val_offset=40, val_limit=16, offset=56, limit=24, out=str(tmp_path), n_resamples=100,
                      batch_size=16)
    slots = SimpleNamespace(questions=qs[56:80], make_generator=lambda: ScriptedGenerator(seed=2), retriever=ret,
                            judge=_Judge())
    info = select_s2g_threshold(cfg, slots, tmp_path)
    run = json.loads((recorded_run / "s2g_threshold.json").read_text())
    bench_val = [(x["question_id"], x["state"], list(x["scores"].values()), x["labels"]["probe"])
                 for x in study.read_state_lines(tmp_path / "s2g_states.jsonl") if x["state"] is not None]
    run_val = [(x["question_id"], x["state"], [x["scores"]["encoder"]], x["labels"]["probe"])
               for x in study.read_state_lines(recorded_run / "s2g_states.jsonl")
               if x["split"] == "val" and x["state"] is not None]
    assert bench_val == run_val
    for k in ("threshold", "feasible", "val_states", "val_positives", "val_stops", "min_stops"):
        assert info[k] == run[k], k


# -- ties at the threshold: score == threshold stops (issue 30) ------------------------------
@pytest.fixture(scope="module")
def small_native():
    from ragfast.data import corpus_from_contexts, load_qa, sample
    from ragfast.methods.s2g.states import record_states
    from ragfast.methods.searchr1.loop import SearchR1Config, run_searchr1
    from ragfast.retrieval.bm25 import BM25Retriever

    qs = load_qa(sample("hotpotqa-dev"))[:12]
    ret = BM25Retriever.build(corpus_from_contexts(qs))
    cfg = SearchR1Config(batch_size=12, topk=2)
    native = run_searchr1(qs, ScriptedGenerator(), ret, cfg)
    rec = record_states(native, _Judge(), ScriptedGenerator())
    # a question with >= 3 states whose scores rise: its state-2 score as the threshold
    b = next(i for i, t in enumerate(native) if t.searches >= 3 and rec.scores[i, 1] < rec.scores[i, 2])
    return qs, ret, cfg, native, rec, b, float(rec.scores[b, 2])


def test_live_loop_stops_at_a_score_equal_to_the_threshold(small_native):
    from ragfast.methods.s2g.loop import run_s2g

    qs, ret, cfg, _, _, b, thr = small_native
    live = run_s2g(qs, ScriptedGenerator(), ret, _Judge(), thr, cfg)
    assert live[b].extra["judge_scores"][2] == thr
    assert live[b].extra["judge_stop_state"] == 2 and live[b].stop_reason == "judge" and live[b].searches == 2


def test_replay_and_sweep_stop_at_a_score_equal_to_the_threshold(small_native):
    from ragfast.methods.s2g.states import replay
    from ragfast.methods.s2g.policy import sweep

    _, _, _, native, rec, b, thr = small_native
    assert replay(rec, thr).stop_state[b] == 2
    for backend in ("ref", "cpp"):
        assert sweep(rec.live_scores(), [thr], rec.lengths, backend=backend)[b, 0] == 2
        # just above the recorded score, state 2 no longer stops
        assert sweep(rec.live_scores(), [np.nextafter(thr, np.inf)], rec.lengths, backend=backend)[b, 0] != 2
    # the study's system level too: state 2 of question b scores exactly the threshold
    lines = study.state_lines(rec, "j")
    a = study.state_arrays([x for x in lines if x["question_id"] == native[b].id])
    assert study.system_metrics(a, "j", "probe", thr, n_resamples=10)["searches"] == 2.0


# -- bench: no validation question searches ---------------------------------------------------
def test_bench_threshold_and_analysis_without_any_search(tmp_path):
    from ragfast.comparison.pipeline import make_config, s2g_analysis, select_s2g_threshold
    from ragfast.data import corpus_from_contexts, load_qa, sample
    from ragfast.methods.searchr1.loop import SearchR1Config, run_searchr1
    from ragfast.retrieval.bm25 import BM25Retriever

    qs = load_qa(sample("hotpotqa-dev"))[:10]
    ret = BM25Retriever.build(corpus_from_contexts(qs))
    cfg = make_config(data=str(sample("hotpotqa-dev")), val_data=str(sample("hotpotqa-dev")), corpus=["contexts"],
                      val_offset=0, val_limit=5, offset=5, limit=5, out=str(tmp_path), n_resamples=100)
    never = lambda: ScriptedGenerator(max_searches=0)  # noqa: E731  answers at once: no state anywhere
    slots = SimpleNamespace(questions=qs[5:], make_generator=never, retriever=ret, judge=_Judge())
    info = select_s2g_threshold(cfg, slots, tmp_path)
    assert info["threshold"] == "inf" and "no validation state" in info["reason"]
    assert "no AP, Brier or calibration" in info["val_ranking_missing"]
    native = [t.to_dict() for t in run_searchr1(qs[5:], never(), ret, SearchR1Config(max_turns=4))]
    an = s2g_analysis(cfg, slots, native, math.inf, tmp_path)
    assert "no calibration figure" in an["calibration_missing"]
    js = json.loads((tmp_path / "s2g_judges.json").read_text())
    assert js["states"] == {"val": 0, "test": 0}


def test_teacher_labels_join_the_states_file(recorded_run, tmp_path):
    import shutil

    from ragfast.methods.s2g.labelling import LabelledState
    from ragfast.methods.s2g.study_files import write_judges

    d = tmp_path / "copy"
    shutil.copytree(recorded_run, d)
    lines = study.read_state_lines(d / "s2g_states.jsonl")
    real = [x for x in lines if x["state"] is not None]
    # the teacher calls every odd-numbered state right; states 1..S as label-states writes them
    lab = [LabelledState(x["question_id"], x["state"], "q", [], [], x["split"], labels={"teacher": x["state"] % 2})
           for x in real if x["state"] >= 1]
    (d / "labelled_states.jsonl").write_text("".join(json.dumps(s.to_dict()) + "\n" for s in lab))
    js = write_judges(d, n_resamples=50)
    back = study.read_state_lines(d / "s2g_states.jsonl")
    assert [x["labels"].get("teacher") for x in back if x["state"] is not None] == \
        [x["state"] % 2 if x["state"] >= 1 else None for x in real]
    r = js["judges"]["encoder"]["teacher"]["test"]
    pairs = _pairs(back, "encoder", "teacher", "test")
    assert r["states"] == len(pairs) and _close(r["ap"], o_ap(pairs))


# -- evaluate_lines' threshold branches and the system level's defaults, by hand ------------
def _line2(q, split, state, S, score, label, em, nem=0.0):
    """A line with two label sources (probe and gold, equal here)."""
    x = _line(q, split, state, S, score, label, em, nem)
    if state is not None:
        x["labels"]["gold"] = label
    return x


# test: t0 is safe from state 0 and first crosses 0.5 at state 2 (delay 2: the first safe state,
# not a later one); t1 crosses at state 0 (0.7: a tie at threshold 0.7), wrongly; t2 never; t3 no search
_TEST = [_line2("t0", "test", 0, 3, 0.1, 1, 1.0), _line2("t0", "test", 1, 3, 0.2, 1, 1.0),
         _line2("t0", "test", 2, 3, 0.6, 1, 1.0),
         _line2("t1", "test", 0, 2, 0.7, 0, 0.0, nem=1.0), _line2("t1", "test", 1, 2, 0.9, 1, 1.0, nem=1.0),
         _line2("t2", "test", 0, 1, 0.3, 1, 1.0), _line2("t3", "test", None, 0, None, None, None)]
# validation, one state per question: 0.9(1) 0.8(1) 0.7(1) 0.6(0) 0.5(1) 0.4(0). At precision >= 0.9
# with >= 2 stops, 0.8 (2 of 2) and 0.7 (3 of 3) qualify: 0.7, recall 3/4. With >= 10 stops none does.
_VAL = [_line2(f"v{i}", "val", 0, 1, s, y, 0.0) for i, (s, y) in
        enumerate([(0.9, 1), (0.8, 1), (0.7, 1), (0.6, 0), (0.5, 1), (0.4, 0)])]


def test_system_level_delay_counts_from_the_first_safe_state_and_defaults():
    from ragfast.scoring.stats import paired_bootstrap

    a = study.state_arrays(_TEST)
    r = study.system_metrics(a, "j", "probe", 0.5)
    assert (r["early_stops"], r["safe_early_stops"], r["unsafe_early_stops"]) == (2, 1, 1)
    assert r["first_safe_stop_delay"] == 2.0  # t0: stop at 2, first safe state 0
    native, policy = np.array([3.0, 2.0, 1.0, 0.0]), np.array([2.0, 0.0, 1.0, 0.0])
    assert r["searches_saved"] == pytest.approx(0.75)
    # defaults: 10000 resamples, seed 0, the same draws as the paired bootstrap called with them
    ci = r["searches_saved_ci"]
    assert ci["n_resamples"] == 10000
    want = paired_bootstrap(native, policy, n_resamples=10000, seed=0).to_dict()
    assert (ci["low"], ci["high"]) == (want["low"], want["high"])
    em, nem = np.array([1.0, 0.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0, 0.0])
    want = paired_bootstrap(em, nem, n_resamples=10000, seed=0).to_dict()
    assert (r["d_em_ci"]["low"], r["d_em_ci"]["high"]) == (want["low"], want["high"])


def test_evaluate_lines_given_threshold_without_validation():
    from ragfast.scoring.stats import paired_bootstrap

    out = study.evaluate_lines(_TEST, given_threshold=0.5, n_resamples=37, seed=3)
    for lab in ("gold", "probe"):
        e = out["judges"]["j"][lab]
        assert "error" not in e
        rec = e["threshold"]
        assert (rec["threshold"], rec["source"], rec["judge"], rec["labels"], rec["val_questions"]) == \
            (0.5, "given", "j", lab, None)
        assert "feasible" not in rec  # no validation figures for a given threshold
        sysm = e["test"]["system"]
        assert sysm["threshold"] == 0.5 and sysm["searches_saved"] == pytest.approx(0.75)
        assert sysm["searches_saved_ci"]["n_resamples"] == 37
        want = paired_bootstrap([3.0, 2.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], n_resamples=37, seed=3).to_dict()
        assert (sysm["searches_saved_ci"]["low"], sysm["searches_saved_ci"]["high"]) == (want["low"], want["high"])
        # first crossings at 0.5: t0 (right), t1 (wrong) -> 1/2
        assert e["test"]["extra_first_crossing_precision_per_question"] == pytest.approx(0.5)
    # neither validation states nor a given threshold: the reason, no system level
    e = study.evaluate_lines(_TEST, n_resamples=37)["judges"]["j"]["probe"]
    assert e["error"] == "no validation states and no given threshold"
    assert "threshold" not in e and "system" not in e["test"] and "ap" in e["test"]


def test_evaluate_lines_chooses_on_validation_with_its_bar():
    out = study.evaluate_lines(_VAL + _TEST, min_stops=2, n_resamples=37, given_threshold=5.0)
    assert (out["min_precision"], out["min_stops"]) == (0.90, 2)
    assert out["questions"] == {"val": 6, "test": 4} and out["states"] == {"val": 6, "test": 6}
    for lab in ("gold", "probe"):
        e = out["judges"]["j"][lab]
        rec = e["threshold"]  # chosen on validation: the given threshold is not used
        assert (rec["threshold"], rec["source"], rec["judge"], rec["labels"], rec["val_questions"]) == \
            (0.7, "selected", "j", lab, 6)
        assert (rec["feasible"], rec["min_stops"], rec["val_stops"], rec["val_positives"]) == (True, 2, 3, 4)
        assert rec["val_precision"] == 1.0 and rec["val_recall"] == pytest.approx(0.75)
        # on test, 0.7 is reached only by t1's state 0 (a tie): one early, unsafe stop
        sysm = e["test"]["system"]
        assert sysm["threshold"] == 0.7 and (sysm["early_stops"], sysm["unsafe_early_stops"]) == (1, 1)
        assert sysm["searches_saved"] == pytest.approx(2 / 4)
    # the default bar (10 stops) is out of reach: never stop, threshold = highest score + 1
    rec = study.evaluate_lines(_VAL + _TEST, n_resamples=37)["judges"]["j"]["probe"]["threshold"]
    assert (rec["threshold"], rec["feasible"], rec["min_stops"]) == (pytest.approx(1.9), False, 10)


def test_evaluate_lines_one_label_class_on_validation_is_an_error_not_a_threshold():
    val = [_line2(f"v{i}", "val", 0, 1, 0.1 * i, 1, 1.0) for i in range(4)]  # every state right to stop
    e = study.evaluate_lines(val + _TEST, given_threshold=0.5, n_resamples=37)["judges"]["j"]["probe"]
    assert "one label class" in e["error"]
    # the given threshold does not stand in for a refused choice
    assert "threshold" not in e and "system" not in e["test"]
    assert "extra_first_crossing_precision_per_question" not in e["test"]
    assert e["val"]["states"] == 4 and e["test"]["states"] == 6  # the ranking figures stay


def test_states_file_errors_name_the_line_and_the_missing_fields(tmp_path):
    from ragfast.errors import DataError

    p = tmp_path / "s2g_states.jsonl"
    good = _line("q0", "test", 0, 1, 0.5, 1, 1.0)
    study.write_state_lines(p, [good, {"question_id": "q1", "split": "test", "state": 0, "native_em": 0.0}])
    with pytest.raises(DataError, match=rf"^{re.escape(str(p))}:2: missing labels, native_searches, probe_em, scores$"):
        study.read_state_lines(p)
    p.write_text(json.dumps(good) + "\n\n{not json\n")
    with pytest.raises(DataError, match=rf"^{re.escape(str(p))}:3: not JSON \("):
        study.read_state_lines(p)
    p.write_text(json.dumps(good) + "\n\n")  # blank lines are skipped
    assert study.read_state_lines(p) == [good]


def test_json_clean_by_hand():
    got = study.json_clean({"a": [1.0, float("nan"), [np.float32(2.5)], (np.int64(3), -math.inf)],
                            "b": np.float32("nan"), "c": np.int64(7), "d": "text", "e": np.inf})
    assert got == {"a": [1.0, None, [2.5], [3, "-inf"]], "b": None, "c": 7, "d": "text", "e": "inf"}
    assert type(got["c"]) is int and type(got["a"][2][0]) is float  # numpy scalars become Python
    assert json.dumps(got)  # and the result is JSON


def test_threshold_record_states_its_definition():
    rec = study.threshold_record(None, judge="j", given=0.25, source="given")
    assert rec["definition"] == ("per validation state (states 0..S-1): highest recall at precision >= "
                                 "min_precision with >= min_stops STOP states; none: highest score + 1")
    assert (rec["threshold"], rec["labels"], rec["val_questions"]) == (0.25, "probe", None) and "reason" not in rec
    assert study.threshold_record(None, judge="j", given=1.0, reason="why")["reason"] == "why"


def test_frozen_threshold_infeasible_record_and_messages():
    # 0.9(1) 0.8(0): no candidate reaches precision 0.9 with 10 stops -> never stop, by hand
    ft = study.frozen_threshold([1, 0], [0.9, 0.8])
    assert (ft.threshold, ft.feasible, ft.recall, ft.stops, ft.states, ft.positives) == (1.9, False, 0.0, 0, 2, 1)
    assert isinstance(ft.precision, float) and math.isnan(ft.precision)  # nothing stops: undefined, not None
    with pytest.raises(ValueError, match=r"^min_precision must be in \[0, 1\], got 1.5$"):
        study.frozen_threshold([1, 0], [0.9, 0.8], min_precision=1.5)
    with pytest.raises(ThresholdError, match=r"^no validation state to choose the STOP threshold on "
                                             r"\(no validation question searched\)$"):
        study.frozen_threshold([], [])


def test_state_lines_gold_labels_follow_the_search_turns():
    # one question, S = 2: state 0 holds no evidence, state 1 the first search's titles. Gold =
    # every supporting title retrieved by that state (only search turns retrieve)
    rec = SimpleNamespace(ids=["a"], native_searches=[2], split=["test"], native_em=[1.0], native_answers=["x"],
                          scores=np.array([[0.25, np.nan]]), probe_em=np.array([[0.0, 1.0]]),
                          probe_answers=[["p0", "p1"]])
    turns = [SimpleNamespace(action="think", retrieved_titles=["T1"]),
             SimpleNamespace(action="search", retrieved_titles=["T1"]),
             SimpleNamespace(action="search", retrieved_titles=["T2"])]
    tr = SimpleNamespace(id="a", turns=turns, supporting_titles=["T1"])
    lines = study.state_lines(rec, "j", trajectories=[tr])
    assert [(x["state"], x["labels"], x["scores"]) for x in lines] == [
        (0, {"probe": 0, "gold": 0}, {"j": 0.25}), (1, {"probe": 1, "gold": 1}, {"j": None})]
    assert [x["probe_answer"] for x in lines] == ["p0", "p1"]
    # without trajectories there is no gold label
    assert [x["labels"] for x in study.state_lines(rec, "j")] == [{"probe": 0}, {"probe": 1}]


def test_ece_bins_and_a_split_without_questions():
    ece, bins = study.ece10([1, 0], [0.0, 0.0])  # p = 0.5 twice: bin [0.5, 0.6)
    assert ece == 0.0 and [(b["lo"], b["hi"]) for b in bins][:2] == [(0.0, 0.1), (0.1, 0.2)]
    assert bins[5]["count"] == 2 and bins[5]["mean_prob"] == 0.5 and bins[5]["frac_positive"] == 0.5
    assert math.isnan(study.ece10([], [])[0])  # no state: undefined, not 0
    lines = [_line("t1", "test", 0, 1, 0.5, 1, 1.0), _line("t0", "test", 0, 1, 0.1, 0, 0.0)]
    a = study.state_arrays(lines)
    assert a["ids"] == ["t1", "t0"] and a["q"].tolist() == [0, 1] and a["questions"] == 2
    # a split without questions (hand-built arrays, as a caller may pass): NaN means, no interval
    e = study.state_arrays([])
    assert e["q"].dtype == np.int64 and e["questions"] == 0 and e["ids"] == []
    e["scores"]["j"], e["labels"]["probe"] = np.empty(0), np.empty(0)
    r = study.system_metrics(e, "j", "probe", 0.5, n_resamples=10)
    assert all(math.isnan(r[k]) for k in ("em", "native_em", "searches", "native_searches", "searches_saved"))
    assert r["early_stops"] == 0 and "searches_saved_ci" not in r
    # one question: its means, but no interval either (a bootstrap needs two)
    r = study.system_metrics(study.state_arrays(lines[:1]), "j", "probe", 0.5, n_resamples=10)
    assert r["searches_saved"] == 1.0 and "searches_saved_ci" not in r and "d_em_ci" not in r
    two = study.system_metrics(a, "j", "probe", 0.5, n_resamples=10)
    assert two["searches_saved_ci"]["n"] == 2 and "d_em_ci" in two

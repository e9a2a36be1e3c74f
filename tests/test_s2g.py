"""S2G: the judge in the Search-R1 loop, replay against live, the reachability audit, the report."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.judges.base import Judge
from ragfast.models.scripted import ScriptedGenerator
from ragfast.methods.s2g.evaluation import evaluate, reachability, render_markdown
from ragfast.methods.s2g.loop import JudgeStopHook, gap_query, run_s2g
from ragfast.methods.s2g.states import RecordedStates, record_states, replay, state_prefixes
from ragfast.methods.searchr1.loop import SearchR1Config, run_searchr1
from ragfast.outputs.results import ResultsWriter


class OverlapJudge(Judge):
    """Deterministic lexical judge: share of question words found in the evidence, plus a
    little per block. Counts its calls and every state it was shown."""

    name = "overlap (test)"
    meaningful = False

    def __init__(self):
        self.calls = 0
        self.seen: list[tuple[str, int]] = []

    def stop_scores(self, states, *, ledger=None, question_ids=None):
        self.calls += 1
        out = []
        for s in states:
            self.seen.append((s.question, len(s.evidence)))
            q = set(re.findall(r"[a-z]{4,}", s.question.lower()))
            ev = set(re.findall(r"[a-z]{4,}", " ".join(s.evidence).lower()))
            out.append(len(q & ev) / max(1, len(q)) + 0.05 * len(s.evidence) if s.evidence else np.nan)
        if ledger is not None:
            ledger.add_batch("judge", list(question_ids), seconds=0.001 * len(states), flops=[1e6] * len(states),
                             input_tokens=[10] * len(states))
        return np.array(out)


class Verdict:
    def __init__(self, gaps):
        self.sufficient = not gaps
        self.gap_items = gaps


class GapJudge(OverlapJudge):
    """Never stops; asks for one named bridge entity."""

    def stop_scores(self, states, **kw):
        return np.full(len(states), -1.0)

    def verdicts(self, states, max_new_tokens=160, *, ledger=None, question_ids=None):
        return [Verdict([{"category": "bridge entity", "target": "Gustave Eiffel", "slot": "birth year",
                          "description": "x"}]) for _ in states]


@pytest.fixture(scope="module")
def hotpot():
    from ragfast.data import corpus_from_contexts, load_qa, sample
    from ragfast.retrieval.bm25 import BM25Retriever

    qs = load_qa(sample("hotpotqa-dev"))[:36]
    return qs, BM25Retriever.build(corpus_from_contexts(qs))


@pytest.fixture(scope="module")
def recorded(hotpot):
    qs, ret = hotpot
    cfg = SearchR1Config(batch_size=16, topk=2)
    native = run_searchr1(qs, ScriptedGenerator(), ret, cfg)
    rec = record_states(native, OverlapJudge(), ScriptedGenerator(), batch_size=25)
    return native, rec, cfg


def test_state_prefixes_follow_the_session(recorded):
    native, rec, _ = recorded
    tr = max(native, key=lambda t: t.searches)
    pre = state_prefixes(tr)
    assert len(pre) == tr.searches + 1 == len(tr.states()) and pre[0] == ""
    for t in range(1, len(pre)):
        assert pre[t].count("<information>") == t and pre[t].endswith("</information>\n\n")
        assert pre[t].startswith(pre[t - 1])
    # the native session at the last state: the answer turn is the only thing after it
    full = "".join(x.generated + x.observation for x in tr.turns)
    assert full.startswith(pre[-1]) and "<answer>" in full[len(pre[-1]):]


def test_record_states_shapes_and_probe_at_native_stop(recorded):
    native, rec, _ = recorded
    assert rec.lengths.tolist() == [t.searches + 1 for t in native]
    assert np.isnan(rec.scores[:, 0]).all()  # state 0 is scored; this judge gives NaN without evidence
    for b, t in enumerate(native):
        assert np.isfinite(rec.scores[b, 1:t.searches + 1]).all()
        # Probing the last state reproduces the native answer: the scripted reasoner is
        # deterministic and its answer turn sees the same session.
        assert rec.probe_answers[b][t.searches] == t.answer
        assert rec.probe_em[b, t.searches] == t.em


def test_replay_equals_live_in_loop_stopping(hotpot, recorded):
    qs, ret = hotpot
    native, rec, cfg = recorded
    s, _, _ = rec.state_table()
    thresholds = list(np.quantile(s[np.isfinite(s)], [0.15, 0.5, 0.85])) + [math.inf, -math.inf]
    stopped_any = 0
    for thr in thresholds:
        judge = OverlapJudge()
        led = CostLedger()
        live = run_s2g(qs, ScriptedGenerator(), ret, judge, thr, cfg, ledger=led)
        r = replay(rec, thr)
        assert [t.em for t in live] == r.em.tolist()
        assert [t.searches for t in live] == r.searches.tolist()
        assert [t.answer for t in live] == r.answers
        stops = [t.extra.get("judge_stop_state", -1) for t in live]
        assert stops == r.stop_state.tolist()
        assert [t.stop_reason == "judge" for t in live] == (r.stop_state >= 0).tolist()
        stopped_any += int((r.stop_state >= 0).sum())
        # the live judge saw the states the reasoner searched from, each once: 0..S-1, or 0..s
        # when it stopped at s; one batched call per turn of each batch
        assert len(judge.seen) == sum(t.searches + (t.stop_reason == "judge") for t in live)
        assert all(t.extra["judged_states"] == len(t.extra["judge_scores"]) for t in live)
        assert judge.calls <= (cfg.max_turns + 1) * math.ceil(len(qs) / cfg.batch_size)
        for t, b in zip(live, range(len(live))):
            sc = t.extra["judge_scores"]
            np.testing.assert_allclose([np.nan if x is None else x for x in sc], rec.scores[b, :len(sc)])
        # judge costs reach the per-question records
        assert led.totals()["judge"]["calls"] == len(judge.seen)
    assert stopped_any > 0
    # +inf never stops (replay = native); -inf stops every trajectory at its first scored state
    # before the native stop (this judge gives state 0 no score)
    assert replay(rec, math.inf).em.tolist() == [t.em for t in native]
    assert replay(rec, -math.inf).stop_state.tolist() == [1 if t.searches >= 2 else -1 for t in native]


class TableJudge(OverlapJudge):
    """Scores from a fixed table keyed by (question, evidence blocks): five levels, so ties at
    any threshold, and state 0 scored (often high enough to stop before any search)."""

    def stop_scores(self, states, *, ledger=None, question_ids=None):
        import zlib

        super().stop_scores(states, ledger=ledger, question_ids=question_ids)
        return np.array([((zlib.crc32(s.question.encode()) + 3 * len(s.evidence)) % 5) / 4.0 for s in states])


def test_live_equals_replay_with_a_stop_at_state_0_and_a_tie(hotpot):
    """The live loop judges the study's states 0..S-1 and stops where the replay of the same
    scores stops (first score >= threshold, hand-computed here), with as many searches."""
    from ragfast.methods.s2g import study

    qs, ret = hotpot
    cfg = SearchR1Config(batch_size=16, topk=2)
    native = run_searchr1(qs, ScriptedGenerator(), ret, cfg)
    rec = record_states(native, TableJudge(), ScriptedGenerator(), batch_size=40)
    seen_state0 = seen_tie = seen_later = 0
    for thr in (0.5, 0.75, 1.0, -math.inf):
        # the oracle: first state s < S (the native searches) with score >= thr
        want = []
        for b, t in enumerate(native):
            hit = [s for s in range(t.searches) if rec.scores[b, s] >= thr]
            want.append(hit[0] if hit else -1)
        judge = TableJudge()
        live = run_s2g(qs, ScriptedGenerator(), ret, judge, thr, cfg)
        r = replay(rec, thr)
        got = [t.extra.get("judge_stop_state", -1) for t in live]
        assert got == want == r.stop_state.tolist()
        assert [t.searches for t in live] == [w if w >= 0 else t.searches for w, t in zip(want, native)]
        assert [t.searches for t in live] == r.searches.tolist()
        assert [t.em for t in live] == r.em.tolist() and [t.answer for t in live] == r.answers
        # the study's system level on the same states gives the same mean search count
        arr = study.state_arrays(study.state_lines(rec, "j"))
        assert study.system_metrics(arr, "j", "probe", thr, n_resamples=10)["searches"] == pytest.approx(
            np.mean([t.searches for t in live]), abs=1e-12)
        for t, w, b in zip(live, want, range(len(live))):
            if w >= 0:
                # the cancelled search is kept in the record, not counted, and nothing was retrieved for it
                cancelled = [x for x in t.turns if x.extra.get("search_cancelled")]
                assert len(cancelled) == 1 and cancelled[0].extra["search_cancelled"] == "judge"
                assert cancelled[0].action == "none" and not cancelled[0].retrieved_ids
                seen_state0 += w == 0
                seen_tie += rec.scores[b, w] == thr
                seen_later += w >= 1
        assert len(judge.seen) == sum(t.searches + (t.stop_reason == "judge") for t in live)
    assert seen_state0 and seen_tie and seen_later
    # resume: the questions not yet finished give the same trajectories as the whole run
    done = {q.id for q in qs[:20]}
    rest = run_s2g(qs, ScriptedGenerator(), ret, TableJudge(), 0.75, cfg, skip_ids=done)
    whole = {t.id: t for t in run_s2g(qs, ScriptedGenerator(), ret, TableJudge(), 0.75, cfg)}
    assert [t.id for t in rest] == [q.id for q in qs[20:]]
    for t in rest:
        w = whole[t.id]
        assert (t.answer, t.searches, t.stop_reason, t.extra.get("judge_stop_state")) == (
            w.answer, w.searches, w.stop_reason, w.extra.get("judge_stop_state"))


def test_gap_items_drive_an_injected_search(hotpot):
    qs, ret = hotpot
    assert gap_query(" Who? ", [{"target": "A", "slot": "b"}, {"description": "desc"}, {"target": "C"},
                                {"target": "D"}]) == "Who? A b desc C"
    cfg = SearchR1Config(batch_size=8, topk=2, max_turns=3)
    live = run_s2g(qs[:4], ScriptedGenerator(), ret, GapJudge(), 0.0, cfg, gap_queries=True)
    injected = [x for t in live for x in t.turns if x.extra.get("injected") == "gap"]
    assert injected and all(x.content.endswith("Gustave Eiffel birth year") for x in injected)
    assert all(t.searches <= 3 for t in live)  # injected searches count against the budget
    with pytest.raises(ConfigError, match="verdicts"):
        JudgeStopHook(OverlapJudge(), 0.0, gap_queries=True)
    with pytest.raises(ConfigError, match="threshold"):
        JudgeStopHook(OverlapJudge(), float("nan"))


def _rec(probe_em, native_em, native_answers, probe_answers, scores=None):
    pe = np.array(probe_em, dtype=float)
    B, T = pe.shape
    S = [len([a for a in row if a != "-"]) - 1 for row in probe_answers]
    sc = np.array(scores, dtype=float) if scores is not None else np.tile(np.arange(T, dtype=float), (B, 1))
    sc[:, 0] = np.nan
    return RecordedStates([f"q{i}" for i in range(B)], sc, pe, [list(r) for r in probe_answers],
                          np.array([s + 1 for s in S]), np.array(native_em, float), np.array(S, float),
                          list(native_answers))


def test_reachability_on_a_constructed_case():
    # q0: 2 searches, right already at state 1 -> answerable early; 1 search removable
    # q1: 2 searches, wrong throughout, probe gives the native (wrong) answer from state 0
    # q2: 1 search, right only at the end
    rec = _rec(probe_em=[[0, 1, 1], [0, 0, 0], [0, 1, 0]], native_em=[1, 0, 1],
               native_answers=["Paris", "Rome", "Oslo"],
               probe_answers=[["x", "Paris", "Paris"], ["Rome", "y", "Rome"], ["z", "Oslo", "-"]])
    r = reachability(rec)
    assert r["questions"] == 3 and r["searches"] == 5
    assert r["answerable_before_native_stop"] == pytest.approx(1 / 3)
    assert r["removable_same_answer"] == 1 + 2 + 0
    assert r["removable_no_em_loss"] == 1 + 2 + 0
    assert r["oracle_em"] == pytest.approx(2 / 3) and r["oracle_searches"] == pytest.approx((1 + 2 + 1) / 3)
    assert r["safe_state_fraction"] == pytest.approx(3 / 8)


def test_recorded_states_roundtrip_and_errors(tmp_path, recorded):
    _, rec, _ = recorded
    rec.save(tmp_path / "states.jsonl")
    back = RecordedStates.load(tmp_path / "states.jsonl")
    np.testing.assert_array_equal(back.lengths, rec.lengths)
    np.testing.assert_array_equal(np.isnan(back.scores), np.isnan(rec.scores))
    np.testing.assert_allclose(np.nan_to_num(back.scores), np.nan_to_num(rec.scores))
    assert back.probe_answers == rec.probe_answers
    with pytest.raises(DataError, match="does not exist"):
        RecordedStates.load(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="2 scores but 1 probes"):
        RecordedStates.from_records([{"id": "a", "scores": [None, 1.0], "probe_em": [0.0], "probe_answers": ["x"],
                                      "native_em": 0, "native_searches": 1}])


def _write_run(tmp_path, hotpot, recorded, threshold):
    qs, ret = hotpot
    native, rec, cfg = recorded
    d = tmp_path / "run"
    d.mkdir()
    split = ["val" if i % 3 == 0 else "test" for i in range(len(native))]
    rec = RecordedStates.from_records([{**r, "split": s} for r, s in zip(rec.to_records(), split)])
    rec.save(d / "states.jsonl")
    (d / "s2g_threshold.json").write_text(json.dumps({"threshold": threshold, "source": "given"}))
    with ResultsWriter(d / "native.jsonl") as w:
        for t in native:
            w.write(t.to_dict())
    test_q = [q for q, s in zip(qs, split) if s == "test"]
    with ResultsWriter(d / "s2g.jsonl") as w:
        run_s2g(test_q, ScriptedGenerator(), ret, OverlapJudge(), threshold, cfg, on_finish=lambda t: w.write(t.to_dict()))
    return d


def test_evaluate_and_report_cli(tmp_path, hotpot, recorded):
    from ragfast.cli import app

    _, rec, _ = recorded
    s, _, _ = rec.state_table()
    thr = float(np.quantile(s[np.isfinite(s)], 0.6))
    d = _write_run(tmp_path, hotpot, recorded, thr)
    ev = evaluate(d, n_resamples=500)
    assert set(ev) >= {"reachability", "ranking", "policy", "paired", "cost", "replay_equals_live"}
    agree = ev["replay_equals_live"]
    assert agree["questions"] == 24 and agree["agree"] == 24
    live, rp = ev["paired"]["live"], ev["paired"]["replay"]
    assert live["d_em"]["delta"] == pytest.approx(rp["d_em"]["delta"])
    assert live["d_searches"]["delta"] == pytest.approx(rp["d_searches"]["delta"])
    assert rp["d_searches"]["delta"] <= 0
    pol = ev["policy"]["test"]
    assert pol["searches_saved"] == pytest.approx(-rp["d_searches"]["delta"] * 24)
    assert 0 <= pol["unsafe_early_stops"] <= pol["early_stops"] <= pol["stops"] <= 24
    c = ev["cost"]
    fl = c["metrics"]["flops"]
    assert c["judge_calls"] > 0 and fl["spent"]["mean"] * c["questions"] == pytest.approx(1e6 * c["judge_calls"])
    assert fl["net"]["mean"] == pytest.approx(fl["saved"]["mean"] - fl["spent"]["mean"])
    assert fl["saved"]["low"] <= fl["saved"]["mean"] <= fl["saved"]["high"]
    # the replay estimate judges exactly the states the live run judged (1e6 FLOPs each here)
    cr = ev["cost_replay"]
    assert cr["judge_states"] == c["checked_states"] == c["judge_calls"]
    assert cr["flops"]["judge"] == pytest.approx(fl["spent"]["mean"] * c["questions"])
    assert cr["seconds"]["judge"] == pytest.approx(0.001 * c["judge_calls"])
    assert "Cost estimate from replay" in render_markdown(ev)
    md = render_markdown(ev)
    for part in ("Candidate reachability", "State ranking", "First-crossing", "Paired quality", "break-even"):
        assert part in md
    res = CliRunner().invoke(app, ["report", "s2g", str(d), "--n-resamples", "300"])
    assert res.exit_code == 0, res.output
    assert "non-inferior" in res.output or "not shown non-inferior" in res.output
    js = json.loads((d / "s2g_report.json").read_text())
    assert js["replay_equals_live"]["agree"] == 24
    assert (d / "s2g_report.md").read_text().startswith("# S2G evaluation")
    res = CliRunner().invoke(app, ["report", "s2g", str(tmp_path / "missing")])
    assert res.exit_code != 0
    # replay only (no live run): the report still has its four parts, without the cost balance
    (d / "s2g.jsonl").unlink()
    ev2 = evaluate(d, n_resamples=300)
    assert "cost" not in ev2 and "live" not in ev2["paired"]
    assert json.dumps(ev2["policy"], sort_keys=True) == json.dumps(ev["policy"], sort_keys=True)  # NaN-aware
    assert "Paired quality" in render_markdown(ev2)


class ScoresStateZeroJudge(OverlapJudge):
    """OverlapJudge that also scores state 0 (no evidence: 0.0), as the study's states need."""

    def stop_scores(self, states, **kw):
        s = super().stop_scores(states, **kw)
        return np.where(np.isnan(s), 0.0, s)


def test_run_s2g_command_end_to_end(tmp_path, monkeypatch):
    import ragfast.runner.slots as slots_mod
    from ragfast.commands.s2g import run_s2g_command
    from ragfast.methods.s2g.study import ThresholdError

    monkeypatch.setattr(slots_mod, "judge", lambda spec, **kw: ScoresStateZeroJudge())
    out = tmp_path / "s2g"
    # validation questions 40..51 of the bundled dev split: with seed 2 the scripted reasoner's
    # no-evidence guess (its answer-only probe at state 0) is right only for question 46, so both
    # label classes exist (it answers as soon as the gold is in its evidence: no other state
    # before its native stop can be right)
    ev = run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(out), retriever="bm25", seed=2,
                         val_data="hotpotqa-dev", val_offset=40, val_limit=12, offset=52, limit=12, batch_size=12,
                         min_precision=0.5, n_resamples=300, progress=False)
    thr = json.loads((out / "s2g_threshold.json").read_text())
    assert thr["source"] == "selected" and thr["val_questions"] == 12 and thr["judge"] == "encoder"
    assert thr["val_positives"] == 1 and thr["feasible"] is False  # 1 right state: never 10 STOP states
    # the one definition: report s2g recomputes the same threshold from s2g_states.jsonl
    js = json.loads((out / "s2g_judges.json").read_text())
    assert js["judges"]["encoder"]["probe"]["threshold"]["threshold"] == thr["threshold"]
    assert ev["replay_equals_live"]["agree"] == ev["replay_equals_live"]["questions"] == 12
    for name in ("native.jsonl", "states.jsonl", "s2g.jsonl", "manifest.json", "s2g_report.md", "ledger-s2g.jsonl",
                 "s2g_states.jsonl", "s2g_judges.json"):
        assert (out / name).exists(), name
    # one label class on validation (questions 12..17: no right state before a native stop) is an error
    with pytest.raises(ThresholdError, match="one label class"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(tmp_path / "one"), retriever="bm25",
                        val_data="hotpotqa-dev", val_offset=12, val_limit=6, offset=24, limit=3, batch_size=12,
                        n_resamples=100, progress=False)
    assert (tmp_path / "one" / "s2g_states.jsonl").exists()  # the recorded work stays
    with pytest.raises(ConfigError, match="already holds"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(out), threshold=0.5)
    with pytest.raises(ConfigError, match="--resume: config.threshold: null in the run on disk, 0.5 now"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(out), retriever="bm25", seed=2,
                        val_data="hotpotqa-dev", val_offset=40, val_limit=12, offset=52, limit=12, batch_size=12,
                        min_precision=0.5, threshold=0.5, resume=True)
    with pytest.raises(ConfigError, match="give one"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(out), threshold=0.5, resume=True,
                        overwrite=True)
    with pytest.raises(ConfigError, match="both the validation and the test"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(tmp_path / "x"), val_data="hotpotqa-dev",
                        limit=5, val_limit=5)
    with pytest.raises(ConfigError, match="--threshold"):
        run_s2g_command(model="scripted", data="hotpotqa-dev", out=str(tmp_path / "y"))


def test_study_builds_the_reasoner_in_the_precision_asked(tmp_path, monkeypatch):
    import ragfast.runner.slots as slots_mod
    from ragfast.commands.s2g import run_s2g_command, study_settings

    seen = {}
    real = slots_mod.reasoner

    def spy(spec, **kw):
        seen.update(kw)
        return real(spec, **kw)

    monkeypatch.setattr(slots_mod, "reasoner", spy)
    monkeypatch.setattr(slots_mod, "judge", lambda spec, **kw: ScoresStateZeroJudge())
    kw = dict(model="scripted", data="hotpotqa-dev", out=str(tmp_path / "o"), retriever="bm25", threshold=0.5,
              offset=52, limit=2, batch_size=2, n_resamples=50, progress=False, live=False)
    run_s2g_command(**kw, dtype="bfloat16", weights="int8", memory_budget="2GB")
    assert (seen["dtype"], seen["weights"], seen["memory_budget"]) == ("bfloat16", "int8", "2GB")
    with pytest.raises(ConfigError, match="config.dtype"):  # a resume in another precision is refused
        run_s2g_command(**kw, resume=True)
    s = study_settings(None, out=str(tmp_path / "p"), dtype="bfloat16", threads=1)
    assert (s.dtype, s.threads) == ("bfloat16", 1)


def test_rest_cost_and_replay_cost_on_a_constructed_trajectory():
    from ragfast.methods.s2g.states import replay_cost, rest_cost
    from ragfast.types import Trajectory, Turn

    def cost(r, s=0.0):
        return {"reasoner": {"seconds": r, "flops": 10 * r}, "search": {"seconds": s, "flops": 0.0}}

    tr = Trajectory("q", "Q?", ["a"], turns=[Turn(0, "g", "search", "x", extra={"cost": cost(1, 2)}),
                                             Turn(1, "g", "invalid", extra={"cost": cost(0.5)}),
                                             Turn(2, "g", "search", "y", extra={"cost": cost(1, 2)}),
                                             Turn(3, "g", "answer", "a", extra={"cost": cost(3)})])
    assert rest_cost(tr) == [[55.0, 9.5], [45.0, 6.5], [30.0, 3.0]]
    rec = RecordedStates.from_records([{
        "id": "q", "scores": [0.1, 0.2, 0.9], "probe_em": [0, 0, 1], "probe_answers": ["x", "y", "a"],
        "native_em": 1, "native_searches": 2, "native_answer": "a", "rest_cost": rest_cost(tr),
        "probe_cost": [[5.0, 0.5], [6.0, 0.6], [7.0, 0.7]], "judge_cost": [[50.0, 0.125], [100.0, 0.25], [100.0, 0.25]]}])
    # the live loop judges states 0..S-1 only: state 2 (0.9) is where the native run answered
    c = replay_cost(rec, 0.5)  # never stops: saves nothing, the judge still scored states 0 and 1
    assert c["seconds"]["saved"] == 0 and c["seconds"]["judge"] == pytest.approx(0.375) and c["judge_states"] == 2
    c = replay_cost(rec, 0.15)  # stops at state 1: saves 6.5 s minus the 0.6 s answer-only turn
    assert c["seconds"]["saved"] == pytest.approx(5.9) and c["judge_states"] == 2
    assert c["flops"]["net"] == pytest.approx(45.0 - 6.0 - 150.0) and not c["flops"]["pays_for_itself"]
    c = replay_cost(rec, 0.1)  # a tie at state 0 stops before any search: saves 9.5 s minus 0.5 s
    assert c["seconds"]["saved"] == pytest.approx(9.0) and c["seconds"]["judge"] == pytest.approx(0.125)
    assert c["judge_states"] == 1 and c["flops"]["net"] == pytest.approx(55.0 - 5.0 - 50.0)


def test_the_bench_s_test_state_probes_continue_the_shelved_native_sessions(tmp_path, monkeypatch):
    """bench with a language-model reasoner: native Search-R1's ended sessions are shelved for S2G's
    test-state analysis, whose probes then compute only their answer turns (the same answers as
    probes that recompute each trajectory's prefix), while S2G's own live run seeds nothing from them."""
    import ragfast.methods.s2g.states as states
    from ragfast.comparison.pipeline import BenchConfig, run_bench
    from ragfast.methods.s2g.method import S2GMethod

    computed: dict[bool, int] = {}
    real = states.record_states

    def spy(trajs, judge, gen, split, **kw):
        before = gen.stats["prefix_tokens_computed"] + gen.stats["prefill_padding_tokens"]
        out = real(trajs, judge, gen, split=split, **kw)
        if split and split[0] == "test":
            computed[shelved] = gen.stats["prefix_tokens_computed"] + gen.stats["prefill_padding_tokens"] - before
        return out

    monkeypatch.setattr(states, "record_states", spy)
    answers = {}
    for shelved in (True, False):
        if not shelved:
            monkeypatch.setattr(S2GMethod, "reads_sessions_of", ())
        out = tmp_path / f"b{shelved}"
        cfg = BenchConfig(reasoner="tiny", index="bm25", data="hotpotqa-dev", offset=10, limit=3, val_data="hotpotqa-dev",
                          val_limit=3, budget=1, max_new_tokens=8, methods=["searchr1", "s2g"], out=str(out),
                          n_resamples=50)
        run_bench(cfg, progress=False, table=False)
        lines = [json.loads(x) for x in (out / "s2g_states.jsonl").read_text().splitlines()]
        answers[shelved] = [(x["question_id"], x["state"], x["probe_answer"]) for x in lines if x["split"] == "test"]
        s2g = [json.loads(x) for x in (out / "trajectories" / "s2g.jsonl").read_text().splitlines()]
        answers[shelved, "s2g"] = [(r["id"], r["answer"], {k: v for k, v in r["cost"]["reasoner"].items()
                                                           if "seconds" not in k}) for r in s2g]
    assert answers[True] and answers[True] == answers[False]
    assert answers[True, "s2g"] == answers[False, "s2g"]  # S2G's live sessions computed and booked alike
    assert computed[False] > 0 and computed[True] < computed[False]

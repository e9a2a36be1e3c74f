"""StepGap: segmentation, every branch of the tree on scripted LLM/NLI outputs, ablations,
batching, rewards, metrics against hand-computed values, and the tiny-model full path."""
import json

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.models.base import Generator
from ragfast.methods.stepgap.checker import CC, IE, MB, NO_GAP, check, segment
from ragfast.methods.stepgap.evaluation import load_annotations, step_metrics
from ragfast.methods.stepgap.rewards import RewardConfig, process_rewards
from ragfast.types import Trajectory, Turn


def obs(*docs):
    body = "".join(f"Doc {i}(Title: {t}) {x}\n" for i, (t, x) in enumerate(docs, 1))
    return f"\n\n<information>{body.strip()}</information>\n\n"


def t1():
    return Trajectory(id="t1", question="Where did the band Tinted Windows first perform?", golden_answers=["Tulsa"], turns=[
        Turn(0, "<think> I need to find the band first. </think>\n<search> Tinted Windows band </search>", "search",
             "Tinted Windows band", observation=obs(
                 ('"Tinted Windows (band)"', "Tinted Windows is an American power pop band. Their first performance "
                                             "was at a festival in Tulsa."),
                 ("Tulsa", "Tulsa is the second-largest city in Oklahoma."))),
        Turn(1, "<think> Tinted Windows first performed in Tulsa. Hanson is a band from Oklahoma. The festival was "
                "held in Austin in 2009. </think>\n<search> Tinted Windows festival 2009 </search>", "search",
             "Tinted Windows festival 2009", observation=obs(("SXSW", "South by Southwest is held in Austin."))),
        Turn(2, "<think> Their debut show happened in Tulsa city. </think>\n<answer> Tulsa </answer>", "answer", "Tulsa"),
    ])


def t2():
    return Trajectory(id="t2", question="Who directed the film Heat?", golden_answers=["Michael Mann"], turns=[
        Turn(0, "<think> Let me search. </think>\n<search> Heat film director </search>", "search", "Heat film director",
             observation=obs(("Heat (1995 film)", "Heat is a 1995 crime film written and directed by Michael Mann."),
                             ("Heat (band)", "Heat is a rock band."))),
        Turn(1, "<think> Heat was directed by Ridley Scott. Heat won an Oscar in 1996. The director cannot be "
                "determined from this. </think>\n<answer> cannot be determined </answer>", "answer",
             "cannot be determined"),
    ])


def t3():
    return Trajectory(id="t3", question="What year was Tulsa founded?", golden_answers=["1836"], turns=[
        Turn(0, "<think> The founding year cannot be determined without searching. </think>\n<search> Tulsa founded "
                "</search>", "search", "Tulsa founded", observation=obs(("Tulsa", "Tulsa is a city in Oklahoma."))),
        Turn(1, "<think> Nothing here. </think>\n<answer> not enough information </answer>", "answer",
             "not enough information"),
        Turn(2, "", "search", "Tulsa founding year", observation=obs(("Tulsa history", "Tulsa was founded in 1836.")),
             extra={"injected": "re-search"}),
    ])


class ScriptedLLM(Generator):
    """Answers each stage prompt from a table keyed by a phrase of the step; records every batch."""

    name = "scripted stage outputs (test)"
    meaningful = False

    def __init__(self, table):
        self.table = table  # (stage, phrase) -> output text
        self.sessions = {}
        self.batches = []

    def start(self, ids, prompts):
        self.sessions.update(zip(ids, prompts))

    def append(self, ids, texts):
        for i, t in zip(ids, texts):
            self.sessions[i] += t

    def end(self, ids):
        for i in ids:
            self.sessions.pop(i, None)

    def generate(self, ids, *, stop, max_new_tokens, ledger=None):
        prompts = [self.sessions[i] for i in ids]
        self.batches.append(prompts)
        outs = []
        for p in prompts:
            stage = "A" if p.endswith('{"aligned":') else "B" if p.endswith('{"justified":') else "C"
            line = next(x for x in p.splitlines() if x.startswith(("STEP", "CLAIM")))
            out = next((v for (st, k), v in self.table.items() if st == stage and k in line), None)
            if out is None:
                out = {"A": ' true, "entity": "x"}', "B": " true}", "C": ' true, "quote": null}'}[stage]
            outs.append(out)
        if ledger is not None:
            ledger.add_batch("reasoner", list(ids), input_tokens=[len(p.split()) for p in prompts],
                             output_tokens=[len(o.split()) for o in outs])
        return outs


class ScriptedNLI:
    """Probabilities (entailment, neutral, contradiction) from phrase rules; records every call."""

    name = "scripted NLI (test)"
    meaningful = False

    def __init__(self):
        self.calls = []

    def describe(self):
        return {"name": self.name, "meaningful": False}

    def score(self, premises, hypotheses, *, ledger=None, question_ids=None):
        self.calls.append(list(zip(premises, hypotheses)))
        out = []
        for p, h in zip(premises, hypotheses):
            if "first performance" in p and ("first performed" in h or "debut show" in h):
                out.append([0.9, 0.05, 0.05])
            elif "Michael Mann" in p and "Ridley Scott" in h:
                out.append([0.02, 0.08, 0.9])
            else:
                out.append([0.1, 0.8, 0.1])
        if ledger is not None:
            ledger.add_batch("nli", list(question_ids), input_tokens=[len(p.split()) + len(h.split())
                                                                      for p, h in zip(premises, hypotheses)])
        return np.asarray(out, dtype=np.float32)


TABLE = {
    ("A", "Hanson is a band"): ' false, "entity": "Hanson"}',
    ("A", "Tinted Windows festival 2009"): " yes it is",  # not JSON: a counted failure, passed on
    ("C", "first performed in Tulsa"): ' true, "quote": "Their first performance was at a festival in Tulsa."}',
    ("C", "held in Austin"): ' true, "quote": "The festival was held in Austin."}',  # not verbatim
    ("C", "is Tulsa."): '{"consistent": false, "quote": null}',  # the answer step; full object form
    ("C", "Ridley Scott"): ' true, "quote": "Heat is a 1995 crime film written and directed by Michael Mann."}',
    ("C", "Oscar"): ' true, "quote": "Heat is a 1995 crime film written and directed by Michael Mann."}',
    ("B", "cannot be determined from this"): " false}",
    ("B", "STEP: cannot be determined"): ' "maybe"}',  # wrong type: failure
    ("B", "not enough information"): " true}",
}


def run_all(stages="ABCDE", thresholds=(0.5, 0.5), ledger=None):
    llm, nli = ScriptedLLM(TABLE), ScriptedNLI()
    res = check([t1(), t2(), t3()], llm, nli, stages=stages, thresholds=thresholds, ledger=ledger)
    got = {(lab.trajectory_id, lab.claim): (lab.label, lab.stage) for lab in res.labels}
    return res, got, llm, nli


# -- segmentation ------------------------------------------------------------------------------
def test_segment_rule():
    steps = segment(t1())
    assert [(s.kind, s.turn, s.claim) for s in steps] == [
        ("search", 0, "Tinted Windows band"),  # the intent sentence "I need to ..." is not a step
        ("claim", 1, "Tinted Windows first performed in Tulsa."),
        ("claim", 1, "Hanson is a band from Oklahoma."),
        ("claim", 1, "The festival was held in Austin in 2009."),
        ("search", 1, "Tinted Windows festival 2009"),
        ("claim", 2, "Their debut show happened in Tulsa city."),
        ("answer", 2, "Tulsa"),
    ]
    assert [s.index for s in steps] == list(range(7))
    assert steps[0].evidence == [] and steps[0].local_turn is None
    assert [d.title for d in steps[1].evidence] == ["Tinted Windows (band)", "Tulsa"]
    last = steps[5]
    assert [d.title for d in last.local] == ["SXSW"] and [d.title for d in last.earlier] == ["Tinted Windows (band)", "Tulsa"]
    assert steps[6].hypothesis == 'The answer to "Where did the band Tinted Windows first perform?" is Tulsa.'
    s3 = segment(t3())
    assert [(s.kind, s.claim) for s in s3] == [
        ("abstain", "The founding year cannot be determined without searching."),
        ("search", "Tulsa founded"),
        ("abstain", "not enough information"),  # "Nothing here." has < 3 words; injected turn gives no step
    ]
    # An observation truncated before </information> (Search-R1's 500-token cap) still counts.
    from ragfast.methods.stepgap.checker import parse_docs

    cut = t1().turns[0].observation[:120]
    assert "</information>" not in cut
    docs = parse_docs(cut, 0)
    assert [d.title for d in docs] == ["Tinted Windows (band)"] and docs[0].text.startswith("Tinted Windows is")
    # A dict record (as read back from results JSONL) segments the same.
    assert [s.claim for s in segment(t1().to_dict())] == [s.claim for s in steps]
    with pytest.raises(DataError):
        segment(42)


# -- the tree ----------------------------------------------------------------------------------
def test_every_branch_of_the_tree():
    led = CostLedger()
    res, got, llm, nli = run_all(ledger=led)
    assert got[("t1", "Hanson is a band from Oklahoma.")] == (CC, "A")
    assert got[("t1", "Tinted Windows festival 2009")] == (NO_GAP, "-")  # A failed to parse: passed on
    assert got[("t1", "Tinted Windows band")] == (NO_GAP, "-")
    assert got[("t1", "Tinted Windows first performed in Tulsa.")] == (NO_GAP, "D")
    assert got[("t1", "The festival was held in Austin in 2009.")] == (IE, "E")  # quote not verbatim, no earlier docs
    assert got[("t1", "Their debut show happened in Tulsa city.")] == (NO_GAP, "E")  # earlier evidence entails
    assert got[("t1", "Tulsa")] == (IE, "C")
    assert got[("t2", "Heat was directed by Ridley Scott.")] == (CC, "D")
    assert got[("t2", "Heat won an Oscar in 1996.")] == (MB, "D")
    assert got[("t2", "The director cannot be determined from this.")] == (CC, "B")
    assert got[("t2", "cannot be determined")] == (NO_GAP, "-")  # B failed to parse
    assert got[("t3", "The founding year cannot be determined without searching.")] == (NO_GAP, "B")  # no evidence
    assert got[("t3", "not enough information")] == (NO_GAP, "B")
    assert res.failures == {"A": 1, "B": 1, "C": 0, "C_quote_not_verbatim": 1}
    by = {(lab.trajectory_id, lab.claim): lab for lab in res.labels}
    lab = by[("t1", "Tinted Windows first performed in Tulsa.")]
    assert lab.quote == "Their first performance was at a festival in Tulsa." and lab.probs[0] == pytest.approx(0.9)
    assert by[("t2", "Heat was directed by Ridley Scott.")].repair == "retract"
    assert by[("t2", "Heat won an Oscar in 1996.")].repair == "bridge"
    assert by[("t1", "Tulsa")].repair == "re-search"
    assert by[("t1", "Hanson is a band from Oklahoma.")].entity == "Hanson"
    # Batched: one generator call per LLM stage and one NLI call per NLI stage, for all trajectories.
    assert len(llm.batches) == 3 and res.calls == {"A": 1, "B": 1, "C": 1, "D": 1, "E": 1}
    assert len(nli.calls) == 2
    assert res.items["A"] == 11 and res.items["B"] == 3
    # The checker's LLM costs are booked as "judge", per question; NLI as "nli".
    tot = led.totals()
    assert "reasoner" not in tot and tot["judge"]["calls"] == res.items["A"] + res.items["B"] + res.items["C"]
    assert set(led.per_question()) == {"t1", "t2", "t3"}
    assert tot["nli"]["calls"] == res.items["D"] + res.items["E"]
    assert res.slots["llm"]["meaningful"] is False and res.slots["nli"]["meaningful"] is False


def test_ablations_switch_stages_off():
    _, full, _, _ = run_all()
    _, no_c, _, nli = run_all("ABDE")
    # Without C, D takes the local documents as premises: the band document entails the claim.
    assert no_c[("t1", "Tinted Windows first performed in Tulsa.")] == (NO_GAP, "D")
    assert no_c[("t1", "Tulsa")] == (MB, "D")  # no longer IE from C; local docs are neutral
    assert all(len(c) > 0 for c in nli.calls)
    _, no_d, _, _ = run_all("ABCE")
    assert no_d[("t2", "Heat was directed by Ridley Scott.")] == (NO_GAP, "-")
    _, no_e, _, _ = run_all("ABCD")
    assert no_e[("t1", "Their debut show happened in Tulsa city.")] == (NO_GAP, "-")
    assert no_e[("t1", "The festival was held in Austin in 2009.")] == (NO_GAP, "-")
    _, no_a, _, _ = run_all("BCDE")
    assert no_a[("t1", "Hanson is a band from Oklahoma.")] == (IE, "E")
    _, no_b, _, _ = run_all("ACDE")
    assert no_b[("t2", "The director cannot be determined from this.")] == (NO_GAP, "-")
    res, none, llm, nli = run_all("")
    assert set(none.values()) == {(NO_GAP, "-")} and llm.batches == [] and nli.calls == []
    _, strict, _, _ = run_all(thresholds=(0.95, 0.5))
    assert strict[("t1", "Tinted Windows first performed in Tulsa.")] == (MB, "D")
    with pytest.raises(ConfigError, match="unknown StepGap stages"):
        check([t1()], stages="ABX")
    with pytest.raises(ConfigError, match="thresholds"):
        check([t1()], thresholds=(1.5, 0.5))


def test_from_turn_checks_only_new_steps():
    llm, nli = ScriptedLLM(TABLE), ScriptedNLI()
    res = check([t1()], llm, nli, from_turn={"t1": 2})
    assert [lab.claim for lab in res.labels] == ["Their debut show happened in Tulsa city.", "Tulsa"]
    assert [lab.step for lab in res.labels] == [5, 6]  # indices stay those of the whole trajectory
    with pytest.raises(DataError, match="duplicate trajectory ids"):
        check([t1(), t1()])


# -- rewards -----------------------------------------------------------------------------------
def test_process_rewards_base_and_shape(tmp_path):
    res, _, _, _ = run_all()
    cfg = RewardConfig()
    recs = {(r["question_id"], r["step"]): r for r in process_rewards(res, cfg)}
    assert len(recs) == len(res.labels)
    # t1 step 2 (Hanson, CC) -> next action is the search (step 4): a matching repair.
    r = recs[("t1", 2)]
    assert (r["label"], r["next_action"]) == (CC, "search")
    assert r["r_base"] == pytest.approx(0.05) and r["r_shape"] == pytest.approx(0.10)
    # t1 step 3 (IE) -> next action is a search: matched.
    assert recs[("t1", 3)]["r_shape"] == pytest.approx(0.10) and recs[("t1", 3)]["r_base"] == pytest.approx(-0.10)
    # t2 step 2 (MB) -> next action is the (abstaining) answer: the gap was ignored.
    assert recs[("t2", 2)]["label"] == MB and recs[("t2", 2)]["r_shape"] == pytest.approx(-0.10)
    assert recs[("t2", 2)]["reward"] == pytest.approx(-0.15)
    # no_gap steps get the base reward only.
    assert recs[("t1", 1)]["r_base"] == pytest.approx(0.20) and recs[("t1", 1)]["r_shape"] == 0.0
    # A near-duplicate next query is penalised.
    dup = t1()
    dup.turns[1].content = "Tinted Windows band"
    res2 = check([dup], ScriptedLLM(TABLE), ScriptedNLI())
    r2 = {x["step"]: x for x in process_rewards(res2, RewardConfig(duplicate=-0.3))}
    assert r2[3]["r_shape"] == pytest.approx(-0.3)
    from ragfast.methods.stepgap.rewards import write_jsonl

    n = write_jsonl(process_rewards(res), tmp_path / "r.jsonl")
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert n == len(lines) == len(res.labels) and {"r_base", "r_shape"} <= set(json.loads(lines[0]))


# -- metrics -----------------------------------------------------------------------------------
def test_step_metrics_hand_computed():
    gold = [NO_GAP, IE, CC, NO_GAP, MB, IE]
    pred = ["IE", "ie", "no_gap", NO_GAP, "MB", "CC"]
    qids = ["q1", "q1", "q1", "q2", "q2", "q3"]
    m = step_metrics(gold, pred, qids)
    # binary: tp=3 (1,4,5) fp=1 (0) fn=1 (2) tn=1 (3)
    assert m["sF1"] == pytest.approx(0.75)
    assert m["BA"] == pytest.approx((3 / 4 + 1 / 2) / 2)
    assert m["QF1"] == pytest.approx(1.0)
    assert m["typed_F1"] == pytest.approx({CC: 0.0, IE: 0.5, MB: 1.0})
    assert m["typed_macro_F1"] == pytest.approx(0.5)
    assert m["label_mix_gold"][IE] == pytest.approx(2 / 6)
    assert m["n_steps"] == 6 and m["n_questions"] == 3
    # Flag everything (as IE, the commonest gold gap): perfect Q-F1, useless BA.
    fa = m["flag_all"]
    assert fa["label"] == IE and fa["QF1"] == pytest.approx(1.0)
    assert fa["sF1"] == pytest.approx(0.8) and fa["BA"] == pytest.approx(0.5)
    assert fa["typed_macro_F1"] == pytest.approx(0.5 / 3)
    with pytest.raises(DataError, match="unknown StepGap label"):
        step_metrics(["weird"], [NO_GAP], ["q"])
    with pytest.raises(DataError, match="2 gold"):
        step_metrics([NO_GAP, NO_GAP], [NO_GAP], ["q"])


def test_annotations_roundtrip(tmp_path):
    from ragfast.methods.stepgap.evaluation import align_annotations

    p = tmp_path / "gold.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"question_id": "t2", "step": 1, "label": "CC", "claim": "Heat was directed by Ridley Scott."},
        {"question_id": "t2", "step": 2, "label": "MB"},
        {"question_id": "t1", "step": 6, "label": "no_gap"},
    ]) + "\n")
    gold = load_annotations(p)
    res, _, _, _ = run_all()
    g, pr, q = align_annotations(gold, res)
    assert g == [NO_GAP, CC, MB] and pr == [IE, CC, MB] and q == ["t1", "t2", "t2"]
    m = step_metrics(g, pr, q)
    assert m["sF1"] == pytest.approx(0.8)  # tp=2 fp=1 fn=0
    p.write_text('{"question_id": "t1", "step": 0}\n')
    with pytest.raises(DataError, match="gold.jsonl:1"):
        load_annotations(p)
    with pytest.raises(DataError, match="not in the checked"):
        align_annotations({("zz", 0): NO_GAP}, res)


# -- tiny random models: the real compute path -------------------------------------------------
def test_full_path_with_tiny_models():
    from ragfast.models.generator import HFGenerator
    from ragfast.models.nli import NLIScorer
    from ragfast.models.tiny import tiny_path

    gen = HFGenerator(tiny_path("qwen2"))
    nli = NLIScorer(tiny_path("deberta-v2"), max_length=256, token_budget=1024)
    led = CostLedger()
    # Short budgets: random weights never close the JSON anyway, and the CPU is shared.
    res = check([t1(), t2(), t3()], gen, nli, ledger=led, max_new_tokens={"A": 6, "B": 4, "C": 6})
    assert len(res.labels) == len(res.steps) == 15
    assert all(lab.label in (NO_GAP, CC, IE, MB) for lab in res.labels)
    # Random weights rarely write valid JSON; whatever failed was counted and passed on.
    assert sum(res.failures.get(s, 0) for s in "ABC") <= res.items["A"] + res.items.get("B", 0) + res.items.get("C", 0)
    assert res.calls["A"] == 1 and res.items["A"] == 11
    tot = led.totals()
    assert tot["judge"]["calls"] == sum(res.items.get(s, 0) for s in "ABC")
    assert tot["nli"]["calls"] == sum(res.items.get(s, 0) for s in "DE") > 0
    assert tot["nli"]["flops"] > 0
    assert res.slots["llm"]["meaningful"] is False and res.slots["nli"]["meaningful"] is False


# -- the loop with repairs ---------------------------------------------------------------------
import math  # noqa: E402
import re  # noqa: E402
from collections import Counter  # noqa: E402

from ragfast.retrieval.base import Hit, Retriever  # noqa: E402


class WordOverlap(Retriever):
    """IDF-weighted word overlap: deterministic and dependency-free, for the loop tests."""

    name = "word overlap (test)"

    def __init__(self, rows):
        self.rows = rows
        self.sets = [set(re.findall(r"\w+", r["contents"].lower())) for r in rows]
        df = Counter(w for s in self.sets for w in s)
        self.idf = {w: math.log(len(rows) / c) for w, c in df.items()}

    def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
        out = []
        for q in queries:
            words = set(re.findall(r"\w+", q.lower()))
            scored = sorted(((sum(self.idf.get(w, 0.0) for w in words & s), -i) for i, s in enumerate(self.sets)),
                            reverse=True)[:k]
            out.append([Hit(self.rows[-i]["id"], sc, self.rows[-i]) for sc, i in scored])
        if ledger is not None:
            ledger.add_batch("search", list(question_ids), seconds=1e-4 * len(queries))
        return out


class ConstNLI(ScriptedNLI):
    def __init__(self, probs):
        super().__init__()
        self.probs = probs

    def score(self, premises, hypotheses, *, ledger=None, question_ids=None):
        super().score(premises, hypotheses, ledger=ledger, question_ids=question_ids)
        return np.tile(np.asarray(self.probs, dtype=np.float32), (len(premises), 1))


def _hotpot(n):
    from ragfast.data import corpus_from_contexts, load_qa, sample

    qs = load_qa(sample("hotpotqa-dev"))[:n]
    corpus = corpus_from_contexts(qs)
    rows = [{"id": i, "contents": c} for i, c in zip(corpus.table.column("id").to_pylist(),
                                                      corpus.table.column("contents").to_pylist())]
    return qs, rows


def _pipeline(nli, repair=True, max_repairs=2, max_turns=3, n=8):
    from ragfast.models.scripted import ScriptedGenerator
    from ragfast.methods.searchr1.loop import SearchR1Config
    from ragfast.methods.stepgap.loop import StepGapConfig, StepGapPipeline

    qs, rows = _hotpot(n)
    cfg = StepGapConfig(searchr1=SearchR1Config(max_turns=max_turns, topk=1), repair=repair, max_repairs=max_repairs)
    pipe = StepGapPipeline(ScriptedGenerator(max_searches=max_turns), WordOverlap(rows), None, nli, cfg)
    return pipe, pipe.run(qs)


def test_loop_bridge_repairs_within_budget():
    pipe, trajs = _pipeline(ConstNLI([0.1, 0.8, 0.1]))  # neutral everywhere -> MISSING_BRIDGE -> bridge search
    injected = 0
    for t in trajs:
        sg = t.extra["stepgap"]
        assert len(sg["labels"]) == len(segment(t)) == len(sg["rewards"])
        assert [lab["step"] for lab in sg["labels"]] == list(range(len(sg["labels"])))
        assert len(sg["repairs"]) <= 2
        assert t.extra["turns_used"] <= 3  # repair searches count against the search budget
        for rep in sg["repairs"]:
            assert rep["label"] == MB and rep["repair"] == "bridge"
            if rep["done"]:
                assert rep["query"] and rep["cost"]["retrieval_calls"] == 1
            else:
                assert rep["skipped"] == "search budget spent"
        inj = [tu for tu in t.turns if tu.extra.get("injected")]
        assert all(tu.extra["injected"] == "stepgap:bridge" and tu.observation for tu in inj)
        assert len(inj) == sg["repair_counts"].get("bridge", 0)
        injected += len(inj)
    assert injected > 0
    tot = pipe.ledger.totals()
    assert tot["nli"]["calls"] > 0 and "judge" not in tot  # no checker LLM: A-C skipped
    assert pipe.hook.checks >= 2  # once per turn with running trajectories, plus the final batch


def test_loop_retracts_contradicted_claims_and_can_stay_passive():
    _, trajs = _pipeline(ConstNLI([0.05, 0.05, 0.9]), max_repairs=1)  # contradiction -> retract
    notes = [tx for t in trajs for tu in t.turns for tx in tu.extra.get("appended", [])]
    assert notes and all("[check] Your claim" in tx for tx in notes)
    assert not any(tu.extra.get("injected") for t in trajs for tu in t.turns)  # retraction spends no search
    assert all(len(t.extra["stepgap"]["repairs"]) <= 1 for t in trajs)
    _, passive = _pipeline(ConstNLI([0.05, 0.05, 0.9]), repair=False)
    assert not any(tu.extra.get("appended") or tu.extra.get("injected") for t in passive for tu in t.turns)
    assert all(t.extra["stepgap"]["labels"] for t in passive)


def test_cli_check_ablate_metrics(tmp_path):
    from typer.testing import CliRunner

    from ragfast.cli import app

    res_path = tmp_path / "results.jsonl"
    res_path.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in (t1(), t2(), t3())))
    runner = CliRunner()
    r = runner.invoke(app, ["stepgap", "check", "--results", str(res_path), "--out", str(tmp_path / "labels.jsonl"),
                            "--rewards", str(tmp_path / "rw.jsonl"), "--nli", "none"])
    assert r.exit_code == 0, r.output
    labels = [json.loads(x) for x in (tmp_path / "labels.jsonl").read_text().splitlines()]
    assert len(labels) == 15 and "nli: none" in r.output
    gold = tmp_path / "gold.jsonl"
    gold.write_text("".join(json.dumps({"question_id": lab["trajectory_id"], "step": lab["step"],
                                        "label": "IE" if lab["kind"] == "answer" else "no_gap"}) + "\n"
                            for lab in labels))
    r = runner.invoke(app, ["stepgap", "metrics", "--annotations", str(gold), "--labels", str(tmp_path / "labels.jsonl")])
    assert r.exit_code == 0, r.output
    m = json.loads(r.output)
    assert m["n_steps"] == 15 and m["sF1"] == 0.0 and m["flag_all"]["QF1"] > 0  # nothing checked -> nothing flagged
    r = runner.invoke(app, ["stepgap", "ablate", "--results", str(res_path), "--annotations", str(gold),
                            "--nli", "tiny", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output[r.output.index("{"):])
    assert set(rep["variants"]) == {"full", "-A", "-B", "-C", "-D", "-E"}
    assert rep["variants"]["full"]["changed_steps"] == 0 and "delta" in rep["variants"]["-D"]


def test_loop_full_path_with_tiny_models():
    """Tiny random qwen2 as reasoner and checker, tiny random DeBERTa-v2 as NLI: the real compute path."""
    from ragfast.models.generator import HFGenerator
    from ragfast.models.nli import NLIScorer
    from ragfast.models.tiny import tiny_path
    from ragfast.methods.searchr1.loop import SearchR1Config
    from ragfast.methods.stepgap.loop import StepGapConfig, StepGapPipeline

    qs, rows = _hotpot(2)
    gen = HFGenerator(tiny_path("qwen2"))
    nli = NLIScorer(tiny_path("deberta-v2"), max_length=256, token_budget=2048)
    cfg = StepGapConfig(searchr1=SearchR1Config(max_turns=1, topk=1, max_new_tokens=8, max_obs_tokens=64),
                        llm_max_new_tokens={"A": 4, "B": 4, "C": 4})
    pipe = StepGapPipeline(gen, WordOverlap(rows), gen, nli, cfg)
    trajs = pipe.run(qs)
    assert len(trajs) == 2
    for t in trajs:
        sg = t.extra["stepgap"]
        assert len(sg["labels"]) == len(segment(t)) == len(sg["rewards"])
        assert all(lab["label"] in (NO_GAP, CC, IE, MB) for lab in sg["labels"])
    slots = pipe.slots()
    assert slots["reasoner"]["meaningful"] is False and slots["nli"]["meaningful"] is False
    assert "reasoner" in pipe.ledger.totals()


def test_repair_queries_and_retraction_text():
    from ragfast.methods.stepgap.repairs import repair_query, retraction_text

    res, _, _, _ = run_all()
    by = {(lab.trajectory_id, lab.claim): (s, lab) for s, lab in zip(res.steps, res.labels)}
    s, lab = by[("t2", "Heat won an Oscar in 1996.")]  # MB with a quote from "Heat (1995 film)"
    q = repair_query(s, lab)
    assert q.startswith("Heat (1995 film)") and "oscar" in q and "1996" in q and "directed" not in q
    s, lab = by[("t1", "Tulsa")]  # IE from C; entity from stage A's table default ("x")
    assert repair_query(s, lab) == f"x {s.question}"
    s, lab = by[("t2", "Heat was directed by Ridley Scott.")]
    assert repair_query(s, lab) is None  # CC is retracted, not searched
    tx = retraction_text(s, lab)
    assert "Heat was directed by Ridley Scott." in tx and "Michael Mann" in tx and "<information>" not in tx


def _c_effect(text, docs):
    """What stage C makes of a completion (the tree's reading of it): IE, a verbatim quote, or nothing."""
    from ragfast.methods.stepgap.checker import _parse_json, _verbatim

    obj = _parse_json("C", text)
    if obj is None:
        return None
    if obj["consistent"] is False:
        return "IE"
    q = obj.get("quote")
    return ("quote", q.strip()) if isinstance(q, str) and q.strip() and _verbatim(q, docs) else None


def test_stage_c_settles_only_completions_whose_outcome_is_fixed():
    """A completion is settled (the generator may stop it) only where every way it could go on
    gives the step nothing from C: each prefix that settles belongs to a completion with no effect,
    over verbatim and invented quotes, escapes (surrogate pairs, cut ones), whitespace and case, a
    capital sigma, and completions that close the quote and add a second key."""
    from ragfast.methods.stepgap.checker import Doc, _parse_json, _quote_settled, _string_prefix

    docs = [Doc("Downers Grove (novel)", "Downers Grove is a 1999 novel by Michael Hornburg. It was filmed in "
                "2015 as \u201cThe Curse\u201d \U0001F600 by \u039a\u039f\u03a3\u039c\u039f\u03a3 studios.", 1)]
    settled = _quote_settled(docs)
    finished = [
        ' true, "quote": "Downers Grove is a 1999 novel by Michael Hornburg."}',
        ' true, "quote": "downers  GROVE is a 1999\\nnovel"}',
        ' true, "quote": "It was filmed in 2015 as \\u201cThe Curse\\u201d \\ud83d\\ude00 by"}',
        ' true, "quote": "\u039a\u039f\u03a3\u039c\u039f\u03a3 studios."}',
        ' true, "quote": "Downers Grove (novel) Downers Grove is a 1999 novel"}',
        ' true, "quote": "Downers Grove (novel): Downers Grove is a 1999 novel"}',
        ' true, "quote": "The Curse of Downers Grove is an American thriller film."}',
        ' true, "quote": "Downers Grove is a 1999 novel", "consistent": false}',
        ' true, "quote": "Michael Hornburg wrote it", "quote": "Downers Grove is a 1999 novel"}',
        ' false, "quote": "The answer is not there yet, so I will copy it."}',
        ' true, "quote": null}',
        ' true, "quote": "It was filmed in 2015 as \\u201',
    ]
    fired = 0
    for text in finished:
        effect = _c_effect(text, docs)
        for n in range(1, len(text) + 1):
            if settled(text[:n]):
                fired += 1
                assert effect is None, (text, text[:n])
    assert fired  # invented quotes do settle
    assert _c_effect(finished[0], docs) == ("quote", "Downers Grove is a 1999 novel by Michael Hornburg.")
    assert _c_effect(finished[2], docs) is not None and _c_effect(finished[3], docs) is not None
    assert not settled(finished[0]) and settled(finished[6]) and settled(' true, "quote": "The Curse of')
    assert _parse_json("C", finished[7]) is None  # a key given twice is not the schema
    assert _string_prefix('ab\\u00e9\\ud83d\\ude00c"d') == "ab\u00e9\U0001F600c"
    assert _string_prefix("ab\\ud83d") == "ab" and _string_prefix("ab\\") == "ab" and _string_prefix("a\\u00") == "a"


def test_broken_completions_settle_only_where_no_text_could_parse():
    """Stages A and C end a completion once its string cannot be followed by JSON (an unescaped
    quote mark followed by a word, a raw newline, an unknown escape): every prefix that settles
    belongs to a completion that does not parse, and completions that close their string and go
    on with a comma or the brace (or escape their quotes) never settle."""
    from ragfast.methods.stepgap.checker import Doc, _broken, _parse_json, _quote_settled

    cases = {
        "C": [
            ' true, "quote": "based on the novel "Downers Grove" by Michael Hornburg."}',
            ' false, "quote": "The answer to "Who plays" is not there yet."}',
            ' true, "quote": "based on the novel \\"Downers Grove\\" by Michael Hornburg."}',
            ' true, "quote": "based on the novel \\u201cDowners Grove\\u201d"}',
            ' true, "quote": "Downers Grove", "page": 3}',
            ' false, "quote": "Downers Grove"  }',
            ' false, "quote": "Downers Grove" \n}',
            ' true, "quote": "two\nlines"}',
            ' true, "quote": "a tab\\tand a bad \\x escape"}',
            ' true, "quote": "a cut \\u00',
            ' false, "quote": null}',
            ' true, "entity": "Downers Grove" by}',
            ' true, "quote": "Downers Grove"',
        ],
        "A": [
            ' true, "entity": "the "stay-behind" operation"}',
            ' false, "entity": "Many right wing WNP were connected to a "stay-behind"  operation? }',
            ' true, "entity": "Gladio"}',
            ' true, "entity": "Gladio", "hop": 2}',
            ' true, "entity": "Operation \\"Gladio\\""}',
            ' true, "quote": "Gladio" x}',
        ],
    }
    docs = [Doc("Downers Grove (novel)", 'Downers Grove is a 1999 novel by Michael Hornburg. The film is based on '
                'the novel "Downers Grove" by Michael Hornburg.', 1)]
    fired = set()
    for stage, texts in cases.items():
        broken = _broken(stage)
        for text in texts:
            cut = text.split("}")[0]  # the generator stops at the closing brace
            for n in range(1, len(cut) + 1):
                if broken(cut[:n]):
                    fired.add(text)
                    assert _parse_json(stage, text) is None and _parse_json(stage, cut[:n]) is None, (text, cut[:n])
    assert fired == {cases["C"][0], cases["C"][1], cases["C"][7], cases["C"][8], cases["A"][0], cases["A"][1]}
    for text in (cases["C"][2], cases["C"][3], cases["C"][4], cases["A"][2], cases["A"][3], cases["A"][4]):
        assert _parse_json("C" if text in cases["C"] else "A", text) is not None
    # Stage C's settled test holds for the broken completions whatever the quote says.
    assert _quote_settled(docs)(' true, "quote": "the novel "Downers Grove" by')
    assert not _quote_settled(docs)(' true, "quote": "the novel "') and _quote_settled(docs)(' true, "quote": "the novel "D')


def test_repeated_steps_complete_once():
    """A think that repeats a sentence gives two steps with one prompt: the LLM stages complete it
    once (booked to the question once), both steps get its label, and items count both."""
    base = t1()
    rep = Trajectory(id="t1", question=base.question, golden_answers=base.golden_answers, turns=[
        base.turns[0],
        Turn(1, "<think> Hanson is a band from Oklahoma. Tinted Windows first performed in Tulsa. Hanson is a band "
                "from Oklahoma. Tinted Windows first performed in Tulsa. </think>\n<search> Tinted Windows festival 2009 "
                "</search>", "search", "Tinted Windows festival 2009", observation=base.turns[1].observation),
    ])
    led, llm, nli = CostLedger(), ScriptedLLM(TABLE), ScriptedNLI()
    res = check([rep], llm, nli, ledger=led)
    got = [(lab.claim, lab.label, lab.stage) for lab in res.labels]
    assert got[1] == got[3] == ("Hanson is a band from Oklahoma.", CC, "A")
    assert got[2] == got[4] == ("Tinted Windows first performed in Tulsa.", NO_GAP, "D")
    sent = [p for batch in llm.batches for p in batch]
    assert len(sent) == len(set(sent)) == 4 + 1  # A: two searches and two distinct claims; C: one claim
    assert res.items["A"] == 6 and res.items["C"] == 2
    assert led.totals()["judge"]["calls"] == len(sent)
    # A memo (the loop's, across rounds) completes each prompt once over several calls.
    memo, llm2, led2 = {}, ScriptedLLM(TABLE), CostLedger()
    first = check([rep], llm2, ScriptedNLI(), memo=memo, from_turn={"t1": 1})
    seen = [p for batch in llm2.batches for p in batch]
    assert len(seen) == 3 + 1  # A: two distinct claims and a search; C: one claim
    again = check([rep], llm2, ScriptedNLI(), memo=memo, ledger=led2)
    assert [p for batch in llm2.batches for p in batch][len(seen):] == [sent[0]]  # only turn 0's search is new
    assert [lab.label for lab in again.labels[1:]] == [lab.label for lab in first.labels] == [x[1] for x in got[1:]]
    assert led2.totals()["judge"]["calls"] == 1

"""The verdict the bench report opens with: does S2G pay, does StepGap pay, measured and projected.

Hand-made trajectories check the figures against oracles written out here (the 7B's FLOPs from
``completion_flops`` call by call, scipy's bootstrap, the stats module's non-inferiority rule);
one small real bench (the scripted oracle, named explicitly) checks that report.md, report.html
and the terminal open or close with the same numbers as summary.json.
"""
from __future__ import annotations

import html
import io
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.stats

from ragfast.comparison import verdict as bv
from ragfast.accounting.flops import completion_flops
from ragfast.accounting.projection import MODEL_PRESETS, project_questions, project_run

Q7 = MODEL_PRESETS["qwen2.5-7b"]
CFG = SimpleNamespace(n_resamples=20000, seed=3, checker_llm="reasoner")


def _rec(qid, turns, *, judge=0.0, nli=0.0, checker=None, search_bytes=1_000_000, searches=None):
    """A trajectory record: ``turns`` reasoner calls of (prompt, cached, output) tokens each."""
    cost = {"reasoner": {"calls": len(turns), "input_tokens": sum(p - k for p, k, _ in turns),
                         "cached_tokens": sum(k for _, k, _ in turns), "output_tokens": sum(o for *_, o in turns),
                         "flops": 0.0, "seconds": 1e-4},
            "encoder": {"calls": len(turns) - 1, "flops": 2e8 * (len(turns) - 1), "seconds": 0.01},
            "search": {"calls": len(turns) - 1, "flops": 1e6 * (len(turns) - 1),
                       "bytes_scanned": search_bytes * (len(turns) - 1), "seconds": 0.005}}
    if judge:
        cost["judge"] = {"calls": 2, "input_tokens": 300, "flops": judge, "seconds": 0.02}
    if nli:
        cost["nli"] = {"calls": 3, "input_tokens": 500, "flops": nli, "seconds": 0.03}
    if checker:
        cost["judge"] = {"calls": 1, "input_tokens": checker[0], "output_tokens": checker[1], "flops": 5e9,
                         "seconds": 0.2}
    return {"id": qid, "cost": cost, "em": 1.0, "searches": len(turns) - 1 if searches is None else searches,
            "turns": turns}


def _native_and_s2g(n=30):
    """Native searches 3 times; S2G's judge stops one question in three a search early. A
    question's calls have one length (the projection prices a record's per-call average)."""
    rng = np.random.default_rng(0)
    native, s2g = [], []
    for i in range(n):
        turns = [(int(rng.integers(600, 900)), 250, int(rng.integers(20, 60)))] * 4
        native.append(_rec(f"q{i}", turns))
        s2g.append(_rec(f"q{i}", turns[:3] if i % 3 == 0 else turns, judge=float(rng.uniform(1e9, 2e9))))
    return native, s2g, rng


def _seven_b(turns):
    """The oracle: reasoner calls priced one by one as Qwen2.5-7B completions."""
    return sum(completion_flops(Q7, p, k, o) for p, k, o in turns)


def test_per_question_projection_sums_to_the_run_projection():
    native, s2g, _ = _native_and_s2g(12)
    q = project_questions(s2g, "h200", {"reasoner": "qwen2.5-7b"})
    run = project_run({"s2g": s2g}, "h200", reasoner="qwen2.5-7b")
    rows = {c["component"]: c for c in run["methods"]["s2g"]["components"]}
    for comp, row in rows.items():
        assert sum(q[r["id"]][comp]["flops"] for r in s2g) == pytest.approx(row["projected_flops"], rel=1e-12)
        assert sum(q[r["id"]][comp]["bytes"] for r in s2g) == pytest.approx(row["projected_bytes"], rel=1e-12)
    # a recorded-only component: its own roofline, here the bytes it scanned over the bandwidth
    r0 = s2g[0]
    assert q[r0["id"]]["search"]["seconds"] == pytest.approx(r0["cost"]["search"]["bytes_scanned"] / 4.8e12)


def test_measured_free_reasoner_cannot_pay_but_the_projected_7b_does():
    """The scripted oracle's turns are free here, so the judge only spends; priced as a 7B's,
    the turns its early stops skipped pay for it. Means against the hand-priced oracle, the
    interval against scipy's bootstrap of the same per-question values."""
    native, s2g, _ = _native_and_s2g()
    records = {"searchr1": native, "s2g": s2g}
    slots = {"reasoner": {"name": "scripted evidence oracle", "class": "ScriptedGenerator"}}
    methods = {"searchr1": {}, "s2g": {"n_paired": 30, "delta_em": {"delta": -0.01, "low": -0.015, "high": 0.0},
                                       "delta_searches": {"delta": -1 / 3, "low": -0.5, "high": -0.2}}}
    summary = {"methods": methods, "slots": slots,
               "break_even": bv.checker_balance(native, s2g, "s2g", slots, CFG),
               "projection": bv.projection(records, slots, CFG)}
    v = bv.verdict(summary)["s2g"]
    judge = np.array([r["cost"]["judge"]["flops"] for r in s2g])
    saved_here = np.array([(a["cost"]["encoder"]["flops"] + a["cost"]["search"]["flops"])
                           - (b["cost"]["encoder"]["flops"] + b["cost"]["search"]["flops"]) for a, b in zip(native, s2g)])
    assert v["measured"]["components"]["reasoner"] == "free"
    assert v["measured"]["net"]["mean"] == pytest.approx(np.mean(saved_here - judge))
    assert v["measured"]["answer"] == "no"  # 200 MFLOPs of encoder per skipped search never covers 1-2 GFLOPs
    want = np.array([_seven_b(a["turns"]) - _seven_b(b["turns"]) for a, b in zip(native, s2g)]) + saved_here - judge
    proj = v["projected"]
    assert proj["net"]["mean"] == pytest.approx(want.mean(), rel=1e-9)
    ref = scipy.stats.bootstrap((want,), np.mean, n_resamples=20000, method="percentile",
                                rng=np.random.default_rng(3))
    se = ref.standard_error
    assert abs(proj["net"]["low"] - ref.confidence_interval.low) < 0.15 * se
    assert abs(proj["net"]["high"] - ref.confidence_interval.high) < 0.15 * se
    assert proj["answer"] == "yes" and proj["net"]["low"] > 0
    assert "projected" in proj["label"] and "not measured" in proj["label"]
    assert set(summary["projection"]["balances"]["s2g"]["components"].values()) == {"projected"}
    # the EM side: the stats module's rule with the study's margin, searches saved = -Δsearches
    assert v["non_inferiority"]["non_inferior"] is True and v["non_inferiority"]["margin"] == 0.02
    assert v["searches_saved"] == {"delta": pytest.approx(1 / 3), "low": 0.2, "high": 0.5}
    s = v["sentence"]
    assert s.endswith(".") and ". " not in s  # one sentence
    assert "does not pay for itself" in s and "it would pay" in s
    assert "the reasoner counted as free (scripted evidence oracle" in s and "non-inferior within 2 points" in s


def test_em_loss_beyond_the_margin_is_not_non_inferior():
    summary = {"methods": {"searchr1": {}, "s2g": {"delta_em": {"delta": -0.01, "low": -0.0201, "high": 0.0}}},
               "slots": {}}
    v = bv.verdict(summary)["s2g"]
    assert v["non_inferiority"]["non_inferior"] is False
    assert "not shown non-inferior within 2 points (low -0.020)" in v["sentence"]
    # no balance in this summary: the verdict says unknown, it does not invent a number
    assert v["measured"]["answer"] == v["projected"]["answer"] == "unknown"


def test_stepgap_checker_llm_stages_count_as_its_spend():
    """With its LLM stages (booked as ``judge``), StepGap's checker is NLI + judge, and the
    projection prices those stages as the 7B when the checker is the reasoner."""
    native, _, _ = _native_and_s2g(10)
    sg = [_rec(r["id"], [(350, 0, 40)] * 4, nli=3e8, checker=(800, 60)) for r in native]
    native = [_rec(r["id"], [(350, 0, 40)] * 4) for r in native]
    slots = {"reasoner": {"name": "a real LM", "class": "Generator"}, "checker": {"name": "the reasoner"}}
    b = bv.checker_balance(native, sg, "stepgap", slots, CFG)
    assert b["spender"] == "nli + judge"
    assert b["metrics"]["flops"]["spent"]["mean"] == pytest.approx(3e8 + 5e9)
    p = bv.projection({"searchr1": native, "stepgap": sg}, slots, CFG)
    assert p["methods"]["stepgap"]["components"]["judge"]["model"] == "qwen2.5-7b"
    spent = p["balances"]["stepgap"]["metrics"]["flops"]["spent"]["mean"]
    assert spent == pytest.approx(3e8 + completion_flops(Q7, 800, 0, 60))
    # without LLM stages it is the NLI alone, as before
    assert bv.checker_balance(native, [_rec(r["id"], [(350, 0, 40)] * 4, nli=3e8) for r in native], "stepgap",
                              slots, CFG)["spender"] == "nli"


def test_no_verdict_without_the_method_or_without_native():
    v = bv.verdict({"methods": {"searchr1": {}}, "slots": {}})
    assert not v["s2g"]["available"] and "S2G did not run" in v["s2g"]["reason"]
    assert not v["stepgap"]["available"] and "--method stepgap" in v["stepgap"]["reason"]
    v = bv.verdict({"methods": {"s2g": {}, "stepgap": {}}, "slots": {}})
    assert all("native Search-R1 did not run" in v[m]["reason"] for m in ("s2g", "stepgap"))


# -- one real bench ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dev14(tmp_path_factory):
    """14 real dev questions; their own contexts are the corpus (~140 passages, embedded in seconds)."""
    from ragfast.data import sample

    data = tmp_path_factory.mktemp("verdict") / "dev14.jsonl"
    data.write_text("\n".join(sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:14]) + "\n",
                    encoding="utf-8")
    return data


@pytest.fixture(scope="module")
def bench_dir(dev14):
    """8 test questions after 6 validation ones, the scripted oracle in the reasoner slot."""
    from ragfast.comparison.pipeline import make_config, run_bench

    data = dev14
    out = data.parent / "run"
    cfg = make_config(data=str(data), val_data=str(data), corpus=["contexts"], val_offset=0, val_limit=6, offset=6,
                      limit=8, out=str(out), n_resamples=2000, reasoner="scripted",
                      methods=["searchr1", "s2g", "stepgap"])
    summary = run_bench(cfg, table=False, progress=False)
    return out, summary


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_report_opens_with_the_verdict_and_its_numbers_are_summary_json(bench_dir):
    out, _ = bench_dir
    s = json.loads((out / "summary.json").read_text())
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert re.findall(r"^## (.+)$", md, flags=re.M)[:2] == ["Verdict", "Run"]
    assert re.findall(r"<h2 id='s\d+'>([^<]+)</h2>", page)[:2] == ["Verdict", "Run"]
    v = s["verdict"]
    for m, key in (("s2g", "break_even"), ("stepgap", "stepgap_balance")):
        rec = v[m]
        assert rec["available"]
        # the measured side is the balance's cache-independent FLOPs, the EM side the paired deltas
        for k in ("spent", "saved", "net"):
            assert rec["measured"][k] == s[key]["metrics"]["flops"][k]
            assert rec["projected"][k] == s["projection"]["balances"][m]["metrics"]["flops"][k]
        assert rec["delta_em"] == s["methods"][m]["delta_em"]
        d = s["methods"][m]["delta_searches"]
        assert rec["searches_saved"] == {"delta": -d["delta"] + 0.0, "low": -d["high"] + 0.0, "high": -d["low"] + 0.0}
        # every figure the section prints is summary.json's, to the digits shown
        sec = _section(md, "Verdict")
        assert rec["sentence"] in sec and html.escape(rec["sentence"]) in page
        em = rec["delta_em"]
        assert f"{em['delta']:+.3f} [{em['low']:+.3f}, {em['high']:+.3f}]" in sec
        net = rec["measured"]["net"]
        assert f"{net['mean'] * 1e-9 + 0.0:+.3g}" in sec and f"{net['low'] * 1e-9 + 0.0:+.3g}" in sec
    # the scripted oracle's compute is free, and the verdict says so
    assert v["s2g"]["measured"]["components"]["reasoner"] == "free"
    assert "the reasoner counted as free (scripted evidence oracle" in v["s2g"]["sentence"]


def test_projection_is_labelled_projected_and_equals_report_cost(bench_dir):
    from ragfast.commands.cost import load_trajectories

    out, _ = bench_dir
    s = json.loads((out / "summary.json").read_text())
    p = s["projection"]
    assert p["label"] == "projected (nominal roofline), not measured" and p["device"]["name"] == "NVIDIA H200 SXM"
    assert p["reasoner"] == "qwen2.5-7b"
    run = project_run(load_trajectories(out), "h200", reasoner="qwen2.5-7b")
    for m, r in run["methods"].items():
        total = sum(c["projected_flops"] for c in r["components"])
        assert p["methods"][m]["flops_per_question"] * r["questions"] == pytest.approx(total, rel=1e-9), m
    sec = _section((out / "report.md").read_text(), "Verdict")
    assert sec.count("(projected)") == 2 and "Projected (nominal roofline), not measured" in sec
    # the measured side holds no projected figure, and the projected side says what it is
    assert "projected" not in json.dumps(s["verdict"]["s2g"]["measured"])
    assert s["verdict"]["s2g"]["projected"]["label"] == p["label"]


def test_no_raw_booleans_in_the_report(bench_dir):
    out, s = bench_dir
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert "| False |" not in md and "| True |" not in md
    assert ">False<" not in page and ">True<" not in page
    assert s["slots"]["checker"]["name"] == "none"  # the scripted reasoner leaves StepGap's LLM stages empty
    assert "| checker | none | empty: nothing runs in this slot |" in md


def test_terminal_prints_the_verdict_last(bench_dir):
    from rich.console import Console

    from ragfast.comparison import report

    _, summary = bench_dir
    buf = io.StringIO()
    report.print_table(summary, Console(file=buf, width=1000, force_terminal=False))
    lines = [x for x in buf.getvalue().splitlines() if x.strip()]
    assert lines[-3].startswith("Verdict") and lines[-2].strip().startswith("Does S2G pay? measured:")
    assert lines[-1].strip().startswith("Does StepGap pay? measured:") and "projected Qwen2.5-7B/H200" in lines[-1]
    em = summary["verdict"]["s2g"]["delta_em"]
    assert f"ΔEM {em['delta']:+.3f} [{em['low']:+.3f}, {em['high']:+.3f}]" in lines[-2]


def test_a_run_without_s2g_and_stepgap_says_so(dev14, tmp_path):
    from ragfast.comparison.pipeline import make_config, run_bench

    out = tmp_path / "native"
    cfg = make_config(data=str(dev14), corpus=["contexts"], offset=0, limit=4, out=str(out), n_resamples=500,
                      reasoner="scripted", methods=["searchr1"])
    run_bench(cfg, table=False, progress=False)
    md = (out / "report.md").read_text()
    sec = _section(md, "Verdict")
    assert md.index("## Verdict") < md.index("## Run")
    assert "Does S2G pay? No verdict: S2G did not run in this run" in sec
    assert "Does StepGap pay? No verdict: StepGap did not run in this run" in sec
    assert "net saving" not in sec and "pays" not in sec

"""End-to-end ``ragfast bench`` on a small subset: structure, ledger sums, plots, resume."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ragfast.comparison.pipeline import BenchConfig, load_ledger, make_config, run_bench
from ragfast.errors import ConfigError, DataError
from ragfast.outputs.results import read_results
from ragfast.outputs.slot_labels import ORACLE_LABEL

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _norm(text):
    """SQuAD's answer normalisation, written out here as the oracle: lower case, ASCII
    punctuation and the articles a/an/the removed, whitespace collapsed."""
    import re
    import string

    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    # 24 real dev questions: 12 validate the S2G threshold, 10 are the test set; the corpus is
    # their own context paragraphs (~240 passages) so the test embeds in seconds, not minutes.
    from ragfast.data import sample

    tmp = tmp_path_factory.mktemp("bench")
    lines = sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:24]
    data = tmp / "dev24.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp / "run"
    cfg = make_config(data=str(data), val_data=str(data), corpus=["contexts"], val_offset=0, val_limit=12, offset=12,
                      limit=10, reasoner="scripted", out=str(out), n_resamples=2000)
    summary = run_bench(cfg)
    return cfg, out, summary


def test_summary_structure(bench_run):
    cfg, out, summary = bench_run
    disk = json.loads((out / "summary.json").read_text())
    assert set(disk["methods"]) == set(cfg.methods)
    for m, s in disk["methods"].items():
        assert {"em", "f1", "searches_per_question", "n_questions", "cost"} <= set(s)
        assert s["n_questions"] == 10
        assert 0.0 <= s["em"] <= 1.0 and 0.0 <= s["f1"] <= 1.0
        # the summary's EM recomputed from the written trajectories with SQuAD-style normalisation
        recs = read_results(out / "trajectories" / f"{m}.jsonl")
        assert len(recs) == 10
        ems = [float(_norm(r["answer"]) in {_norm(g) for g in r["golden_answers"]}) if r["answer"] is not None
               else 0.0 for r in recs]
        assert [r["em"] for r in recs] == ems, m
        assert s["em"] == pytest.approx(sum(ems) / 10, abs=1e-12), m
        for comp, c in s["cost"].items():
            assert set(c) == {"calls", "tokens", "flops", "seconds"}, (m, comp)
    assert {"reasoner", "retriever", "judge", "nli"} <= set(disk["slots"])
    assert disk["slots"]["reasoner"]["meaningful"] is False  # the scripted oracle says so
    assert disk["slots"]["reasoner"]["answers_meaningful"] == ORACLE_LABEL
    # the judge's verdict is measured on this run's validation states, against counting documents
    judge = disk["slots"]["judge"]
    measured = disk["s2g_threshold"].get("judge_vs_doc_count")
    if measured and measured["measured"]:
        assert judge["ranking_vs_doc_count"] == measured
        assert "counting documents" in judge["answers_meaningful"]
        assert measured["meaningful"] == (measured["low"] > 0)
        if not measured["meaningful"]:
            assert judge["meaningful"] is False and judge["answers_meaningful"].startswith("NO")
    else:
        assert "not measured" in judge["answers_meaningful"]
    for m in cfg.methods:
        if m != "searchr1":
            assert "delta_em" in disk["methods"][m]
    for name in ("summary.csv", "report.md", "report.html", "ragfast.log"):
        assert (out / name).stat().st_size > 0
    log = (out / "ragfast.log").read_text()
    assert "bench:" in log and "searchr1:" in log
    page = (out / "report.html").read_text()
    assert page.count("<img src='data:image/png;base64,") == len(disk["plots"])
    for s in disk["methods"].values():
        assert s["ci"]["em"]["low"] <= s["em"] <= s["ci"]["em"]["high"]


def test_ledger_totals_equal_per_question_sums(bench_run):
    cfg, out, _ = bench_run
    for m in cfg.methods:
        recs = read_results(out / "trajectories" / f"{m}.jsonl")
        led = load_ledger(out / "ledgers" / f"{m}.jsonl", {r["id"] for r in recs})
        per_q = led.per_question()
        assert set(per_q) == {r["id"] for r in recs}, m
        for r in recs:
            for comp, row in r["cost"].items():
                assert per_q[r["id"]][comp]["flops"] == pytest.approx(row["flops"], rel=1e-6, abs=1e-3), (m, comp)
                assert per_q[r["id"]][comp]["seconds"] == pytest.approx(row["seconds"], rel=1e-4, abs=1e-5), (m, comp)
        summary = json.loads((out / "summary.json").read_text())["methods"][m]["cost"]
        tot = led.totals()
        for comp in summary:
            if comp == "total":
                continue
            assert summary[comp]["flops"] == pytest.approx(tot[comp]["flops"], rel=1e-6, abs=1e-3), (m, comp)
            assert summary[comp]["calls"] == pytest.approx(tot[comp]["calls"]), (m, comp)


def test_plots_are_png(bench_run):
    _, out, summary = bench_run
    assert {"pareto.png", "cost_bars.png"} <= set(summary["plots"])
    for name in summary["plots"]:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name


def test_resume_does_no_new_work(bench_run):
    cfg, out, _ = bench_run
    before = {p.name: p.read_bytes() for p in (out / "trajectories").iterdir()}
    ledgers = {p.name: p.read_bytes() for p in (out / "ledgers").iterdir()}
    run_bench(cfg, resume=True)
    assert {p.name: p.read_bytes() for p in (out / "trajectories").iterdir()} == before
    assert {p.name: p.read_bytes() for p in (out / "ledgers").iterdir()} == ledgers


def test_refuses_to_mix_runs(bench_run):
    cfg, _, _ = bench_run
    with pytest.raises(DataError, match="--resume"):
        run_bench(cfg)


def test_resume_with_other_data_or_slots_is_refused_by_name(bench_run, tmp_path):
    import dataclasses

    cfg, out, _ = bench_run
    before = {p.name: p.read_bytes() for p in (out / "trajectories").iterdir()}
    other = tmp_path / "other.jsonl"
    other.write_text(Path(cfg.data).read_text(encoding="utf-8").replace("?", "? "), encoding="utf-8")
    for change, named in (({"data": str(other)}, "data.test.sha256"), ({"index": "bm25"}, "slots.index"),
                          ({"limit": 9}, "questions"), ({"budget": 3}, "config.budget")):
        with pytest.raises(ConfigError, match="--resume: " + named.replace(".", r"\.")):
            run_bench(dataclasses.replace(cfg, **change), resume=True)
    assert {p.name: p.read_bytes() for p in (out / "trajectories").iterdir()} == before


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown method"):
        BenchConfig(methods=["searchr1", "magic"])
    with pytest.raises(ConfigError, match="unknown preset"):
        make_config("nope")
    bad = tmp_path / "c.yaml"
    bad.write_text("budget: 3\nwhatever: 1\n")
    with pytest.raises(ConfigError, match="whatever"):
        make_config(yaml_path=str(bad))
    good = tmp_path / "g.yaml"
    good.write_text("budget: 2\ntopk: 5\n")
    assert make_config(yaml_path=str(good), topk=4).topk == 4


def test_paper_preset_names_every_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFAST_MODELS", str(tmp_path / "models"))
    out = subprocess.run([sys.executable, "-m", "ragfast.cli", "bench", "--preset", "paper", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert out.returncode == 2
    msg = out.stderr
    for name in ("SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo-v0.2", "e5-base-v2", "e5_Flat.index", "wiki-18.jsonl"):
        assert name in msg, msg
    assert "Traceback" not in msg


@pytest.mark.slow
def test_ray_bench_equals_single_process(bench_run, tmp_path):
    """``ragfast bench --ray local`` gives the same per-question outcomes as one process."""
    import dataclasses

    cfg, out, summary = bench_run
    methods = ["searchr1", "s2g", "stepgap"]
    rcfg = dataclasses.replace(cfg, out=str(tmp_path / "ray"), ray="local", ray_workers=2, methods=methods)
    rsum = run_bench(rcfg)
    for m in methods:
        a = {r["id"]: r for r in read_results(out / "trajectories" / f"{m}.jsonl")}
        b = {r["id"]: r for r in read_results(Path(rcfg.out) / "trajectories" / f"{m}.jsonl")}
        assert set(a) == set(b), m
        for qid in a:
            for key in ("answer", "em", "f1", "searches", "stop_reason"):
                assert a[qid][key] == b[qid][key], (m, qid, key)
            assert [t["retrieved_ids"] for t in a[qid]["turns"]] == [t["retrieved_ids"] for t in b[qid]["turns"]], (m, qid)
        assert rsum["methods"][m]["em"] == summary["methods"][m]["em"]
        # the ledger of the Ray run adds up to its per-question records too
        led = load_ledger(Path(rcfg.out) / "ledgers" / f"{m}.jsonl", set(b))
        for qid, r in b.items():
            for comp, row in r["cost"].items():
                assert led.per_question()[qid][comp]["calls"] == pytest.approx(row["calls"]), (m, qid, comp)

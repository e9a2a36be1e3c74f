"""Cost at a declared scale: roofline pricing of recorded work, and `ragfast report cost`."""
from __future__ import annotations

import json

import pytest

from ragfast.errors import ConfigError
from ragfast.accounting.flops import completion_flops
from ragfast.accounting.projection import MODEL_PRESETS, decoder_params, device_profile, project_run

Q7 = MODEL_PRESETS["qwen2.5-7b"]


def _traj(qid, **reasoner):
    return {"id": qid, "cost": {"reasoner": {"calls": 2, "input_tokens": 300, "cached_tokens": 500,
                                             "output_tokens": 120, "flops": 1.0, "seconds": 0.5, **reasoner},
                                "search": {"calls": 2, "flops": 0, "bytes_scanned": 8_000_000, "seconds": 0.01}}}


def test_presets_and_devices():
    assert decoder_params(Q7) == pytest.approx(7.6e9, rel=0.01)  # Qwen2.5-7B has 7.6B weights
    assert device_profile("cpu-4").flops_per_s == 2 * device_profile("cpu-2").flops_per_s
    with pytest.raises(ConfigError, match="unknown device profile 'tpu'"):
        device_profile("tpu")
    with pytest.raises(ConfigError, match="neither a model preset"):
        project_run({"m": [_traj("a")]}, "h200", reasoner="/nonexistent/model")


def test_reasoner_flops_recomputed_from_tokens_and_roofline_bound():
    trajs = [_traj("a"), _traj("b")]
    p = project_run({"native": trajs}, "h200", reasoner="qwen2.5-7b", batch=1)
    rows = {c["component"]: c for c in p["methods"]["native"]["components"]}
    r = rows["reasoner"]
    # per call: 400 prompt tokens of which 250 cached, 60 generated; two calls per question
    assert r["projected_flops"] == pytest.approx(2 * 2 * completion_flops(Q7, 400, 250, 60))
    assert r["measured_flops"] == 2.0 and r["model"] == "qwen2.5-7b"
    # one sequence at a time, streaming 15 GB of weights costs more than 150 fresh prompt tokens'
    # arithmetic (an H200 needs ~206 tokens per weight read to be compute-bound), and decoding
    # is bandwidth-bound on any GPU
    assert r["bound"] == "prefill memory, decode memory"
    assert r["projected_seconds"] >= r["projected_bytes"] / 4.8e12 * 0.99
    big = project_run({"native": trajs}, "h200", reasoner="qwen2.5-7b", batch=256)
    rb = {c["component"]: c for c in big["methods"]["native"]["components"]}["reasoner"]
    assert rb["projected_seconds"] < r["projected_seconds"]  # batching amortises weight reads
    assert rb["bound"].startswith("prefill compute")
    s = rows["search"]
    assert s["model"] == "as recorded" and s["projected_seconds"] == pytest.approx(2 * 8e6 / 4.8e12)
    slow = project_run({"native": trajs}, "cpu-2", reasoner="qwen2.5-7b", batch=1)
    assert slow["methods"]["native"]["projected_seconds_per_question"] > \
        p["methods"]["native"]["projected_seconds_per_question"] * 50


def test_report_cost_command_on_a_real_run(tmp_path):
    from typer.testing import CliRunner

    from ragfast.cli import app
    from ragfast.commands.methods import run_one

    out = tmp_path / "run"
    run_one("searchr1", reasoner="scripted", index="bm25", data="hotpotqa-dev", offset=0, limit=4, out=str(out),
            progress=False)
    res = CliRunner().invoke(app, ["report", "cost", str(out), "--reasoner-config", "qwen2.5-7b",
                                   "--device-profile", "a100"])
    assert res.exit_code == 0, res.output
    assert "projected (nominal roofline), not measured" in res.output and "A100" in res.output
    proj = json.loads((out / "cost_projection.json").read_text())
    (m,) = proj["methods"].values()
    rows = {c["component"]: c for c in m["components"]}
    assert m["questions"] == 4 and rows["reasoner"]["projected_flops"] > 1e9
    assert (out / "cost_projection.md").read_text().startswith("## Cost at a declared scale")
    res = CliRunner().invoke(app, ["report", "cost", str(tmp_path / "missing")])
    assert res.exit_code != 0

"""``bench/gpu_suite.py --dry-run``: every step of the GPU lease script runs on the CPU (Triton
interpreter, tiny sizes) and writes its results as it goes. Slow: about a minute of CPU, most of
it the two-question ``ragfast bench`` run.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_dry_run_runs_every_step_and_saves_results(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "suite"
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    steps = summary["steps"]
    for name in ("build", "check", "topk B=1", "topk B=17", "topk", "prefix", "bench", "total"):
        assert name in steps, (name, list(steps))
    assert steps["check"]["status"] == "passed" and steps["bench"]["status"] == "passed"
    assert summary["ok"] is True
    # the bound certified the tiny searches in the first round (the near-ties went further)
    assert steps["topk B=1"]["certified"]["bf16"].startswith("[1]")
    rows = list(csv.DictReader((out / "gpu_suite.csv").open()))
    providers = {row["provider"] for row in rows if row["op"] == "topk_ip"}
    assert {"ragfast triton fp32", "ragfast triton bf16", "ragfast triton int8", "torch fp32 mm+topk (cuBLAS)"} <= providers
    assert any(row["op"] == "prefix_attention" and row["provider"] == "ragfast triton" for row in rows)
    assert all(float(row["p50"]) > 0 for row in rows)
    assert "timing" in summary["goals"]  # not evaluated without an H100/H200, and it says so
    assert (out / "summary.md").read_text().startswith("# gpu_suite (dry-run)")
    assert (out / "bench-run" / "summary.json").exists()


def test_without_a_gpu_the_real_run_refuses_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_suite.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--dry-run" in r.stderr

"""(slow) The default bench's reasoner slot on the real model: the bundled Search-R1 adapter over
Qwen2.5-Coder-0.5B-Instruct (its base fetched by `.ci/run` with `ragfast models get`, the same
step `ragfast bench` takes on first use), run through the bench with no reasoner flag."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ragfast.runner.settings import RunSettings

pytestmark = pytest.mark.slow


def test_default_bench_runs_the_trained_reasoner(tmp_path):
    # 160 new tokens per turn (its turns are 50-100 tokens; the protocol's 500 only lets a rare
    # runaway turn hold the batch): 20 min at the protocol's cap under load 5, on 2 cores
    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "bench", "--method", "searchr1", "--method", "s2g",
                        "--limit", "2", "--val-limit", "2", "--batch-size", "2", "--max-new-tokens", "160", "--no-progress",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    man = json.loads((out / "manifest.json").read_text())
    slot = man["slots"]["reasoner"]
    assert slot["name"] == RunSettings().reasoner and slot["base"] == "qwen2.5-coder-0.5b"
    assert slot["meaningful"] is True and slot["architecture"] == "Qwen2ForCausalLM"
    rows = [json.loads(x) for x in (out / "trajectories" / "searchr1.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        # the adapter learned the protocol: its first turn searches, and the run ends in an answer
        # or the budget, never in an invalid turn
        assert row["turns"][0]["action"] == "search", row["turns"][0]
        assert row["stop_reason"] in ("answer", "max_turns")
        assert row["cost"]["reasoner"]["flops"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["methods"]["s2g"]["n_questions"] == 2
    assert "s2g" in summary["verdict"]

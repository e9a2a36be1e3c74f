"""Issue 14's cost determinism, end to end through the CLI.

One small bench, three ways: clean (all four methods), killed with SIGKILL at two points and
resumed twice, and each method alone. Every per-method result in ``summary.json`` (EM, F1,
searches, question count, every cost component's calls, tokens and FLOPs) and every per-question
trajectory must be identical across them, timing aside.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

METHODS = ("searchr1", "s2g", "stepgap", "reloop")
# Wall-clock measurements: they differ between any two runs, so they are not compared.
TIMING = {"seconds", "device_seconds", "seconds_per_q", "delta_seconds", "wall_seconds",
          # the methods' report sections: RELOOP's and StepGap's checker wall time per question
          "seconds_per_question", "judge_seconds", "nli_seconds", "checker_to_reasoner_seconds"}
# Nothing else may differ. A call served from a cache filled earlier in the process is charged
# as computed, and ``reused`` counts only what the same question read before on its method's
# ledger, so it does not depend on what ran before (the judge is shared by S2G and RELOOP).
# (``bytes_scanned`` is charged per query, the bytes a search for it alone reads, so it does not
# depend on how a resume batches the leftovers.)
RUN_DEPENDENT: set[str] = set()
# Only a run with native Search-R1 in it has paired deltas against it.
PAIRED = {"n_paired", "n_failed_either", "delta_em", "delta_searches", "delta_flops", "delta_seconds"}


def strip_timing(obj: Any) -> Any:
    """``obj`` without its timing and run-dependent fields, at any depth."""
    if isinstance(obj, dict):
        return {k: strip_timing(v) for k, v in obj.items() if k not in TIMING | RUN_DEPENDENT}
    if isinstance(obj, list):
        return [strip_timing(v) for v in obj]
    return obj


def differences(a: Any, b: Any, path: str = "", *, close: bool = False) -> list[str]:
    """Every path where ``a`` and ``b`` differ, with both values.

    With ``close``, floats outside a ``cost`` block need only agree to 1e-5 relative: a query
    embedded in another batch (a resume batches the leftover questions differently) pads to
    another length and its similarity scores move in the 7th digit. Costs stay exact.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: only in {'first' if k in a else 'second'}")
            else:
                out += differences(a[k], b[k], f"{path}.{k}", close=close and k != "cost")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]", close=close)]
    if close and isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6):
        return []
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []  # an empty calibration bin is NaN in both
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def method_results(out: Path, alone: bool = False) -> dict[str, Any]:
    """summary.json's per-method blocks, timing stripped (and paired deltas when comparing to a lone run)."""
    methods = json.loads((out / "summary.json").read_text(encoding="utf-8"))["methods"]
    return {m: strip_timing({k: v for k, v in s.items() if not (alone and k in PAIRED)}) for m, s in methods.items()}


def whole_summary(out: Path) -> dict[str, Any]:
    """All of summary.json but what describes the run rather than its results, timing stripped.

    ``run`` (wall time, machine, start time) and the plot list describe the run; the checker
    balances' ``text`` renders their numbers, seconds included, and the numbers are compared.
    """
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    for key in ("run", "plots", "plots_missing"):
        s.pop(key, None)
    for key in ("break_even", "stepgap_balance"):
        if key in s:
            s[key] = {k: v for k, v in s[key].items() if k != "text"}
    return strip_timing(s)


def trajectories(out: Path, method: str) -> dict[str, Any]:
    """question id -> its trajectory record, timing stripped."""
    lines = (out / "trajectories" / f"{method}.jsonl").read_text(encoding="utf-8").splitlines()
    recs = [json.loads(line) for line in lines if line.strip()]
    by_id = {r["id"]: strip_timing(r) for r in recs}
    assert len(by_id) == len(recs), f"{out}/{method}: a question recorded twice"
    return by_id


def ledger_totals(out: Path, method: str) -> dict[str, dict[str, float]]:
    """component -> calls, tokens and FLOPs of a method's ledger file (what a resume keeps of it)."""
    from ragfast.runner.recording import load_ledger

    led = load_ledger(out / "ledgers" / f"{method}.jsonl", set(trajectories(out, method)))
    return {c: {k: row[k] for k in ("calls", "tokens", "flops") if k in row} for c, row in led.totals().items()}


def lines_in(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def bench_env(tmp_path_factory):
    """24 bundled dev questions (12 validate, 10 test), their own contexts as corpus, a private cache."""
    from ragfast.data import sample

    tmp = tmp_path_factory.mktemp("determinism")
    data = tmp / "dev24.jsonl"
    data.write_text("\n".join(sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:24]) + "\n",
                    encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               RAGFAST_CACHE=str(tmp / "cache"))
    # batch size 2 so trajectories land a few at a time and a kill falls between questions
    args = ["--data", str(data), "--val-data", str(data), "--corpus", "contexts", "--val-offset", "0",
            "--val-limit", "12", "--offset", "12", "--limit", "10", "--device", "cpu", "--batch-size", "2"]
    return tmp, env, args


def bench_cmd(args: list[str], out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "ragfast.cli", "bench", "--reasoner", "scripted", *args, "--out", str(out), *extra]


def run_to_end(args: list[str], env: dict[str, str], out: Path, *extra: str) -> None:
    r = subprocess.run(bench_cmd(args, out, *extra), env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def run_and_kill(args: list[str], env: dict[str, str], out: Path, watch: list[Path], *extra: str) -> bool:
    """Start a bench; SIGKILL it once any file in ``watch`` holds a line. True when it was killed."""
    proc = subprocess.Popen(bench_cmd(args, out, *extra), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if any(lines_in(p) >= 1 for p in watch):
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.02)
        assert proc.poll() == 0, "the bench failed before it could be killed"
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_clean_killed_resumed_and_alone_give_identical_results(bench_env):
    tmp, env, args = bench_env
    clean = tmp / "clean"
    run_to_end(args, env, clean)

    # Killed twice, resumed twice: once mid-searchr1, once mid-s2g/stepgap.
    killed = tmp / "killed"
    kills = [run_and_kill(args, env, killed, [killed / "trajectories" / "searchr1.jsonl"])]
    kills.append(run_and_kill(args, env, killed, [killed / "trajectories" / f"{m}.jsonl" for m in ("s2g", "stepgap")],
                              "--resume"))
    assert kills == [True, True], f"a kill came too late: the bench had finished ({kills})"
    run_to_end(args, env, killed, "--resume")

    want = method_results(clean)
    assert set(want) == set(METHODS)
    assert differences(method_results(killed), want) == []
    # the rest too: the S2G threshold and analysis, the checker balances, the slots' verdicts
    assert differences(whole_summary(killed), whole_summary(clean))[:5] == []
    for m in METHODS:
        assert differences(trajectories(killed, m), trajectories(clean, m), f"killed:{m}", close=True)[:5] == []
        # the ledger file kept no records of the questions killed mid-way
        assert differences(ledger_totals(killed, m), ledger_totals(clean, m), f"ledger:{m}") == []

    for m in METHODS:
        alone = tmp / f"alone-{m}"
        run_to_end(args, env, alone, "--method", m)
        assert differences(method_results(alone, alone=True)[m], method_results(clean, alone=True)[m], m) == []
        if m == "s2g":  # the threshold is chosen on the same validation questions whatever else runs
            assert differences(whole_summary(alone)["s2g_threshold"], whole_summary(clean)["s2g_threshold"]) == []
        assert differences(trajectories(alone, m), trajectories(clean, m), f"alone:{m}", close=True)[:5] == []

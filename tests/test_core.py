"""The backend registry, the cost ledger and the CLI root."""
import json
import subprocess
import sys

import pytest

import ragfast
from ragfast.ops.registry import BackendError, register, resolve
from ragfast.accounting.ledger import CostLedger


def test_version_and_backends_shape():
    info = ragfast.backends()
    assert info["available"]["ref"] is True
    assert set(info["available"]) == {"ref", "cpp", "triton"}
    assert isinstance(info["ops"], dict)


def test_compiled_core_imports():
    import ragfast._C as C

    b = C.build_info()
    assert b["max_threads"] >= 1
    assert isinstance(b["ops"], list)


def test_env_override_and_errors(monkeypatch):
    register("_test_op", "ref", lambda: "ref")
    assert resolve("_test_op")[0] == "ref"
    with pytest.raises(BackendError, match="no 'cpp' implementation"):
        resolve("_test_op", "cpp")
    monkeypatch.setenv("RAGFAST_BACKEND", "bogus")
    with pytest.raises(BackendError, match="RAGFAST_BACKEND"):
        resolve("_test_op")
    with pytest.raises(BackendError, match="unknown op"):
        resolve("_no_such_op", "ref")


def test_ledger_batch_split_sums_exactly():
    led = CostLedger()
    led.add_batch("reasoner", ["a", "b", "a"], seconds=3.0, input_tokens=[10, 20, 30], output_tokens=[1, 2, 3],
                  flops=[1.0, 2.0, 3.0])
    led.add("search", "b", seconds=0.5, bytes_scanned=100)
    tot = led.totals()
    per_q = led.per_question()
    assert tot["reasoner"]["calls"] == 3 and tot["reasoner"]["batches"] == 1
    assert per_q["a"]["reasoner"]["input_tokens"] == 40
    assert per_q["a"]["reasoner"]["seconds"] == pytest.approx(2.0)  # (1+3)/6 of 3 s
    s = sum(q[c]["seconds"] for q in per_q.values() for c in q)
    assert s == pytest.approx(tot["total"]["seconds"])
    with pytest.raises(ValueError, match="unknown cost component"):
        led.add("gpu", "a")
    with pytest.raises(ValueError, match="2 entries for 3"):
        led.add_batch("judge", ["a", "b", "c"], input_tokens=[1, 2])


def test_ledger_roundtrip(tmp_path):
    led = CostLedger()
    led.add("nli", "q1", input_tokens=5, flops=1e6)
    led.save(tmp_path / "l.jsonl")
    back = CostLedger.load(tmp_path / "l.jsonl")
    assert back.totals()["nli"]["flops"] == 1e6


def test_cli_version_and_backends():
    out = subprocess.run([sys.executable, "-m", "ragfast.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and ragfast.__version__ in out.stdout
    out = subprocess.run([sys.executable, "-m", "ragfast.cli", "backends", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["available"]["ref"] is True

"""``ragfast run searchr1 --ray``: a Ray run writes what the single-process run writes.

The command runs as a user runs it (``python -m ragfast.cli`` in a subprocess), on 8 HotpotQA
questions with the scripted reasoner and BM25 (``--offset 0``): once in one process (default
batch size), once on a local Ray cluster (``--ray local --ray-workers 2 --batch-size 2``: 4 batches over 2
workers). Per-question records (timing aside), EM, F1 and searches must be identical; resume
and bad options are checked too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from ragfast.outputs.results import read_manifest, read_results, strip_timing  # noqa: E402

N = 8
TRAJ, LEDGER = Path("trajectories") / "searchr1.jsonl", Path("ledgers") / "searchr1.jsonl"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "RAY_DEDUP_LOGS": "0"}


def _cli(data: Path, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--model", "scripted", "--retriever", "bm25",
           "--data", str(data), "--offset", "0", "--no-progress", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, cwd=str(data.parent))


def _records(out: Path) -> dict[str, dict]:
    return {r["id"]: strip_timing(r) for r in read_results(out / TRAJ, allow_partial_tail=False)}


def _summary_line(stdout: str) -> list[str]:
    """The cells of the Search-R1 row of the summary table, but its timing column (ms/q, the last)."""
    line = next(x for x in stdout.splitlines() if "Search-R1" in x)
    return [c.strip() for c in line.strip().strip("│").split("│")][:-1]


def _untimed_cost(summary: dict) -> dict:
    # "batches" counts loop batches, which differ with --batch-size; everything else must match.
    return {c: {k: v for k, v in row.items() if k not in ("seconds", "device_seconds", "batches")}
            for c, row in summary["methods"]["searchr1"]["cost"].items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A small QA file: the first 8 questions of the bundled HotpotQA dev sample."""
    from ragfast.data import sample

    lines = sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines(keepends=True)
    path = tmp_path_factory.mktemp("data") / "hotpot8.jsonl"
    path.write_text("".join(lines[:N]), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def single(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "A"
    r = _cli(data, out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.fixture(scope="module")
def on_ray(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ray") / "B"
    r = _cli(data, out, "--ray", "local", "--ray-workers", "2", "--batch-size", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.mark.slow
def test_ray_run_equals_single_process_run(data, single, on_ray):
    (a, ra), (b, rb) = single, on_ray
    from ragfast.data import load_qa

    ids = [q.id for q in load_qa(data)]
    recs_a, recs_b = _records(a), _records(b)
    assert len(recs_a) == N and recs_a == recs_b
    assert list(recs_b) == ids  # the Ray run's file is in question order, each question once

    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    ma_, mb_ = sa["methods"]["searchr1"], sb["methods"]["searchr1"]
    for key in ("n_questions", "em", "f1", "searches_per_question"):
        assert ma_[key] == mb_[key], key
    assert sa["run"]["this_run_questions"] == sb["run"]["this_run_questions"]
    assert [d["meaningful"] for d in sa["slots"].values()] == [d["meaningful"] for d in sb["slots"].values()]
    assert mb_["n_questions"] == N and sb["run"]["this_run_questions"] == {"searchr1": N} and sb["run"]["wall_seconds"] > 0
    assert _untimed_cost(sa) == _untimed_cost(sb)
    ray = sb["run"]["ray"]["searchr1"]
    assert ray["address"] == "local" and ray["workers"] == 2
    assert ray["batches_run"] == N // 2 and ray["retried_batches"] == 0
    assert sb["slots"] == read_manifest(b)["slots"]

    ma, mb = read_manifest(a), read_manifest(b)
    assert mb["pipeline"] == ma["pipeline"] == "bench" and mb["seed"] == ma["seed"] == 0
    assert mb["config"] == {**ma["config"], "batch_size": 2}
    assert mb["ray"] == {"address": "local", "workers": 2, "worker_gpus": 0.0}
    assert mb["slots"]["reasoner"]["class"] == "ScriptedGenerator" and mb["slots"]["reasoner"]["meaningful"] is False
    assert mb["slots"]["reasoner"]["device"] == "cpu"
    assert mb["slots"]["retriever"]["name"] == "bm25" and mb["slots"]["retriever"]["via"] == "ray actor"
    assert "pid" not in mb["slots"]["reasoner"]

    ledgers = sorted((b / "ledgers").glob("*.jsonl"))
    assert len(ledgers) == 1
    led = [json.loads(x) for x in ledgers[0].read_text().splitlines()]
    assert {r["question_id"] for r in led} == set(ids)  # every question's costs, none from elsewhere

    # The same summary row (timing aside) and the same slot verdicts, on stdout.
    assert _summary_line(rb.stdout) == _summary_line(ra.stdout)
    verdicts = [x for x in ra.stdout.splitlines() if "answers meaningful" in x]
    assert verdicts and verdicts == [x for x in rb.stdout.splitlines() if "answers meaningful" in x]
    assert "answers meaningful: NO" in rb.stdout
    assert "ray: 2 worker(s) at 'local', 4 batch(es)" in rb.stderr
    assert "Traceback" not in rb.stderr


@pytest.mark.slow
def test_ray_limit_then_resume_runs_only_the_rest(data, single, tmp_path):
    a, _ = single
    out = tmp_path / "C"
    # --limit on Ray: the first 5 questions, answered exactly as in the full run (the corpus
    # still comes from every question of the file).
    first = _cli(data, out, "--ray", "local", "--ray-workers", "2", "--batch-size", "2", "--limit", "5")
    assert first.returncode == 0, first.stderr[-3000:]
    from ragfast.data import load_qa

    ids = [q.id for q in load_qa(data)]
    recs_a = _records(a)  # in finish order: compare by id
    assert _records(out) == {i: recs_a[i] for i in ids[:5]}
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"]["searchr1"]["n_questions"] == 5 and s["run"]["this_run_questions"] == {"searchr1": 5}
    # ... then interrupted mid-line.
    with open(out / TRAJ, "a", encoding="utf-8") as f:
        f.write('{"id": "torn", "em"')

    # Another configuration is refused before any Ray actor starts.
    bad = _cli(data, out, "--ray", "local", "--batch-size", "2", "--topk", "5", "--resume", timeout=120)
    assert bad.returncode == 2 and "config.topk: 3 in the run on disk, 5 now" in bad.stderr and "Traceback" not in bad.stderr

    r = _cli(data, out, "--ray", "local", "--ray-workers", "2", "--batch-size", "2", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cut a partial last line" in r.stderr and f"resume: 5 of {N} questions already done" in r.stderr
    assert _records(out) == recs_a
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"]["searchr1"]["n_questions"] == N and s["run"]["this_run_questions"] == {"searchr1": N - 5}
    ledgers = sorted((out / "ledgers").glob("*.jsonl"))
    assert len(ledgers) == 1  # one ledger for the run, appended to by the resume
    led = [json.loads(x) for x in ledgers[0].read_text().splitlines()]
    assert {x["question_id"] for x in led} == set(ids)  # every question's costs, the summary's scope
    assert s["methods"]["searchr1"]["cost"]["total"]["calls"] == sum(x["calls"] for x in led)
    assert f"│ Search-R1 │ {N} │" in r.stdout


@pytest.mark.parametrize("extra, message", [
    (("--ray", "local", "--ray-workers", "0"), "--ray-workers must be an integer >= 1, got 0"),
    (("--ray-workers", "2"), "--ray-workers needs --ray"),
    (("--ray", "local", "--device", "cuda"), "--device cannot be used with --ray"),
])
def test_bad_ray_options_are_clear_errors(data, tmp_path, extra, message):
    out = tmp_path / "out"
    r = _cli(data, out, *extra, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert message in " ".join(r.stderr.split())  # rich may wrap the line
    assert "Traceback" not in r.stderr
    assert not (out / TRAJ).exists()  # refused before anything ran


@pytest.mark.slow
def test_killed_ray_run_keeps_the_costs_of_its_finished_questions(data, single, tmp_path):
    """The driver appends each batch's cost records as the batch comes back, before its results."""
    import signal
    import time

    from ragfast.runner.recording import load_ledger

    out = tmp_path / "K"
    cmd = [sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--model", "scripted", "--retriever", "bm25",
           "--data", str(data), "--offset", "0", "--no-progress", "--out", str(out), "--ray", "local", "--ray-workers", "1",
           "--batch-size", "2"]
    # its own process group, so the kill takes the local Ray cluster it started with it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV,
                            cwd=str(data.parent), start_new_session=True)
    results = out / TRAJ
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            if results.exists() and results.read_bytes().count(b"\n") >= 2:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ids = [json.loads(x)["id"] for x in results.read_text().splitlines() if x.endswith("}")]
    assert 2 <= len(ids) < N

    def per_question(path: Path) -> dict:
        led = load_ledger(path, None)
        return {q: {c: {k: v for k, v in row.items() if k not in ("seconds", "device_seconds")} for c, row in d.items()}
                for q, d in led.per_question().items()}

    got, clean = per_question(out / LEDGER), per_question(single[0] / LEDGER)
    assert set(ids) <= set(got) and {q: got[q] for q in ids} == {q: clean[q] for q in ids}

"""Crash-safe results files, the run manifest, and kill-then-resume of ``ragfast run searchr1``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragfast.errors import DataError
from ragfast.outputs.results import (ResultsWriter, finished_ids, read_manifest, read_results, repair_tail, slot_entry,
                             strip_timing, write_manifest)


def test_writer_appends_refuses_duplicates_and_foreign_files(tmp_path):
    p = tmp_path / "r.jsonl"
    with ResultsWriter(p) as w:
        w.write({"id": "a", "em": 1.0})
        w.write({"id": "b", "em": 0.0, "text": "ünïcode\nnewline"})
        with pytest.raises(DataError, match="already in"):
            w.write({"id": "a"})
        with pytest.raises(DataError, match="needs an 'id'"):
            w.write({"em": 1})
    assert [r["id"] for r in read_results(p)] == ["a", "b"]
    assert read_results(p)[1]["text"] == "ünïcode\nnewline"
    assert p.read_text(encoding="utf-8").count("\n") == 2  # one line per record, embedded newline escaped
    with pytest.raises(DataError, match="--resume"):
        ResultsWriter(p)
    with ResultsWriter(p, resume=True) as w:
        assert w.done == {"a", "b"}
        w.write({"id": "c"})
    assert finished_ids(p) == {"a", "b", "c"}
    assert finished_ids(tmp_path / "missing.jsonl") == set()


def test_partial_last_line_is_cut_on_resume(tmp_path):
    p = tmp_path / "r.jsonl"
    with ResultsWriter(p) as w:
        w.write({"id": "a"})
        w.write({"id": "b", "big": "x" * 200_000})  # longer than one read-back block
    whole = p.read_bytes()
    with open(p, "ab") as f:
        f.write(b'{"id": "c", "big": "' + b"y" * 150_000)  # killed mid-write
    assert finished_ids(p) == {"a", "b"}  # the partial line does not count as finished
    with pytest.raises(DataError, match="partial last line"):
        read_results(p, allow_partial_tail=False)
    with ResultsWriter(p, resume=True) as w:
        assert w.repaired_bytes == 150_000 + len(b'{"id": "c", "big": "')
        assert p.read_bytes() == whole
        w.write({"id": "c"})
    assert [r["id"] for r in read_results(p, allow_partial_tail=False)] == ["a", "b", "c"]
    assert repair_tail(p) == 0
    only = tmp_path / "only.jsonl"
    only.write_bytes(b'{"id": "half')
    assert repair_tail(only) == len(b'{"id": "half') and only.read_bytes() == b""


def test_corrupt_line_is_named(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": "a"}\nnot json\n')
    with pytest.raises(DataError, match=r"r.jsonl:2: not valid JSON"):
        read_results(p)
    p.write_text('{"id": "a"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r":2: .*JSON object with an 'id'"):
        read_results(p)


def test_manifest_slots_and_resume_guard(tmp_path):
    from ragfast.models.scripted import ScriptedGenerator

    gen = ScriptedGenerator()
    write_manifest(tmp_path, pipeline="searchr1", slots={"reasoner": gen, "judge": {"name": "j", "meaningful": True}},
                   config={"topk": 3}, seed=1, extra={"data": "x"})
    m = read_manifest(tmp_path)
    assert m["slots"]["reasoner"]["meaningful"] is False
    assert m["slots"]["reasoner"]["answers_meaningful"].startswith("NO")
    assert "evidence reachability" in m["slots"]["reasoner"]["note"]
    assert m["config"] == {"topk": 3} and m["seed"] == 1 and m["data"] == "x"
    write_manifest(tmp_path, pipeline="searchr1", slots={"reasoner": gen}, config={"topk": 3}, seed=1)  # same run
    with pytest.raises(DataError, match=r"config\.topk: 3 in the run on disk, 5 now"):
        write_manifest(tmp_path, pipeline="searchr1", slots={"reasoner": gen}, config={"topk": 5}, seed=1)
    with pytest.raises(DataError, match=r"seed: 1 in the run on disk, 2 now"):
        write_manifest(tmp_path, pipeline="searchr1", slots={"reasoner": gen}, config={"topk": 3}, seed=2)
    assert slot_entry(object())["meaningful"] is True


def test_strip_timing():
    rec = {"id": "a", "cost": {"reasoner": {"seconds": 1.5, "flops": 2.0, "device_seconds": 0.1}},
           "turns": [{"extra": {"cost": {"search": {"seconds": 3, "calls": 1}}}}]}
    assert strip_timing(rec) == {"id": "a", "cost": {"reasoner": {"flops": 2.0}},
                                 "turns": [{"extra": {"cost": {"search": {"calls": 1}}}}]}


TRAJ = Path("trajectories") / "searchr1.jsonl"


def _cli(out, *extra):
    # The scripted oracle with BM25 keeps torch out of the subprocesses (start-up dominates on a
    # loaded machine); one question per batch makes the run long enough to kill mid-way.
    return [sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--model", "scripted", "--retriever", "bm25",
            "--data", "hotpotqa-dev", "--offset", "0", "--limit", "80", "--batch-size", "1", "--no-progress", "--out",
            str(out),
            *extra]


# Runs the CLI with ResultsWriter.write wrapped: after the HOLD-th record is on disk (fsynced) the
# process says so in a file and waits to be killed, so the kill lands mid-run whatever the load.
_HELD_CLI = """
import pathlib, runpy, sys, time
from ragfast.outputs import results
hold, flag = int(sys.argv[1]), pathlib.Path(sys.argv[2])
orig, seen = results.ResultsWriter.write, []
def write(self, record):
    orig(self, record)
    seen.append(record["id"])
    if len(seen) == hold:
        flag.write_text(str(hold))
        time.sleep(600)
results.ResultsWriter.write = write
sys.argv = ["ragfast"] + sys.argv[3:]
runpy.run_module("ragfast.cli", run_name="__main__")
"""


def test_kill_mid_run_then_resume_matches_uninterrupted_run(tmp_path):
    from ragfast.commands.methods import run_one

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    killed = tmp_path / "killed"
    flag = tmp_path / "held"
    cmd = [sys.executable, "-c", _HELD_CLI, "3", str(flag)] + _cli(killed)[3:]
    err = tmp_path / "stderr.txt"
    with open(err, "wb") as errf:  # a file, not a pipe: a full pipe would block the child
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errf, env=env)
    res = killed / TRAJ
    deadline = time.monotonic() + 300  # a liveness guard only: the kill waits for the flag, not a time
    try:
        while not flag.exists():
            assert proc.poll() is None, "the run ended before its third record: " + err.read_text()[-2000:]
            assert time.monotonic() < deadline, "no third record within 300 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    n_before = len(read_results(res))
    assert n_before == 3

    r = subprocess.run(_cli(killed, "--resume"), capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resume: {n_before} of 80 questions already done" in r.stderr
    said = " ".join(r.stdout.split())  # rich wraps long lines
    assert "EM" in said and "ms/q" in said and "search/q" in said
    assert "answers meaningful: NO" in said and "evidence reachability" in said

    # The same run, uninterrupted (in-process: same code path as the CLI).
    full = tmp_path / "full"
    run_one("searchr1", reasoner="scripted", index="bm25", data="hotpotqa-dev", offset=0, limit=80, batch_size=1,
            out=str(full), progress=False)

    def content(path):
        return {x["id"]: strip_timing(x) for x in read_results(path / TRAJ, allow_partial_tail=False)}

    a, b = content(full), content(killed)
    assert len(a) == 80 and a == b
    lines = (killed / TRAJ).read_text().splitlines()
    assert len(lines) == 80 and len({json.loads(x)["id"] for x in lines}) == 80
    summary = json.loads((killed / "summary.json").read_text())
    s1 = summary["methods"]["searchr1"]
    assert s1["n_questions"] == 80 and summary["run"]["this_run_questions"] == {"searchr1": 80 - n_before}
    assert summary["slots"]["reasoner"]["meaningful"] is False
    assert s1["em"] == pytest.approx(sum(x["em"] for x in a.values()) / 80)

    # Resuming with another configuration would mix two runs in one file: refused by name.
    from ragfast.errors import ConfigError

    with pytest.raises(ConfigError, match=r"config\.topk: 3 in the run on disk, 5 now"):
        run_one("searchr1", reasoner="scripted", index="bm25", data="hotpotqa-dev", offset=0, limit=80, batch_size=1,
                topk=5, out=str(killed), resume=True, progress=False)


@pytest.mark.parametrize("flag, value, named", [
    ("--data", "hotpotqa-train", "data.test"),   # another file: its content hash differs
    ("--retriever", "default", "slots.index"),
    ("--offset", "1", "questions"),             # another slice of the same file (a larger --limit is fine)
    ("--corpus", "contexts", "slots.corpus"),
])
def test_resume_with_other_settings_exits_2_naming_the_difference(tmp_path, flag, value, named):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = tmp_path / "run"
    first = [sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--model", "scripted", "--retriever", "bm25",
             "--data", "hotpotqa-dev", "--offset", "0", "--limit", "3", "--no-progress", "--out", str(out)]
    r = subprocess.run(first, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    before = (out / TRAJ).read_bytes()
    again = list(first)
    if flag in again:
        again[again.index(flag) + 1] = value
    else:
        again += [flag, value]
    r = subprocess.run(again + ["--resume"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: --resume: " + named), r.stderr
    assert (out / TRAJ).read_bytes() == before  # finished work untouched


def test_readers_take_both_run_layouts(tmp_path):
    """eval-reasoner and stepgap check read a run directory of either layout: the hand-written run
    commands' results.jsonl and the bench's (and generated run M's) trajectories/<m>.jsonl."""
    from ragfast.methods.searchr1.reasoner_eval import load_trajectories
    from ragfast.outputs.results import trajectories_path

    line = '{"id": "q1", "question": "Q?", "answer": "a", "golden_answers": ["a"], "em": 1.0, "turns": []}\n'
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    (new / "trajectories").mkdir(parents=True)
    (old / "results.jsonl").write_text(line)
    (new / "trajectories" / "searchr1.jsonl").write_text(line)
    (new / "trajectories" / "stepgap.jsonl").write_text("")
    assert trajectories_path(old) == old / "results.jsonl"
    assert trajectories_path(new) == new / "trajectories" / "searchr1.jsonl"
    assert trajectories_path(new, "stepgap") == new / "trajectories" / "stepgap.jsonl"
    assert trajectories_path(old / "results.jsonl") == old / "results.jsonl"
    assert [t.id for t in load_trajectories(old)] == [t.id for t in load_trajectories(new)] == ["q1"]
    with pytest.raises(DataError, match="not a `ragfast run reloop` output directory"):
        trajectories_path(new, "reloop")

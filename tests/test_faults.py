"""Faults: two writers, kills, corrupt files, changed inputs, bad input at the edge (issue 27).

Every test here reproduces one defect that gave wrong results, lost work, or a traceback before
it was fixed. The CLI runs use the scripted reasoner over BM25 (seconds each); the kill tests
kill a real process at a point chosen by what is on disk.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragfast.errors import ConfigError, DataError

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# Wall time differs between any two runs; everything else in a cost must not.
TIMING = {"seconds", "device_seconds"}
# Where `ragfast run searchr1` writes (the bench's layout).
TRAJ, LEDGER = Path("trajectories") / "searchr1.jsonl", Path("ledgers") / "searchr1.jsonl"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ragfast.cli", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def run_args(out: Path, *extra: str, limit: int = 10) -> list[str]:
    return ["run", "searchr1", "--model", "scripted", "--retriever", "bm25", "--data", "hotpotqa-dev",
            "--offset", "0", "--limit", str(limit), "--batch-size", "1", "--no-progress", "--out", str(out), *extra]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The single non-empty stderr line of a refused command (exit code 2, no traceback)."""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


def files_under(p: Path) -> dict[str, int]:
    """Every file under ``p`` with its size, but the lock file (it holds the pid of its last holder)."""
    return {str(f.relative_to(p)): f.stat().st_size for f in p.rglob("*")
            if f.is_file() and f.name != ".ragfast.lock"} if p.exists() else {}


def no_timing(obj):
    if isinstance(obj, dict):
        return {k: no_timing(v) for k, v in obj.items() if k not in TIMING}
    return obj


# -- two writers --------------------------------------------------------------------------------
def test_second_writer_is_refused_naming_the_holder(tmp_path):
    from ragfast.outputs.outdir import lock_dir

    out = tmp_path / "run"
    with lock_dir(out):  # this process holds --out, as a running command would
        before = files_under(out)
        err = one_error_line(cli(*run_args(out)))
        assert f"is in use by another ragfast process (pid {os.getpid()})" in err
        assert files_under(out) == before  # nothing written beside the holder
        # a resume takes the same lock
        err = one_error_line(cli(*run_args(out, "--resume")))
        assert f"pid {os.getpid()}" in err
    r = cli(*run_args(out))  # released: the run goes ahead
    assert r.returncode == 0, r.stderr[-2000:]


def test_lock_is_released_when_the_holder_is_killed(tmp_path):
    out = tmp_path / "held"
    code = ("import sys, time; from ragfast.outputs.outdir import lock_dir\n"
            f"with lock_dir({str(out)!r}):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        from ragfast.outputs.outdir import lock_dir

        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            with lock_dir(out):
                pass
        holder.kill()
        holder.wait(timeout=30)
        with lock_dir(out):  # SIGKILL leaves no stale lock
            pass
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.mark.slow
def test_two_concurrent_runs_never_mix(tmp_path):
    out = tmp_path / "both"
    procs = [subprocess.Popen([sys.executable, "-m", "ragfast.cli", *run_args(out)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=ENV) for _ in range(2)]
    res = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], res
    lines = (out / TRAJ).read_text().splitlines()
    assert len(lines) == 10 and len({json.loads(x)["id"] for x in lines}) == 10


# -- accounting that survives a kill ------------------------------------------------------------
def _kill_after(args: list[str], path: Path, lines: int) -> int:
    """Start the CLI, SIGKILL it once ``path`` holds ``lines`` lines; the lines finished then."""
    proc = subprocess.Popen([sys.executable, "-m", "ragfast.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 180
    try:
        while time.time() < deadline and proc.poll() is None:
            if path.exists() and path.read_bytes().count(b"\n") >= lines:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    return path.read_bytes().count(b"\n")


def _ledger_by_question(out: Path, name: str | Path = LEDGER) -> dict[str, dict]:
    from ragfast.accounting.ledger import CostLedger
    from ragfast.runner.recording import load_ledger

    led: CostLedger = load_ledger(out / name, None)
    return {q: {c: no_timing(row) for c, row in d.items()} for q, d in led.per_question().items()}


def _finished_ids(path: Path) -> list[str]:
    return [json.loads(x)["id"] for x in path.read_text().splitlines() if x.endswith("}")]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "run"
    r = cli(*run_args(out, limit=40))
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.parametrize("kill_at", [5, pytest.param(1, marks=pytest.mark.slow), pytest.param(23, marks=pytest.mark.slow),
                                     pytest.param(36, marks=pytest.mark.slow)])
def test_killed_run_keeps_its_costs_and_resume_costs_what_a_clean_run_does(clean_run, tmp_path, kill_at):
    out = tmp_path / "killed"
    done = _kill_after(run_args(out, limit=40), out / TRAJ, kill_at)
    assert kill_at <= done < 40
    # the ledger was written as questions finished: every finished question has its records
    ids = {json.loads(x)["id"] for x in (out / TRAJ).read_text().splitlines() if x.endswith("}")}
    assert ids <= set(_ledger_by_question(out))
    r = cli(*run_args(out, "--resume", limit=40))
    assert r.returncode == 0, r.stderr[-2000:]
    from ragfast.runner.recording import load_ledger

    clean_s = json.loads((clean_run / "summary.json").read_text())
    resumed_s = json.loads((out / "summary.json").read_text())
    clean, resumed = clean_s["methods"]["searchr1"], resumed_s["methods"]["searchr1"]
    # a clean run's ledger file holds every record it made: the file's totals are the summary's
    for comp, row in load_ledger(clean_run / LEDGER, None).totals().items():
        want = clean["cost"][comp]
        assert {k: row[k] for k in ("calls", "flops")} == pytest.approx({k: want[k] for k in ("calls", "flops")}), comp
    # the summary's cost covers every question, as its EM does (issue 24 #7) ...
    assert resumed["n_questions"] == clean["n_questions"] == 40
    assert resumed_s["run"]["this_run_questions"]["searchr1"] < 40
    for comp in clean["cost"]:
        assert no_timing(resumed["cost"][comp]) == no_timing(clean["cost"][comp]), comp
    assert resumed["em"] == clean["em"]
    # ... and so does the ledger, question by question, with nothing counted twice
    assert _ledger_by_question(out) == _ledger_by_question(clean_run)


def test_killed_s2g_study_keeps_the_native_passes_costs_and_resumes_to_the_clean_result(clean_run, tmp_path):
    # study s2g's native pass is run searchr1's loop over the same corpus (every question of the
    # file), model and batch size: each finished question's records must be the clean run's.
    out = tmp_path / "s2g"
    args = ["study", "s2g", *run_args(out, limit=40)[2:], "--threshold", "0.5", "--no-live", "--n-resamples", "50"]
    done = _kill_after(args, out / "native.jsonl", 4)
    assert 4 <= done < 40
    ids = _finished_ids(out / "native.jsonl")
    got, clean = _ledger_by_question(out, "ledger-native.jsonl"), _ledger_by_question(clean_run)
    assert set(ids) <= set(got) <= set(ids) | {None}  # at most the setup records beside them
    assert {q: got[q] for q in ids} == {q: clean[q] for q in ids}
    # a rerun without --resume would have deleted the finished work: it is refused, files kept
    before = files_under(out)
    assert "pass --resume to continue it" in one_error_line(cli(*args))
    assert files_under(out) == before
    # other settings are refused, naming the one that differs
    assert "config.threshold" in one_error_line(cli(*args[:-5], "--threshold", "0.6", *args[-3:], "--resume"))
    r = cli(*args, "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resume: {len(ids)} of 40 questions already done" in r.stderr
    # the resumed study holds every question once, each as the clean run made it
    nat = [json.loads(x) for x in (out / "native.jsonl").read_text().splitlines()]
    ref = {d["id"]: d for d in map(json.loads, (clean_run / TRAJ).read_text().splitlines())}
    assert sorted(d["id"] for d in nat) == sorted(ref)
    assert [(d["answer"], [t["generated"] for t in d["turns"]]) for d in nat] == [
        (ref[d["id"]]["answer"], [t["generated"] for t in ref[d["id"]]["turns"]]) for d in nat]
    resumed = _ledger_by_question(out, "ledger-native.jsonl")
    assert {q: v for q, v in resumed.items() if q is not None} == {q: v for q, v in clean.items() if q is not None}
    states = [json.loads(x) for x in (out / "states.jsonl").read_text().splitlines()]
    assert {s["id"] for s in states} == set(ref)


def test_killed_stepgap_run_keeps_its_costs_and_resume_costs_what_a_clean_run_does(tmp_path):
    sg = ["run", "stepgap", "--model", "scripted", "--retriever", "bm25", "--data", "hotpotqa-dev", "--offset", "0",
          "--limit", "8", "--batch-size", "1", "--no-progress", "--out"]
    r = cli(*sg, str(tmp_path / "clean"))
    assert r.returncode == 0, r.stderr[-2000:]
    clean = _ledger_by_question(tmp_path / "clean", "ledgers/stepgap.jsonl")
    out = tmp_path / "killed"
    done = _kill_after([*sg, str(out)], out / "trajectories" / "stepgap.jsonl", 3)
    assert 3 <= done < 8
    ids = _finished_ids(out / "trajectories" / "stepgap.jsonl")
    got = _ledger_by_question(out, "ledgers/stepgap.jsonl")
    # every finished question's records, as the clean run made them (NLI and reasoner included)
    assert set(ids) <= set(got) and {q: got[q] for q in ids} == {q: clean[q] for q in ids}
    assert all({"reasoner", "nli"} <= set(clean[q]) for q in ids)
    # a resume drops the records of the question killed mid-way and completes the file
    r = cli(*sg, str(out), "--resume")
    assert r.returncode == 0, r.stderr[-2000:]
    assert _ledger_by_question(out, "ledgers/stepgap.jsonl") == clean


def test_corrupt_ledger_line_is_refused_not_dropped(clean_run, tmp_path):
    import shutil

    out = tmp_path / "corrupt"
    shutil.copytree(clean_run, out)
    led = out / LEDGER
    lines = led.read_text().splitlines(keepends=True)
    lines[len(lines) // 2] = '{"component": "search", "question_id": "x", "calls": 1, "byt\n'
    led.write_text("".join(lines))
    before = led.read_bytes()
    err = one_error_line(cli(*run_args(out, "--resume", limit=40)))
    assert f"{led}:{len(lines) // 2 + 1}: corrupt ledger line" in err
    assert led.read_bytes() == before


def test_summary_json_holds_null_not_nan(tmp_path):
    from ragfast.outputs.results import dumps

    text = dumps({"a": float("nan"), "b": [1.0, float("inf")], "c": {"d": -float("inf")}})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None}}
    assert "NaN" not in text and "Infinity" not in text
    import numpy as np

    assert json.loads(dumps({"x": np.float32("nan"), "y": np.arange(2)})) == {"x": None, "y": [0, 1]}


# -- resume without a manifest ------------------------------------------------------------------
def test_resume_without_manifest_but_with_results_is_refused(clean_run, tmp_path):
    import shutil

    out = tmp_path / "nomanifest"
    shutil.copytree(clean_run, out)
    (out / "manifest.json").unlink()
    before = files_under(out)
    err = one_error_line(cli(*run_args(out, "--resume", "--topk", "5", limit=40)))
    assert "manifest.json is missing" in err and "searchr1.jsonl" in err
    assert files_under(out) == before


# -- index build resume keyed by content --------------------------------------------------------
def _corpus(path: Path, word: str, n: int) -> Path:
    rows = [{"id": str(i), "contents": f'"{word} {i}"\n{word} passage number {i} about {word}s and more {word}.'}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _wait_for(pred, proc: subprocess.Popen, timeout: float = 180) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.slow
def test_index_build_resume_refuses_another_corpus(tmp_path):
    import numpy as np

    a, b = _corpus(tmp_path / "A.jsonl", "apple", 160), _corpus(tmp_path / "B.jsonl", "brick", 160)
    out = tmp_path / "X"
    args = ["index", "build", "--encoder", "minilm", "--out", str(out), "--chunk-size", "20", "--batch-size", "4"]
    proc = subprocess.Popen([sys.executable, "-m", "ragfast.cli", *args, "--corpus", str(a)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        first = out / "chunks" / "emb-00000.npy"
        assert _wait_for(first.exists, proc), "the build finished (or failed) before a chunk was on disk"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert not (out / "vectors.npy").exists()
    before = files_under(out)
    err = one_error_line(cli(*args, "--corpus", str(b)))  # same size, chunking and encoder: other content
    assert "holds an index built from other inputs (corpus.sha256:" in err
    assert files_under(out) == before
    # the same corpus resumes, and every row is A's
    r = cli(*args, "--corpus", str(a), "--keep-chunks")
    assert r.returncode == 0, r.stderr[-2000:]
    from ragfast.data import load_corpus
    from ragfast.encoders.encoder import Encoder

    want = Encoder("minilm").encode_passages(load_corpus(str(a)).contents(range(160))).numpy()
    got = np.load(out / "vectors.npy")
    np.testing.assert_allclose(got, want, atol=2e-5)
    # a finished build with its chunks kept refuses the other corpus too
    err = one_error_line(cli(*args, "--corpus", str(b), "--keep-chunks"))
    assert "corpus.sha256" in err
    # chunks whose build.json is gone: refused, never reinterpreted
    (out / "build.json").unlink()
    err = one_error_line(cli(*args, "--corpus", str(a)))
    assert "but no build.json" in err


def test_embedding_chunks_refuse_another_corpus_of_the_same_size(minilm_encoder, tmp_path):
    from ragfast.encoders.encoder import encode_corpus

    a = [f"apple passage {i}" for i in range(12)]
    b = [f"brick passage {i}" for i in range(12)]
    out = tmp_path / "emb"
    encode_corpus(minilm_encoder, a, out, chunk_size=4, progress=False, max_chunks=1)
    with pytest.raises(DataError, match="the corpus content changed"):
        encode_corpus(minilm_encoder, b, out, chunk_size=4, progress=False)
    (out / "meta.json").unlink()
    with pytest.raises(DataError, match="chunk.* but no meta.json"):
        encode_corpus(minilm_encoder, a, out, chunk_size=4, progress=False)


# -- bounded waits ------------------------------------------------------------------------------
@pytest.fixture
def hung_server():
    """A loopback server that accepts connections and reads requests but never answers."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            held.append(c)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(timeout=5)
    for c in held:
        c.close()
    srv.close()


def test_hung_server_times_out_with_a_progress_line_and_one_error(hung_server, monkeypatch, caplog):
    import httpx

    from ragfast.infra import http

    monkeypatch.setattr(http, "WAIT_NOTICE_S", 0.2)
    monkeypatch.setenv("RAGFAST_CALL_TIMEOUT", "1.0")
    monkeypatch.setenv("RAGFAST_TOTAL_TIMEOUT", "30")
    url = hung_server + "/retrieve"
    with httpx.Client(timeout=600) as client, caplog.at_level("WARNING", logger="ragfast.infra.http"):
        with pytest.raises(DataError, match=rf"^{url} did not answer within 1 s \(--call-timeout\)"):
            http.post_json(client, url, {"queries": ["q"]}, retries=2, error=DataError)
    assert any(f"still waiting for {url}" in r.getMessage() for r in caplog.records)
    # the total bound wins over the per-call one
    monkeypatch.setenv("RAGFAST_CALL_TIMEOUT", "60")
    monkeypatch.setenv("RAGFAST_TOTAL_TIMEOUT", "0.5")
    with httpx.Client() as client:
        with pytest.raises(DataError, match=r"within 0 s \(--total-timeout\)|gave up on .* \(--total-timeout\)"):
            http.get_json(client, url, error=DataError)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "abc"])
def test_bad_timeout_flag_is_one_line(value, tmp_path):
    r = cli("--call-timeout", value, "run", "searchr1", "--model", "scripted", "--out", str(tmp_path / "o"))
    if value == "abc":  # typer refuses a non-number itself (its usage error, exit 2)
        assert r.returncode == 2 and "Traceback" not in r.stderr
    else:
        assert "--call-timeout must be a number of seconds > 0" in one_error_line(r)
    assert not (tmp_path / "o").exists()


def test_hung_retriever_ends_the_run_with_one_line_naming_the_url(hung_server, tmp_path):
    out = tmp_path / "run"
    r = cli("--call-timeout", "2", "--total-timeout", "6", "run", "searchr1", "--model", "scripted", "--retriever",
            hung_server, "--data", "hotpotqa-dev", "--offset", "0", "--limit", "3", "--no-progress", "--out", str(out), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(err) == 1 and hung_server in err[0] and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "every one of its 3 questions failed (retriever 3" in err[0]
    # one timed-out call carried the three questions: each is recorded once, as a transient failure
    recs = [json.loads(x) for x in (out / TRAJ).read_text().splitlines()]
    assert len(recs) == 3 and all(r["failure"]["component"] == "retriever" and r["failure"]["transient"] for r in recs)


# -- validation at the edge: one line, exit 2, no new files -------------------------------------
def _hotpot_rows(n: int = 3) -> list[dict]:
    from ragfast.data import sample

    return [json.loads(x) for x in sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:n]]


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (CLI arguments after the output options, a phrase the one error line holds)."""
    rows = _hotpot_rows()
    ff = tmp / "ff.jsonl"
    ff.write_bytes(json.dumps(rows[0]).encode() + b"\n" + json.dumps(rows[1]).encode()[:-2] + b"\xff\"}\n")
    corpus_ff = tmp / "corpus_ff.jsonl"
    corpus_ff.write_bytes(b'{"id": "0", "contents": "\\"T\\"\\nok"}\n{"id": "1", "contents": "bad \xff"}\n')
    answer_int = _write_rows(tmp / "answer_int.jsonl", [{**rows[0], "answer": 123}] + rows[1:])
    ctx_str = _write_rows(tmp / "ctx_str.jsonl", [{**rows[0], "context": "str"}] + rows[1:])
    long_q = _write_rows(tmp / "long_q.jsonl", [{**rows[0], "question": "why " * 5000}] + rows[1:])
    long_p = _write_rows(tmp / "long_p.jsonl", [{"id": "0", "contents": '"T"\nok'},
                                                 {"id": "1", "contents": '"T"\n' + "x" * (200000 - 4)}])
    cfg = {}
    for name, text in (("budget_str", 'budget: "4"\n'), ("syntax", "topk: [3\nseed: 1\n"),
                       ("dup", "topk: 3\nseed: 1\ntopk: 5\n"), ("nan", "threshold: .nan\n")):
        cfg[name] = tmp / f"{name}.yaml"
        cfg[name].write_text(text, encoding="utf-8")
    run = ["run", "searchr1", "--model", "scripted", "--retriever", "bm25", "--no-progress", "--offset", "0", "--limit",
           "2"]
    bench = ["bench", "--reasoner", "scripted", "--limit", "2", "--val-limit", "2"]
    return {
        "xff in --data": (run + ["--data", str(ff)], "ff.jsonl:2: not UTF-8 text (byte 0xff"),
        "xff in --corpus": (["index", "build", "--encoder", "bm25", "--corpus", str(corpus_ff)],
                            "corpus_ff.jsonl:2: not UTF-8 text"),
        "answer: 123": (run + ["--data", str(answer_int)], "gold answers must be strings, got int 123"),
        "context: str": (run + ["--data", str(ctx_str)], "'context' must be an object"),
        "question too long": (run + ["--data", str(long_q)], "over the limit of 4096 (id"),
        "passage too long": (["index", "build", "--encoder", "bm25", "--corpus", str(long_p)],
                             "passage 1 (id '1') has 200000 characters, over the limit of 100000"),
        "YAML budget: '4'": (bench + ["--config", str(cfg["budget_str"])], "--budget must be an integer, got str '4'"),
        "YAML budget: '4' (run)": (run + ["--config", str(cfg["budget_str"])], "--budget must be an integer, got str '4'"),
        "YAML syntax": (run + ["--config", str(cfg["syntax"])], "syntax.yaml:2:5: not valid YAML"),
        "YAML duplicate key": (run + ["--config", str(cfg["dup"])], "duplicate key 'topk' (first on line 1)"),
        "YAML threshold NaN": (bench + ["--config", str(cfg["nan"])], "--threshold must be a number (not NaN)"),
        "--threshold nan": (bench + ["--method", "s2g", "--threshold", "nan"], "--threshold must be a number (not NaN)"),
        "--val-limit 0": (["bench", "--reasoner", "scripted", "--limit", "2", "--val-limit", "0"], "--val-limit must be >= 1"),
    }


CASES = ["xff in --data", "xff in --corpus", "answer: 123", "context: str", "question too long", "passage too long",
         "YAML budget: '4'",
         "YAML budget: '4' (run)", "YAML syntax", "YAML duplicate key", "YAML threshold NaN", "--threshold nan",
         "--val-limit 0"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_no_new_files(case, tmp_path):
    args, phrase = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    before = files_under(tmp_path)
    err = one_error_line(cli(*args, "--out", str(out)))
    assert phrase in err, err
    assert not out.exists(), files_under(out)
    assert files_under(tmp_path) == before


def test_yaml_method_is_an_alias_of_methods(tmp_path):
    from ragfast.comparison.pipeline import make_config
    from ragfast.runner.config_file import load_yaml

    p = tmp_path / "m.yaml"
    p.write_text("method: [searchr1, s2g]\n", encoding="utf-8")
    assert load_yaml(str(p)) == {"methods": ["searchr1", "s2g"]}
    assert make_config(yaml_path=str(p)).methods == ["searchr1", "s2g"]
    p.write_text("method: [searchr1]\nmethods: [s2g]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="set the same setting"):
        load_yaml(str(p))


# -- model files, remote scores, pickles --------------------------------------------------------
def test_pickled_npy_index_is_refused(tmp_path):
    import numpy as np

    from ragfast.retrieval.dense import DenseIndex

    p = tmp_path / "evil.npy"
    np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match="pickled Python objects"):
        DenseIndex.load(p)


def test_truncated_safetensors_is_one_model_error(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    from ragfast.checks import check_safetensors
    from ragfast.errors import ModelError

    f = tmp_path / "model.safetensors"
    save_file({"w": np.ones((64, 64), dtype=np.float32)}, str(f))
    check_safetensors(tmp_path)  # whole: fine
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelError, match="truncated or not a safetensors file"):
        check_safetensors(tmp_path)
    f.write_bytes(b"\x05")
    with pytest.raises(ModelError, match="truncated"):
        check_safetensors(tmp_path)


def test_trainer_state_is_loaded_weights_only(tmp_path):
    import pickle

    import torch

    from ragfast.judges.train.causal import load_trainer_state

    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    p = tmp_path / "trainer_state.pt"
    with open(p, "wb") as f:
        pickle.dump({"step": 1, "x": Evil()}, f)
    with pytest.raises(ConfigError, match="not a plain trainer state"):
        load_trainer_state(p)
    assert not marker.exists()  # the pickle's code never ran
    torch.save({"step": 3, "losses": [0.5], "optimizer": {"state": {}, "param_groups": []}}, p)
    assert load_trainer_state(p)["step"] == 3


@pytest.mark.parametrize("score", ["NaN", "Infinity", '"0.5"', "true"])
def test_remote_judge_refuses_a_score_that_is_not_a_number_or_null(score):
    import httpx

    from ragfast.errors import ModelError
    from ragfast.judges.remote import RemoteJudge

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"judge": {"name": "j", "meaningful": True}})
        n = len(json.loads(request.content)["states"])
        body = '{"scores": [0.25' + (", " + score) * (n - 1) + "]}"
        return httpx.Response(200, content=body.encode(), headers={"content-type": "application/json"})

    client = httpx.Client(transport=httpx.MockTransport(handler))
    judge = RemoteJudge("http://judge.test", client=client)
    with pytest.raises(ModelError, match=r"sent score 1 = .*not a finite number or null"):
        judge.stop_scores([("q", ["a"]), ("q", ["a", "b"])])
    ok = httpx.Client(transport=httpx.MockTransport(
        lambda r: handler(r) if r.url.path == "/health" else httpx.Response(200, json={"scores": [0.5, None]})))
    got = RemoteJudge("http://judge.test", client=ok).stop_scores([("q", ["a"]), ("q", ["b"])])
    assert got[0] == 0.5 and got[1] != got[1]  # null: the state could not be scored (NaN, never stops)


# -- a full disk --------------------------------------------------------------------------------
def test_full_disk_is_one_line_and_resume_completes_the_run(clean_run, tmp_path, monkeypatch, capsys):
    import errno

    from ragfast import cli as cli_mod
    from ragfast.outputs.results import ResultsWriter

    real_write, calls = ResultsWriter.write, {"n": 0}

    def write(self, record):
        calls["n"] += 1
        if calls["n"] == 6:  # the disk fills in the middle of the sixth line
            data = json.dumps(record).encode()
            self._f.write(data[: len(data) // 2])
            self._f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, record)

    monkeypatch.setattr(ResultsWriter, "write", write)
    out = tmp_path / "full"
    monkeypatch.setattr(sys, "argv", ["ragfast", *run_args(out, limit=40)])
    with pytest.raises(SystemExit) as exc:
        cli_mod.main()
    assert exc.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip().startswith("error:")]
    assert len(err) == 1 and "the disk is full" in err[0] and "--resume" in err[0]
    monkeypatch.setattr(ResultsWriter, "write", real_write)
    r = cli(*run_args(out, "--resume", limit=40))
    assert r.returncode == 0 and "cut a partial last line" in r.stderr, r.stderr[-2000:]
    clean = json.loads((clean_run / "summary.json").read_text())
    got = json.loads((out / "summary.json").read_text())
    got, clean = got["methods"]["searchr1"], clean["methods"]["searchr1"]
    assert got["n_questions"] == 40 and got["em"] == clean["em"]
    assert no_timing(got["cost"]["total"]) == no_timing(clean["cost"]["total"])
    assert _ledger_by_question(out) == _ledger_by_question(clean_run)


# -- servers ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bm25_app_parts():
    from ragfast.data import Corpus
    from ragfast.retrieval.bm25 import BM25Retriever

    corpus = Corpus.from_rows([{"id": str(i), "contents": f'"T{i}"\npassage {i} about topic {i % 5}'}
                               for i in range(30)])
    return BM25Retriever.build(corpus)


def test_server_needs_json_content_type_and_the_token(bm25_app_parts):
    from fastapi.testclient import TestClient

    from ragfast.retrieval.server import create_app

    body = json.dumps({"queries": ["topic 3"], "topk": 2})
    with TestClient(create_app(bm25_app_parts)) as cl:
        r = cl.post("/retrieve", content=body, headers={"content-type": "text/plain"})  # a "simple" CORS request
        assert r.status_code == 415 and "application/json" in r.json()["detail"]
        assert cl.post("/retrieve", content=body).status_code == 415  # no Content-Type at all
        ok = cl.post("/retrieve", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200 and len(ok.json()["result"][0]) == 2
    with TestClient(create_app(bm25_app_parts, api_key="s3cret")) as cl:
        assert cl.get("/health").status_code == 401
        assert cl.post("/retrieve", json={"queries": ["x"]}, headers={"authorization": "Bearer wrong"}).status_code == 401
        r = cl.post("/retrieve", json={"queries": ["topic 3"]}, headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200


def test_judge_server_needs_json_content_type(monkeypatch):
    from fastapi.testclient import TestClient

    from ragfast.judges import load as load_judge
    from ragfast.judges.server import make_app

    with TestClient(make_app(load_judge("head"), api_key="k")) as cl:
        body = json.dumps({"states": [{"question": "q", "evidence": ["e"]}]})
        assert cl.post("/score", content=body, headers={"content-type": "application/json"}).status_code == 401
        r = cl.post("/score", content=body, headers={"content-type": "text/plain", "authorization": "Bearer k"})
        assert r.status_code == 415
        r = cl.post("/score", content=body, headers={"content-type": "application/json", "authorization": "Bearer k"})
        assert r.status_code == 200 and len(r.json()["scores"]) == 1


@pytest.mark.parametrize("args, phrase", [
    (["--port", "70000"], "--port must be a TCP port from 1 to 65535, got 70000"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 is reachable from other machines: set --api-key"),
])
@pytest.mark.parametrize("command", ["serve-retriever", "serve-judge"])
def test_server_bind_checks_are_one_line_before_anything_loads(command, args, phrase, tmp_path):
    extra = ["--corpus", "wiki-sample", "--encoder", "bm25"] if command == "serve-retriever" else []
    env = {k: v for k, v in ENV.items() if k != "RAGFAST_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", command, *extra, *args], capture_output=True, text=True,
                       env=env, timeout=120)
    assert phrase in one_error_line(r)


def _serve_in_thread(app, head_timeout_s: float):
    import socket
    import threading

    import uvicorn

    from ragfast.serving import uvicorn_options

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, **uvicorn_options("127.0.0.1", port, head_timeout_s=head_timeout_s,
                                                                  keep_alive_s=1.0), log_level="error"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, t, port


def test_idle_and_slow_loris_connections_are_closed(bm25_app_parts):
    import socket

    from ragfast.retrieval.server import create_app

    server, thread, port = _serve_in_thread(create_app(bm25_app_parts), head_timeout_s=1.0)
    try:
        idle = socket.create_connection(("127.0.0.1", port))
        loris = socket.create_connection(("127.0.0.1", port))
        loris.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\n")
        for s in (idle, loris):
            s.settimeout(20)  # a bound on the test, not a performance figure
        for i in range(40):  # the slow client keeps trickling header bytes
            try:
                loris.sendall(b"X-a: b\r\n")
            except OSError:
                break
            time.sleep(0.1)
        assert loris.recv(1024) == b""  # closed by the server: no whole head within the deadline
        assert idle.recv(1024) == b""
        # a normal client is still served, and its kept-alive connection may send the next request
        import httpx

        with httpx.Client() as cl:
            for _ in range(3):
                r = cl.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["topic 1"], "topk": 1})
                assert r.status_code == 200
        idle.close()
        loris.close()
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_stalled_body_gets_408_and_its_connection_is_closed(bm25_app_parts):
    import socket

    import httpx

    from ragfast.retrieval.server import create_app

    server, thread, port = _serve_in_thread(create_app(bm25_app_parts), head_timeout_s=1.0)
    try:
        slow = socket.create_connection(("127.0.0.1", port))
        slow.settimeout(20)  # a bound on the test, not a performance figure
        # a whole head, then 1 of the 40 body bytes it announced, then nothing
        slow.sendall(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40\r\n\r\n{")
        got = b""
        while True:
            part = slow.recv(4096)
            if not part:
                break  # closed by the server
            got += part
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), got
        assert json.loads(body)["detail"] == "body not complete 1 s after its head (--head-timeout-s)"
        slow.close()
        with httpx.Client() as cl:  # a normal client is still served
            r = cl.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["topic 1"], "topk": 1})
            assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_request_cancelled_at_shutdown_is_one_log_line_and_a_503(caplog):
    import asyncio
    import logging

    from ragfast.serving import RequestIdMiddleware

    async def hangs(scope, receive, send):
        await asyncio.sleep(3600)

    sent = []

    async def send(msg):
        sent.append(msg)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def main():
        mw = RequestIdMiddleware(hangs, logger=logging.getLogger("ragfast.test.shutdown"))
        task = asyncio.ensure_future(mw({"type": "http", "method": "POST", "path": "/score", "headers": []},
                                        receive, send))
        await asyncio.sleep(0.05)
        task.cancel()  # what uvicorn does to requests still running past --graceful-s
        await asyncio.wait([task])
        return task

    with caplog.at_level("ERROR", logger="ragfast.test.shutdown"):
        task = asyncio.run(main())
    assert not task.cancelled() and task.exception() is None
    lines = [r for r in caplog.records if r.name == "ragfast.test.shutdown"]
    assert len(lines) == 1 and "cancelled: 503 the server is shutting down" in lines[0].getMessage()
    assert lines[0].exc_info is None  # no traceback
    assert sent[0]["status"] == 503 and b"shutting down" in sent[1]["body"]


def test_manifest_mismatch_names_the_first_changed_field_in_one_short_line(tmp_path):
    from ragfast.outputs.results import write_manifest

    cfg = {"methods": ["searchr1", "s2g", "stepgap", "reloop"], "topk": 3, "corpus": ["contexts"] * 40}
    write_manifest(tmp_path, pipeline="bench", slots={}, config=cfg, seed=0)
    with pytest.raises(DataError) as exc:
        write_manifest(tmp_path, pipeline="bench", slots={}, config={**cfg, "methods": ["s2g"]}, seed=0)
    msg = str(exc.value)
    assert 'config.methods: ["searchr1", "s2g", "stepgap", "reloop"] in the run on disk, ["s2g"] now' in msg
    assert len(msg) < 300 and "\n" not in msg


def test_length_caps_are_flags(tmp_path):
    rows = _hotpot_rows(2)
    data = _write_rows(tmp_path / "q.jsonl", [{**rows[0], "question": "why " * 1100}] + rows[1:])
    out = tmp_path / "out"
    assert "over the limit of 4096" in one_error_line(cli(*run_args(out, limit=2)[:7], str(data), *run_args(out)[8:]))
    r = cli("--max-question-chars", "5000", *run_args(out, limit=2)[:7], str(data), *run_args(out, limit=2)[8:])
    assert r.returncode == 0, r.stderr[-2000:]


def test_file_fingerprint_sees_a_rewrite_of_the_same_size(tmp_path):
    from ragfast.checks import file_fingerprint

    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 300_000)
    before = file_fingerprint(f)
    st = f.stat()
    with open(f, "r+b") as fh:  # same size, same mtime: only the middle sample changes
        fh.seek(150_000)
        fh.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_fingerprint(f) != before
    assert file_fingerprint(tmp_path / "nope") == "missing"

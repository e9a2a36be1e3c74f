"""Per-question failure as data (issue 40): a refused question is recorded and the run goes on.

The reasoner is a fake OpenAI-compatible server on loopback (the stdlib's threading HTTP server:
it starts in milliseconds). It knows the gold answers of the data it serves, answers every
question with ``<answer> gold </answer>`` (after one search of the question where asked to), and refuses the questions it is told to
with vLLM's 400 ("This model's maximum context length is 4096 tokens ..."), or fails them with
a 503 every time. So an answered question must score EM 1 and a refused one must be recorded
with its error: both are checked against the server's own list, not against ragfast's output.
"""
from __future__ import annotations

import json
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ragfast.errors import DataError, ModelError, RagfastError, blame, mark_transient
from ragfast.types import Question

CONTEXT_400 = ("This model's maximum context length is 4096 tokens. However, you requested 4721 tokens "
               "(4221 in the messages, 500 in the completion). Please reduce the length of the messages.")


class FakeServer:
    """An OpenAI-compatible /v1/completions server that answers gold and refuses chosen questions.

    ``refuse``: question texts answered 400 (context length); ``unavailable``: answered 503 on
    every attempt. A prompt is matched to the longest question text it contains.
    """

    def __init__(self):
        self.gold: dict[str, str] = {}
        self.refuse: set[str] = set()
        self.unavailable: set[str] = set()
        self.search_first = False
        self.requests = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests += 1
                prompt = body["prompt"] if isinstance(body["prompt"], str) else ""
                q = max((q for q in server.gold if q in prompt), key=len, default=None)
                if q in server.refuse:
                    return self._send(400, {"object": "error", "message": CONTEXT_400, "code": 400})
                if q in server.unavailable:
                    return self._send(503, {"object": "error", "message": "overloaded", "code": 503})
                stop = body.get("stop") or []
                gold = server.gold.get(q, "unknown")
                # the instruction names the tag once; an observation adds it
                if "</answer>" in stop and server.search_first and prompt.count("<information>") < 2:
                    choice = {"text": f"<search> {q} ", "finish_reason": "stop", "stop_reason": "</search>"}
                elif "</answer>" in stop:  # a Search-R1 turn: answer
                    choice = {"text": f"<answer> {gold} ", "finish_reason": "stop", "stop_reason": "</answer>"}
                else:  # a checker stage (stop "}") or RELOOP's head (stop "\n")
                    choice = {"text": gold, "finish_reason": "stop", "stop_reason": None}
                n = len(prompt.split())
                self._send(200, {"id": "c", "object": "text_completion", "model": body["model"],
                                 "choices": [{"index": 0, **choice}],
                                 "usage": {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                                           "prompt_tokens_details": {"cached_tokens": 0}}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def serve(self, questions, refuse=(), unavailable=(), search_first=False) -> "FakeServer":
        """Serve ``questions`` (gold = the first answer), refusing those at the given indices;
        ``search_first``: search the question once before answering."""
        self.search_first = search_first
        self.gold = {q.question.strip().rstrip("?"): q.golden_answers[0] for q in questions}
        self.refuse = {questions[i].question.strip().rstrip("?") for i in refuse}
        self.unavailable = {questions[i].question.strip().rstrip("?") for i in unavailable}
        self.requests = 0
        return self


@pytest.fixture(scope="module")
def server():
    srv = FakeServer()
    srv.thread.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


@pytest.fixture(scope="module")
def questions():
    from ragfast.data import load_qa

    return load_qa("hotpotqa-dev")[:6]


def _records(out: Path, method: str = "searchr1") -> list[dict]:
    return [json.loads(x) for x in (out / "trajectories" / f"{method}.jsonl").read_text().splitlines()]


def _settings(server, out, **kw):
    # the lexical encoder where no judge reads the encoder: no model to load
    return {**dict(data="hotpotqa-dev", offset=0, limit=6, index="bm25", corpus=["contexts"], reasoner=server.url,
                   encoder="hashing", out=str(out), n_resamples=50), **kw}


def _check_one_refused(records, questions, refused: int, component: str = "reasoner") -> None:
    """Every question once; the refused one recorded with the server's message, the others answered right."""
    assert sorted(r["id"] for r in records) == sorted(q.id for q in questions)
    by = {r["id"]: r for r in records}
    for i, q in enumerate(questions):
        r = by[q.id]
        if i == refused:
            f = r["failure"]
            assert f["component"] == component and f["error"] == "ModelError" and not f["transient"]
            assert "answered 400" in f["message"] and "maximum context length is 4096 tokens" in f["message"]
            assert r["stop_reason"].startswith(f"failed: {component}: ModelError: ") and r["em"] == 0.0
        else:
            assert "failure" not in r and r["em"] == 1.0, (i, r["stop_reason"], r["answer"])


# -- the case: six questions, --batch-size 1, the third refused -------------------------
def test_cli_six_questions_the_third_refused_exits_0_with_five_answered(server, questions, tmp_path, monkeypatch,
                                                                         capsys):
    from ragfast import cli as cli_mod

    server.serve(questions, refuse=[2])
    out = tmp_path / "run"
    monkeypatch.setattr("sys.argv", ["ragfast", "run", "searchr1", "--reasoner", server.url, "--retriever", "bm25",
                                     "--corpus", "contexts", "--encoder", "hashing", "--data", "hotpotqa-dev", "--offset", "0",
                                     "--limit", "6", "--batch-size", "1", "--no-progress", "--json", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        cli_mod.main()
    err = capsys.readouterr().err
    assert exc.value.code in (0, None), err[-2000:]
    _check_one_refused(_records(out), questions, refused=2)
    s = json.loads((out / "summary.json").read_text())["methods"]["searchr1"]
    assert s["n_questions"] == 6 and s["failures"]["count"] == 1 and s["failures"]["by_component"] == {"reasoner": 1}
    assert s["em"] == pytest.approx(5 / 6) and "scores 0" in s["failures"]["scored"]
    lines = [x for x in err.splitlines() if x.startswith("failed questions")]
    assert len(lines) == 1 and "searchr1 1 of 6 (reasoner 1)" in lines[0] and "--retry-failed" in lines[0]
    md = (out / "report.md").read_text()
    assert "## Failed questions" in md and "1 of 6" in md and "reasoner: 1" in md


@pytest.mark.parametrize("method,batch_size", [("searchr1", 64), ("searchr1", 1), ("s2g", 4), ("stepgap", 64)])
def test_one_refused_question_in_a_batch_is_recorded_and_the_rest_answered(server, questions, tmp_path, method,
                                                                          batch_size):
    from ragfast.commands.methods import run_one

    server.serve(questions, refuse=[3])
    extra = {"threshold": 0.5, "encoder": "minilm"} if method == "s2g" else {}
    summary = run_one(method, progress=False, batch_size=batch_size, **_settings(server, tmp_path / "r", **extra))
    _check_one_refused(_records(tmp_path / "r", method), questions, refused=3)
    assert summary["methods"][method]["failures"]["count"] == 1


def test_a_refused_s2g_validation_question_is_left_out_of_the_threshold(server, tmp_path):
    from ragfast.commands.methods import run_one
    from ragfast.data import load_qa

    qs = load_qa("hotpotqa-dev")[:10]
    server.serve(qs, refuse=[1], search_first=True)  # validation questions 0-3, test questions 6-9
    out = tmp_path / "r"
    run_one("s2g", progress=False, **_settings(server, out, offset=6, limit=4, val_limit=4, encoder="minilm"))
    th = json.loads((out / "s2g_threshold.json").read_text())
    assert th["val_failed"] == 1 and th["val_questions"] == 3
    states = [json.loads(x) for x in (out / "s2g_states.jsonl").read_text().splitlines()]
    assert {x["question_id"] for x in states if x["split"] == "val"} == {qs[i].id for i in (0, 2, 3)}
    assert [r["em"] for r in _records(out, "s2g")] == [1.0] * 4


def test_bench_records_each_methods_failure_and_pairs_them_in_the_deltas(server, questions, tmp_path):
    from ragfast.comparison.pipeline import make_config, run_bench

    server.serve(questions, refuse=[1])
    cfg = make_config(**_settings(server, tmp_path / "b", threshold=0.5, batch_size=3, encoder="minilm"))
    summary = run_bench(cfg, table=False, progress=False)
    for m in ("searchr1", "s2g", "stepgap"):
        _check_one_refused(_records(tmp_path / "b", m), questions, refused=1)
    # RELOOP's head is the URL reasoner: the same question is refused there, named as the head
    rel = {r["id"]: r for r in _records(tmp_path / "b", "reloop")}
    assert len(rel) == 6 and rel[questions[1].id]["failure"]["component"] == "head"
    assert sum("failure" in r for r in rel.values()) == 1
    methods = summary["methods"]
    for m in ("s2g", "stepgap", "reloop"):
        assert methods[m]["n_failed_either"] == 1 and methods[m]["n_paired"] == 6
    assert summary["stepgap_balance"]["n_failed_either"] == 1
    assert "1 paired question(s) failed in either method" in summary["stepgap_balance"]["text"]


# -- resume: failures are kept unless --retry-failed -------------------------------------------
def test_resume_keeps_recorded_failures_and_retry_failed_runs_them_again(server, questions, tmp_path, monkeypatch,
                                                                          capsys):
    from ragfast import cli as cli_mod
    from ragfast.commands.methods import run_one
    from ragfast.runner.recording import load_ledger

    out = tmp_path / "r"
    server.serve(questions, refuse=[2, 4])
    run_one("searchr1", progress=False, batch_size=2, **_settings(server, out))
    assert sorted(r["id"] for r in _records(out) if "failure" in r) == sorted([questions[2].id, questions[4].id])
    server.serve(questions)  # the server would answer them now
    s = run_one("searchr1", resume=True, progress=False, batch_size=2, **_settings(server, out))
    assert server.requests == 0 and s["methods"]["searchr1"]["failures"]["count"] == 2
    assert "resume: 6 of 6 questions already done (2 of them recorded as failed: --retry-failed runs them again)" \
        in " ".join(capsys.readouterr().err.split())
    assert s["run"]["this_run_questions"]["searchr1"] == 0
    monkeypatch.setattr("sys.argv", ["ragfast", "run", "searchr1", "--reasoner", server.url, "--retriever", "bm25",
                                     "--corpus", "contexts", "--encoder", "hashing", "--data", "hotpotqa-dev",
                                     "--offset", "0", "--limit", "6", "--batch-size", "2", "--n-resamples", "50",
                                     "--no-progress", "--json", "--out", str(out), "--resume", "--retry-failed"])
    with pytest.raises(SystemExit) as exc:
        cli_mod.main()
    assert exc.value.code in (0, None)
    assert "--retry-failed: 2 question(s) recorded as failed run again" in " ".join(capsys.readouterr().err.split())
    s = json.loads((out / "summary.json").read_text())
    assert server.requests == 2 and s["methods"]["searchr1"]["failures"]["count"] == 0
    recs = _records(out)
    assert sorted(r["id"] for r in recs) == sorted(q.id for q in questions)  # each once
    assert all(r["em"] == 1.0 and "failure" not in r for r in recs)
    # the ledger holds every question's reasoner call once: one completion each
    per_q = load_ledger(out / "ledgers" / "searchr1.jsonl", None).per_question()
    assert {q: v["reasoner"]["calls"] for q, v in per_q.items()} == {q.id: 1 for q in questions}


# -- transient failures: retries first, then the question is recorded --------------------------
def test_a_question_whose_server_fails_past_its_retries_is_recorded_as_transient(server, questions, tmp_path,
                                                                                 monkeypatch):
    from ragfast.commands.methods import run_one

    monkeypatch.setattr("time.sleep", lambda s: None)  # the client's backoff between retries
    server.serve(questions, unavailable=[0])
    run_one("searchr1", progress=False, batch_size=6, **_settings(server, tmp_path / "r"))
    by = {r["id"]: r for r in _records(tmp_path / "r")}
    f = by[questions[0].id]["failure"]
    assert f["transient"] and "answered 503" in f["message"] and f["component"] == "reasoner"
    assert all(by[q.id]["em"] == 1.0 for q in questions[1:])
    # three attempts for the failed request (the client's retries), then one more for each other question
    assert server.requests >= 3 + 5


# -- a run where nothing is answered is an error ------------------------------------------------
def test_every_question_failed_is_exit_2_in_one_line_with_the_files_written(server, questions, tmp_path, monkeypatch,
                                                                             capsys):
    from ragfast import cli as cli_mod

    server.serve(questions, refuse=range(6))
    out = tmp_path / "run"
    monkeypatch.setattr("sys.argv", ["ragfast", "run", "searchr1", "--reasoner", server.url, "--retriever", "bm25",
                                     "--corpus", "contexts", "--encoder", "hashing", "--data", "hotpotqa-dev", "--offset", "0",
                                     "--limit", "6", "--no-progress", "--out", str(out)])
    with pytest.raises(SystemExit) as exc:
        cli_mod.main()
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert exc.value.code == 2 and len(err) == 1
    assert "searchr1: every one of its 6 questions failed (reasoner 6" in err[0] and "answered 400" in err[0]
    assert json.loads((out / "summary.json").read_text())["methods"]["searchr1"]["failures"]["count"] == 6


def test_a_component_failing_every_question_stops_the_run_after_ten_in_a_row(server, tmp_path):
    from ragfast.commands.methods import run_one
    from ragfast.data import load_qa

    qs = load_qa("hotpotqa-dev")[:30]
    server.serve(qs, refuse=range(30))
    with pytest.raises(RagfastError, match=r"searchr1: 10 questions in a row failed, none answered between them "
                                           r"\(last: reasoner: ModelError: .*answered 400"):
        run_one("searchr1", progress=False, batch_size=1, **_settings(server, tmp_path / "r", limit=30))
    assert server.requests == 10 and len(_records(tmp_path / "r")) == 10


# -- a local component that rejects one question's input: the batch is narrowed down -----------
@pytest.fixture(scope="module")
def clean_scripted(tmp_path_factory):
    from ragfast.commands.methods import run_one

    out = tmp_path_factory.mktemp("clean") / "r"
    run_one("searchr1", progress=False, **_scripted(out))
    return out


def _scripted(out, **kw):
    return dict(data="hotpotqa-dev", offset=0, limit=24, index="bm25", corpus=["contexts"], encoder="hashing",
                reasoner="scripted", batch_size=8, out=str(out), n_resamples=50, **kw)


@pytest.mark.parametrize("refill", [False, True])
def test_a_query_the_index_rejects_fails_only_its_question(clean_scripted, tmp_path, monkeypatch, refill):
    from ragfast.commands.methods import run_one
    from ragfast.data import load_qa
    from ragfast.outputs.results import strip_timing
    from ragfast.retrieval.bm25 import BM25Retriever

    qs = load_qa("hotpotqa-dev")[:24]
    poison = {qs[5].question.strip(), qs[17].question.strip()}
    real = BM25Retriever.search
    calls = {"n": 0}

    def search(self, queries, k, **kw):
        calls["n"] += 1
        bad = [q for q in queries if any(p.rstrip("?") in q for p in poison)]
        if bad:  # a local component refusing an input it cannot take: no question named
            raise DataError(f"query rejected by the index: {bad[0][:40]!r}")
        return real(self, queries, k, **kw)

    monkeypatch.setattr(BM25Retriever, "search", search)
    summary = run_one("searchr1", progress=False, **_scripted(tmp_path / "r", refill=refill))
    got = {r["id"]: r for r in _records(tmp_path / "r")}
    ref = {r["id"]: r for r in _records(clean_scripted)}
    assert sorted(got) == sorted(ref)
    for q in qs:
        if q.id in (qs[5].id, qs[17].id):
            f = got[q.id]["failure"]
            assert f == {"component": "retriever", "error": "DataError", "transient": False,
                         "message": f["message"]} and "query rejected by the index" in f["message"]
        else:  # every other question exactly as the run without the fault made it
            assert strip_timing(got[q.id]) == strip_timing(ref[q.id]), q.id
    assert summary["methods"]["searchr1"]["failures"] == {"count": 2, "by_component": {"retriever": 2},
                                                          "scored": summary["methods"]["searchr1"]["failures"]["scored"]}


# -- at scale: 1,000 questions, 1% refused -------------------------------------------------------
def test_a_thousand_questions_with_one_percent_refused_lose_nothing_and_write_nothing_twice(server, tmp_path):
    from ragfast.commands.methods import run_one
    from ragfast.data import load_qa

    rows = [{"id": f"q{i:04d}", "question": f"which number follows {i} in item {i * 7919 % 1000}",
             "golden_answers": [str(i + 1)]} for i in range(1000)]
    data = tmp_path / "thousand.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    qs = load_qa(str(data))
    refused = sorted(random.Random(0).sample(range(1000), 10))
    server.serve(qs, refuse=refused)
    out = tmp_path / "r"
    summary = run_one("searchr1", progress=False, data=str(data), offset=0, limit=1000, index="bm25",
                      corpus=["wiki-sample"], encoder="hashing", reasoner=server.url, out=str(out), n_resamples=50,
                      batch_size=64)
    recs = _records(out)
    assert len(recs) == 1000 and sorted(r["id"] for r in recs) == [q.id for q in qs]  # each once, none lost
    failed = sorted(r["id"] for r in recs if "failure" in r)
    assert failed == [qs[i].id for i in refused]
    assert all(r["em"] == 1.0 for r in recs if "failure" not in r)
    s = summary["methods"]["searchr1"]
    assert s["failures"]["count"] == 10 and s["em"] == pytest.approx(0.99)
    # each refusal costs the other questions of its batch one more request, nothing more
    assert server.requests <= 1000 + 10 * 64


# -- the isolation itself, against a brute-force oracle ------------------------------------------
def _isolate(qs, bad, *, named, transient, batch=64):
    """isolate() over a method that runs batches of ``batch`` in order; a bad question fails its batch's call."""
    from ragfast.outputs.failures import FailureStreak, isolate

    finished: list[str] = []
    recorded: list[str] = []
    runs = {"n": 0}

    def run(todo):
        runs["n"] += 1
        for i in range(0, len(todo), batch):
            chunk = todo[i:i + batch]
            hit = [q.id for q in chunk if q.id in bad]
            if hit:
                exc = mark_transient(ModelError("refused"), True) if transient else ModelError("refused")
                with blame("reasoner", hit[:1] if named else [q.id for q in chunk]):
                    raise exc
            finished.extend(q.id for q in chunk)

    try:
        isolate(run, qs, done=lambda: set(finished) | set(recorded), record=lambda q, e: recorded.append(q.id),
                forget=lambda ids: None, streak=FailureStreak("test"))
    finally:
        assert len(finished) + len(recorded) == len(set(finished) | set(recorded))  # nothing twice
    return finished, recorded, runs["n"]


@pytest.mark.parametrize("named", [True, False])
def test_isolate_records_exactly_the_failing_questions_once(named):
    qs = [Question(f"q{i}", f"question {i}", ["a"]) for i in range(1000)]
    bad = {q.id for q in random.Random(1).sample(qs, 10)}
    finished, recorded, runs = _isolate(qs, bad, named=named, transient=False)
    assert sorted(recorded) == sorted(bad) and sorted(finished + recorded) == sorted(q.id for q in qs)
    if named:
        assert runs == 11  # one run, then one more after each named failure
    else:  # halving a batch of 64: about two runs per level of log2(64) per failure
        assert runs <= 1 + 10 * (2 * 6 + 1)


def test_isolate_records_a_transient_calls_questions_and_stops_when_calls_fail_in_a_row():
    qs = [Question(f"q{i}", f"question {i}", ["a"]) for i in range(1000)]
    chunks = [qs[i:i + 64] for i in range(0, 1000, 64)]
    # the calls of batches 1, 5 and 9 fail after their retries: their questions, and only those, are recorded
    finished, recorded, _ = _isolate(qs, {chunks[i][7].id for i in (1, 5, 9)}, named=False, transient=True)
    assert sorted(recorded) == sorted(q.id for i in (1, 5, 9) for q in chunks[i])
    assert sorted(finished + recorded) == sorted(q.id for q in qs)
    # two calls in a row fail for everything they carried: the component is down, the run stops
    with pytest.raises(RagfastError, match="test: 128 questions in a row failed, none answered between them"):
        _isolate(qs, {chunks[3][0].id, chunks[4][0].id}, named=False, transient=True)


@pytest.mark.slow
def test_on_ray_a_refused_question_is_recorded_and_its_batch_answered(server, questions, tmp_path):
    # Each worker actor isolates its batch's failures as the single process does: before, the
    # refusal came back as the batch's error and stopped the run.
    pytest.importorskip("ray")
    from ragfast.commands.methods import run_one

    server.serve(questions, refuse=[3])
    summary = run_one("searchr1", progress=False, batch_size=2, ray="local", ray_workers=2,
                      **_settings(server, tmp_path / "r"))
    _check_one_refused(_records(tmp_path / "r"), questions, refused=3)
    failures = summary["methods"]["searchr1"]["failures"]
    assert failures["count"] == 1 and failures["by_component"] == {"reasoner": 1}

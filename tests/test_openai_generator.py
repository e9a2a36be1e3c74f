"""The URL reasoner against a scripted OpenAI-compatible server: issue 24's defects, one test each.

The server here is an ``httpx.MockTransport`` that answers ``/v1/models`` and
``/v1/completions`` the way vLLM 0.32 does (``stop_reason`` a stop string, an end-of-sequence
token id or null; ``usage`` with or without ``prompt_tokens_details``), so each defect is
reproduced without a real server (``tests/test_vllm.py`` runs the real one, marked slow).
"""
from __future__ import annotations

import functools
import json
import logging

import pytest

httpx = pytest.importorskip("httpx")

from ragfast.accounting.ledger import CostLedger  # noqa: E402
from ragfast.protocol import STOP, parse_action  # noqa: E402

URL = "http://127.0.0.1:8000"


class FakeServer:
    """Answers like vLLM; ``reply(body) -> choice fields`` decides each completion."""

    def __init__(self, reply, *, usage_details: bool = True, max_model_len: int | None = 4096,
                 model: str = "served"):
        self.reply = reply
        self.usage_details = usage_details
        self.max_model_len = max_model_len
        self.model = model
        self.requests: list[dict] = []

    def __call__(self, request: "httpx.Request") -> "httpx.Response":
        if request.url.path == "/v1/models":
            card = {"id": self.model, "object": "model"}
            if self.max_model_len:
                card["max_model_len"] = self.max_model_len
            return httpx.Response(200, json={"object": "list", "data": [card]})
        body = json.loads(request.content)
        self.requests.append(body)
        choice = {"index": 0, "finish_reason": "stop", "stop_reason": None, **self.reply(body)}
        n_prompt = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
        usage = {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3}
        usage["prompt_tokens_details"] = {"cached_tokens": n_prompt // 2} if self.usage_details else None
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "model": body["model"],
                                         "choices": [choice], "usage": usage})


@pytest.fixture
def serve(monkeypatch):
    """serve(FakeServer) -> an OpenAIGenerator factory talking to it."""
    from ragfast.models.openai_generator import OpenAIGenerator

    def start(server: FakeServer, **kw):
        monkeypatch.setattr(httpx, "Client", functools.partial(_REAL_CLIENT, transport=httpx.MockTransport(server)))
        return OpenAIGenerator(kw.pop("url", URL), kw.pop("model", None), **kw)

    return start


_REAL_CLIENT = httpx.Client


def _one_turn(gen, prompt="Question: who?\n") -> str:
    gen.start(["a"], [prompt])
    try:
        return gen.generate(["a"], stop=list(STOP), max_new_tokens=8)[0]
    finally:
        gen.end(["a"])


# -- 1: an unclosed tag before end-of-sequence is not a valid action ---------------------------
@pytest.mark.parametrize("stop_reason", [2, None])
@pytest.mark.parametrize("text", ["<answer> London", "<search> capital of france"])
def test_unclosed_tag_then_end_of_sequence_stays_invalid(serve, text, stop_reason):
    gen = serve(FakeServer(lambda b: {"text": text, "stop_reason": stop_reason}))
    out = _one_turn(gen)
    assert out == text and parse_action(out) == ("invalid", None)
    assert gen.describe()["stop_source"] == {"server": 1}


def _without_stop_reason(srv: FakeServer):
    """A transport for ``srv`` whose completions carry no ``stop_reason`` key at all."""
    def handler(request):
        r = srv(request)
        if request.url.path.endswith("/completions"):
            body = r.json()
            body["choices"][0].pop("stop_reason")
            return httpx.Response(200, json=body)
        return r

    return httpx.MockTransport(handler)


def test_the_stop_string_the_server_names_is_restored(serve):
    gen = serve(FakeServer(lambda b: {"text": "<search> paris", "stop_reason": "</search>"}))
    assert parse_action(_one_turn(gen)) == ("search", "paris")
    # SGLang names it in matched_stop (and sends no stop_reason)
    srv = FakeServer(lambda b: {"text": "<answer> x", "matched_stop": "</answer>"})
    sg = serve(srv)
    sg._client = _REAL_CLIENT(transport=_without_stop_reason(srv))
    assert parse_action(_one_turn(sg)) == ("answer", "x")
    srv_eos = FakeServer(lambda b: {"text": "<answer> x", "matched_stop": 2})
    sg_eos = serve(srv_eos)
    sg_eos._client = _REAL_CLIENT(transport=_without_stop_reason(srv_eos))
    assert parse_action(_one_turn(sg_eos)) == ("invalid", None)


def test_a_server_that_never_says_why_it_stopped_gets_a_counted_guess(serve):
    srv = FakeServer(lambda b: {"text": "<search> q"})
    gen = serve(srv)
    gen._client = _REAL_CLIENT(transport=_without_stop_reason(srv))
    assert parse_action(_one_turn(gen)) == ("search", "q")
    assert gen.describe()["stop_source"] == {"guessed": 1}


# -- 2: the prompt budget applies to URL reasoners ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir():
    from ragfast.models.tiny import tiny_path

    return tiny_path("qwen2")


def test_prompt_budget_sends_the_last_tokens_like_the_local_backend(serve, tiny_dir):
    from transformers import AutoTokenizer

    srv = FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}, max_model_len=None)
    gen = serve(srv, tokenizer=tiny_dir, max_context=40)
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    short = "Question: who wrote hamlet?\n"
    long = short + " ".join(["Paris is the capital of France."] * 30)
    led = CostLedger()
    gen.start(["s", "l"], [short, long])
    gen.generate(["s", "l"], stop=list(STOP), max_new_tokens=8, ledger=led)
    sent = {json.dumps(r["prompt"]) for r in srv.requests}
    assert json.dumps(short) in sent  # under the budget: the text as it is
    ids = tok(long, add_special_tokens=False)["input_ids"]
    assert len(ids) > 40 and json.dumps(ids[-40:]) in sent  # the last 40 token ids, as HFGenerator keeps them
    assert gen.describe()["prompt_truncations"] == 1
    (rec,) = [r for r in led.records if r.question_id == "l"]
    assert rec.input_tokens + rec.cached_tokens == 40  # the server's usage of what was sent


def test_the_servers_context_length_leaves_room_for_the_answer(serve, tiny_dir):
    srv = FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}, max_model_len=64)
    gen = serve(srv, tokenizer=tiny_dir, max_context=4096)
    assert gen.server_max_len == 64
    _one_turn(gen, "Question: " + "where is paris " * 60)
    assert isinstance(srv.requests[0]["prompt"], list) and len(srv.requests[0]["prompt"]) == 64 - 8
    from ragfast.errors import ConfigError

    gen.start(["b"], ["hi"])
    with pytest.raises(ConfigError, match="max-new-tokens 64 leaves no room"):
        gen.generate(["b"], stop=list(STOP), max_new_tokens=64)


def test_the_cli_passes_the_prompt_budget_to_a_url_reasoner(serve):
    from ragfast.runner import slots as build

    serve(FakeServer(lambda b: {"text": ""}))  # patches the client for the factory's generator too
    gen = build.reasoner(URL, max_context=123, check=False)
    assert gen.max_context == 123 and gen.describe()["prompt_budget"] == 123


# -- 4: cached tokens not reported are said, not silently 0 -------------------------------------
def test_usage_without_cached_tokens_warns_and_says_so(serve, caplog):
    gen = serve(FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}, usage_details=False))
    with caplog.at_level(logging.WARNING, logger="ragfast.models.openai_generator"):
        _one_turn(gen)
        _one_turn(gen)
    warned = [r for r in caplog.records if "--enable-prompt-tokens-details" in r.getMessage()]
    assert len(warned) == 1  # once, not per call
    assert gen.describe()["cached_tokens"].startswith("NOT reported on 2 of 2 calls")
    ok = serve(FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}))
    _one_turn(ok)
    assert ok.describe()["cached_tokens"] == "reported by the server"


# -- 5: a tiny random-weight model is not meaningful over a URL either --------------------------
def test_the_tiny_marker_makes_a_url_reasoner_not_meaningful(serve, tiny_dir):
    from ragfast.outputs.results import slot_entry
    from ragfast.outputs.slot_labels import RANDOM_LABEL

    gen = serve(FakeServer(lambda b: {"text": ""}), tokenizer=tiny_dir)
    d = slot_entry(gen)
    assert d["meaningful"] is False and d["answers_meaningful"] == RANDOM_LABEL
    cfg_only = serve(FakeServer(lambda b: {"text": ""}), model_config=tiny_dir / "config.json")
    assert cfg_only.meaningful is False
    assert serve(FakeServer(lambda b: {"text": ""})).meaningful is True


# -- 6: the slot description says what the calls used -----------------------------------------
def test_describe_before_and_after_calls(serve):
    gen = serve(FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}))
    d0 = gen.describe()
    assert d0["calls"] == 0 and d0["token_source"].startswith("no calls yet")
    _one_turn(gen)
    _one_turn(gen)
    d = gen.describe()
    assert d["calls"] == 2 and d["token_source"] == {"usage": 2} and d["call_seconds_p50"] >= 0
    assert d["server_max_model_len"] == 4096


# -- 8: the URL reasoner books the cache-independent FLOPs -------------------------------------
def test_flops_uncached_prices_every_prompt_token(serve, tiny_dir):
    from ragfast.accounting.flops import completion_flops

    gen = serve(FakeServer(lambda b: {"text": "<answer> x", "stop_reason": "</answer>"}), model_config=tiny_dir)
    led = CostLedger()
    gen.start(["a"], ["one two three four five six seven eight"])
    gen.generate(["a"], stop=list(STOP), max_new_tokens=8, ledger=led)
    (r,) = led.records
    assert (r.input_tokens, r.cached_tokens, r.output_tokens) == (4, 4, 3)
    assert r.flops == pytest.approx(completion_flops(tiny_dir, 8, 4, 3))
    assert r.flops_uncached == pytest.approx(completion_flops(tiny_dir, 8, 0, 3)) and r.flops_uncached > r.flops


# -- 10: minor ----------------------------------------------------------------------------------
def test_a_trajectory_that_never_answers_has_no_answer(serve):
    from ragfast.methods.searchr1.loop import SearchR1Config, run_searchr1
    from ragfast.retrieval.base import Retriever
    from ragfast.types import Question

    class Nothing(Retriever):
        def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
            return [[] for _ in queries]

    gen = serve(FakeServer(lambda b: {"text": "I am not sure", "finish_reason": "length"}))
    (t,) = run_searchr1([Question("q", "who?", ["and"])], gen, Nothing(), SearchR1Config(max_turns=2, max_new_tokens=8))
    assert all(turn.action == "invalid" for turn in t.turns)
    # the invalid-action notice quotes "<answer> and </answer>"; that is not the model's answer
    assert t.answer is None and t.em == 0


def test_resume_accepts_localhost_for_127_0_0_1():
    from ragfast.models.openai_generator import canonical_url
    from ragfast.runner.recording import fingerprint

    assert canonical_url("http://localhost:8000/") == canonical_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert canonical_url("http://LOCALHOST:9/v1#m") == "http://127.0.0.1:9/v1#m"
    assert canonical_url("https://example.org:8000/v1") == "https://example.org:8000/v1"
    a = fingerprint(method="searchr1", data={}, questions=[], slots={"reasoner": "http://localhost:8000"}, config={})
    b = fingerprint(method="searchr1", data={}, questions=[], slots={"reasoner": "http://127.0.0.1:8000/"}, config={})
    assert a == b


def test_resume_accepts_localhost_in_the_model_identity(serve):
    gen = serve(FakeServer(lambda b: {"text": ""}), url="http://localhost:8000")
    assert gen.name == "served @ http://127.0.0.1:8000/v1"


def test_a_task_stopped_by_an_error_is_not_printed_done(capsys):
    from ragfast.infra.progress import RunProgress, progress_task

    with RunProgress(plain=True):
        with pytest.raises(RuntimeError):
            with progress_task("reloop", 10):
                raise RuntimeError("server died")
        with progress_task("searchr1", 1) as t:
            t.advance()
    err = capsys.readouterr().err.splitlines()
    reloop = [x for x in err if "reloop" in x]
    assert reloop and not reloop[-1].endswith("done") and "stopped by an error" in reloop[-1]
    assert [x for x in err if "searchr1" in x][-1].endswith("done")


# -- 9: a tiny Qwen2 that vLLM's CPU backend serves, and crafted protocol checkpoints ------------
def test_qwen2_served_has_head_dim_32_and_a_replier_replies_on_the_local_backend(tmp_path):
    from transformers import AutoConfig

    from ragfast.errors import ModelError
    from ragfast.models.generator import HFGenerator
    from ragfast.models.tiny import make_replier, tiny_path

    cfg = AutoConfig.from_pretrained(str(tiny_path("qwen2-served")), local_files_only=True)
    assert cfg.hidden_size // cfg.num_attention_heads == 32  # vLLM's CPU attention refuses 16
    for i, (reply, want) in enumerate([("<search> paris </search>", "<search> paris </search>"),
                                       ("<answer> London<|im_end|>", "<answer> London")]):
        g = HFGenerator(make_replier(tmp_path / str(i), reply))
        assert g.meaningful is False and "crafted" in g.describe()["note"]
        g.start(["a"], [g.format_prompt("Question: who?")])
        assert g.generate(["a"], stop=list(STOP), max_new_tokens=12) == [want]
        g.append(["a"], ["\n\n<information>Doc 1(Title: X) y</information>\n\n"])
        assert g.generate(["a"], stop=list(STOP), max_new_tokens=12) == [want]  # whatever came before
    with pytest.raises(ModelError, match="bigram chain"):
        make_replier(tmp_path / "bad", "<search> paris</search>")  # '<' followed by 'search' and '/'

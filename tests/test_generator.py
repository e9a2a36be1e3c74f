"""Reasoner backends: HFGenerator token-exactness (batching, KV reuse), stops, OpenAI client."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, ModelError
from ragfast.methods.searchr1.loop import STOP, SearchR1Config, build_prompt, run_searchr1
from ragfast.retrieval.base import Hit, Retriever
from ragfast.types import Question

torch = pytest.importorskip("torch")

OBS = "\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France. Turn {t}.</information>\n\n"
QUESTIONS = ["who wrote hamlet", "what is the capital of france and why is it there", "x",
             "which river runs through the city that hosted the 1900 olympics"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # Tiny matmuls on a shared, loaded 2-core box: two OpenMP threads spin on each other
    # (a 3x64 @ 64x128 linear measured 20 ms with 2 threads vs 0.1 ms with 1).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def qwen2():
    from ragfast.models.tiny import tiny_path

    return tiny_path("qwen2")


def _gen(path, **kw):
    from ragfast.models.generator import HFGenerator

    return HFGenerator(path, **kw)


def _multi_turn(g, sids, questions, turns=3, max_new=24, one_at_a_time=False, ledger=None):
    for s, q in zip(sids, questions):
        g.start([s], [g.format_prompt(build_prompt(q))])
    outs = []
    for t in range(turns):
        if one_at_a_time:
            outs.append([g.generate([s], stop=STOP, max_new_tokens=max_new, ledger=ledger)[0] for s in sids])
        else:
            outs.append(g.generate(sids, stop=STOP, max_new_tokens=max_new, ledger=ledger))
        g.append(sids, [OBS.format(t=t)] * len(sids))
    toks = {s: g.session_tokens(s) for s in sids}
    g.end(sids)
    return outs, toks


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_batched_equals_one_at_a_time_and_kv_reuse_equals_reencoding(kind):
    from ragfast.models.tiny import tiny_path

    path = tiny_path(kind)
    sids = [f"s{i}" for i in range(len(QUESTIONS))]
    led_reuse, led_full = CostLedger(), CostLedger()
    batched, tok_b = _multi_turn(_gen(path, max_batch=3), sids, QUESTIONS, ledger=led_reuse)
    single, tok_s = _multi_turn(_gen(path), sids, QUESTIONS, one_at_a_time=True)
    full, tok_f = _multi_turn(_gen(path, kv_reuse=False), sids, QUESTIONS, ledger=led_full)
    assert batched == single == full
    assert tok_b == tok_s == tok_f
    assert all(len(o) > 0 for turn in batched for o in turn)
    # The turns differ (the observations changed the context), so the cache was really used.
    r, f = led_reuse.totals()["reasoner"], led_full.totals()["reasoner"]
    assert r["cached_tokens"] > 0 and f["cached_tokens"] == 0
    assert r["input_tokens"] + r["cached_tokens"] == f["input_tokens"]
    assert r["output_tokens"] == f["output_tokens"]
    assert 0 < r["flops"] < f["flops"]


def test_complete_ends_a_completion_once_its_prompt_settles(qwen2):
    """``complete(settled=...)``: a completion ends at the first token after which its test holds,
    a prefix of the full one, and the ledger books only the tokens generated; a prompt without a
    test (and a generator given none) runs to its budget as before."""
    from ragfast.accounting.ledger import CostLedger
    from ragfast.models.base import complete_ids

    g = _gen(qwen2)
    prompts = [g.format_prompt(build_prompt(q)) for q in QUESTIONS[:3]]
    full_led, part_led = CostLedger(), CostLedger()
    full = g.complete(prompts, max_new_tokens=24, ledger=full_led)
    part = g.complete(prompts, max_new_tokens=24, ledger=part_led,
                      settled=[lambda t: len(t) >= 12, None, lambda t: False])
    names = dict(zip(complete_ids(3), "abc"))  # the completions' sessions, as the ledger names them
    out = {k: {names[q]: v["reasoner"]["output_tokens"] for q, v in led.per_question().items()}
           for k, led in (("full", full_led), ("part", part_led))}
    assert full[0].startswith(part[0]) and len(part[0]) >= 12 and len(part[0]) < len(full[0])
    assert out["part"]["a"] < out["full"]["a"]
    assert part[1:] == full[1:] and [out["part"][q] for q in "bc"] == [out["full"][q] for q in "bc"]
    # the first token after which the text reaches 12 characters ends it
    toks = g.encode(part[0])
    assert len(g.tokenizer.decode(toks[:-1], skip_special_tokens=True)) < 12


def test_stop_string_cuts_and_session_is_retokenised(qwen2):
    g = _gen(qwen2)
    p = g.format_prompt(build_prompt(QUESTIONS[0]))
    g.start(["a"], [p])
    free = g.generate(["a"], stop=[], max_new_tokens=20)[0]
    g.end(["a"])
    words = free.split()
    assert len(words) >= 3
    stop_str = " " + words[2]  # a string the model is known to produce mid-output
    g.start(["a"], [p])
    cut = g.generate(["a"], stop=[stop_str, "</never>"], max_new_tokens=20)[0]
    assert cut.endswith(stop_str) and free.startswith(cut) and len(cut) < len(free)
    assert g.session_tokens("a") == g.encode(p) + g.encode(cut)
    # The next turn continues from the (cropped) cache and matches a fresh re-encoding.
    g.append(["a"], [OBS.format(t=0)])
    nxt = g.generate(["a"], stop=STOP, max_new_tokens=12)[0]
    g2 = _gen(qwen2, kv_reuse=False)
    g2.start(["a"], [p + cut + OBS.format(t=0)])
    assert g2.generate(["a"], stop=STOP, max_new_tokens=12)[0] == nxt


def test_eos_stops_and_is_not_in_the_text(qwen2):
    g = _gen(qwen2)
    p = g.format_prompt(build_prompt(QUESTIONS[1]))
    g.start(["a"], [p])
    g.generate(["a"], stop=[], max_new_tokens=8)
    ids = g.last_generated["a"]
    assert len(ids) == 8
    g.end(["a"])
    g.eos_ids = sorted(set(g.eos_ids) | {ids[3]})  # pretend the 4th generated token ends the sequence
    g.start(["a"], [p])
    text = g.generate(["a"], stop=[], max_new_tokens=8)[0]
    first = min(i for i, t in enumerate(ids) if t in g.eos_ids)
    assert text == g.tokenizer.decode(ids[:first], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_chat_template_truncation_and_context_cap(qwen2):
    g = _gen(qwen2, max_context=64)
    u = build_prompt("who wrote hamlet")
    assert g.format_prompt(u) == f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n"
    long_obs = OBS.format(t=0) * 20
    (cut,) = g.truncate_tokens([long_obs], 70)
    assert len(g.encode(long_obs)) > 70 and long_obs.startswith(cut)
    g.start(["a"], ["short prompt"])
    before = len(g.session_tokens("a"))
    g.append(["a"], [cut])
    assert len(g.session_tokens("a")) == before + 70  # the exact truncated ids, not a re-tokenisation
    led = CostLedger()
    out = g.generate(["a"], stop=STOP, max_new_tokens=5, ledger=led)[0]
    assert out and g._sessions["a"].truncations == 1  # noqa: SLF001
    assert led.totals()["reasoner"]["input_tokens"] == 64  # cut to the last 64 tokens, re-encoded


def test_bad_arguments_are_named(tmp_path, qwen2):
    with pytest.raises(ModelError, match="no config.json"):
        _gen(tmp_path)
    with pytest.raises(ConfigError, match="max_batch"):
        _gen(qwen2, max_batch=0)
    g = _gen(qwen2)
    with pytest.raises(KeyError, match="no open session"):
        g.generate(["nope"], stop=STOP, max_new_tokens=3)
    assert g.describe()["meaningful"] is False and "random-weight" in g.describe()["note"]


class _Lex(Retriever):
    def __init__(self, rows):
        self.rows = rows

    def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
        out = []
        for q in queries:
            qs = set(q.lower().split())
            sc = sorted(range(len(self.rows)), key=lambda i: (-len(qs & set(self.rows[i]["contents"].lower().split())), i))
            out.append([Hit(self.rows[i]["id"], 1.0, self.rows[i]) for i in sc[:k]])
        return out


ROWS = [{"id": "d0", "contents": '"Paris"\nParis is the capital of France.'},
        {"id": "d1", "contents": '"Hamlet"\nHamlet is a tragedy by William Shakespeare.'}]


def test_loop_runs_on_hf_generator_with_costs(qwen2):
    qs = [Question(f"q{i}", q, ["Paris"]) for i, q in enumerate(QUESTIONS)]
    led = CostLedger()
    tr = run_searchr1(qs, _gen(qwen2), _Lex(ROWS), SearchR1Config(max_turns=2, max_new_tokens=16), ledger=led)
    # A random-weight model writes no tags: every turn is invalid, then the final generation.
    for t in tr:
        assert [x.action for x in t.turns] == ["invalid", "invalid", "invalid"]
        assert t.stop_reason == "max_turns" and t.cost["reasoner"]["calls"] == 3
        assert t.cost["reasoner"]["cached_tokens"] > 0 and t.cost["reasoner"]["flops"] > 0
    assert led.totals()["reasoner"]["batches"] == 3  # one batched call per turn


# -- OpenAI-compatible client against a fake server ---------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    """A FastAPI stand-in for vLLM's /v1/completions: deterministic text, stop string left out."""
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi import FastAPI

    app = FastAPI()
    state = {"inflight": 0, "max_inflight": 0, "requests": []}

    @app.post("/v1/completions")
    async def completions(body: dict):
        state["requests"].append(body)
        state["inflight"] += 1
        state["max_inflight"] = max(state["max_inflight"], state["inflight"])
        if state.pop("hold_first", False):
            # The first request waits until a second one is in flight: a concurrent client gets
            # there at once, a serial one never does (max_inflight stays 1 after the deadline).
            deadline = time.monotonic() + 10
            while state["inflight"] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        state["inflight"] -= 1
        prompt = body["prompt"]
        if "slow" in prompt:  # a long turn: a partial call returns the others first
            await asyncio.sleep(state.get("slow_seconds", 0.0))
        n_obs = prompt.count("<information>Doc")
        if n_obs < 2:
            full, named = f"<think>step {n_obs}</think>\n<search> capital of France {n_obs} </search> tail", True
        else:
            full, named = "<think>done</think>\n<answer> Paris </answer> tail", False
        stop = [s for s in body.get("stop", []) if s in full]
        first = min(stop, key=full.index) if stop else None
        text = full[:full.index(first)] if first else full
        choice = {"index": 0, "text": text, "finish_reason": "stop" if first else "length"}
        if named:
            # vLLM names the matched stop string; the answer turn sends no stop_reason key at all
            # (a server that never says why it stopped) to exercise the client's fallback. A
            # null stop_reason is vLLM's end-of-sequence: nothing to restore (issue 24 #1).
            choice["stop_reason"] = first
        return {"id": "x", "object": "text_completion", "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                          "total_tokens": 0}}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not server.started:
        if time.time() > deadline or not th.is_alive():
            pytest.fail("fake OpenAI server did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    th.join(timeout=10)


def test_openai_generator_in_the_loop(fake_server):
    from ragfast.models.openai_generator import OpenAIGenerator

    url, state = fake_server
    state["hold_first"] = True
    g = OpenAIGenerator(url, "fake-model", concurrency=4)
    qs = [Question(f"q{i}", "What is the capital of France", ["Paris"]) for i in range(6)]
    led = CostLedger()
    tr = run_searchr1(qs, g, _Lex(ROWS), SearchR1Config(max_turns=4, topk=1), ledger=led)
    for t in tr:
        assert [x.action for x in t.turns] == ["search", "search", "answer"]
        assert t.turns[0].generated == "<think>step 0</think>\n<search> capital of France 0 </search>"
        assert t.turns[2].generated.endswith("<answer> Paris </answer>")  # restored without stop_reason
        assert t.answer == "Paris" and t.em == 1.0 and t.stop_reason == "answer"
    assert 1 < state["max_inflight"] <= 4
    body = state["requests"][0]
    assert body["temperature"] == 0.0 and body["stop"] == list(STOP) and body["max_tokens"] == 500
    assert led.totals()["reasoner"]["calls"] == 18 and led.totals()["reasoner"]["output_tokens"] > 0
    g.close()


def test_openai_generator_partial_calls_and_the_loop(fake_server):
    """Requests stay in flight across partial calls; the loop with partial turns gives the
    trajectories of fixed batches, in more calls."""
    from ragfast.models.openai_generator import OpenAIGenerator

    url, state = fake_server
    state["slow_seconds"] = 1.0
    g = OpenAIGenerator(url, "fake-model", concurrency=4)
    g.start(["fast", "slow"], ["q fast", "q slow"])
    led = CostLedger()
    first = g.generate(["fast", "slow"], stop=STOP, max_new_tokens=50, ledger=led, partial=True)
    assert first[0].endswith("</search>") and first[1] is None
    assert [r.question_id for r in led.records] == ["fast"]
    with pytest.raises(RuntimeError, match="middle of a turn"):
        g.append(["slow"], ["x"])
    g.append(["fast"], ["\n\n<information>Doc 1 x</information>\n\n"])
    # the slow request is not sent again: the next call waits for the one in flight
    later = g.generate(["slow", "fast"], stop=STOP, max_new_tokens=50, ledger=led)
    assert later[0] == first[0] and later[1].startswith("<think>step 1")  # the slow turn; fast's next
    assert sum(r["prompt"] == "q slow" for r in state["requests"]) == 1
    assert len(led.records) == 3
    # ending a session drops its request in flight; its answer is never read
    g.start(["gone"], ["q slow"])
    assert g.generate(["gone", "fast"], stop=STOP, max_new_tokens=50, partial=True)[0] is None
    g.end(["gone"])
    assert "gone" not in g._flight
    state["slow_seconds"] = 0.3
    out = {}
    for refill in (False, True):
        g2 = OpenAIGenerator(url, "fake-model", concurrency=4)
        n = [0]
        inner = g2.generate
        g2.generate = lambda *a, **k: (n.__setitem__(0, n[0] + 1), inner(*a, **k))[1]
        qs = [Question(f"q{i}", "What is the capital of France" + (" slow" if i % 3 == 0 else ""), ["Paris"])
              for i in range(6)]
        tr = run_searchr1(qs, g2, _Lex(ROWS), SearchR1Config(max_turns=4, topk=1, batch_size=6, refill=refill))
        out[refill] = ([[(x.action, x.generated) for x in t.turns] for t in tr], n[0])
        g2.close()
    assert out[True][0] == out[False][0] and out[True][1] > out[False][1]
    state["slow_seconds"] = 0.0
    g.close()


def test_openai_generator_errors(fake_server):
    from ragfast.models.openai_generator import OpenAIGenerator

    with pytest.raises(ConfigError, match="http"):
        OpenAIGenerator("localhost:1", "m")
    g = OpenAIGenerator(f"http://127.0.0.1:{_free_port()}", "m", retries=0, timeout=2)
    g.start(["a"], ["hi"])
    with pytest.raises(ModelError, match="cannot reach"):
        g.generate(["a"], stop=STOP, max_new_tokens=4)
    url, _ = fake_server
    g = OpenAIGenerator(url + "/v1/", "m")  # a trailing /v1/ is accepted
    assert g.base_url == url + "/v1"


def test_run_command_with_the_tiny_model(tmp_path):
    import json

    from ragfast.commands.methods import run_one

    s = run_one("searchr1", reasoner="tiny", index="bm25", data="hotpotqa-dev", offset=0, limit=3, budget=1,
                max_new_tokens=6, out=str(tmp_path), progress=False)
    assert s["methods"]["searchr1"]["n_questions"] == 3
    assert not all(s["slots"][k]["meaningful"] for k in ("reasoner", "retriever"))
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["slots"]["reasoner"]["class"] == "HFGenerator" and m["slots"]["reasoner"]["meaningful"] is False
    assert m["config"]["budget"] == 1 and m["config"]["max_new_tokens"] == 6
    recs = [json.loads(x) for x in (tmp_path / "trajectories" / "searchr1.jsonl").read_text().splitlines()]
    for r in recs:
        assert {"id", "question", "golden_answers", "answer", "em", "f1", "searches", "stop_reason", "turns",
                "cost"} <= set(r)
        assert len(r["turns"]) == 2 and r["cost"]["reasoner"]["flops"] > 0
    with pytest.raises(ConfigError, match=r"missing files .*\n  reasoner: .*nope"):  # named before anything loads
        run_one("searchr1", reasoner=str(tmp_path / "nope"), index="bm25", data="hotpotqa-dev", offset=0, limit=1,
                out=str(tmp_path / "o2"), progress=False)
    # A URL without a served name is fine (the server's only model is used), but it must answer.
    with pytest.raises(ConfigError, match="cannot reach the reasoner server"):
        run_one("searchr1", reasoner="http://127.0.0.1:9", index="bm25", data="hotpotqa-dev", offset=0, limit=1,
                out=str(tmp_path / "o3"), progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_greedy_picks_equal_torch_argmax_in_every_dtype(qwen2, dtype, monkeypatch):
    """The CPU generator picks greedy tokens with ragfast's argmax (fp32, bf16) or torch's (other
    dtypes): the tokens are those of torch.argmax on the same logits, and no dtype is refused."""
    import ragfast.models.generator as G

    g = _gen(qwen2, dtype=dtype)
    prompts = [g.format_prompt(build_prompt(q)) for q in QUESTIONS]
    sids = [f"d{i}" for i in range(len(prompts))]
    g.start(sids, prompts)
    g.generate(sids, stop=[], max_new_tokens=12)
    ours = [list(g.last_generated[s]) for s in sids]
    g.end(sids)
    monkeypatch.setattr(G, "greedy_pick", lambda t: t.argmax(dim=-1))
    g.start(sids, prompts)
    g.generate(sids, stop=[], max_new_tokens=12)
    assert [list(g.last_generated[s]) for s in sids] == ours
    g.end(sids)


def test_the_head_gets_row_major_input_even_at_one_row(tiny_qwen2_dir):
    # transformers hands the head hidden[:, -1:, :]; at one row torch calls that view contiguous,
    # and its bf16 matmul on it ran 20x slower than on a copy (Qwen2.5-0.5B's head, Intel Xeon)
    import torch

    from ragfast.models.generator import HFGenerator

    gen = HFGenerator(tiny_qwen2_dir, dtype="bfloat16", memory_budget=None)
    head = gen.model.get_output_embeddings()
    d = head.in_features
    seen = []
    head.register_forward_pre_hook(lambda m, a: seen.append((tuple(a[0].shape), a[0].stride())))  # after ours
    for B in (1, 3):
        h = torch.randn(B, 7, d, dtype=torch.bfloat16)
        with torch.inference_mode():
            y = head(h[:, -1:, :])
            # the same values as the head's pass on a row-major copy (its few rows take gemv, whose
            # sums need not round as F.linear's do: they differed on a Zen 4 EPYC)
            want = head(h[:, -1:, :].clone(memory_format=torch.contiguous_format))
        assert torch.equal(y, want)
        torch.testing.assert_close(y.float(), torch.nn.functional.linear(h[:, -1:, :].float(), head.weight.float()),
                                   rtol=2 ** -7, atol=2 ** -7 * float(y.float().abs().max()))
    assert seen == [((1, 1, d), (d, d, 1)), ((1, 1, d), (d, d, 1)), ((3, 1, d), (d, d, 1)), ((3, 1, d), (d, d, 1))]


@pytest.mark.parametrize("features, want", [(("avx2", "avx512f"), None), (("avx512f", "avx512bf16"), "bfloat16"),
                                            (("avx512f", "amx-tile", "amx-bf16"), "bfloat16"), ((), None)])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_natively(tiny_qwen2_dir, monkeypatch, features, want):
    import torch

    from ragfast.models.generator import HFGenerator
    from ragfast.models.weight_quant import auto_dtype
    from ragfast.ops import machine

    monkeypatch.setattr(machine, "cpu_features", lambda: features)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # a torch or CPU without oneDNN's bf16
        want = None
    assert auto_dtype("cpu") == want
    gen = HFGenerator(tiny_qwen2_dir, dtype="auto", memory_budget=None)
    assert gen.dtype == (torch.bfloat16 if want else torch.float32)  # the tiny checkpoint is fp32
    assert gen.describe()["dtype"] == (want or "float32")


def test_run_settings_default_to_auto_dtype_and_name_a_bad_one():
    from ragfast.runner.settings import RunSettings

    assert RunSettings().dtype == "auto"
    with pytest.raises(ConfigError, match="--dtype must be one of auto, float32"):
        RunSettings(dtype="fp8")


def test_partial_turns_give_the_texts_of_whole_turns(qwen2):
    """A partial call returns the finished turns and keeps the others decoding; calls that go on
    with them, leave some out (set aside) or end them give the texts one whole call gives."""
    sids = [f"s{i}" for i in range(len(QUESTIONS))]
    ref = _gen(qwen2)
    ref.start(sids, [ref.format_prompt(build_prompt(q)) for q in QUESTIONS])
    probe = ref.generate(sids, stop=[], max_new_tokens=12)
    # Each row's own text of tokens 2-4 (row 0) or a later span as its stop: the rows end at different steps.
    stops = [ref.tokenizer.decode(ref.last_generated[s][k:k + 3], skip_special_tokens=True)
             for s, k in zip(sids, (1, 5, 8, 3))]
    assert all(stops) and len(probe) == len(sids)
    ref.end(sids)
    ref.start(sids, [ref.format_prompt(build_prompt(q)) for q in QUESTIONS])
    want = ref.generate(sids, stop=stops, max_new_tokens=12)
    ref.append(sids, [OBS.format(t=0)] * len(sids))
    want2 = ref.generate(sids, stop=stops, max_new_tokens=12)

    g = _gen(qwen2)
    g.start(sids, [g.format_prompt(build_prompt(q)) for q in QUESTIONS])
    led = CostLedger()
    got: dict[str, str] = {}
    calls = 0
    while len(got) < len(sids):
        todo = [s for s in sids if s not in got]
        if calls == 1 and len(todo) > 1:
            todo = todo[1:]  # one row set aside for a call, then taken up again
        out = g.generate(todo, stop=stops, max_new_tokens=12, ledger=led, partial=True)
        calls += 1
        assert len(out) == len(todo)
        got.update({s: t for s, t in zip(todo, out) if t is not None})
        with pytest.raises(RuntimeError, match="middle of a turn"):
            if len(got) < len(sids):
                g.append([s for s in sids if s not in got][:1], ["x"])
            else:
                raise RuntimeError("middle of a turn")  # nothing left mid-turn to refuse
    assert calls > 1 and [got[s] for s in sids] == want
    # The ledger holds one record per turn, whatever the calls: the FLOPs of the whole call's.
    ref_led = CostLedger()
    r2 = _gen(qwen2)
    r2.start(sids, [r2.format_prompt(build_prompt(q)) for q in QUESTIONS])
    r2.generate(sids, stop=stops, max_new_tokens=12, ledger=ref_led)
    assert len(led.records) == len(sids)
    assert {r.question_id: r.flops for r in led.records} == {r.question_id: r.flops for r in ref_led.records}
    assert sum(r.seconds for r in led.records) > 0
    # The next turn from the sessions the partial calls left: the same as from the whole call's.
    g.append(sids, [OBS.format(t=0)] * len(sids))
    assert g.generate(sids, stop=stops, max_new_tokens=12) == want2
    # Ending a session mid-turn drops its row; the others finish as before.
    g3 = _gen(qwen2)
    g3.start(sids, [g3.format_prompt(build_prompt(q)) for q in QUESTIONS])
    first = g3.generate(sids, stop=stops, max_new_tokens=12, partial=True)
    mid = [s for s, t in zip(sids, first) if t is None]
    assert len(mid) >= 2
    g3.end(mid[:1])
    assert g3.generate(mid[1:], stop=stops, max_new_tokens=12) == [want[sids.index(s)] for s in mid[1:]]


def test_the_loop_with_partial_turns_gives_the_same_trajectories(qwen2):
    from ragfast.outputs.results import strip_timing

    qs = [Question(f"q{i}", q, ["Paris"]) for i, q in enumerate(QUESTIONS * 2)]
    qs = [Question(f"q{i}", q.question + " " * (i // 4), ["Paris"]) for i, q in enumerate(qs)]
    probe = _gen(qwen2)
    probe.start([q.id for q in qs], [probe.format_prompt(build_prompt(q.question)) for q in qs])
    probe.generate([q.id for q in qs], stop=[], max_new_tokens=20)
    # Tokens the rows write at different steps, taken as end-of-sequence: turns of mixed lengths.
    eos = {probe.last_generated[q.id][k] for q, k in zip(qs, (2, 7, 13, 4, 16))}
    out, calls = {}, {}
    for refill in (False, True):
        g = _gen(qwen2, max_batch=5)
        g.eos_ids = sorted(set(g.eos_ids) | eos)
        n = [0]
        inner = g.generate
        g.generate = lambda *a, **k: (n.__setitem__(0, n[0] + 1), inner(*a, **k))[1]
        cfg = SearchR1Config(max_turns=2, max_new_tokens=20, batch_size=5, refill=refill)
        tr = run_searchr1(qs, g, _Lex(ROWS), cfg)
        out[refill], calls[refill] = [strip_timing(t.to_dict()) for t in tr], n[0]
    assert calls[True] > calls[False]  # partial calls: more of them, each returning what finished
    for a, b in zip(out[False], out[True]):
        for t in (a, b):
            for turn in t["turns"]:
                turn["extra"].pop("cost", None)
            t.pop("cost", None)
        assert a == b

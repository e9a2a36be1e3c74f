"""HFGenerator's memory budget: keys/values grow with what the rows write, and the batch shrinks to fit.

Oracles: transformers' ``DynamicLayer`` for the growing buffer's contents; the generator without
a budget (one chunk of every session) for the greedy text, which must not change when the
budget splits a turn into smaller chunks; and the bytes of one token's keys/values computed
here from the model's ``config.json`` (layers x KV heads x head size x 2 x 4 bytes in fp32).
"""
from __future__ import annotations

import json
import logging

import pytest

from ragfast.errors import ConfigError, MemoryBudgetError, blame
from ragfast.methods.searchr1.loop import build_prompt

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUESTIONS = ["who wrote hamlet", "x", "what is the capital of france and why is it there",
             "which river runs through the city that hosted the 1900 olympics", "when", "how tall is the eiffel tower"]
OBS = "\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France. Turn {t}.</information>\n\n"


@pytest.fixture(scope="module")
def kv_heavy(tmp_path_factory, random_lm):
    """A random-weight Qwen2 whose keys/values outweigh its activations (8 layers, 2 KV heads of 64, a
    64-wide MLP), as a real model's do once sessions hold a few hundred tokens; the tiny Qwen2's tokenizer."""
    from transformers import Qwen2Config

    return random_lm(Qwen2Config, tmp_path_factory.mktemp("kvheavy"), 5, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                     max_position_embeddings=4096)


def _kv_per_token(path) -> int:
    c = json.loads((path / "config.json").read_text())
    return c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2 * 4


def _turns(path, turns=3, max_new=24, **kw):
    from ragfast.models.generator import HFGenerator

    g = HFGenerator(path, max_batch=len(QUESTIONS), **kw)
    sids = [f"s{i}" for i in range(len(QUESTIONS))]
    g.start(sids, [g.format_prompt(build_prompt(q)) for q in QUESTIONS])
    texts, chunks = [], []
    for t in range(turns):
        texts.append(g.generate(sids, stop=[], max_new_tokens=max_new))
        chunks.append(list(g.last_chunks))
        g.append(sids, [OBS.format(t=t)] * len(sids))
    return g, texts, chunks


def test_buffered_layer_grows_by_step_up_to_the_limit():
    from transformers.cache_utils import DynamicLayer

    from ragfast.models.kv_buffer import BufferedLayer

    gen = torch.Generator().manual_seed(4)
    ref, buf = DynamicLayer(), BufferedLayer(capacity=5, step=3, limit=10)
    caps = []
    for t in (5, 1, 1, 1, 1, 1, 2):  # the last update passes the limit: the buffer takes what it must
        k, v = torch.randn(2, 3, t, 4, generator=gen), torch.randn(2, 3, t, 4, generator=gen)
        ref.update(k, v)
        bk, bv = buf.update(k.clone(), v.clone())
        assert torch.equal(bk, ref.keys) and torch.equal(bv, ref.values)
        caps.append(buf.buf_k.shape[-2])
    assert caps == [5, 8, 8, 8, 10, 10, 12]
    assert buf.nbytes() == 2 * 2 * 3 * 12 * 4 * 4


def test_kv_grows_with_what_the_rows_write(kv_heavy):
    """Rows that stop after a few tokens of a 400-token turn: the preallocating path holds keys/values
    for all 400, the growing one for what was written (plus one step)."""
    from ragfast.models.generator import HFGenerator

    probe = HFGenerator(kv_heavy, max_batch=6, memory_budget=None)
    sids = [f"s{i}" for i in range(len(QUESTIONS))]
    prompts = [probe.format_prompt(build_prompt(q)) for q in QUESTIONS]
    probe.start(sids, prompts)
    probe.generate(sids, stop=[], max_new_tokens=8)
    # Each row's own text of tokens 3-5 as a stop string: every row stops within its first 5 tokens.
    stops = sorted({probe.tokenizer.decode(probe.last_generated[s][2:5], skip_special_tokens=True) for s in sids})
    assert all(stops)
    runs = {}
    for step in (0, 4):
        g = HFGenerator(kv_heavy, max_batch=6, memory_budget=None, kv_step=step)
        g.start(sids, prompts)
        runs[step] = (g.generate(sids, stop=stops, max_new_tokens=400), g)
    (pre_text, pre), (grow_text, grow) = runs[0], runs[4]
    assert pre_text == grow_text
    written = max(len(grow.last_generated[s]) for s in sids)
    assert written <= 5
    longest = max(len(probe.encode(p)) for p in prompts)
    pt = _kv_per_token(kv_heavy)
    assert pre.stats["kv_peak_bytes"] >= len(sids) * (longest + 400) * pt
    # The padded batch (prompt + written + one step) and at most as much again of kept rows and the shared prefix.
    assert grow.stats["kv_peak_bytes"] <= 2 * len(sids) * (longest + written + 4) * pt
    assert grow.stats["kv_peak_bytes"] < pre.stats["kv_peak_bytes"] / 2


def test_the_budget_shrinks_the_batch_and_keeps_the_text(kv_heavy, caplog):
    free, free_text, free_chunks = _turns(kv_heavy, memory_budget=None)
    assert free_chunks == [[6]] * 3
    # The free run's own peak: the plan assumes every row writes its whole turn, so it must split to stay
    # under it (smaller budgets make it drop kept caches too: the next test).
    budget = free.stats["kv_peak_bytes"]
    with caplog.at_level(logging.INFO, logger="ragfast.models.generator"):
        tight, text, chunks = _turns(kv_heavy, memory_budget=budget)
    assert text == free_text
    assert all(sum(c) == 6 for c in chunks) and any(len(c) > 1 for c in chunks)
    assert tight.stats["kv_peak_bytes"] < budget
    assert tight.stats["planned_peak_bytes"] <= budget
    assert tight.stats["caches_dropped_for_memory"] == 0
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("memory budget" in m and "ran in chunks of" in m for m in lines)
    mem = tight.describe()["memory"]
    assert mem["budget_bytes"] == budget and mem["budget"] == "given" and mem["smallest_chunk"] == min(map(min, chunks))
    assert tight.budget_note.startswith("memory budget: chunks of")


def test_kept_caches_are_dropped_when_they_leave_no_room(kv_heavy, caplog):
    free, free_text, _ = _turns(kv_heavy, memory_budget=None)
    budget = int(free.stats["kv_peak_bytes"] * 0.5)
    with caplog.at_level(logging.WARNING, logger="ragfast.models.generator"):
        tight, text, chunks = _turns(kv_heavy, memory_budget=budget)
    assert text == free_text  # the dropped caches were computed again, to the same tokens
    assert tight.stats["caches_dropped_for_memory"] > 0
    assert tight.stats["kv_peak_bytes"] <= budget
    assert any("dropped those of" in r.getMessage() for r in caplog.records)


def test_a_budget_too_small_for_one_session_is_one_line_not_a_question_failure(kv_heavy):
    from ragfast.outputs.failures import is_question_failure
    from ragfast.models.generator import HFGenerator

    g = HFGenerator(kv_heavy, memory_budget="100kB")
    g.start(["a"], [g.format_prompt(build_prompt("who wrote hamlet"))])
    with pytest.raises(MemoryBudgetError, match=r"memory budget 100.00 kB \(given\) is too small") as ei:
        with blame("reasoner", ["a"]):
            g.generate(["a"], stop=[], max_new_tokens=8)
    assert "\n" not in str(ei.value)
    assert not is_question_failure(ei.value)  # it depends on the budget: the run stops, nothing is recorded


def test_sizes_parse_and_bad_ones_are_named():
    from ragfast.models.memory_budget import parse_size
    from ragfast.runner.settings import RunSettings

    assert parse_size("6GB") == 6 * 10**9 and parse_size("5.5GiB") == int(5.5 * 2**30)
    assert parse_size("800 MB") == 800 * 10**6 and parse_size(123456) == 123456 and parse_size("none") is None
    for bad in ("six", "6XB", 0, "-1GB", True):
        with pytest.raises(ConfigError, match="memory-budget"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="--memory-budget must be a size"):
        RunSettings(memory_budget="lots")
    assert RunSettings(memory_budget=4 * 10**9).memory_budget == 4 * 10**9


def test_a_run_records_the_budget_and_the_peaks(tmp_path):
    from ragfast.commands.methods import run_one

    kw = dict(reasoner="tiny", index="bm25", data="hotpotqa-dev", offset=0, limit=3, budget=1, max_new_tokens=6,
              progress=False)
    s = run_one("searchr1", memory_budget="2MB", out=str(tmp_path / "a"), **kw)
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    mem = m["slots"]["reasoner"]["memory"]
    assert mem["budget_bytes"] == 2 * 10**6 and 0 < mem["kv_peak_bytes"] <= 2 * 10**6
    assert mem["shrunk_calls"] > 0  # three prompts' prefill activations do not fit 2 MB at once
    assert m["memory"]["memory_budget"] == "2MB" and m["memory"]["rss_peak_bytes"] > 10**8
    assert "memory_budget" not in m["config"]  # a resume may change it: it does not change the results
    assert s["run"]["rss_peak_bytes"] >= m["memory"]["rss_peak_bytes"]
    assert s["slots"]["reasoner"]["memory"]["budget_bytes"] == 2 * 10**6
    with pytest.raises(MemoryBudgetError, match="too small for one session's turn"):
        run_one("searchr1", memory_budget="10kB", out=str(tmp_path / "b"), **kw)


def test_a_prefill_in_row_groups_is_planned_with_one_groups_activations():
    """The 1.5B Qwen's second turn of issue 40 (64 rows, 1,000 cached and 1,000 new tokens, 500 to
    write): in one pass the prefill's activations set the peak; in groups of 4,096 new tokens (4 rows)
    they count 4 rows, and the cache the whole batch decodes into is what remains."""
    from transformers import Qwen2Config

    from ragfast.models.memory_budget import GenerationBytes

    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936)
    gb = GenerationBytes.of(cfg, 2)
    assert gb.kv_per_token == 28 * 2 * 2 * 128 * 2  # 28 KiB of bf16 per token, as the issue says
    rows, past, new, max_new, step = 64, 1000, 1000, 500, 64
    row_act = new * gb.act_per_token + (past + new) * gb.gqa_per_position + new * (past + new)
    base = rows * (past + new + step) * gb.kv_per_token + rows * gb.logits_per_row
    decode = rows * (past + new + max_new) * (gb.kv_per_token + gb.kv_per_token // 28) + rows * (gb.logits_per_row + 2500)
    whole = gb.chunk_peak(rows, past, new, max_new, step, 0, 0)
    grouped = gb.chunk_peak(rows, past, new, max_new, step, 0, 0, prefill_tokens=4096)
    assert whole == base + rows * row_act > decode
    assert grouped == max(base + 4 * row_act, decode) < whole
    assert gb.chunk_peaks([(past, new, 0)] * rows, max_new, step, 0, 4096)[-1] == grouped


def test_the_freed_heap_is_handed_back_where_the_c_library_can():
    import platform

    from ragfast.models.memory_budget import release_free_heap

    assert release_free_heap() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


def test_held_bytes_counts_each_storage_once():
    """Caches that view one storage hold it together: counted once in the total, and in no cache's own
    bytes (dropping one of them frees nothing); a cropped view counts its whole storage."""
    from ragfast.models.memory_budget import held_bytes

    def kv(n):
        return [(torch.zeros(2, n, 4), torch.zeros(2, n, 4))]

    a, b, shared = kv(10), kv(6), kv(3)
    nested = [(k[:, :4], v[:, :4]) for k, v in a]  # a probe seeded from `a`
    seeded = [(k[:, :2], v[:, :2]) for k, v in shared]  # a session seeded from the kept prefix
    total, own = held_bytes({"a": a, "b": b, "nested": nested, "seeded": seeded, "none": None}, shared)
    per = 2 * 4 * 4  # bytes per token: 2 heads x 4 dims x fp32, keys and values apiece
    assert total == (10 + 6 + 3) * per * 2
    assert own == {"a": 0, "b": 6 * per * 2, "nested": 0, "seeded": 0, "none": 0}
    assert held_bytes({"a": a}) == (10 * per * 2, {"a": 10 * per * 2})

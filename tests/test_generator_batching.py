"""HFGenerator's batching machinery: in-place KV buffers, shared prompt prefixes, left padding.

Oracles: transformers' own ``DynamicLayer`` for the buffered cache layer, and transformers'
``generate`` run one prompt at a time (no padding, no shared prefix, its own cache) for the
greedy tokens of a tiny random-weight Llama shaped like SmolLM2 (tied embeddings, 3 KV heads
for 9 query heads).
"""
from __future__ import annotations


import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.methods.searchr1.loop import build_prompt

torch = pytest.importorskip("torch")

# Lengths differ (left padding) and all share the Search-R1 instruction (a shared prefix).
QUESTIONS = ["who wrote hamlet", "x", "what is the capital of france and why is it there",
             "which river runs through the city that hosted the 1900 olympics", "when"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, random_lm):
    """A random-weight Llama with SmolLM2's layout, the tiny Qwen2's tokenizer and chat template."""
    from transformers import LlamaConfig

    return random_lm(LlamaConfig, tmp_path_factory.mktemp("llama"), 11, hidden_size=72, intermediate_size=96,
                     num_hidden_layers=3, num_attention_heads=9, num_key_value_heads=3, head_dim=8,
                     max_position_embeddings=2048, tie_word_embeddings=True)


def _hf(path, **kw):
    from ragfast.models.generator import HFGenerator

    return HFGenerator(path, **kw)


def _reference_ids(g, prompt, max_new):
    """transformers' generate on one unpadded prompt: the greedy ids, cut after the first EOS."""
    ids = torch.tensor([g.encode(prompt)])
    with torch.inference_mode():
        out = g.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                               do_sample=False, pad_token_id=g.pad_id, eos_token_id=g.eos_ids)
    t = out[0, ids.shape[1]:].tolist()
    cut = next((j for j, x in enumerate(t) if x in g.eos_ids), None)
    return t if cut is None else t[:cut + 1]


def test_batched_left_padded_shared_prefix_equals_generate_one_at_a_time(llama):
    max_new = 12
    batched = _hf(llama, max_batch=len(QUESTIONS), min_prefix=8)
    prompts = [batched.format_prompt(build_prompt(q)) for q in QUESTIONS]
    sids = [f"s{i}" for i in range(len(prompts))]
    lens = {len(batched.encode(p)) for p in prompts}
    assert len(lens) > 1  # the rows really are left-padded to different lengths
    led = CostLedger()
    batched.start(sids, prompts)
    batched.generate(sids, stop=[], max_new_tokens=max_new, ledger=led)
    got = [batched.last_generated[s] for s in sids]
    want = [_reference_ids(batched, p, max_new) for p in prompts]
    assert got == want
    assert batched.stats["prefill_padding_tokens"] > 0
    # The common prefix was computed once and reused by the other rows, and booked once.
    n = batched.stats["prefix_tokens_computed"]
    assert n > 20 and batched.stats["prefix_tokens_reused"] == n * (len(prompts) - 1)
    tot = led.totals()["reasoner"]
    assert tot["cached_tokens"] == n * (len(prompts) - 1)
    assert tot["input_tokens"] + tot["cached_tokens"] == sum(len(batched.encode(p)) for p in prompts)

    # One at a time: the first prompt (all but its last token) is kept and shared with the next.
    single = _hf(llama, min_prefix=8)
    for s, p in zip(sids, prompts):
        single.start([s], [p])
        single.generate([s], stop=[], max_new_tokens=max_new)
        assert single.last_generated[s] == want[sids.index(s)]
        single.end([s])
    assert single.stats["prefix_tokens_reused"] > 0
    # Sharing off and re-encoding: the same tokens again.
    for kw in ({"share_prefix": False}, {"kv_reuse": False}):
        g = _hf(llama, max_batch=2, **kw)
        g.start(sids, prompts)
        g.generate(sids, stop=[], max_new_tokens=max_new)
        assert [g.last_generated[s] for s in sids] == want
        assert g.stats["prefix_tokens_computed"] == 0


def test_min_prefix_is_checked(llama):
    from ragfast.errors import ConfigError

    with pytest.raises(ConfigError, match="min_prefix"):
        _hf(llama, min_prefix=0)


def test_buffered_layer_matches_dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    from ragfast.models.kv_buffer import BufferedLayer

    g = torch.Generator().manual_seed(3)
    ref, buf = DynamicLayer(), BufferedLayer(capacity=6)

    def kv(b, t):
        return torch.randn(b, 3, t, 5, generator=g), torch.randn(b, 3, t, 5, generator=g)

    def same():
        assert buf.get_seq_length() == ref.get_seq_length()
        assert torch.equal(buf.keys, ref.keys) and torch.equal(buf.values, ref.values)

    for t in (4, 1, 1, 7, 1):  # the 7 runs past the capacity: the buffer grows
        k, v = kv(4, t)
        rk, rv = ref.update(k, v)
        bk, bv = buf.update(k.clone(), v.clone())
        assert torch.equal(rk, bk) and torch.equal(rv, bv)
        same()
    # Poison the unused tail: nothing past the filled length may ever be read.
    buf.buf_k[:, :, buf.n:] = float("nan")
    buf.buf_v[:, :, buf.n:] = float("nan")
    ref.crop(-3)
    buf.crop(-3)
    same()
    idx = torch.tensor([3, 0])
    ref.batch_select_indices(idx)
    buf.batch_select_indices(idx)
    same()
    k, v = kv(2, 2)
    ref.update(k, v)
    buf.update(k, v)
    same()
    assert not torch.isnan(buf.keys).any()
    with pytest.raises(ValueError, match="negative"):
        buf.crop(2)


def test_row_views_write_into_the_reserved_batch_buffers():
    from transformers.cache_utils import DynamicLayer

    from ragfast.models.kv_buffer import BufferedLayer

    g = torch.Generator().manual_seed(5)
    whole, parts = BufferedLayer(capacity=9), []
    whole.reserve(5, 3, 4, torch.float32, "cpu")
    whole.buf_k.fill_(float("nan"))  # poisoned: only what the views write may be read
    whole.buf_v.fill_(float("nan"))
    ref = DynamicLayer()
    k, v = torch.randn(5, 3, 6, 4, generator=g), torch.randn(5, 3, 6, 4, generator=g)
    ref.update(k, v)
    for lo, hi in ((0, 2), (2, 3), (3, 5)):  # odd groups, as a prefill's last group is
        part = whole.rows(lo, hi)
        pk, pv = part.update(k[lo:hi, :, :4].clone(), v[lo:hi, :, :4].clone())
        assert pk.shape == (hi - lo, 3, 4, 4)
        part.update(k[lo:hi, :, 4:].clone(), v[lo:hi, :, 4:].clone())
        parts.append(part)
    whole.fill_to(6)
    assert whole.get_seq_length() == 6
    assert torch.equal(whole.keys, ref.keys) and torch.equal(whole.values, ref.values)
    with pytest.raises(RuntimeError, match="row view of 9 tokens cannot take 10"):
        parts[0].update(*(torch.zeros(2, 3, 4, 4),) * 2)  # a view that grew would write elsewhere


def test_left_padding_into_a_reserved_buffer_equals_a_padded_copy(llama):
    """The two ways a turn's cache takes the sessions' kept keys/values: written in place into reserved
    (NaN-poisoned) buffers, or one zero-padded copy per layer into transformers' own cache."""
    from transformers import AutoConfig, DynamicCache

    from ragfast.models.kv_buffer import buffered_cache, fill_left_padded, reserve_rows

    config = AutoConfig.from_pretrained(llama)
    g = torch.Generator().manual_seed(7)
    lens = [5, 0, 2]  # a row with nothing cached stays all padding

    def kept():
        g.manual_seed(7)
        return [None if n == 0 else [(torch.randn(3, n, 8, generator=g), torch.randn(3, n, 8, generator=g))
                                     for _ in range(config.num_hidden_layers)] for n in lens]

    reserved = buffered_cache(config, 9)
    assert reserve_rows(reserved, config, 3, torch.float32, "cpu")
    for layer in reserved.layers:
        layer.buf_k.fill_(float("nan"))
        layer.buf_v.fill_(float("nan"))
    rows = kept()
    fill_left_padded(reserved, rows, 6)
    assert all(kv is None or all(x is None for x in kv) for kv in rows)  # each layer let go once moved
    plain = DynamicCache(config=config)
    fill_left_padded(plain, kept(), 6)
    for a, b in zip(reserved.layers, plain.layers):
        assert a.get_seq_length() == b.get_seq_length() == 6
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(plain.layers[0].keys[1], torch.zeros(3, 6, 8))


def test_a_prefill_in_row_groups_gives_the_tokens_of_one_pass(llama):
    """Groups of one to a few rows, with and without kept caches to pad in (second turn on): the same
    greedy tokens as one prefill pass, in float32."""
    from ragfast.errors import ConfigError

    prompts = [build_prompt(q) for q in QUESTIONS]
    obs = "\n\n<information>Doc 1(Title: \"Paris\") Paris is the capital of France.</information>\n\n"
    sids = [f"s{i}" for i in range(len(prompts))]
    runs = {}
    for tokens in (0, 150, 40):
        g = _hf(llama, max_batch=len(prompts), min_prefix=8, prefill_tokens=tokens)
        g.start(sids, [g.format_prompt(p) for p in prompts])
        got = []
        for _ in range(3):
            g.generate(sids, stop=[], max_new_tokens=6)
            got.append([g.last_generated[s] for s in sids])
            g.append(sids, [obs] * len(sids))
        runs[tokens] = (got, g.stats["prefill_groups"])
    assert runs[0][1] == 0
    assert runs[150][1] > 3 and runs[40][1] > runs[150][1]  # the first turn's rows alone, later ones in groups
    assert runs[150][0] == runs[0][0] and runs[40][0] == runs[0][0]
    with pytest.raises(ConfigError, match="prefill_tokens"):
        _hf(llama, prefill_tokens=-1)


def test_prefill_groups_split_by_length_pad_less_and_give_the_tokens_of_one_pass(llama, monkeypatch):
    """Rows of very different lengths: with passes priced low, the prefill splits where the padding
    was, each group computing only its own longest row; the greedy tokens stay those of one pass."""
    import ragfast.models.kv_buffer as kvb

    prompts = [build_prompt(q) for q in QUESTIONS]
    sids = [f"s{i}" for i in range(len(prompts))]
    out = {}
    for cheap in (False, True):
        monkeypatch.setattr(kvb, "PASS_TOKENS", 1 if cheap else 10**9)  # 10**9: never split
        g = _hf(llama, max_batch=len(prompts), min_prefix=8, prefill_tokens=4096)
        g.start(sids, [g.format_prompt(p) for p in prompts])
        g.generate(sids, stop=[], max_new_tokens=6)
        out[cheap] = ([g.last_generated[s] for s in sids], g.stats["prefill_groups"], g.stats["prefill_padding_tokens"])
    assert out[False][1] == 0 and out[True][1] > 1
    assert out[True][2] < out[False][2]
    assert out[True][0] == out[False][0]


def test_prefill_groups_are_the_cheapest_contiguous_split():
    """Against every contiguous split of random rows (brute force): the same cost, every group
    within the budget unless it is one row."""
    import itertools
    import random

    from ragfast.models.kv_buffer import prefill_groups

    rng = random.Random(3)

    def cost(groups, new, c):
        return sum((hi - lo) * max(new[lo:hi]) + c for lo, hi in groups)

    for _ in range(300):
        n = rng.randint(1, 7)
        new = sorted(rng.randint(1, 60) for _ in range(n)) if rng.random() < 0.5 else [rng.randint(1, 60) for _ in range(n)]
        budget, c = rng.choice([0, 30, 80, 500]), rng.choice([0, 5, 40])
        got = prefill_groups(new, budget, c)
        assert [lo for lo, _ in got] == [0] + [hi for _, hi in got[:-1]] and got[-1][1] == n  # contiguous, all rows
        if budget == 0:
            assert got == [(0, n)]
            continue
        assert all(hi - lo == 1 or (hi - lo) * max(new[lo:hi]) <= budget for lo, hi in got)
        best = min(cost(list(zip((0,) + cuts, cuts + (n,))), new, c)
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k)
                   if all(hi - lo == 1 or (hi - lo) * max(new[lo:hi]) <= budget
                          for lo, hi in zip((0,) + cuts, cuts + (n,))))
        assert cost(got, new, c) == best


def test_cutting_finished_rows_out_frees_the_prefill_buffers(llama):
    """Once a row finishes it is cut out of the batch; nothing but the batch cache's own layers may
    still hold its first buffers (a kept row view of the grouped prefill did: 2.3 GB of the 1.5B's
    peak). The layers keep a view of their first rows until their next growth or merge."""
    import gc

    prompts = [build_prompt(q) for q in QUESTIONS]
    sids = [f"s{i}" for i in range(len(prompts))]
    probe = _hf(llama, max_batch=len(prompts), min_prefix=8, prefill_tokens=0)
    probe.start(sids, [probe.format_prompt(p) for p in prompts])
    probe.generate(sids, stop=[], max_new_tokens=8)
    stop = probe.tokenizer.decode(probe.last_generated["s2"][1:3], skip_special_tokens=True)
    g = _hf(llama, max_batch=len(prompts), min_prefix=8, prefill_tokens=40)
    seen = {"first": None, "checked": 0}

    def after(module, args, kwargs, out):
        ids, cache = kwargs["input_ids"], kwargs["cache"]
        if ids.shape[1] != 1:
            return
        if seen["first"] is None:
            seen["first"] = (ids.shape[0], cache.layers[0].buf_k.untyped_storage().nbytes())
        elif ids.shape[0] < seen["first"][0]:
            own = {id(x) for layer in cache.layers for x in (layer.buf_k, layer.buf_v, layer.keys, layer.values)}
            pinned = [tuple(t.shape) for t in gc.get_objects() if isinstance(t, torch.Tensor)
                      and not t.is_mkldnn  # the prepacked weights: opaque, no storage to ask
                      and t.untyped_storage().nbytes() == seen["first"][1] and id(t) not in own]
            assert not pinned, pinned
            seen["checked"] += 1

    g.model.register_forward_hook(after, with_kwargs=True)
    g.start(sids, [g.format_prompt(p) for p in prompts])
    g.generate(sids, stop=[stop], max_new_tokens=8)
    assert g.stats["prefill_groups"] > 1 and seen["checked"] > 0  # grouped, and a row was cut out mid-turn


def test_buffered_cache_only_for_full_attention_layers(llama):
    from transformers import AutoConfig, MistralConfig

    from ragfast.models.kv_buffer import BufferedLayer, buffered_cache

    cache = buffered_cache(AutoConfig.from_pretrained(llama), 10)
    assert cache is not None and all(isinstance(x, BufferedLayer) for x in cache.layers)
    sliding = MistralConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    assert buffered_cache(sliding, 10) is None


def _layered_batch(config, g, spans, capacity):
    """A buffered batch cache whose row b holds ``spans[b] = (pad_between, cached, new)`` tokens laid
    out as a prefill leaves them ([pad | cache][pad | new], right-aligned), NaN-poisoned where unused;
    returns the cache, its mask and each row's per-layer (keys, values) of its own tokens."""
    from ragfast.models.kv_buffer import buffered_cache, reserve_rows

    width = max(c + p + n for p, c, n in spans)
    cache = buffered_cache(config, capacity)
    assert reserve_rows(cache, config, len(spans), torch.float32, "cpu")
    mask = torch.zeros((len(spans), width), dtype=torch.long)
    own = [[] for _ in spans]
    for layer in cache.layers:
        layer.buf_k.fill_(float("nan"))
        layer.buf_v.fill_(float("nan"))
        layer.buf_k[:, :, :width].zero_()
        layer.buf_v[:, :, :width].zero_()
        for b, (p, c, n) in enumerate(spans):
            k, v = torch.randn(3, c + n, 8, generator=g), torch.randn(3, c + n, 8, generator=g)
            cols = list(range(width - n - p - c, width - n - p)) + list(range(width - n, width))
            layer.buf_k[b, :, cols], layer.buf_v[b, :, cols] = k, v
            mask[b, cols] = 1
            own[b].append((k, v))
        layer.fill_to(width)
    return cache, mask, own


def test_merging_batches_and_cutting_rows_keep_each_rows_keys_and_values(llama):
    """merge_left_padded right-aligns every row at the longest span (its padding zeroed, never NaN),
    cut_rows hands back exactly a row's own keys/values and keeps the others in order."""
    from transformers import AutoConfig

    from ragfast.models.kv_buffer import cut_rows, merge_left_padded

    config = AutoConfig.from_pretrained(llama)
    g = torch.Generator().manual_seed(3)
    # padding between cache and new tokens in one part; a short part; every part's first columns
    # padding in all its rows (the merge drops them)
    a, ma, own_a = _layered_batch(config, g, [(2, 5, 3), (0, 1, 2), (4, 0, 1)], capacity=17)
    b, mb, own_b = _layered_batch(config, g, [(0, 3, 1), (1, 2, 2)], capacity=9)
    merged, mask = merge_left_padded(config, [(a, ma), (b, mb)], step=4, limit=None)
    own = own_a + own_b
    width = max(int(ma.shape[1]), int(mb.shape[1]))
    assert tuple(mask.shape) == (5, width)
    assert torch.equal(mask[:3, width - ma.shape[1]:], ma) and torch.equal(mask[3:, width - mb.shape[1]:], mb)
    for i, layer in enumerate(merged.layers):
        assert layer.get_seq_length() == width and layer.buf_k.shape[2] >= width + 4
        assert not torch.isnan(layer.keys).any() and not torch.isnan(layer.values).any()
        for r in range(5):
            ok = mask[r].bool()
            assert torch.equal(layer.keys[r][:, ok], own[r][i][0]) and torch.equal(layer.values[r][:, ok], own[r][i][1])
            assert torch.count_nonzero(layer.keys[r][:, ~ok]) == 0
    assert all(layer.buf_k is None for layer in a.layers + b.layers)  # the parts' buffers let go
    kept, order = cut_rows(merged, mask, [3, 0], [True, False])
    assert kept[1] is None and len(kept[0]) == config.num_hidden_layers
    assert all(torch.equal(k, own[3][i][0]) and torch.equal(v, own[3][i][1]) for i, (k, v) in enumerate(kept[0]))
    assert order == [4, 1, 2]  # the last row fills the first hole; no other row moves
    rest = mask[order]
    for i, layer in enumerate(merged.layers):
        assert layer.keys.shape[0] == 3
        for r, src in enumerate(order):
            assert torch.equal(layer.keys[r][:, rest[r].bool()], own[src][i][0])
            assert torch.equal(layer.values[r][:, rest[r].bool()], own[src][i][1])
    assert cut_rows(merged, rest, [0, 1, 2], [False] * 3) == ([None] * 3, [])
    assert all(not layer.is_initialized or layer.buf_k is None for layer in merged.layers)

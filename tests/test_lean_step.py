"""The lean decode step (ragfast.models.lean_step): the model's logits and keys/values bit for bit,
on left-padded rows, one and several tokens a row, every weight storage and ISA level; the
generator's turns with it equal those without; models it does not fit fall back."""
import pytest
import torch

from ragfast.protocol import build_prompt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory, random_lm):
    """A random-weight two-layer Llama (no projection biases, 6 query / 2 key-value heads)."""
    from transformers import LlamaConfig

    return random_lm(LlamaConfig, tmp_path_factory.mktemp("llama"), 7, hidden_size=96, intermediate_size=160,
                     num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                     max_position_embeddings=4096)


def _prepared(path, dtype, weights):
    from ragfast.models.generator import HFGenerator

    return HFGenerator(path, dtype=dtype, weights=weights, draft_tokens=0, memory_budget=None)


def _padded_cache(model, rows, seed):
    """A cache of ``len(rows)`` left-padded prompts (random ids, lengths ``rows``) after a prefill
    pass, with the 2-D mask; the model's own forward fills it."""
    from ragfast.models.kv_buffer import cache_for

    g = torch.Generator().manual_seed(seed)
    T = max(rows)
    ids = torch.randint(3, model.config.vocab_size, (len(rows), T), generator=g)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for r, n in enumerate(rows):
        mask[r, T - n:] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    cache = cache_for(model.config, T + 8)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, mask, pos[:, -1:] + 1


def _clone(cache):
    import copy

    return copy.deepcopy(cache)


@pytest.mark.parametrize("dtype,weights", [("float32", "native"), ("bfloat16", "native"), ("bfloat16", "int8"),
                                           ("bfloat16", "w8a8"), ("float32", "w8a8"), ("float16", "native")])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_lean_step_gives_the_models_logits_and_cache_bit_for_bit(kind, dtype, weights, tiny_qwen2_dir,
                                                                  tiny_llama_dir, isa_level):
    from ragfast.models.lean_step import lean_forward, lean_plan

    gen = _prepared(tiny_qwen2_dir if kind == "qwen2" else tiny_llama_dir, dtype, weights)
    model = gen.model
    plan = lean_plan(model)
    assert plan is not None and len(plan.layers) == 2
    for rows, t in (([5], 1), ([7, 3, 9], 1), ([4, 11], 3), ([1, 6, 6, 2, 8], 2)):
        cache, mask, pos0 = _padded_cache(model, rows, seed=len(rows) * 10 + t)
        ids = torch.randint(3, model.config.vocab_size, (len(rows), t), generator=torch.Generator().manual_seed(t))
        pos = pos0 + torch.arange(t)[None, :]
        full = torch.cat([mask, mask.new_ones(len(rows), t)], dim=1)
        ref_cache, lean_cache = _clone(cache), _clone(cache)
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=full, position_ids=pos, cache=ref_cache, use_cache=True,
                         logits_to_keep=t).logits
        got = lean_forward(plan, ids, full, pos, lean_cache, t)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (rows, t, (got.float() - want.float()).abs().max())
        for a, b in zip(ref_cache.layers, lean_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("drafts", [0, 4])
def test_generator_turns_are_the_same_with_and_without_lean_steps(tiny_qwen2_dir, drafts):
    """Three sessions of different lengths, two turns each (an observation between), drafts off and
    on: the same texts and session tokens; the lean generator took every decode step lean."""
    from ragfast.models.generator import HFGenerator

    qs = ["who wrote hamlet", "when was the eiffel tower finished and by whom", "capital of peru"]
    outs = []
    for lean in (False, True):
        g = HFGenerator(tiny_qwen2_dir, dtype="bfloat16", weights="w8a8", draft_tokens=drafts, memory_budget=None)
        g.lean_steps = lean
        sids = [f"s{i}" for i in range(len(qs))]
        g.start(sids, [g.format_prompt(build_prompt(q)) for q in qs])
        texts = [g.generate(sids, stop=["</search>"], max_new_tokens=24)]
        g.append(sids, ["<information>obs 397 1045</information>"] * len(sids))
        texts.append(g.generate(sids, stop=[], max_new_tokens=16))
        outs.append((texts, [g.session_tokens(s) for s in sids]))
        assert g.stats["decode_steps"] > 0
        assert g.stats["lean_steps"] == (g.stats["decode_steps"] if lean else 0)
    assert outs[0] == outs[1]


def test_models_the_lean_step_does_not_fit_fall_back(tiny_qwen2_dir, tmp_path, random_lm):
    """A forward hook inside the body or on the model, training mode and another model type: no plan, with the reason."""
    from transformers import Qwen3Config

    from ragfast.models.lean_step import lean_plan, why_not_lean

    gen = _prepared(tiny_qwen2_dir, "float32", "native")
    model = gen.model
    assert why_not_lean(model) is None
    h = model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_plan(model) is None and "hooks" in why_not_lean(model)
    h.remove()
    h = model.register_forward_pre_hook(lambda *a: None)
    assert lean_plan(model) is None
    h.remove()
    model.train()
    assert lean_plan(model) is None and "training" in why_not_lean(model)
    model.eval()
    assert lean_plan(model) is not None
    q3 = _prepared(random_lm(Qwen3Config, tmp_path, 3, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16), "float32", "native")
    assert lean_plan(q3.model) is None and "qwen3" in why_not_lean(q3.model)

"""prefill_attention (ragfast.ops.prefill_attention): every compiled level against the reference, and in a model."""
import numpy as np
import pytest
import torch

from ragfast.ops.prefill_attention import prefill_attention, prefill_attention_cpp, prefill_attention_ref
from ragfast.ops.registry import available

needs_cpp = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def inputs(g, B, H, Hkv, L, T, D, dtype, *, spare=3):
    """q as transformers hands it ([B, L, H, D] storage seen as [B, H, L, D]); k and v as the
    buffered cache's views (the first T of T + spare tokens); a random padding mask with one row
    all masked where B > 1."""
    q = torch.randn(B, L, H, D, generator=g).to(dtype).transpose(1, 2)
    k = (torch.randn(B, Hkv, T + spare, D, generator=g) * 2).to(dtype)[:, :, :T]
    v = torch.randn(B, Hkv, T + spare, D, generator=g).to(dtype)[:, :, :T]
    mask = torch.rand(B, T, generator=g) > 0.3
    if B > 1:
        mask[B // 2] = False
    return q, k, v, mask


def check(got, want, dtype):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not torch.isnan(got).any()
    # fp32: sums in another order. bf16: the amx and avx512bf16 tasks round the softmax's exponentials to bf16
    # before the values' product (relative error 2^-9 each), and outputs may round a unit apart.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# (B, H, Hkv, L, T, D). The amx and avx512bf16 levels' tasks take bf16 with D in {32, 64, 96, 128}:
# blocks of 16 queries whole and partial (L = 1, 5, 16, 37, 50), keys in 8-, 16- and 32-key steps
# whole and partial, no cache (T = L) and a cache longer than the queries; other D run the portable
# task. Their rows pack the G heads of each query side by side: a few queries of many heads fill
# a block and cross into the next mid-query (L = 3, 4, 6 with G = 7, 12).
SHAPES = [(4, 14, 2, 3, 60, 64), (2, 14, 2, 6, 200, 64), (1, 12, 1, 4, 33, 32),
          (1, 1, 1, 1, 1, 32), (2, 4, 2, 5, 5, 64), (3, 14, 2, 37, 80, 64), (2, 6, 3, 16, 19, 17),
          (1, 8, 1, 50, 70, 128), (2, 2, 1, 33, 33, 96), (2, 3, 1, 9, 300, 32), (1, 7, 1, 1, 45, 64),
          (2, 4, 4, 20, 51, 80), (1, 2, 2, 64, 64, 128)]


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, dtype):
    g = seeded()
    for B, H, Hkv, L, T, D in SHAPES:
        q, k, v, mask = inputs(g, B, H, Hkv, L, T, D, dtype)
        for m in (mask, None):
            out = torch.full((B, L, H, D), float("nan"), dtype=dtype)  # poisoned: every value must be written
            got = prefill_attention_cpp(q, k, v, m, out=out)
            check(got, prefill_attention_ref(q, k, v, m), dtype)
            assert got.data_ptr() == out.data_ptr()
        if B > 1:  # the all-masked row is zeros, as the reference says
            assert prefill_attention_cpp(q, k, v, mask)[B // 2].float().abs().sum().item() == 0.0


@needs_cpp
def test_one_query_is_the_decode_step(isa_level):
    """L = 1 sees every key its mask allows: decode_attention's semantics."""
    from ragfast.ops.decode_attention import decode_attention_ref

    g = seeded()
    q, k, v, mask = inputs(g, 3, 8, 2, 1, 41, 64, torch.bfloat16)
    mask[:, -1] = True
    check(prefill_attention_cpp(q, k, v, mask), decode_attention_ref(q, k, v, mask), torch.bfloat16)


@needs_cpp
def test_scale_and_large_scores(isa_level):
    g = seeded()
    q, k, v, mask = inputs(g, 2, 8, 2, 23, 41, 64, torch.bfloat16)
    for scale in (0.01, 0.125, 3.0):
        check(prefill_attention(q * 4, k, v, mask, scale, backend="cpp"),
              prefill_attention_ref(q * 4, k, v, mask, scale), torch.bfloat16)


@needs_cpp
def test_the_result_does_not_depend_on_threads():
    g = seeded()
    q, k, v, mask = inputs(g, 5, 14, 2, 40, 90, 64, torch.bfloat16)
    outs = [prefill_attention_cpp(q, k, v, mask)]
    before = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(prefill_attention_cpp(q, k, v, mask))
    finally:
        torch.set_num_threads(before)
    for o in outs:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_bad_input_is_one_line(backend):
    if backend == "cpp" and not available()["cpp"]:
        pytest.skip("ragfast._C not built")
    q, k, v = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8)
    for bad, match in (((torch.zeros(2, 4, 6, 8), k, v, None), "need at least as many keys"),
                       ((q, torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8), None), "not a multiple"),
                       ((q, k.bfloat16(), v, None), "must all be fp32 or all bf16"),
                       ((q, k, v, torch.ones(2, 4, dtype=torch.bool)), "mask must be"),
                       ((q, k, torch.zeros(2, 2, 6, 8), None), "do not fit")):
        with pytest.raises(ValueError, match=match) as e:
            prefill_attention(*bad, backend=backend)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def qwen2_d32(tmp_path_factory, random_lm):
    """A random-weight two-layer Qwen2 whose head dim (32) the amx level's prefill task takes."""
    from transformers import Qwen2Config

    return random_lm(Qwen2Config, tmp_path_factory.mktemp("qwen_d32"), 5, hidden_size=128, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=4096)


@needs_cpp
def test_a_model_prefills_with_the_kernel_as_with_sdpa(qwen2_d32, monkeypatch):
    """A bf16 model with the kernels on: a left-padded prompt pass, then a pass over its cache, run the
    prefill kernel where the level has it (counted), and its logits at the real tokens are as close
    to the fp32 model's (SDPA) as bf16 SDPA's are: bf16 roundings differ between the two, so the
    fp32 model is the oracle and bf16 SDPA the yardstick."""
    from transformers import AutoModelForCausalLM

    import ragfast.ops.prefill_attention as op
    from ragfast.models import attention
    from ragfast.ops.registry import cpp_module

    fast = cpp_module().isa_current() in attention.PREFILL_LEVELS
    calls = []
    real = op.prefill_attention_cpp
    monkeypatch.setattr(op, "prefill_attention_cpp", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    op.register("prefill_attention", "cpp", op.prefill_attention_cpp)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(qwen2_d32), dtype=torch.bfloat16, local_files_only=True)
        g = seeded()
        ids = torch.randint(3, 400, (3, 40), generator=g)
        mask = torch.ones(3, 40, dtype=torch.long)
        mask[0, :7] = 0  # left padding
        mask[2, :19] = 0
        logits = {}
        for on, dtype in ((True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)):
            model.to(dtype)
            assert attention.set_decode_attention(model, on) == on
            calls.clear()
            with torch.inference_mode():
                first = model(input_ids=ids[:, :25], attention_mask=mask[:, :25], use_cache=True)
                second = model(input_ids=ids[:, 25:], attention_mask=mask, past_key_values=first.past_key_values)
            logits[on, dtype] = torch.cat([first.logits, second.logits], 1).float()[mask.bool()]
            assert bool(calls) == (on and fast)
            assert all(s[2] > 1 for s in calls) and len(calls) in (0, 4)  # two passes x two layers
        truth = logits[False, torch.float32]
        err = {on: (logits[on, torch.bfloat16] - truth).abs().mean().item() for on in (True, False)}
        assert err[True] <= 1.5 * err[False], err
        agree = {on: (logits[on, torch.bfloat16].argmax(-1) == truth.argmax(-1)).float().mean().item()
                 for on in (True, False)}
        assert agree[True] >= agree[False] - 0.05, agree
    finally:
        op.register("prefill_attention", "cpp", real)


@needs_cpp
def test_the_hook_routes_prefill_passes(monkeypatch):
    """bf16 passes of several tokens under a causal padding mask (or none, without a cache) go to the
    prefill kernel at PREFILL_LEVELS; fp32, a head dim it does not take, a sliding window or no mask
    over a cache go to SDPA. Both answer alike."""
    import types

    import ragfast.ops.prefill_attention as op
    from ragfast.models import attention
    from ragfast.ops.prefill_attention import visible
    from ragfast.ops.registry import cpp_module

    attention._register()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hook = ALL_ATTENTION_FUNCTIONS[attention.ATTN_IMPL]
    calls = []
    real = op.prefill_attention_cpp
    monkeypatch.setattr(op, "prefill_attention_cpp", lambda *a, **k: calls.append(1) or real(*a, **k))
    op.register("prefill_attention", "cpp", op.prefill_attention_cpp)
    fast = cpp_module().isa_current() in attention.PREFILL_LEVELS
    try:
        g = seeded()
        for dtype, D, L, T, masked, window, want in (
                (torch.bfloat16, 32, 5, 9, True, None, True), (torch.bfloat16, 64, 9, 9, False, None, True),
                (torch.float32, 32, 5, 9, True, None, False), (torch.bfloat16, 16, 5, 9, True, None, False),
                (torch.bfloat16, 32, 5, 9, True, 4, False), (torch.bfloat16, 32, 5, 9, False, None, False)):
            module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False,
                                           sliding_window=window)
            q = torch.randn(2, 4, L, D, generator=g).to(dtype)
            k, v = (torch.randn(2, 2, T, D, generator=g).to(dtype) for _ in range(2))
            pad = torch.ones(2, T, dtype=torch.bool)
            if masked:
                pad[1, :2] = False
            calls.clear()
            out, _ = hook(module, q, k, v, visible(L, T, pad)[:, None] if masked else None, scaling=0.25)
            assert bool(calls) == (want and fast), (dtype, D, L, T, masked, window)
            assert out.shape == (2, L, 4, D)
            if want and fast:
                check(out.transpose(1, 2), op.prefill_attention_ref(q, k, v, pad, 0.25), dtype)
        # A bf16 decode step (one query, a padding mask or none) takes the prefill kernel only where
        # it beats the decode kernel; it sees every key its mask allows either way.
        on_prefill = cpp_module().isa_current() in attention.DECODE_ON_PREFILL_LEVELS
        module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, sliding_window=None)
        for masked in (True, False):
            q = torch.randn(2, 4, 1, 64, generator=g).bfloat16()
            k, v = (torch.randn(2, 2, 30, 64, generator=g).bfloat16() for _ in range(2))
            pad = torch.rand(2, 30, generator=g) > 0.3 if masked else torch.ones(2, 30, dtype=torch.bool)
            pad[:, -1] = True
            calls.clear()
            out, _ = hook(module, q, k, v, pad[:, None, None, :] if masked else None, scaling=0.25)
            assert bool(calls) == on_prefill, masked
            check(out.transpose(1, 2), op.prefill_attention_ref(q, k, v, pad, 0.25), torch.bfloat16)
    finally:
        op.register("prefill_attention", "cpp", real)

"""decode_attention (ragfast.ops.decode_attention): every compiled level against the reference, and in a model."""
import numpy as np
import pytest
import torch

from ragfast.ops.decode_attention import decode_attention, decode_attention_cpp, decode_attention_ref
from ragfast.ops.registry import available

needs_cpp = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


def seeded():
    return torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))


def inputs(g, B, H, Hkv, T, D, dtype, *, spare=3):
    """q as transformers hands it ([B, 1, H, D] storage seen as [B, H, 1, D]); k and v as the
    buffered cache's views (the first T of T + spare tokens); a random padding mask, one row all
    masked where B > 1 and the last key always visible elsewhere."""
    q = torch.randn(B, 1, H, D, generator=g).to(dtype).transpose(1, 2)
    k = (torch.randn(B, Hkv, T + spare, D, generator=g) * 2).to(dtype)[:, :, :T]
    v = torch.randn(B, Hkv, T + spare, D, generator=g).to(dtype)[:, :, :T]
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[:, -1] = True
    if B > 1:
        mask[B // 2] = False
    return q, k, v, mask


def check(got, want, dtype, fp32_tol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not torch.isnan(got).any()
    # fp32 sums in another order; bf16 outputs may round one unit apart
    tol = dict(rtol=fp32_tol, atol=fp32_tol) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -9)
    torch.testing.assert_close(got.float(), want.float(), **tol)


# The amx level's tile task takes bf16 with D in {32, 64, 96, 128} and G <= 16: whole and partial
# 16-key tiles (T = 16, 37, 300, 1), G = 16 and 17 (the latter on the avx512 task). The values'
# pass keeps up to 5 heads' sums in registers for D <= 64 and 3 for D <= 128: G = 1, 2, 5, 7, 8,
# 12 and 17 split into every group size, with the head dim's last 16 lanes whole and partial
# (D = 56, 64, 120, 128).
SHAPES = [(1, 1, 1, 1, 1), (2, 4, 4, 5, 48), (3, 14, 2, 37, 64), (2, 6, 3, 19, 17), (1, 8, 1, 70, 128),
          (4, 2, 1, 33, 80), (2, 3, 1, 9, 256), (2, 2, 2, 11, 300), (2, 16, 1, 16, 32), (2, 6, 2, 300, 96),
          (1, 17, 1, 5, 64), (3, 4, 2, 1, 64), (2, 3, 3, 23, 56), (2, 10, 2, 29, 64), (1, 12, 1, 18, 64),
          (2, 5, 1, 21, 120)]


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_matches_the_reference(isa_level, dtype):
    g = seeded()
    for B, H, Hkv, T, D in SHAPES:
        q, k, v, mask = inputs(g, B, H, Hkv, T, D, dtype)
        for m in (mask, None):
            out = torch.full((B, 1, H, D), float("nan"), dtype=dtype)  # poisoned: every value must be written
            got = decode_attention_cpp(q, k, v, m, out=out)
            check(got, decode_attention_ref(q, k, v, m), dtype)
            assert got.data_ptr() == out.data_ptr()
        if B > 1:  # the all-masked row is zeros, as the reference says
            assert torch.equal(got[B // 2].float().abs().sum(), torch.tensor(0.0)) or m is None


@needs_cpp
def test_scale_and_large_scores(isa_level):
    """A given scale, and scores far apart (the softmax's max shift and its exponentials' range):
    scores of a few hundred carry fp32 rounding of about 1e-5 into the weights."""
    g = seeded()
    q, k, v, mask = inputs(g, 3, 8, 2, 41, 64, torch.float32)
    for scale in (0.01, 0.125, 3.0):
        check(decode_attention(q * 4, k, v, mask, scale, backend="cpp"), decode_attention_ref(q * 4, k, v, mask, scale),
              torch.float32, fp32_tol=1e-5 if scale < 1 else 2e-4)


@needs_cpp
def test_the_result_does_not_depend_on_threads():
    g = seeded()
    q, k, v, mask = inputs(g, 9, 14, 2, 57, 64, torch.bfloat16)
    outs = [decode_attention_cpp(q, k, v, mask) for _ in range(1)]
    before = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(decode_attention_cpp(q, k, v, mask))
    finally:
        torch.set_num_threads(before)
    for o in outs:
        assert torch.equal(o, outs[0])


@pytest.mark.parametrize("backend", ["cpp", "ref"])
def test_bad_input_is_one_line(backend):
    if backend == "cpp" and not available()["cpp"]:
        pytest.skip("ragfast._C not built")
    q, k, v = torch.zeros(2, 4, 1, 8), torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8)
    for bad, match in (((torch.zeros(2, 4, 2, 8), k, v, None), "one query token"),
                       ((q, torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 5, 8), None), "not a multiple"),
                       ((q, k.bfloat16(), v, None), "must all be fp32 or all bf16"),
                       ((q, k, v, torch.ones(2, 4, dtype=torch.bool)), "mask must be"),
                       ((q, k, torch.zeros(2, 2, 6, 8), None), "do not fit")):
        with pytest.raises(ValueError, match=match) as e:
            decode_attention(*bad, backend=backend)
        assert "\n" not in str(e.value)


@needs_cpp
def test_generator_decodes_with_the_kernel_as_with_sdpa(tiny_qwen2_dir, monkeypatch):
    """HFGenerator turns the kernel on; its batched, left-padded decode steps run it (counted) and
    give SDPA's greedy tokens (fp32: in bf16 near-equal logits of a random model may flip, the
    op's bf16 results are checked above); prefill passes stay on SDPA."""
    import ragfast.ops.decode_attention as op
    from ragfast.models.attention import decode_attention_on, set_decode_attention
    from ragfast.models.generator import HFGenerator

    from ragfast.models import attention
    from ragfast.ops.registry import cpp_module

    # fp32 at amx is left to SDPA for speed only: the routing is tested there as on the AVX-512 levels
    monkeypatch.setattr(attention, "BF16_ONLY_LEVELS", ())
    fast = cpp_module().isa_current() in attention.FAST_LEVELS  # below them SDPA serves every pass
    calls = []
    real = op.decode_attention_cpp
    monkeypatch.setattr(op, "decode_attention_cpp", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    op.register("decode_attention", "cpp", op.decode_attention_cpp)
    try:
        gen = HFGenerator(tiny_qwen2_dir, dtype="float32", memory_budget=None)
        assert decode_attention_on(gen.model)
        # prompts of different lengths: left padding in the prompt and, after a first turn, in the
        # cache; four rows x two key/value heads reach MIN_TASKS
        prompts = [gen.format_prompt("Who wrote Hamlet?"), gen.format_prompt("Capital of Peru, the country in South America?"),
                   gen.format_prompt("2+2?"), gen.format_prompt("Name a river.")]
        out = {}
        for on in (True, False):
            assert set_decode_attention(gen.model, on) == on
            calls.clear()
            ids = ["a", "b", "c", "d"]
            gen.start(ids, prompts)
            gen.generate(ids, stop=[], max_new_tokens=6)
            gen.append(ids, [" and then", " so", " ok, more text here", "."])
            gen.generate(ids, stop=[], max_new_tokens=6)
            out[on] = [list(gen.last_generated[s]) for s in ids]
            gen.end(ids)
            assert bool(calls) == (on and fast) and all(s[2] == 1 for s in calls)
        assert out[True] == out[False] and all(len(t) == 6 for t in out[True])
    finally:
        op.register("decode_attention", "cpp", real)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hook_routes_each_pass(dtype, monkeypatch):
    """Which passes the registered attention gives the kernel: decode steps of enough rows x heads,
    or a bf16 step with no mask; prefill and small padded steps go to SDPA. Both answer alike."""
    import types

    import ragfast.ops.decode_attention as op
    from ragfast.models import attention
    from ragfast.ops.registry import cpp_module

    attention._register()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    hook = ALL_ATTENTION_FUNCTIONS[attention.ATTN_IMPL]
    calls = []
    real = op.decode_attention_cpp
    monkeypatch.setattr(op, "decode_attention_cpp", lambda *a, **k: calls.append(1) or real(*a, **k))
    op.register("decode_attention", "cpp", op.decode_attention_cpp)
    level = cpp_module().isa_current()
    fast = level in attention.FAST_LEVELS and not (level in attention.BF16_ONLY_LEVELS and dtype == torch.float32)
    try:
        g = seeded()
        module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
        for B, Lq, masked, want in ((4, 1, True, True), (1, 1, True, False), (1, 1, False, dtype == torch.bfloat16),
                                    (4, 3, True, False)):
            q = torch.randn(B, 4, Lq, 16, generator=g).to(dtype)
            k, v = (torch.randn(B, 2, 9, 16, generator=g).to(dtype) for _ in range(2))
            mask = None
            if masked:
                mask = torch.ones(B, 1, Lq, 9, dtype=torch.bool)
                mask[:, :, :, 0] = False
            calls.clear()
            out, _ = hook(module, q, k, v, mask, scaling=0.25)
            assert bool(calls) == (want and fast), (B, Lq, masked)
            assert out.shape == (B, Lq, 4, 16)
            if Lq == 1:
                m = None if mask is None else mask[:, 0, 0, :]
                check(out.transpose(1, 2), decode_attention_ref(q, k, v, m, 0.25), dtype)
    finally:
        op.register("decode_attention", "cpp", real)

"""prefix_attention: Triton kernel (interpreter) and FlexAttention against the dense-mask reference."""
import pytest
import torch

import ragfast
from ragfast.ops.prefix_attention import (check_inputs, dense_mask, flex_block_mask, prefix_attention,
                                          prefix_attention_flex, prefix_attention_ref)

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}


def _desc(B, Lq, Lk, gen, style="random"):
    """A random mask description in which every query sees itself."""
    a = torch.arange(Lq) + (Lk - Lq)
    if style == "causal":
        return torch.zeros((B, Lq), dtype=torch.int32), torch.zeros((B, Lq), dtype=torch.int32)
    hi = torch.randint(0, Lk + 1, (B, Lq), generator=gen, dtype=torch.int32)
    back = torch.randint(0, 9, (B, Lq), generator=gen)
    lo = (a[None] - back).clamp(min=0).to(torch.int32)
    return hi, lo


def _qkv(B, H, Hkv, Lq, Lk, D, dtype, gen, contiguous=True):
    if contiguous:
        q = torch.randn(B, H, Lq, D, generator=gen)
        k = torch.randn(B, Hkv, Lk, D, generator=gen)
        v = torch.randn(B, Hkv, Lk, D, generator=gen)
    else:
        # transformers' layout: [B, L, H, D] transposed to [B, H, L, D], plus a strided head dim.
        q = torch.randn(B, Lq, H, 2 * D, generator=gen)[..., ::2].transpose(1, 2)
        k = torch.randn(B, Lk, Hkv, D, generator=gen).transpose(1, 2)
        v = torch.randn(B, Lk, Hkv, D + 3, generator=gen)[..., :D].transpose(1, 2)
        assert q.stride(-1) == 2 and not q.is_contiguous()
    return q.to(dtype), k.to(dtype), v.to(dtype)


def test_dense_mask_matches_definition():
    gen = torch.Generator().manual_seed(1)
    B, Lq, Lk = 2, 7, 12
    hi, lo = _desc(B, Lq, Lk, gen)
    m = dense_mask(hi, lo, Lk)
    assert m.shape == (B, 1, Lq, Lk)
    for b in range(B):
        for i in range(Lq):
            a = Lk - Lq + i
            for j in range(Lk):
                want = j < hi[b, i] or (lo[b, i] <= j <= a)
                assert bool(m[b, 0, i, j]) == want


def test_ref_causal_equals_sdpa_causal():
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(1, 2, 2, 9, 9, 8, torch.float32, gen)
    hi, lo = _desc(1, 9, 9, gen, "causal")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(prefix_attention_ref(q, k, v, hi, lo), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,contiguous", [
    # B, H, Hkv, Lq, Lk, D
    ((1, 1, 1, 1, 1, 16), True),
    ((2, 4, 2, 19, 19, 16), False),     # no cache, GQA, transformers' strided layout
    ((1, 4, 4, 37, 60, 24), True),      # cached prefix, head dim not a power of two
    ((2, 2, 1, 45, 99, 32), False),     # odd lengths over several key blocks
])
def test_triton_matches_ref(dtype, shape, contiguous):
    from ragfast.kernels.prefix_attention import prefix_attention as kernel

    gen = torch.Generator().manual_seed(hash((shape, contiguous)) % 2**31)
    B, H, Hkv, Lq, Lk, D = shape
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, dtype, gen, contiguous)
    hi, lo = _desc(B, Lq, Lk, gen)
    check_inputs(q, k, v, hi, lo)
    want = prefix_attention_ref(q, k, v, hi, lo)
    out = torch.full((B, H, Lq, D), float("nan"), dtype=dtype)  # poisoned: unwritten elements show
    got = kernel(q, k, v, hi, lo, D ** -0.5, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # The public op dispatches to the same kernel.
    via_op = prefix_attention(q, k, v, hi, lo, backend="triton")
    torch.testing.assert_close(via_op.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_packed_layout_and_scale():
    """The judge's layout: a causal main stream, then suffixes that each see a prefix + themselves."""
    gen = torch.Generator().manual_seed(5)
    S, main, suf = 11, 40, [5, 3, 6]
    ends = [S + 10, S + 25, S + 40]
    Lq = main + sum(suf)
    Lk = S + Lq
    hi = torch.zeros((1, Lq), dtype=torch.int32)
    lo = torch.zeros((1, Lq), dtype=torch.int32)
    pos = main
    for e, n in zip(ends, suf):
        hi[0, pos:pos + n] = e
        lo[0, pos:pos + n] = S + pos
        pos += n
    q, k, v = _qkv(1, 4, 2, Lq, Lk, 16, torch.float32, gen)
    want = prefix_attention_ref(q, k, v, hi, lo, scale=0.3)
    got = prefix_attention(q, k, v, hi, lo, scale=0.3, backend="triton")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # A suffix row equals plain causal attention over [its prefix, itself].
    s0 = main
    keys = torch.cat([k[:, :, :ends[0]], k[:, :, S + s0:S + s0 + suf[0]]], dim=2)
    vals = torch.cat([v[:, :, :ends[0]], v[:, :, S + s0:S + s0 + suf[0]]], dim=2)
    kk, vv = keys.repeat_interleave(2, 1), vals.repeat_interleave(2, 1)
    qq = q[:, :, s0:s0 + suf[0]]
    m = torch.ones(suf[0], keys.shape[2], dtype=torch.bool).tril(keys.shape[2] - suf[0])
    alone = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=m, scale=0.3)
    torch.testing.assert_close(got[:, :, s0:s0 + suf[0]], alone, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flex_matches_ref(dtype):
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 37, 70, 16
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, dtype, gen, contiguous=False)
    hi, lo = _desc(B, Lq, Lk, gen)
    want = prefix_attention_ref(q, k, v, hi, lo)
    got = prefix_attention_flex(q, k, v, hi, lo)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    again = prefix_attention(q, k, v, hi, lo, backend="flex")
    torch.testing.assert_close(again.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    bm = flex_block_mask(hi, lo, Lk)
    torch.testing.assert_close(prefix_attention_flex(q, k, v, hi, lo, block_mask=bm).float(), want.float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_bad_inputs_name_the_problem():
    q = torch.randn(1, 4, 5, 8)
    k = torch.randn(1, 2, 7, 8)
    hi = torch.zeros((1, 5), dtype=torch.int32)
    lo = torch.zeros((1, 5), dtype=torch.int32)
    with pytest.raises(ValueError, match="see itself"):
        bad = lo.clone()
        bad[0, 0] = 3  # query 0 sits at key 2
        prefix_attention(q, k, k, hi, bad)
    with pytest.raises(ValueError, match="not a multiple"):
        prefix_attention(q, torch.randn(1, 3, 7, 8), torch.randn(1, 3, 7, 8), hi, lo)
    with pytest.raises(ValueError, match="queries must be the last"):
        prefix_attention(torch.randn(1, 4, 9, 8), k, k, torch.zeros((1, 9), dtype=torch.int32),
                         torch.zeros((1, 9), dtype=torch.int32))
    with pytest.raises(ValueError, match=r"prefix_hi must be \[B, Lq\]"):
        prefix_attention(q, k, k, hi[:, :3], lo)
    with pytest.raises(ValueError, match="integer"):
        prefix_attention(q, k, k, hi.float(), lo)
    with pytest.raises(ValueError, match="share one float dtype"):
        prefix_attention(q, k.half(), k.half(), hi, lo)
    with pytest.raises(ValueError, match="prefix_hi must lie"):
        prefix_attention(q, k, k, hi + 99, lo)


def test_registered_backends():
    ops = ragfast.backends()["ops"]
    assert set(ops["prefix_attention"]["implementations"]) >= {"ref", "triton"}

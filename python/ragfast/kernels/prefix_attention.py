"""Triton kernel: flash attention under a "prefix limit + own segment" mask.

The mask is described per query row instead of as a dense [Lq, Lk] matrix. Queries are the
last ``Lq`` of the ``Lk`` keys (a KV-cached prefix of ``Lk - Lq`` keys comes first), so query
``i`` sits at absolute key index ``a = Lk - Lq + i``, and it may see key ``j`` when

    j < prefix_hi[i]            (the shared prefix it continues from), or
    seg_lo[i] <= j <= a         (its own segment, causally).

A plain causal row is ``prefix_hi = 0, seg_lo = 0``. In the judge's packed layout the main
stream (question + evidence) is causal and each state's short suffix sees the evidence up to the
end of its own state plus itself. A query block touches at most two key ranges, ``[0, max hi)``
and ``[min lo, last query]``; the kernel walks only those, so a suffix block skips the evidence
of later states entirely.

Online softmax in fp32 (inputs fp32 or fp16). Grouped-query attention: query head ``h`` reads
key/value head ``h // (H // Hkv)``. Any strides are accepted.
"""
from __future__ import annotations

import triton
import triton.language as tl

# A finite "minus infinity" for the running max: starting at -inf would make the first
# rescale exp(-inf - -inf) = NaN for rows that have seen no visible key yet. A tl.constexpr:
# Triton 3.9 refuses a plain float global when compiling for a GPU (the interpreter accepts it,
# so only the AOT check, ragfast.kernels.aot, caught this).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _attend_range(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, hi, lo, a, m_ok, d_ok, offs_d,
                  lo_n, hi_n, Lk, scale, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # One online-softmax pass over the key blocks [lo_n, hi_n).
    for start_n in range(lo_n, hi_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Lk
        k = tl.load(k_base + offs_n[None, :] * skn + offs_d[:, None] * skd,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            # fp32 inputs: full-precision products (the default would be TF32 on NVIDIA GPUs,
            # about 1e-3 relative error, too coarse for packed == naive within 1e-4).
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        vis = (offs_n[None, :] < hi[:, None]) | ((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] <= a[:, None]))
        vis = vis & n_ok[None, :] & m_ok[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs_n[:, None] * svn + offs_d[None, :] * svd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefix_attn_fwd(
    Q, K, V, O, HI, LO,
    sqb, sqh, sqm, sqd,
    skb, skh, skn, skd,
    svb, svh, svn, svd,
    sob, soh, som, sod,
    shb, shm, slb, slm,
    H, Lq, Lk, D, scale,
    GROUP,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP
    off = Lk - Lq

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < Lq
    d_ok = offs_d < D

    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    hi = tl.load(HI + b * shb + offs_m * shm, mask=m_ok, other=0)
    # Rows past Lq get lo = Lk so that they neither widen the key ranges nor see anything.
    lo = tl.load(LO + b * slb + offs_m * slm, mask=m_ok, other=Lk)
    a = offs_m + off

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    hi_max = tl.minimum(tl.max(hi, axis=0), Lk)
    lo_min = tl.min(lo, axis=0)
    a_max = tl.minimum(pid_m * BLOCK_M + BLOCK_M, Lq) - 1 + off
    # Range 1: the prefix keys [0, hi_max); range 2: the own segments, starting where range 1
    # stopped so no key block is counted twice.
    end1 = tl.cdiv(hi_max, BLOCK_N) * BLOCK_N
    start2 = tl.maximum((lo_min // BLOCK_N) * BLOCK_N, end1)
    end2 = a_max + 1

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, hi, lo, a, m_ok, d_ok,
                                  offs_d, 0, end1, Lk, scale, BLOCK_N, IEEE)
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, k_base, v_base, skn, skd, svn, svd, hi, lo, a, m_ok, d_ok,
                                  offs_d, start2, end2, Lk, scale, BLOCK_N, IEEE)

    # Every valid row sees at least itself (checked by the wrapper), so l_i > 0 there.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# The wrapper's choices, all compiled by the AOT check (ragfast.kernels.aot): a 32 x 32 tile, the
# head dim padded to a power of two from 16 to MAX_HEAD_DIM, fp32 / fp16 / bf16, 4 warps. Where
# the check measured spills with 32 x 32 the key block is 16: fp32 from head dim 64 (80 B on
# sm_80 at 64; 668 B on sm_90 at 128, with 4 or 8 warps) and fp16 / bf16 at head dim 32 (12 B on
# sm_90, where ptxas capped the kernel at 128 registers); 32 x 16 spills nothing there. Head
# dim 256 spilled in every dtype (fp32: 75 KB) and no model here uses it: the path stops at 128.
BLOCK_M = 32
BLOCK_N = 32
MAX_HEAD_DIM = 128
NUM_WARPS = 4
NUM_STAGES = 3  # Triton's CUDA defaults, named so that the AOT specs launch what the wrapper does
HEAD_BLOCKS = (16, 32, 64, 128)


def tile_for(fp32: bool, block_d: int) -> tuple[int, int]:
    """``(block_m, block_n)`` the wrapper launches for this dtype class and padded head dim."""
    if (fp32 and block_d >= 64) or (not fp32 and block_d == 32):
        return BLOCK_M, 16
    return BLOCK_M, BLOCK_N


def prefix_attention(q, k, v, prefix_hi, seg_lo, scale: float, out=None):
    """Launch the kernel; shapes and dtypes are checked by ``ragfast.ops.prefix_attention``.

    q: [B, H, Lq, D]; k, v: [B, Hkv, Lk, D]; prefix_hi, seg_lo: int32 [B, Lq]; returns
    [B, H, Lq, D] in q's dtype (written into ``out`` when given). Head dims up to 128 (the tile
    holds a whole head; larger ones would need a split over D that no model here uses).
    """
    import torch

    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"prefix_attention (triton): head dim {D} > {MAX_HEAD_DIM}; use backend='ref' or 'flex'")
    if out is None:
        out = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    block_m, block_n = tile_for(q.dtype == torch.float32, block_d)
    grid = (triton.cdiv(Lq, block_m), B * H)
    _prefix_attn_fwd[grid](
        q, k, v, out, prefix_hi, seg_lo,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *prefix_hi.stride(), *seg_lo.stride(),
        H, Lq, Lk, D, float(scale),
        H // Hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def aot_specs() -> list:
    """Every configuration :func:`prefix_attention` can launch (for :mod:`ragfast.kernels.aot`)."""
    from ragfast.kernels.spec import KernelSpec

    specs = []
    names = _prefix_attn_fwd.arg_names
    for dt in ("fp32", "fp16", "bf16"):
        for bd in HEAD_BLOCKS:
            sig = {}
            for n in names:
                if n in ("Q", "K", "V", "O"):
                    sig[n] = "*" + dt
                elif n in ("HI", "LO"):
                    sig[n] = "*i32"
                elif n == "scale":
                    sig[n] = "fp32"
                elif n in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "IEEE"):
                    sig[n] = "constexpr"
                else:
                    sig[n] = "i32"
            bm, bn = tile_for(dt == "fp32", bd)
            consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "IEEE": dt == "fp32"}
            specs.append(KernelSpec("prefix_attention._prefix_attn_fwd", f"{dt} {bm}x{bn} D<={bd} w4",
                                    _prefix_attn_fwd, sig, consts, NUM_WARPS, NUM_STAGES,
                                    aligned=("Q", "K", "V", "O", "HI", "LO")))
    return specs

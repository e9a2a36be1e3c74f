"""Triton inner-product top-k: per-block candidates, then a merge.

Each program scores a ``BLOCK_Q x BLOCK_N`` tile (queries x corpus rows) with ``tl.dot`` over
``BLOCK_D`` slices of d, masks excluded / sub-threshold / NaN scores to -inf, and extracts the
tile's best ``KSEL = min(k, BLOCK_N)`` per query (repeated max + leftmost argmax, so equal
scores leave in ascending id order). The ``[B, N]`` score matrix is never written: only
``B x ceil(N / BLOCK_N) x KSEL`` candidates are, and a stable sort over them picks the final k.

Storage: fp32 or fp16 rows (fp16 is widened to fp32 before the dot; ``input_precision="ieee"``
keeps fp32 dots exact on GPUs, where tf32 would be the default). Runs on CUDA, or on the CPU
under ``TRITON_INTERPRET=1`` (used by the tests).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_ip_block_kernel(
    q_ptr, c_ptr, ex_ptr, out_s_ptr, out_i_ptr,
    B, N, D, E,
    stride_qb, stride_qd, stride_cn, stride_cd,
    min_score,
    NBLK,
    HAS_MIN: tl.constexpr, KSEL: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_n = tl.program_id(1)
    rq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    qmask = rq < B
    nmask = rn < N
    acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        dmask = rd < D
        qt = tl.load(q_ptr + rq[:, None] * stride_qb + rd[None, :] * stride_qd,
                     mask=qmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        ct = tl.load(c_ptr + rn[:, None] * stride_cn + rd[None, :] * stride_cd,
                     mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(qt, tl.trans(ct), input_precision="ieee")
    neg = float("-inf")
    valid = qmask[:, None] & nmask[None, :] & (acc == acc)  # acc == acc drops NaN
    if HAS_MIN:
        valid = valid & (acc >= min_score)
    for e in range(0, E):
        xid = tl.load(ex_ptr + rq * E + e, mask=qmask, other=-1)
        valid = valid & (rn[None, :] != xid[:, None])
    s = tl.where(valid, acc, neg)
    cols = tl.arange(0, BLOCK_N)
    base = (rq * NBLK + pid_n) * KSEL
    for t in range(KSEL):
        best = tl.max(s, axis=1)
        arg = tl.argmax(s, axis=1, tie_break_left=True)
        ids = tl.where(best > neg, pid_n * BLOCK_N + arg, -1)
        tl.store(out_s_ptr + base + t, best, mask=qmask)
        tl.store(out_i_ptr + base + t, ids.to(tl.int64), mask=qmask)
        s = tl.where(cols[None, :] == arg[:, None], neg, s)


def topk_ip_triton(queries: torch.Tensor, corpus: torch.Tensor, k: int, *, min_score: float | None = None,
                   exclude: torch.Tensor | None = None, block_q: int = 16, block_n: int = 64,
                   block_d: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k inner product with Triton (called by ``ragfast.ops.topk_ip(..., backend="triton")``).

    Parameters
    ----------
    queries : torch.Tensor
        ``[B, d]`` float32 (any strides).
    corpus : torch.Tensor
        ``[N, d]`` float32 or float16 (any strides).
    k : int
        Results per query (validated by the op layer: ``1 <= k <= N``).
    min_score : float, optional
        Scores below it are dropped.
    exclude : torch.Tensor, optional
        ``[B, E]`` int64 ids to skip, -1 padded.

    Returns
    -------
    (scores, ids) : ``[B, k]`` float32 and int64, descending, ties by lower id, -inf / -1 fill.
    """
    if corpus.dtype not in (torch.float32, torch.float16):
        raise TypeError(f"triton topk_ip scans float32/float16 storage, got {corpus.dtype}")
    B, D = queries.shape
    N = corpus.shape[0]
    dev = corpus.device
    q = queries.to(device=dev, dtype=torch.float32)
    nblk = triton.cdiv(N, block_n)
    ksel = min(k, block_n)
    cand_s = torch.empty((B, nblk, ksel), dtype=torch.float32, device=dev)
    cand_i = torch.empty((B, nblk, ksel), dtype=torch.int64, device=dev)
    if exclude is not None and exclude.numel():
        ex = exclude.to(device=dev, dtype=torch.int64).contiguous()
        E = ex.shape[1]
    else:
        ex = torch.full((1,), -1, dtype=torch.int64, device=dev)
        E = 0
    grid = (triton.cdiv(B, block_q), nblk)
    _topk_ip_block_kernel[grid](
        q, corpus, ex, cand_s, cand_i,
        B, N, D, E,
        q.stride(0), q.stride(1), corpus.stride(0), corpus.stride(1),
        0.0 if min_score is None else float(min_score),
        nblk,
        HAS_MIN=min_score is not None, KSEL=ksel,
        BLOCK_Q=block_q, BLOCK_N=block_n, BLOCK_D=block_d,
    )
    # Merge: candidates are laid out block by block (ascending ids), each block's best-first with
    # equal scores in ascending id order, so a stable descending sort keeps the tie rule.
    cs = cand_s.reshape(B, nblk * ksel)
    ci = cand_i.reshape(B, nblk * ksel)
    vals, order = torch.sort(cs, dim=1, descending=True, stable=True)
    vals = vals[:, :k].contiguous()
    ids = torch.gather(ci, 1, order[:, :k])
    empty = vals == -math.inf
    return vals, ids.masked_fill(empty, -1).contiguous()

"""Triton inner-product top-k: exact scans, and certified tensor-core passes for bf16 / int8.

fp32 and fp16 rows are scanned exactly (:mod:`ragfast.kernels.topk_scan`, mode 0). bf16 rows and
int8 codes first go through a tensor-core pass (modes 1 and 2) that keeps, per query, the
``fetch`` best first-pass scores; those candidates are re-scored exactly in fp32 against the
stored vectors (bf16 rows; the int8 corpus's re-score copy, or its dequantised codes), and the
result is kept only when it is *certified*:

Let ``s(r)`` be row r's exact score and ``a(r)`` its first-pass score, with ``|a(r) - s(r)| <= E``
for every row (the bound below). Every row left out of the re-scoring has ``a(r) <= u``, where
``u`` is the larger of the best first-pass score cut from the pooled candidates and each block's
``KSEL``-th score (a block keeps its ``KSEL`` best, so nothing it dropped is above its last).
If ``u + E < T``, with ``T`` the k-th re-scored score (or ``min_score`` / -inf when fewer than k
hits were found), then every row left out has ``s(r) < T``: it can neither enter the top k nor
tie with its last member, so the re-scored top k is the exact top k with the exact tie rule.
Queries that fail the test are searched again with 4x the candidates per block and 8x the
re-scored pool, and any still uncertified are searched exactly (mode 0 / 3). Nothing depends on
the data being "nice": the bound only decides how much work a query costs, never its answer.

The bound ``E`` (u = 2^-24, fp32's unit roundoff; ``cmax`` = the largest row norm, which the
kernel measures while it scans; all margins at least 2x the textbook constants, since tensor
cores may truncate rather than round while accumulating):

* bf16 rows, query split ``q = q_hi + q_lo + r`` (``q_hi, q_lo`` bf16, ``r`` exact in fp32): the
  2d bf16 products are exact in fp32, so ``|a - s| <= cmax (|r| + 8 d u (|q_hi| + |q_lo|))``;
  the fp32 re-scoring adds ``4 d u |q| cmax``.
* int8 codes ``c`` with row scale ``sc`` and query codes ``qc`` with scale ``sq`` (``q^ = qc sq``):
  the int32 dot is exact, its scaling adds ``4 u |q^| cmax``; the query's quantisation error adds
  ``|q - q^| cmax``; the reference's fp32 dequantisation ``u |q| cmax``; a re-score copy differs
  from the dequantised codes by at most ``delta`` per row (measured once per corpus and cached),
  which adds ``|q| delta``; the re-scoring adds ``4 d u |q| (cmax + delta)``.

Every norm is computed in fp32 and the bound is multiplied by 1.01, which covers their rounding
(relative error below ``d u``, under 0.6% for d < 10^5).
"""
from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from ragfast.kernels.topk_scan import BF16_TC, INT8_TC, choose_config, scan, topk_exact

__all__ = ["topk_ip_triton", "split_bf16", "quantize_queries", "copy_gap", "INT8_MAX_DIM"]

_U = 2.0 ** -24
_INFLATE = 1.01
# int32 accumulation of d products of codes in [-127, 127] is exact while d * 127^2 < 2^31.
INT8_MAX_DIM = (2 ** 31 - 1) // (127 * 127)
# Candidates re-scored per query in the first round: at least 128, which costs B * 128 * d
# gathered elements (25 MB of bf16 at B = 256, d = 768), noise next to a 1M-row scan, and leaves
# room between the k-th score and the cut for the int8 bound (about 0.014 on unit 768-d rows,
# where rank 10 and rank 129 of 1M random rows lie about 0.02 apart).
_MIN_FETCH = 128
# Elements of the [B, m, d] gather made at once while re-scoring (128 MiB of fp32).
_GATHER_CHUNK = 1 << 25


def split_bf16(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q = hi + lo + r`` with ``hi, lo`` bf16 (round to nearest) and ``r`` fp32.

    Both differences are exact in fp32 (a number minus its rounding to fewer mantissa bits at
    the same exponent range is representable), so ``|r|`` is known exactly.
    """
    q = q.float()
    hi = q.to(torch.bfloat16)
    d1 = q - hi.float()
    lo = d1.to(torch.bfloat16)
    return hi.contiguous(), lo.contiguous(), d1 - lo.float()


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and fp32 scales of queries, by the corpus's rule (``max|x| / 127`` per row)."""
    q = q.float()
    amax = q.abs().amax(dim=1)
    sq = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).contiguous()
    codes = torch.round(q / sq[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return codes, sq


_GAPS: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref, float]] = {}


def copy_gap(codes: torch.Tensor, scale: torch.Tensor, copy: torch.Tensor) -> float:
    """Largest ``|copy[i] - codes[i] * scale[i]|`` over rows (L2), cached per corpus object.

    One pass over the codes and the copy, made the first time a corpus is searched (the cache
    holds weak references, so it never keeps a corpus alive; a corpus modified in place after
    its first search keeps its old figure). Rows whose gap is NaN hold a NaN and are never hits.
    """
    hit = _GAPS.get(id(copy))
    if hit is not None and hit[0]() is copy and hit[1]() is codes and hit[2]() is scale:
        return hit[3]
    worst = 0.0
    N, d = codes.shape
    step = max(1, _GATHER_CHUNK // max(1, d))
    for i in range(0, N, step):
        deq = codes[i:i + step].float() * scale[i:i + step, None]
        g = torch.linalg.vector_norm(copy[i:i + step].float() - deq, dim=1)
        g = g[~torch.isnan(g)]
        if g.numel():
            worst = max(worst, float(g.max()))
    for key in [k for k, v in _GAPS.items() if v[0]() is None]:
        del _GAPS[key]
    _GAPS[id(copy)] = (weakref.ref(copy), weakref.ref(codes), weakref.ref(scale), worst)
    return worst


def _norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x.double(), dim=1)


def _rescore(q: torch.Tensor, ids: torch.Tensor, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Exact fp32 scores of the candidates ``ids`` ([B, m], -1 = none): -inf for none / NaN."""
    B, m = ids.shape
    d = q.shape[1]
    out = torch.empty((B, m), dtype=torch.float32, device=q.device)
    step = max(1, _GATHER_CHUNK // max(1, m * d))
    for i in range(0, B, step):
        idx = ids[i:i + step].long()
        rows = rows_of(idx.clamp(min=0))  # [b, m, d] fp32
        s = (rows * q[i:i + step, None, :]).sum(dim=2)
        out[i:i + step] = s.masked_fill((idx < 0) | torch.isnan(s), -math.inf)
    return out


def _select(s: torch.Tensor, ids: torch.Tensor, k: int, min_score: float | None):
    """Top k of re-scored candidates by (score desc, id asc), -inf / -1 fill."""
    if min_score is not None:
        s = s.masked_fill(s < min_score, -math.inf)
    o = torch.argsort(ids, dim=1)
    s, ids = s.gather(1, o), ids.gather(1, o)
    o = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :k]
    s, ids = s.gather(1, o), ids.gather(1, o).to(torch.int64)
    return s, ids.masked_fill(s == -math.inf, -1)


def _approx_round(mode, qa, qb, rows, row_scale, k, ksel, fetch, exclude, rescore_rows, qf, bound, min_score):
    """One certified round; returns (scores, ids, certified mask) for these queries."""
    cfg = choose_config(mode, qa.shape[0])
    res = scan(mode, qa, qb, rows, row_scale, ksel, exclude=exclude, config=cfg)
    B, nblk, ks = res.scores.shape
    flat, flat_i = res.scores.reshape(B, -1), res.ids.reshape(B, -1)
    pool = flat.shape[1]
    m = min(pool, max(fetch, k))
    top = torch.topk(flat, min(m + 1, pool), dim=1)
    vals = top.values[:, :m]
    cand = flat_i.gather(1, top.indices[:, :m]).masked_fill(vals == -math.inf, -1)
    neg = torch.full((B,), -math.inf, device=flat.device)
    u = top.values[:, m] if pool > m else neg
    if ks < cfg.block_n:  # each block's last kept score bounds what the block dropped
        u = torch.maximum(u, res.scores[:, :, -1].amax(dim=1))
    exact = _rescore(qf, cand, rescore_rows)
    s, i = _select(exact, cand, k, min_score)
    if s.shape[1] < k:  # fewer candidates than k (tiny corpus): pad
        pad = k - s.shape[1]
        s = torch.cat([s, torch.full((B, pad), -math.inf, device=s.device)], dim=1)
        i = torch.cat([i, torch.full((B, pad), -1, dtype=torch.int64, device=i.device)], dim=1)
    cmax = res.norms.max().double()  # a device tensor: no host sync until the caller's one
    E = bound(cmax)
    floor = -math.inf if min_score is None else float(min_score)
    T = torch.where(s[:, k - 1] > -math.inf, s[:, k - 1].double(), torch.full_like(E, floor))
    ok = (u == -math.inf) | (u.double() + E < T)
    return s, i, ok


def topk_ip_triton(queries: torch.Tensor, corpus: torch.Tensor, k: int, *, min_score: float | None = None,
                   exclude: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                   rescore: torch.Tensor | None = None, fetch: int | None = None,
                   stats: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k inner product with Triton (called by ``ragfast.ops.topk_ip(..., backend="triton")``).

    Parameters
    ----------
    queries : torch.Tensor
        ``[B, d]`` float32 (any strides; copied contiguous, ``B * d`` floats).
    corpus : torch.Tensor
        ``[N, d]`` float32 / float16 (scanned exactly), bfloat16 (bf16 tensor-core pass, then
        certified re-scoring), or int8 codes with ``scale`` (int8 tensor-core pass, then
        certified re-scoring). Unit stride inside a row, any row stride.
    k : int
        Results per query (validated by the op layer: ``1 <= k <= N``).
    min_score : float, optional
        Scores below it are dropped.
    exclude : torch.Tensor, optional
        ``[B, E]`` int64 ids to skip, -1 padded.
    scale : torch.Tensor, optional
        int8 only: ``[N]`` float32 per-row scales (row ``i`` is ``corpus[i] * scale[i]``).
    rescore : torch.Tensor, optional
        int8 only: ``[N, d]`` copy the final scores are computed against (else the codes).
    fetch : int, optional
        Candidates re-scored per query in the first round of the approximate modes (default
        ``max(2k, 128)``; later rounds only for queries the bound cannot certify).
    stats : dict, optional
        Filled with ``mode`` and the number of queries each round certified
        (``rounds``: list of ints; ``exact``: queries that needed the exact scan).

    Returns
    -------
    (scores, ids) : ``[B, k]`` float32 and int64, descending, ties by lower id, -inf / -1 fill.
    """
    dev = corpus.device
    q = queries.to(device=dev, dtype=torch.float32).contiguous()
    B, d = q.shape
    if corpus.dtype in (torch.float32, torch.float16):
        if stats is not None:
            stats.update(mode="exact-fp32", rounds=[], exact=B)
        return topk_exact(q, corpus, k, min_score=min_score, exclude=exclude)
    if corpus.dtype == torch.bfloat16:
        mode = BF16_TC
        hi, lo, r = split_bf16(q)
        qa, qb = hi, lo
        nr, nh, nl, nq = _norm(r), _norm(hi), _norm(lo), _norm(q)

        def bound(cmax):
            return _INFLATE * cmax * (nr + 8 * d * _U * (nh + nl) + 4 * d * _U * nq)

        def rows_of(idx):
            return corpus[idx].float()

        def exact_all(sel, ex):
            return topk_exact(q[sel], corpus, k, min_score=min_score, exclude=ex)
        row_scale = None
    elif corpus.dtype == torch.int8:
        if scale is None:
            raise TypeError("triton topk_ip over int8 codes needs their per-row scale")
        scale = scale.to(device=dev, dtype=torch.float32).contiguous()
        mode = INT8_TC
        codes, sq = quantize_queries(q)
        qa, qb = codes, sq
        qhat = codes.double() * sq.double()[:, None]
        e, nqh, nq = _norm(q.double() - qhat), _norm(qhat), _norm(q)
        delta = copy_gap(corpus, scale, rescore) if rescore is not None else 0.0

        def bound(cmax):
            return _INFLATE * (e * cmax + 4 * _U * nqh * cmax + _U * nq * cmax + nq * delta
                               + 4 * d * _U * nq * (cmax + delta))

        if rescore is not None:
            def rows_of(idx):
                return rescore[idx].float()

            def exact_all(sel, ex):
                return topk_exact(q[sel], rescore, k, min_score=min_score, exclude=ex)
        else:
            def rows_of(idx):
                return corpus[idx].float() * scale[idx][..., None]

            def exact_all(sel, ex):
                return topk_exact(q[sel], corpus, k, row_scale=scale, min_score=min_score, exclude=ex)
        row_scale = scale
        if d > INT8_MAX_DIM:  # int32 accumulation could overflow: exact scan only
            if stats is not None:
                stats.update(mode="exact-int8", rounds=[], exact=B)
            return exact_all(torch.arange(B, device=dev), exclude)
    else:
        raise TypeError(f"triton topk_ip scans float32/float16/bfloat16 rows or int8 codes, got {corpus.dtype}")

    scores = torch.full((B, k), -math.inf, dtype=torch.float32, device=dev)
    ids = torch.full((B, k), -1, dtype=torch.int64, device=dev)
    todo = torch.arange(B, device=dev)
    block_n = choose_config(mode, B).block_n
    ksel = min(block_n, max(16, k))
    fetch = max(int(fetch) if fetch else 2 * k, _MIN_FETCH)
    done_per_round = []
    for ks, m in ((ksel, fetch), (min(block_n, 4 * ksel), 8 * fetch)):
        if not len(todo):
            break
        ex = exclude[todo] if exclude is not None else None
        b_sel = todo

        def sub_bound(cmax, b_sel=b_sel):
            return bound(cmax)[b_sel]

        first = len(todo) == B  # every query still to do: no gathers
        s, i, ok = _approx_round(mode, qa if first else qa[todo], qb if first else qb[todo], corpus, row_scale, k,
                                 ks, m, ex, rows_of, q if first else q[todo], bound if first else sub_bound, min_score)
        if first and bool(ok.all()):  # the common case: one host sync, no scatter
            if stats is not None:
                stats.update(mode="bf16-tc" if mode == BF16_TC else "int8-tc", rounds=done_per_round + [B], exact=0)
            return s, i
        good = todo[ok]
        scores[good], ids[good] = s[ok], i[ok]
        done_per_round.append(int(ok.sum()))
        todo = todo[~ok]
    if len(todo):
        ex = exclude[todo] if exclude is not None else None
        s, i = exact_all(todo, ex)
        scores[todo], ids[todo] = s, i
    if stats is not None:
        stats.update(mode="bf16-tc" if mode == BF16_TC else "int8-tc", rounds=done_per_round, exact=int(len(todo)))
    return scores, ids

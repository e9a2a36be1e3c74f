"""Exact top-k over a bf16 corpus through torch's bf16 matmul (oneDNN; AMX tiles on Intel Xeon).

torch bf16 ``mm`` rounds the query to bf16 and its output to bf16, so its scores are only
approximate. This pass keeps the reference's results anyway, by a proof rather than an
over-fetch:

* every approximate score ``a`` is within ``e = c * ||q|| * max||x||`` of the exact fp32 score
  ``s = q . x`` (``c`` below: the query's and the output's bf16 rounding, and fp32 accumulation
  over ``d`` terms in any order);
* so if ``A_k`` is the k-th largest approximate score, the k-th exact score is at least
  ``A_k - e``, and every row the reference returns (ties at the cut included) has
  ``a >= A_k - 2e``;
* all those rows are re-scored exactly (fp32 query against the bf16 rows widened to fp32) and
  the top-k is taken by (score desc, id asc), the reference's tie rule.

``max||x||`` is one pass over the corpus, cached per corpus tensor (invalidated by any in-place
write to it). Where the bound cannot hold (a row norm or ``||q|| max||x||`` so large that a
product could overflow) the caller's exact path runs instead: :func:`bf16_bound_ok` says when.
"""
from __future__ import annotations

import math
import weakref

import torch

__all__ = ["bf16_error_bound", "bf16_bound_ok", "max_row_norm", "topk_ip_torch_bf16"]

# Unit roundoff of bf16 is 2^-9 (8 significant bits, round to nearest even); 2^-8 keeps a
# factor 2 of margin for whatever rounding mode a matmul library's conversions use.
_U_BF16 = 2.0 ** -8
_U_F32 = 2.0 ** -24
# Beyond this ||q|| max||x||, a product or a partial sum could overflow fp32/bf16 and a row drop
# out of the approximate pass unseen (the same cut as the compiled AMX fp32 pass).
_OVERFLOW = 1e30
# Queries re-scored at once: bounds the [rows, candidates, d] fp32 gather (32 x 200 x 768 x 4 B
# = 20 MB with the ~200 candidates of 200k random unit vectors at d = 768).
_RESCORE_ROWS = 32

# id(tensor) -> (weak reference, tensor version, max norm). Not a WeakKeyDictionary: that
# compares keys with ==, which for tensors is elementwise.
_NORMS: dict[int, tuple[weakref.ref, int, float]] = {}


def _forget(key: int, r: weakref.ref) -> None:
    if key in _NORMS and _NORMS[key][0] is r:
        del _NORMS[key]


def max_row_norm(x: torch.Tensor, chunk: int = 65536) -> float:
    """The largest L2 norm of a row of ``x`` (NaN rows ignored: they never score), computed in
    fp32 chunks of ``chunk`` rows and cached for this tensor until it is written in place."""
    hit = _NORMS.get(id(x))
    if hit is not None and hit[0]() is x and hit[1] == x._version:
        return hit[2]
    m = 0.0
    for s in range(0, x.shape[0], chunk):
        n = torch.linalg.vector_norm(x[s:s + chunk].float(), dim=1)
        n = n[~torch.isnan(n)]
        if n.numel():
            m = max(m, float(n.max()))
    # An fp32 sum of squares rounds: inflate by d roundoffs so the cached value is an upper bound.
    m *= 1.0 + (x.shape[1] + 2) * _U_F32
    key = id(x)
    _NORMS[key] = (weakref.ref(x, lambda r: _forget(key, r)), x._version, m)
    return m


def bf16_error_bound(d: int) -> float:
    """``c`` with ``|a - s| <= c * ||q|| * ||x||`` for torch's bf16 score ``a`` of a row and
    its exact score ``s``: the query's rounding (``u``), fp32 accumulation over ``d`` terms
    (``gamma_d``, any order), the output's rounding (``u``), each on the previous."""
    gamma = d * _U_F32 / (1.0 - d * _U_F32)
    return (_U_BF16 + gamma * (1 + _U_BF16) + _U_BF16 * (1 + _U_BF16) * (1 + gamma)) * (1 + 2 ** -20)


def bf16_bound_ok(q: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether :func:`topk_ip_torch_bf16`'s bound holds for these queries over ``x``."""
    xm = max_row_norm(x)
    qm = float(torch.linalg.vector_norm(q.float(), dim=1).max()) if q.numel() else 0.0
    return math.isfinite(xm) and qm * xm < _OVERFLOW


def topk_ip_torch_bf16(q: torch.Tensor, x: torch.Tensor, k: int, min_score: float | None,
                       exclude: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``q @ x.float().T`` (the reference's scores for a bf16 corpus ``x``) through
    a torch bf16 first pass and an exact re-score of every row it cannot rule out.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, d]`` float32 finite queries, ``B >= 1``.
    x : torch.Tensor
        ``[N, d]`` bfloat16 corpus rows.
    k : int
        ``1 <= k <= N``.
    min_score : float or None
        Results below it are dropped (id -1, score -inf).
    exclude : torch.Tensor or None
        ``[B, E]`` int64 ids never returned, -1 padding.

    Returns
    -------
    (scores, ids) : ``[B, k]`` float32 and int64, (score desc, id asc); the caller checks
    :func:`bf16_bound_ok` first.
    """
    B, N = q.shape[0], x.shape[0]
    d = x.shape[1]
    qn = torch.linalg.vector_norm(q, dim=1) * (1.0 + (d + 2) * _U_F32)  # an upper bound of ||q||
    e = bf16_error_bound(d) * qn * max_row_norm(x)  # [B]
    approx = q.to(torch.bfloat16) @ x.T  # [B, N] bf16
    if exclude is not None:
        rows = torch.arange(B)[:, None].expand_as(exclude)
        keep = exclude >= 0
        approx[rows[keep], exclude[keep]] = -math.inf
    # Most queries' candidates lie in the top `width` approximate scores (random unit vectors,
    # 200k x 768: ~60 within 2e of the 10th), so one topk on the bf16 scores finds them; each
    # pass over the [B, N] scores costs about a third of the mm here (Intel Xeon, load 13:
    # mm 269 ms, a NaN mask 116 ms, a count 163 ms, topk 52 ms at B = 16, N = 200k), so the
    # full-matrix path runs only for a query whose band is wider, or when a row scored NaN.
    width = min(N, max(4 * k, k + 128))
    a_c, ids = torch.topk(approx, width, dim=1)
    a_c = a_c.float()
    if bool(torch.isnan(a_c).any()):  # topk ranks NaN first: NaN rows (never returned) out
        approx.masked_fill_(torch.isnan(approx), -math.inf)
        a_c, ids = torch.topk(approx, width, dim=1)
        a_c = a_c.float()
    thresh = a_c[:, k - 1] - 2 * e  # the k-th approximate score minus twice the bound
    if min_score is not None:  # a row whose exact score could reach min_score has a >= min_score - e
        thresh = torch.maximum(thresh, min_score - e)
    if width < N and not bool((a_c[:, -1] < thresh).all()):
        # some query's band reaches past the top `width`: widen to every row above its threshold
        # (-inf rows, excluded or NaN, are never candidates, whatever the threshold)
        af = approx.float()
        count = ((af >= thresh[:, None]) & (af > -math.inf)).sum(dim=1)
        width = min(N, max(k, int(count.max())))
        a_c, ids = torch.topk(af, width, dim=1)
        del af
    # the `width` largest approximate scores hold every row at or above its query's threshold
    # (count <= width, and any row left out scores below every row kept); extras are harmless
    del approx
    exact = torch.empty((B, width), dtype=torch.float32)
    for s in range(0, B, _RESCORE_ROWS):
        rows_x = x[ids[s:s + _RESCORE_ROWS]].float()  # [b, width, d]
        exact[s:s + _RESCORE_ROWS] = torch.bmm(rows_x, q[s:s + _RESCORE_ROWS, :, None]).squeeze(-1)
    exact.masked_fill_(torch.isnan(exact) | (a_c == -math.inf), -math.inf)
    if min_score is not None:
        exact.masked_fill_(exact < min_score, -math.inf)
    # (score desc, id asc): sort by id, then a stable sort by score
    o = torch.argsort(ids, dim=1)
    exact, ids = exact.gather(1, o), ids.gather(1, o)
    o = torch.sort(exact, dim=1, descending=True, stable=True).indices[:, :k]
    scores, ids = exact.gather(1, o).contiguous(), ids.gather(1, o).contiguous()
    return scores, ids.masked_fill(scores == -math.inf, -1)

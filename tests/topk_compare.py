"""Tie-aware comparison of two top-k results (the way faiss's own tests compare searches).

Two correct implementations may order rows whose scores differ by less than their rounding
error differently (SIMD levels sum in different orders; faiss uses BLAS), so ids are compared
only where the scores separate them:

* scores agree position by position within ``atol`` (empty slots: -inf in both);
* an id whose score is clear of the k-th score by more than ``atol`` is in both results;
* an id whose score is more than ``atol`` from both neighbours in the list is at the same position;
* the number of filled slots agrees, except for hits within ``atol`` of ``min_score``.
"""
from __future__ import annotations

import numpy as np


def tolerance(dtype: str = "fp32", scale: float = 1.0) -> float:
    """Score tolerance for results over ``dtype`` storage with scores of magnitude ``scale``:
    fp32 sums of a few hundred products agree to ~1e-6 relative; the re-scored low-precision
    paths compute exact fp32 dots over the stored vectors, so the same tolerance holds."""
    return {"fp32": 1e-5, "fp16": 1e-5, "bf16": 1e-5, "int8": 1e-5}[dtype] * max(1.0, scale)


def _np(x):
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def assert_topk_agree(s1, i1, s2, i2, *, atol: float = 1e-5, min_score: float | None = None) -> None:
    """Assert two ``[B, k]`` (scores, ids) results agree up to near-ties (see module doc)."""
    s1, i1, s2, i2 = (_np(x) for x in (s1, i1, s2, i2))
    assert s1.shape == s2.shape == i1.shape == i2.shape, (s1.shape, s2.shape, i1.shape, i2.shape)
    for r in range(s1.shape[0]):
        f1, f2 = i1[r] >= 0, i2[r] >= 0
        n1, n2 = int(f1.sum()), int(f2.sum())
        assert f1[:n1].all() and f2[:n2].all(), f"row {r}: empty slots before filled ones"
        if n1 != n2:
            assert min_score is not None, f"row {r}: {n1} vs {n2} hits"
            extra = np.concatenate([s1[r][min(n1, n2):n1], s2[r][min(n1, n2):n2]])
            assert (np.abs(extra - min_score) <= atol).all(), f"row {r}: hit counts differ away from min_score"
        n = min(n1, n2)
        a, b = s1[r][:n].astype(np.float64), s2[r][:n].astype(np.float64)
        np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=f"row {r}: scores")
        if n == 0:
            continue
        ids1, ids2 = i1[r][:n], i2[r][:n]
        assert len(set(ids1.tolist())) == n and len(set(ids2.tolist())) == n, f"row {r}: duplicate ids"
        kth = min(a[-1], b[-1])
        clear1 = {int(i) for i, s in zip(ids1, a) if s > kth + atol}
        clear2 = {int(i) for i, s in zip(ids2, b) if s > kth + atol}
        assert clear1 <= set(ids2.tolist()) and clear2 <= set(ids1.tolist()), \
            f"row {r}: a clearly top-k id is missing: {sorted(clear1 ^ clear2)}"
        for j in range(n):
            prev_gap = a[j - 1] - a[j] if j > 0 else np.inf
            next_gap = a[j] - a[j + 1] if j + 1 < n else 0.0  # the (k+1)-th is unknown
            if prev_gap > atol and next_gap > atol:
                assert ids1[j] == ids2[j], f"row {r}, rank {j}: ids {ids1[j]} vs {ids2[j]} with clear scores"

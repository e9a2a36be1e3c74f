"""Statistics for paired method comparisons and for judging a STOP-score ranking.

* :func:`paired_bootstrap`: mean paired difference with a percentile or BCa bootstrap CI,
  resampling questions; several comparisons (rows) share one set of resamples.
* :func:`non_inferiority`: the verdict against a margin.
* :func:`average_precision`, :func:`brier`, :func:`calibration_table`: how well STOP scores
  rank and how well STOP probabilities are calibrated.
* :func:`precision_recall`, :func:`unsafe_stop_fraction`: what a stopping rule did.

The resampling runs through the ``bootstrap`` op (:mod:`ragfast.ops.policy`). With the ``ref``
backend the draws are exactly those of ``scipy.stats.bootstrap`` for
``rng=numpy.random.default_rng(seed)``, so the intervals agree with scipy to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import expit, ndtr, ndtri

from ragfast.ops.policy import bootstrap_means


@dataclass
class BootstrapResult:
    """A paired bootstrap estimate ``mean(a - b)`` and its confidence interval.

    ``delta``, ``low``, ``high`` and ``se`` are floats for one comparison and arrays (one entry
    per row) for several.
    """

    delta: Any
    low: Any
    high: Any
    se: Any
    method: str
    confidence: float
    n_resamples: int
    n: int
    backend: str = ""

    @property
    def ci(self) -> tuple[Any, Any]:
        return self.low, self.high

    def to_dict(self) -> dict[str, Any]:
        def f(v):
            return v.tolist() if isinstance(v, np.ndarray) else float(v)

        return {"delta": f(self.delta), "low": f(self.low), "high": f(self.high), "se": f(self.se),
                "method": self.method, "confidence": self.confidence, "n_resamples": self.n_resamples,
                "n": self.n, "backend": self.backend}


def _interp_sorted(sorted_rows: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Row-wise linear-interpolation quantile (numpy's default method) of rows sorted at least
    at the two order statistics around each level."""
    R = sorted_rows.shape[1]
    pos = np.clip(q, 0.0, 1.0) * (R - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, R - 1)
    t = pos - lo
    rows = np.arange(sorted_rows.shape[0])
    a, b = sorted_rows[rows, lo], sorted_rows[rows, hi]
    # numpy's lerp form: stable at both ends
    return np.where(t >= 0.5, b - (b - a) * (1 - t), a + (b - a) * t)


def _row_quantiles(x: np.ndarray, q_lo: np.ndarray, q_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two linear-interpolation quantiles per row. With the same levels on every row (the
    percentile method) four order statistics by partition suffice, ~3x cheaper than the full
    sort BCa's per-row levels need."""
    R = x.shape[1]
    if np.all(q_lo == q_lo[0]) and np.all(q_hi == q_hi[0]):
        ks = []
        for q in (q_lo[0], q_hi[0]):
            lo = int(np.floor(np.clip(q, 0.0, 1.0) * (R - 1)))
            ks += [lo, min(lo + 1, R - 1)]
        part = np.partition(x, sorted(set(ks)), axis=1)
        return _interp_sorted(part, q_lo), _interp_sorted(part, q_hi)
    srt = np.sort(x, axis=1)
    return _interp_sorted(srt, q_lo), _interp_sorted(srt, q_hi)


def paired_bootstrap(a, b=None, n_resamples: int = 10000, seed: int = 0, method: str = "percentile",
                     confidence: float = 0.95, *, backend: str | None = None) -> BootstrapResult:
    """Paired bootstrap CI of the mean difference ``mean(a - b)``, resampling questions.

    Parameters
    ----------
    a, b : array_like, shape (n,) or (K, n)
        Per-question outcomes of the two systems on the same n questions (e.g. EM of the
        policy and of the native run). ``b=None`` takes ``a`` as the differences already. With
        K rows (e.g. one per threshold) every resample draws one set of questions for all rows.
    n_resamples : int, default 10000
    seed : int, default 0
        Non-negative. Same seed, same interval (for one backend).
    method : {"percentile", "bca"}
        BCa follows Efron & Tibshirani (14.3, 15.36), as ``scipy.stats.bootstrap`` does, with
        the jackknife of the mean in closed form. Where every difference is equal the
        acceleration is taken as 0 (scipy returns NaN) and the interval collapses to the point.
    confidence : float, default 0.95
        Two-sided level.
    backend : {"ref", "cpp"}, optional
        Resampling backend (see :mod:`ragfast.ops.policy`).

    Returns
    -------
    BootstrapResult
        ``delta`` (the observed mean difference), ``low``, ``high``, ``se`` (standard deviation
        of the bootstrap distribution).

    Raises
    ------
    ValueError
        On mismatched shapes, NaN outcomes, an unknown method or a confidence outside (0, 1).
    """
    if method not in ("percentile", "bca"):
        raise ValueError(f"method must be 'percentile' or 'bca', got {method!r}")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    A = np.asarray(a, dtype=np.float64)
    if b is None:
        d = A
    else:
        B = np.asarray(b, dtype=np.float64)
        if A.shape != B.shape:
            raise ValueError(f"a and b must have the same shape (paired questions), got {A.shape} and {B.shape}")
        d = A - B
    if d.ndim not in (1, 2) or d.shape[-1] < 1:
        raise ValueError(f"expected 1-D [n] or 2-D [K, n] outcomes with n >= 1, got shape {d.shape}")
    if not np.all(np.isfinite(d)):
        raise ValueError("outcomes contain NaN or inf; drop or fill those questions first")
    one = d.ndim == 1
    D = d[None, :] if one else d
    K, n = D.shape
    from ragfast.ops.registry import resolve

    be, _ = resolve("bootstrap", backend)
    theta_b = bootstrap_means(D, n_resamples, seed, backend=be)  # [K, R]
    theta = D.mean(axis=1)
    alpha = (1.0 - float(confidence)) / 2.0
    if method == "percentile":
        q_lo = np.full(K, alpha)
        q_hi = np.full(K, 1.0 - alpha)
    else:
        th = theta[:, None]
        # scipy's percentile-of-score ("mean" kind) as a fraction
        pct = ((theta_b < th).sum(1) + (theta_b <= th).sum(1)) / (2.0 * theta_b.shape[1])
        z0 = ndtri(pct)
        if n > 1:
            # Jackknife of the mean in closed form: theta_(i) = (sum - d_i) / (n - 1).
            jk = (D.sum(1, keepdims=True) - D) / (n - 1)
            U = (n - 1) * (jk.mean(1, keepdims=True) - jk)
            num = (U ** 3).sum(1) / n ** 3
            den = (U ** 2).sum(1) / n ** 2
            with np.errstate(invalid="ignore", divide="ignore"):
                a_hat = np.where(den > 0, num / np.where(den > 0, den, 1.0) ** 1.5 / 6.0, 0.0)
        else:
            a_hat = np.zeros(K)
        z_a = ndtri(alpha)
        n1, n2 = z0 + z_a, z0 - z_a
        q_lo = ndtr(z0 + n1 / (1 - a_hat * n1))
        q_hi = ndtr(z0 + n2 / (1 - a_hat * n2))
        # A degenerate distribution (all resample means equal) gives 0/0 above: collapse.
        flat = np.ptp(theta_b, axis=1) == 0
        q_lo = np.where(flat | np.isnan(q_lo), alpha, q_lo)
        q_hi = np.where(flat | np.isnan(q_hi), 1.0 - alpha, q_hi)
    low, high = _row_quantiles(theta_b, q_lo, q_hi)
    se = theta_b.std(axis=1, ddof=1) if theta_b.shape[1] > 1 else np.zeros(K)
    pick = (lambda v: float(v[0])) if one else (lambda v: v)
    return BootstrapResult(delta=pick(theta), low=pick(low), high=pick(high), se=pick(se), method=method,
                           confidence=float(confidence), n_resamples=int(n_resamples), n=int(n), backend=be)


@dataclass
class NonInferiority:
    """Verdict of a non-inferiority check: ``non_inferior`` when ``low > -margin``."""

    non_inferior: bool
    low: float
    high: float
    margin: float

    def __bool__(self) -> bool:
        return bool(self.non_inferior)

    @property
    def verdict(self) -> str:
        return "non-inferior" if self.non_inferior else "not shown non-inferior"

    def to_dict(self) -> dict[str, Any]:
        return {"non_inferior": bool(self.non_inferior), "low": self.low, "high": self.high,
                "margin": self.margin, "verdict": self.verdict}


def non_inferiority(delta_ci, margin: float) -> NonInferiority | list[NonInferiority]:
    """Is the new system no worse than the old by more than ``margin``?

    Parameters
    ----------
    delta_ci : BootstrapResult or (low, high)
        CI of ``mean(new - old)`` for a quality measure where higher is better (e.g. EM as a
        fraction). For a cost where lower is better pass the CI of ``old - new``.
    margin : float
        Largest acceptable loss, in the units of the difference (2 EM points = 0.02), >= 0.

    Returns
    -------
    NonInferiority
        ``non_inferior`` is True when the CI's lower bound lies above ``-margin``. For a
        multi-row :class:`BootstrapResult`, a list with one verdict per row.
    """
    if not np.isfinite(margin) or margin < 0:
        raise ValueError(f"margin must be a finite number >= 0, got {margin}")
    if isinstance(delta_ci, BootstrapResult):
        low, high = delta_ci.low, delta_ci.high
    else:
        try:
            low, high = delta_ci
        except (TypeError, ValueError):
            raise ValueError("delta_ci must be a BootstrapResult or a (low, high) pair") from None
    lo, hi = np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)
    if np.isnan(lo).any() or np.isnan(hi).any():
        raise ValueError("the confidence interval contains NaN")
    if lo.ndim == 0:
        return NonInferiority(bool(lo > -margin), float(lo), float(hi), float(margin))
    return [NonInferiority(bool(l > -margin), float(l), float(h), float(margin)) for l, h in zip(lo, hi)]


# -- ranking and calibration -------------------------------------------------------------------
def _labels_scores(labels, scores, what: str) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels)
    s = np.asarray(scores, dtype=np.float64)
    if y.ndim != 1 or s.shape != y.shape:
        raise ValueError(f"labels and {what} must be 1-D of the same length, got {y.shape} and {s.shape}")
    if y.size and not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0/1 (or booleans)")
    return y.astype(np.int64), s


def average_precision(labels, scores) -> float:
    """Average precision of a score ranking, as ``sklearn.metrics.average_precision_score``.

    ``AP = sum_k (R_k - R_{k-1}) P_k`` over the distinct score thresholds, highest first.

    Parameters
    ----------
    labels : array_like of {0, 1}, shape (N,)
        1 = stopping at that state is right.
    scores : array_like, shape (N,)
        STOP scores. NaN (a state that could not be scored) ranks below every real score.

    Returns
    -------
    float
        NaN when there is no positive label (AP is undefined).
    """
    y, s = _labels_scores(labels, scores, "scores")
    P = int(y.sum())
    if P == 0:
        return float("nan")
    s = np.where(np.isnan(s), -np.inf, s)
    order = np.argsort(-s, kind="mergesort")
    ys, ss = y[order], s[order]
    tp = np.cumsum(ys)
    # last position of each block of tied scores = one threshold (compared, not subtracted:
    # -inf - -inf is NaN, which split the NaN-scored states into one threshold each)
    ends = np.r_[np.flatnonzero(ss[1:] != ss[:-1]), ys.size - 1]
    tp_e = tp[ends]
    prec = tp_e / (ends + 1)
    rec = tp_e / P
    return float(np.sum(np.diff(np.r_[0.0, rec]) * prec))


def brier(labels, probs) -> float:
    """Mean squared error of STOP probabilities, as ``sklearn.metrics.brier_score_loss``.

    Parameters
    ----------
    labels : array_like of {0, 1}, shape (N,)
    probs : array_like in [0, 1], shape (N,)
        E.g. :func:`sigmoid` of a log-odds STOP score. NaN is rejected.
    """
    y, p = _labels_scores(labels, probs, "probs")
    if y.size == 0:
        raise ValueError("brier: no states")
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError("probs must lie in [0, 1] and not be NaN (map log-odds scores with sigmoid())")
    return float(np.mean((p - y) ** 2))


def sigmoid(x) -> np.ndarray:
    """Log-odds to probability, NaN kept. For S2G's score ``log P(true) - log P(false)`` this
    is the probability of "true" renormalised over the two words."""
    return expit(np.asarray(x, dtype=np.float64))


def calibration_table(labels, probs, n_bins: int = 10) -> dict[str, Any]:
    """Reliability table on ``n_bins`` equal-width probability bins.

    Bins are ``[0, 1/n], (1/n, 2/n], ..., ((n-1)/n, 1]``: a probability on an edge falls in the
    lower bin, as in ``sklearn.calibration.calibration_curve`` with ``strategy="uniform"``. NaN
    probabilities are left out and counted.

    Returns
    -------
    dict
        ``bins``: a list of rows ``{lo, hi, count, mean_prob, frac_positive}`` (empty bins
        included, with NaN means); ``ece``: expected calibration error (count-weighted mean
        of ``|frac_positive - mean_prob|``); ``n``; ``n_nan``.
    """
    if int(n_bins) < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    y, p = _labels_scores(labels, probs, "probs")
    keep = ~np.isnan(p)
    n_nan = int((~keep).sum())
    y, p = y[keep], p[keep]
    if (p < 0).any() or (p > 1).any():
        raise ValueError("probs must lie in [0, 1]")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    idx = np.searchsorted(edges[1:-1], p, side="left")
    cnt = np.bincount(idx, minlength=n_bins)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mp, fy = sp / cnt, sy / cnt
    rows = [{"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": int(cnt[i]),
             "mean_prob": float(mp[i]), "frac_positive": float(fy[i])} for i in range(n_bins)]
    nz = cnt > 0
    ece = float(np.sum(cnt[nz] * np.abs(fy[nz] - mp[nz])) / cnt.sum()) if cnt.sum() else float("nan")
    return {"bins": rows, "ece": ece, "n": int(cnt.sum()), "n_nan": n_nan}


# -- what a stopping rule did -----------------------------------------------------------------
def precision_recall(stops, labels) -> tuple[float, float]:
    """STOP precision and recall of boolean decisions against 0/1 labels.

    precision = right stops / stops (NaN when nothing stops); recall = right stops /
    positives (NaN when there is no positive).
    """
    st = np.asarray(stops, dtype=bool)
    y = np.asarray(labels)
    if st.shape != y.shape:
        raise ValueError(f"stops and labels must have the same shape, got {st.shape} and {y.shape}")
    y = y.astype(bool)
    tp = int((st & y).sum())
    ns, npos = int(st.sum()), int(y.sum())
    return (tp / ns if ns else float("nan")), (tp / npos if npos else float("nan"))


def unsafe_stop_fraction(index, safe, native_stop) -> dict[str, float]:
    """Early stops, and how many of them were unsafe.

    Parameters
    ----------
    index : array_like of int, shape (B,)
        First-crossing state per question (-1 = never stopped).
    safe : array_like of {0, 1}, shape (B, T)
        1 where answering from that state is right (e.g. the answer-only probe's EM).
    native_stop : array_like of int, shape (B,)
        The state at which the native run answered (its number of searches).

    Returns
    -------
    dict
        ``stops``, ``early_stops`` (stops before the native stop), ``unsafe_early_stops``,
        ``unsafe_fraction`` (of the early stops; NaN when there are none) and
        ``early_precision`` (its complement).
    """
    idx = np.asarray(index, dtype=np.int64)
    sf = np.asarray(safe)
    ns = np.asarray(native_stop, dtype=np.int64)
    if idx.ndim != 1 or sf.ndim != 2 or sf.shape[0] != idx.shape[0] or ns.shape != idx.shape:
        raise ValueError(f"expected index [B], safe [B, T], native_stop [B]; got {idx.shape}, {sf.shape}, {ns.shape}")
    if (idx >= sf.shape[1]).any():
        raise ValueError("index points past the last state column of safe")
    stopped = idx >= 0
    early = stopped & (idx < ns)
    s_at = sf[np.arange(idx.size), np.where(stopped, idx, 0)].astype(bool)
    unsafe = early & ~s_at
    ne, nu = int(early.sum()), int(unsafe.sum())
    return {"stops": int(stopped.sum()), "early_stops": ne, "unsafe_early_stops": nu,
            "unsafe_fraction": nu / ne if ne else float("nan"),
            "early_precision": (ne - nu) / ne if ne else float("nan")}


__all__ = ["BootstrapResult", "NonInferiority", "paired_bootstrap", "non_inferiority", "average_precision",
           "brier", "sigmoid", "calibration_table", "precision_recall", "unsafe_stop_fraction"]


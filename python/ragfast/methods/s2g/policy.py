"""Stopping policies on STOP scores: first crossing, threshold sweeps, threshold selection and
counterfactual evaluation on recorded trajectories.

Conventions
-----------
A score matrix ``scores[B, T]`` holds one row per trajectory (question) and one column per
state: column ``t`` is the state after ``t`` searches (state 0 = nothing retrieved yet). A
state that was not scored (or could not be) is NaN and never stops. ``lengths[b]`` says how
many columns of row b are real states; the rest is padding.

The deployed rule stops a trajectory at the FIRST state whose score is ``>= threshold`` (a
score equal to the threshold stops). ``+inf`` is the "never stop" threshold for finite scores.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ragfast.ops.policy import sweep as _sweep_op


def sweep(scores, thresholds, lengths=None, *, out=None, backend: str | None = None) -> np.ndarray:
    """First-crossing state of every trajectory at every threshold.

    Parameters
    ----------
    scores : array_like, shape (B, T)
        STOP scores, NaN where a state was not scored.
    thresholds : array_like, shape (M,)
        A state stops when ``score >= threshold``.
    lengths : array_like of int, shape (B,), optional
        Real states per row; padded columns (and empty trajectories, length 0) never stop.
    out : numpy.ndarray of int64, shape (B, M), optional
        C-contiguous buffer to write into.
    backend : {"ref", "cpp"}, optional
        Default: the compiled kernel where available.

    Returns
    -------
    numpy.ndarray of int64, shape (B, M)
        First crossing state index, -1 where the trajectory never crosses.
    """
    return _sweep_op(scores, thresholds, lengths, out=out, backend=backend)


def first_crossing(scores, threshold: float, lengths=None, *, backend: str | None = None) -> np.ndarray:
    """Index of the first state whose score is ``>= threshold``, per trajectory.

    Parameters
    ----------
    scores : array_like, shape (B, T)
    threshold : float
        Ties stop (``score == threshold`` crosses). NaN is rejected; ``+inf`` never stops a
        finite score.
    lengths : array_like of int, shape (B,), optional
        See :func:`sweep`.
    backend : {"ref", "cpp"}, optional

    Returns
    -------
    numpy.ndarray of int64, shape (B,)
        -1 where the trajectory never crosses (all scores below, NaN, or no states).
    """
    h = np.asarray(threshold, dtype=np.float64)
    if h.ndim != 0:
        raise ValueError(f"threshold must be a scalar (use sweep() for several), got shape {h.shape}")
    return _sweep_op(scores, h.reshape(1), lengths, backend=backend)[:, 0]


# -- threshold selection -----------------------------------------------------------------------
def _check_labels(scores, labels, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels)
    if s.ndim != 1 or y.shape != s.shape:
        raise ValueError(f"scores and labels must be 1-D of one length (one entry per state), got {s.shape} "
                         f"and {y.shape}")
    if y.size and not np.isin(y, (0, 1)).all():
        raise ValueError("labels must be 0/1 (1 = stopping at this state is right)")
    g = None
    if groups is not None:
        g = np.asarray(groups)
        if g.shape != s.shape:
            raise ValueError(f"groups must give one question id per state ({s.shape[0]}), got shape {g.shape}")
    return s, y.astype(np.int64), g


def _group_matrix(values: list[np.ndarray], groups: np.ndarray, fill: list[Any]) -> tuple[list[np.ndarray], np.ndarray]:
    """Scatter per-state vectors into [G, Tmax] matrices, one row per group in order of first
    appearance, states kept in their given order."""
    _, first, inv = np.unique(groups, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    gi = rank[inv.reshape(-1)]
    order = np.argsort(gi, kind="stable")
    sorted_g = gi[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_g)) + 1]
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
    G = first.size
    lengths = np.bincount(gi, minlength=G)
    Tm = int(lengths.max()) if G else 0
    out = []
    for v, f in zip(values, fill):
        m = np.full((G, Tm), f, dtype=np.result_type(v.dtype, np.asarray(f).dtype))
        m[gi, pos] = v
        out.append(m)
    return out, lengths


def _grouped_counts(s, y, g, h, backend) -> tuple[np.ndarray, np.ndarray, int]:
    """Questions stopped and stopped at a right state under the first-crossing rule, per
    threshold, plus the number of questions with any right state."""
    (S, Y), L = _group_matrix([s, y], g, [np.nan, 0])
    idx = sweep(S, h, L, backend=backend)
    hit = idx >= 0
    right = np.take_along_axis(Y, np.where(hit, idx, 0), axis=1).astype(bool) & hit
    return hit.sum(0), right.sum(0), int((Y.sum(1) > 0).sum())


def stop_precision_recall(scores, labels, thresholds, groups=None, *, backend: str | None = None
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """STOP precision, recall and number of stops at each threshold.

    Parameters
    ----------
    scores, labels : array_like, shape (N,)
        One entry per state; label 1 = stopping there is right. NaN scores never stop.
    thresholds : array_like, shape (M,)
    groups : array_like, shape (N,), optional
        Question id of each state (states of a question in trajectory order). Without groups
        every state is its own decision. With groups the deployed rule is scored: each question
        stops at its first crossing; precision = questions stopped at a right state / questions
        stopped, recall = questions stopped at a right state / questions having a right state.

    Returns
    -------
    precision, recall : numpy.ndarray, shape (M,)
        NaN where nothing stops (precision) or nothing is right (recall).
    stops : numpy.ndarray of int64, shape (M,)
    """
    s, y, g = _check_labels(scores, labels, groups)
    h = np.atleast_1d(np.asarray(thresholds, dtype=np.float64))
    if g is None:
        stop = s[:, None] >= h[None, :]
        ns = stop.sum(0)
        tp = (stop & (y[:, None] == 1)).sum(0)
        npos = int(y.sum())
    else:
        ns, tp, npos = _grouped_counts(s, y, g, h, backend)
    with np.errstate(invalid="ignore", divide="ignore"):
        prec = np.where(ns > 0, tp / np.maximum(ns, 1), np.nan)
        rec = np.full(h.shape, np.nan) if npos == 0 else tp / npos
    return prec, rec, ns.astype(np.int64)


def select_threshold(scores, labels, min_precision: float = 0.90, groups=None, *,
                     backend: str | None = None) -> float:
    """The threshold that maximises STOP recall subject to STOP precision ``>= min_precision``.

    Candidates are the distinct finite scores (a state stops when ``score >= threshold``; NaN
    never stops). Among feasible candidates with the highest recall the HIGHEST threshold wins
    (the most conservative one).

    This is a general selection rule (per state, or per question with ``groups``). The S2G
    study's frozen threshold, which ``ragfast bench``, ``study s2g`` and ``report s2g`` use, is
    :func:`ragfast.methods.s2g.study.frozen_threshold` (per state, states 0..S-1, at least 10
    STOP states, "never stop" = highest score + 1).

    Parameters
    ----------
    scores : array_like, shape (N,)
        One STOP score per state.
    labels : array_like of {0, 1}, shape (N,)
        1 = stopping at that state is right (sufficient evidence, or safe by the probe).
    min_precision : float in [0, 1], default 0.90
    groups : array_like, shape (N,), optional
        Question id per state; scores the first-crossing rule per question instead of each
        state alone (see :func:`stop_precision_recall`).

    Returns
    -------
    float
        The threshold, or ``+inf`` (never stop) when no candidate reaches the precision.
    """
    if not 0.0 <= float(min_precision) <= 1.0:
        raise ValueError(f"min_precision must be in [0, 1], got {min_precision}")
    s, y, g = _check_labels(scores, labels, groups)
    cand = np.unique(s[np.isfinite(s)])
    if cand.size == 0:
        return float("inf")
    if g is None:
        # One sort gives stops and right stops at every distinct score: O(N log N).
        order = np.argsort(-cand, kind="mergesort")
        c_desc = cand[order]
        fin = np.isfinite(s) | (s == np.inf)
        ss, yy = s[fin], y[fin]
        o = np.argsort(-ss, kind="mergesort")
        ss, yy = ss[o], yy[o]
        # number of states with score >= c, for each candidate c (descending)
        ns = np.searchsorted(-ss, -c_desc, side="right")
        tp_cum = np.r_[0, np.cumsum(yy)]
        tp = tp_cum[ns]
        prec = tp / ns
        feasible = prec >= float(min_precision)
        if not feasible.any():
            return float("inf")
        best = tp[feasible].max()
        # descending candidates: the first feasible one reaching the best recall is the highest
        k = np.flatnonzero(feasible & (tp == best))[0]
        return float(c_desc[k])
    ns, tp, _ = _grouped_counts(s, y, g, cand, backend)
    # compare right-stop counts, not float recalls, so ties are exact
    feasible = (ns > 0) & (tp / np.maximum(ns, 1) >= float(min_precision))
    if not feasible.any():
        return float("inf")
    best = tp[feasible].max()
    return float(cand[np.flatnonzero(feasible & (tp == best))[-1]])  # cand ascending: last = highest


# -- counterfactual evaluation -----------------------------------------------------------------
def outcome_at(index, per_state, native) -> np.ndarray:
    """Per-question outcome of a stopping policy: ``per_state[b, index]`` where the trajectory
    stopped, the native outcome where it never crossed.

    Parameters
    ----------
    index : array_like of int, shape (B,) or (B, M)
        First-crossing indices (-1 = never), e.g. from :func:`first_crossing` or :func:`sweep`.
    per_state : array_like, shape (B, T)
        Outcome of stopping at each state (e.g. the answer-only probe's EM).
    native : array_like, shape (B,)
        Outcome of the run that was not stopped.

    Returns
    -------
    numpy.ndarray, shape of ``index``
    """
    idx = np.asarray(index, dtype=np.int64)
    ps = np.asarray(per_state)
    nat = np.asarray(native)
    if ps.ndim != 2 or nat.shape != (ps.shape[0],) or idx.shape[0] != ps.shape[0] or idx.ndim not in (1, 2):
        raise ValueError(f"expected index [B] or [B, M], per_state [B, T], native [B]; got {idx.shape}, "
                         f"{ps.shape}, {nat.shape}")
    if idx.size and (idx.max() >= ps.shape[1] or idx.min() < -1):
        raise ValueError(f"index must lie in [-1, {ps.shape[1] - 1}]")
    i2 = idx if idx.ndim == 2 else idx[:, None]
    vals = np.take_along_axis(ps, np.where(i2 >= 0, i2, 0), axis=1)
    out = np.where(i2 >= 0, vals, nat[:, None])
    return out if idx.ndim == 2 else out[:, 0]


@dataclass
class PolicyOutcome:
    """What a stopping policy does to each question (arrays of shape (B,) or (B, M))."""

    index: np.ndarray
    em: np.ndarray
    searches: np.ndarray
    stopped: np.ndarray  # crossed somewhere
    early: np.ndarray  # crossed before the native stop (saved at least one search)
    unsafe: np.ndarray  # early, and stopping there was wrong (per-state outcome 0)
    harmful: np.ndarray  # early, native answer right and the stopped one wrong


def evaluate_policy(index, state_em, native_em, native_searches, state_searches=None) -> PolicyOutcome:
    """Counterfactual EM and searches of a stopping policy on recorded trajectories.

    Parameters
    ----------
    index : array_like of int, shape (B,) or (B, M)
        First-crossing states (-1 = never stopped).
    state_em : array_like, shape (B, T)
        EM of the answer given when stopping at each state (the answer-only probe).
    native_em, native_searches : array_like, shape (B,)
        EM and number of searches of the native (unstopped) run.
    state_searches : array_like, shape (B, T), optional
        Searches spent when stopping at each state; default the column index (state t follows
        t searches).

    Returns
    -------
    PolicyOutcome
    """
    idx = np.asarray(index, dtype=np.int64)
    sem = np.asarray(state_em, dtype=np.float64)
    nem = np.asarray(native_em, dtype=np.float64)
    nsr = np.asarray(native_searches, dtype=np.float64)
    if sem.ndim != 2:
        raise ValueError(f"state_em must be [B, T], got shape {sem.shape}")
    B, T = sem.shape
    ssr = (np.broadcast_to(np.arange(T, dtype=np.float64), (B, T)) if state_searches is None
           else np.asarray(state_searches, dtype=np.float64))
    if ssr.shape != (B, T):
        raise ValueError(f"state_searches must be [B, T] = {(B, T)}, got {ssr.shape}")
    em = outcome_at(idx, sem, nem)
    sr = outcome_at(idx, ssr, nsr)
    col = (lambda v: v[:, None]) if idx.ndim == 2 else (lambda v: v)
    stopped = idx >= 0
    early = stopped & (sr < col(nsr))
    at = outcome_at(idx, sem, np.zeros(B))
    unsafe = early & (at <= 0)
    harmful = early & (col(nem) > 0) & (em <= 0)
    return PolicyOutcome(idx, em, sr, stopped, early, unsafe, harmful)


@dataclass
class ThresholdCurve:
    """Per-threshold behaviour and paired quality/cost deltas with bootstrap CIs."""

    thresholds: np.ndarray
    stops: np.ndarray
    early_stops: np.ndarray
    unsafe_early_stops: np.ndarray
    harmful_early_stops: np.ndarray
    em: np.ndarray
    searches: np.ndarray
    d_em: np.ndarray
    d_em_low: np.ndarray
    d_em_high: np.ndarray
    d_searches: np.ndarray
    d_searches_low: np.ndarray
    d_searches_high: np.ndarray
    non_inferior: np.ndarray
    margin: float
    meta: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        names = [k for k in self.__dataclass_fields__ if k not in ("margin", "meta")]
        cols = {k: np.asarray(getattr(self, k)) for k in names}
        return [{k: (v[i].item()) for k, v in cols.items()} for i in range(self.thresholds.size)]


def threshold_curve(scores, state_em, native_em, native_searches, thresholds, lengths=None, *,
                    state_searches=None, n_resamples: int = 10000, seed: int = 0, method: str = "percentile",
                    confidence: float = 0.95, margin: float = 0.02, searches_ci: bool = True,
                    dedupe: bool = True, backend: str | None = None) -> ThresholdCurve:
    """Sweep thresholds over recorded trajectories: behaviour, ΔEM and Δsearches with CIs.

    Every threshold's paired differences (policy minus native, per question) are bootstrapped
    with one shared set of question resamples, so the curve is coherent across thresholds.
    Identical difference rows (thresholds that change nothing) are resampled once.

    Parameters
    ----------
    scores : array_like, shape (B, T)
        STOP scores per state (NaN = not scored).
    state_em : array_like, shape (B, T)
        EM when stopping at each state.
    native_em, native_searches : array_like, shape (B,)
    thresholds : array_like, shape (M,)
    lengths : array_like of int, shape (B,), optional
    state_searches : array_like, shape (B, T), optional
        See :func:`evaluate_policy`.
    n_resamples, seed, method, confidence
        See :func:`ragfast.scoring.stats.paired_bootstrap`.
    margin : float, default 0.02
        Non-inferiority margin on EM (2 points).
    searches_ci : bool, default True
        Also bootstrap Δsearches (else its CI is NaN).
    dedupe : bool, default True
        Resample each distinct difference row once (same result, less work).
    backend : {"ref", "cpp"}, optional
        For both the sweep and the bootstrap.

    Returns
    -------
    ThresholdCurve
    """
    from ragfast.scoring.stats import paired_bootstrap

    idx = sweep(scores, thresholds, lengths, backend=backend)
    out = evaluate_policy(idx, state_em, native_em, native_searches, state_searches)
    nem = np.asarray(native_em, dtype=np.float64)
    nsr = np.asarray(native_searches, dtype=np.float64)
    d_em = (out.em - nem[:, None]).T  # [M, B]
    rows = [d_em]
    if searches_ci:
        rows.append((out.searches - nsr[:, None]).T)
    D = np.concatenate(rows, axis=0)
    # Thresholds that change nothing give identical rows; resample each distinct row once
    # (shared indices make the result identical to resampling every row).
    if dedupe:
        uniq, inv = np.unique(D, axis=0, return_inverse=True)
        inv = inv.reshape(-1)
    else:
        uniq, inv = D, np.arange(D.shape[0])
    res = paired_bootstrap(uniq, n_resamples=n_resamples, seed=seed, method=method, confidence=confidence,
                           backend=backend)
    lo, hi = np.asarray(res.low)[inv], np.asarray(res.high)[inv]
    M = d_em.shape[0]
    nan = np.full(M, np.nan)
    d_em_mean = d_em.mean(1)
    d_sr_mean = (out.searches - nsr[:, None]).mean(0)
    return ThresholdCurve(
        thresholds=np.atleast_1d(np.asarray(thresholds, dtype=np.float64)),
        stops=out.stopped.sum(0), early_stops=out.early.sum(0), unsafe_early_stops=out.unsafe.sum(0),
        harmful_early_stops=out.harmful.sum(0), em=out.em.mean(0), searches=out.searches.mean(0),
        d_em=d_em_mean, d_em_low=lo[:M], d_em_high=hi[:M], d_searches=d_sr_mean,
        d_searches_low=lo[M:] if searches_ci else nan, d_searches_high=hi[M:] if searches_ci else nan,
        non_inferior=lo[:M] > -margin, margin=float(margin),
        meta={"n_resamples": int(n_resamples), "seed": int(seed), "method": method, "confidence": confidence,
              "backend": res.backend, "distinct_rows": int(uniq.shape[0]), "rows": int(D.shape[0])})


__all__ = ["sweep", "first_crossing", "select_threshold", "stop_precision_recall", "outcome_at",
           "evaluate_policy", "PolicyOutcome", "threshold_curve", "ThresholdCurve"]

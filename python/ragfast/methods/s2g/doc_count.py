"""The STOP judge's slot verdict: does it rank validation states better than counting documents?

A state after more searches has read more documents, so "more documents = more likely
sufficient" is a free ranking any judge must beat. The comparison is a paired bootstrap over
validation questions of ``stop AP(judge) - stop AP(document count)``, with the study's stop AP
(:func:`ragfast.methods.s2g.study.stop_ap`: ties kept in input order, never merged). The
merged-tie AP (sklearn's, :func:`ragfast.scoring.stats.average_precision`) is reported beside it, named
as such.

Too few positives: not measured
    With fewer than :data:`MIN_POSITIVES` (5) positive validation states there is no verdict.
    AP over ``P`` positives moves in steps of order ``1/P`` (a single positive's AP is 1/its
    rank: one state moving up one rank halves or doubles it), and a question resample misses
    all ``P`` positives with probability about ``exp(-P)`` when they sit in distinct questions:
    37% of resamples at P = 1, 0.7% at P = 5. Below 5 the interval is conditioned on the
    resamples that happen to hold a positive, and says nothing about the judge.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["RankingVerdict", "doc_count_scores", "judge_vs_doc_count", "MIN_POSITIVES"]

#: Fewest positive validation states for a verdict (see the module docstring for why 5).
MIN_POSITIVES = 5


@dataclass
class RankingVerdict:
    """The judge's validation ranking against the document-count baseline.

    ``judge_ap`` and ``doc_count_ap`` are the study's stop AP; ``*_merged_ties`` the
    sklearn-style AP (tied scores merged) beside them. ``measured`` is False when there were
    too few positives (or no negative): the AP fields are then NaN and ``label`` says why.
    """

    judge_ap: float
    doc_count_ap: float
    delta: float
    low: float
    high: float
    n_questions: int
    n_states: int
    meaningful: bool
    label: str
    n_positives: int = 0
    measured: bool = True
    judge_ap_merged_ties: float = float("nan")
    doc_count_ap_merged_ties: float = float("nan")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def doc_count_scores(groups: np.ndarray) -> np.ndarray:
    """Searches made before each state (0, 1, ...: the state index), from the question ids.

    ``groups`` is the group column of :meth:`ragfast.methods.s2g.states.RecordedStates.state_table`
    (the study's states 0..S-1): each question's states are contiguous and in turn order, so a
    state's position within its group is its search count (documents read = searches x top-k,
    the same ranking).
    """
    g = np.asarray(groups)
    if g.size == 0:
        return np.zeros(0)
    starts = np.r_[0, np.flatnonzero(np.diff(g) != 0) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, g.size]))
    return (np.arange(g.size) - first).astype(np.float64)


def judge_vs_doc_count(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, *, n_resamples: int = 1000,
                       seed: int = 0, min_positives: int = MIN_POSITIVES) -> RankingVerdict | None:
    """Paired bootstrap (over questions) of ``stop AP(judge) - stop AP(document count)``.

    Parameters
    ----------
    scores, labels, groups : np.ndarray
        The validation state table in question order, then state order: judge scores,
        right-to-stop labels (0/1), question index.
    n_resamples : int
    seed : int
    min_positives : int
        Fewest positive states for a verdict (default :data:`MIN_POSITIVES`).

    Returns
    -------
    RankingVerdict or None
        None without any state; ``measured=False`` ("too few positives: not measured") with
        fewer than ``min_positives`` positives or no negative.
    """
    from ragfast.methods.s2g.study import stop_ap
    from ragfast.scoring.stats import average_precision

    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    g = np.asarray(groups)
    if y.size == 0:
        return None
    uniq, inv = np.unique(g, return_inverse=True)
    n_q, n_pos = len(uniq), int(y.sum())
    if n_pos < min_positives or n_pos == y.size:
        why = (f"too few positives: not measured ({n_pos} positive of {y.size} validation states; a verdict needs "
               f"{min_positives})" if n_pos < min_positives else
               f"no negative state: not measured (all {y.size} validation states are right to stop)")
        nan = float("nan")
        return RankingVerdict(nan, nan, nan, nan, nan, n_q, int(y.size), False, why, n_pos, False)
    base = doc_count_scores(g)
    ap_j, ap_b = stop_ap(y, s), stop_ap(y, base)
    # states of question k are order[starts[k]:starts[k] + counts[k]]; a resample's index is built
    # with one repeat + arange instead of concatenating per-question arrays (kept in resample
    # order: the stop AP's tie order is the input order)
    order = np.argsort(inv, kind="stable")
    counts = np.bincount(inv, minlength=n_q)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    rng = np.random.default_rng(seed)
    deltas = []
    for _ in range(n_resamples):
        pick = rng.integers(0, n_q, n_q)
        lens = counts[pick]
        shift = np.repeat(starts[pick] - np.r_[0, np.cumsum(lens)[:-1]], lens)
        idx = order[shift + np.arange(int(lens.sum()))]
        if y[idx].sum() == 0:
            continue
        deltas.append(stop_ap(y[idx], s[idx]) - stop_ap(y[idx], base[idx]))
    low, high = (np.quantile(deltas, [0.025, 0.975]) if deltas else (np.nan, np.nan))
    delta = ap_j - ap_b
    meaningful = bool(np.isfinite(low) and low > 0)
    fig = f"stop AP {ap_j:.3f} vs {ap_b:.3f}, Δ {delta:+.3f} [{low:+.3f}, {high:+.3f}], {n_pos} positives"
    if meaningful:
        label = f"yes: ranks validation states better than counting documents ({fig})"
    elif np.isfinite(high) and high < 0:
        label = f"NO: worse than counting documents (validation {fig})"
    else:
        label = f"NO: no better than counting documents (validation {fig})"
    return RankingVerdict(float(ap_j), float(ap_b), float(delta), float(low), float(high), n_q, int(y.size),
                          meaningful, label, n_pos, True, float(average_precision(y, s)),
                          float(average_precision(y, base)))

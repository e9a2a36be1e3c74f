"""Slot verdicts from measurement: does a component's output mean anything in this run?

A slot's label must agree with the numbers of the same run. Two verdicts are measured here:

- the STOP judge ranks validation states; it is worth its compute only if it ranks them
  better than the free baseline of counting documents (a state after more searches has read
  more documents, so "more documents = more likely sufficient" is a ranking any judge must
  beat). The comparison is a paired bootstrap over validation questions of
  ``AP(judge) - AP(document count)``;
- a scripted oracle is labelled for what it is (it knows the gold answers).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["RankingVerdict", "doc_count_scores", "judge_vs_doc_count", "ORACLE_LABEL", "RANDOM_LABEL"]

ORACLE_LABEL = "NO: knows the gold answers; EM = evidence reachability"
RANDOM_LABEL = "NO: random weights (exercises the compute path only)"


@dataclass
class RankingVerdict:
    """The judge's validation ranking against the document-count baseline."""

    judge_ap: float
    doc_count_ap: float
    delta: float
    low: float
    high: float
    n_questions: int
    n_states: int
    meaningful: bool
    label: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def doc_count_scores(groups: np.ndarray) -> np.ndarray:
    """Searches made before each state (1, 2, ...), from the per-question group ids.

    ``groups`` is the group column of :meth:`ragfast.methods.s2g.states.RecordedStates.state_table`:
    each question's states are contiguous and in turn order, so a state's position within its
    group is its search count (documents read = searches x top-k, the same ranking).
    """
    g = np.asarray(groups)
    if g.size == 0:
        return np.zeros(0)
    starts = np.r_[0, np.flatnonzero(np.diff(g) != 0) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, g.size]))
    return (np.arange(g.size) - first + 1).astype(np.float64)


def judge_vs_doc_count(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray, *, n_resamples: int = 1000,
                       seed: int = 0) -> RankingVerdict | None:
    """Paired bootstrap (over questions) of ``AP(judge) - AP(document count)`` on validation states.

    Parameters
    ----------
    scores, labels, groups : np.ndarray
        The validation state table: judge scores, right-to-stop labels (0/1), question index.
    n_resamples : int
    seed : int

    Returns
    -------
    RankingVerdict or None
        None when AP is undefined (no positive or no negative state).
    """
    from ragfast.stats import average_precision

    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    g = np.asarray(groups)
    if y.size == 0 or y.sum() == 0 or y.sum() == y.size:
        return None
    base = doc_count_scores(g)
    ap_j, ap_b = average_precision(y, s), average_precision(y, base)
    uniq, inv = np.unique(g, return_inverse=True)
    n_q = len(uniq)
    # states of question k are order[starts[k]:starts[k] + counts[k]]; a resample's index is built
    # with one repeat + arange instead of concatenating per-question arrays
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
        deltas.append(average_precision(y[idx], s[idx]) - average_precision(y[idx], base[idx]))
    low, high = (np.quantile(deltas, [0.025, 0.975]) if deltas else (np.nan, np.nan))
    delta = ap_j - ap_b
    meaningful = bool(np.isfinite(low) and low > 0)
    if meaningful:
        label = (f"yes: ranks validation states better than counting documents (AP {ap_j:.3f} vs {ap_b:.3f}, "
                 f"Δ {delta:+.3f} [{low:+.3f}, {high:+.3f}])")
    elif np.isfinite(high) and high < 0:
        label = (f"NO: worse than counting documents (validation AP {ap_j:.3f} vs {ap_b:.3f}, "
                 f"Δ {delta:+.3f} [{low:+.3f}, {high:+.3f}])")
    else:
        label = (f"NO: no better than counting documents (validation AP {ap_j:.3f} vs {ap_b:.3f}, "
                 f"Δ {delta:+.3f} [{low:+.3f}, {high:+.3f}])")
    return RankingVerdict(float(ap_j), float(ap_b), float(delta), float(low), float(high), n_q, int(y.size),
                          meaningful, label)

"""S2G's counterfactual evaluation on recorded states: a threshold sweep of the live rule.

The judge's calibration and the study's other figures live in :mod:`ragfast.methods.s2g.study`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ragfast.methods.s2g.policy import sweep
from ragfast.scoring.stats import unsafe_stop_fraction

__all__ = ["threshold_sweep"]


def threshold_sweep(rec: Any, threshold: float, n_thresholds: int = 60) -> dict[str, Any]:
    """EM, searches and unsafe early stops per threshold, replayed on recorded states (live rule).

    Parameters
    ----------
    rec : RecordedStates
        Judge scores and answer-only probe results of every state
        (:func:`ragfast.methods.s2g.states.record_states`).
    threshold : float
        The frozen threshold; always one of the swept ones.
    n_thresholds : int
        Thresholds at the score quantiles.

    Returns
    -------
    dict
        ``sweep`` (thresholds, em, searches, unsafe), ``n_states``; empty when no state has a
        finite score.
    """
    sc, _, _ = rec.state_table()
    fin = sc[np.isfinite(sc)]
    if fin.size == 0:
        return {}
    ths = np.unique(np.quantile(fin, np.linspace(0, 1, n_thresholds)))
    if np.isfinite(threshold):
        ths = np.unique(np.r_[ths, threshold])
    idx = sweep(rec.live_scores(), ths, rec.lengths)
    B = len(rec.ids)
    rows = np.arange(B)
    em, searches, unsafe = [], [], []
    for j in range(len(ths)):
        i = idx[:, j]
        stopped = i >= 0
        em.append(float(np.where(stopped, rec.probe_em[rows, np.where(stopped, i, 0)], rec.native_em).mean()))
        # stopping at state t means t searches were made
        searches.append(float(np.where(stopped, np.minimum(i, rec.native_searches), rec.native_searches).mean()))
        u = unsafe_stop_fraction(i, rec.probe_em, rec.native_searches.astype(np.int64))
        unsafe.append(float(u["unsafe_early_stops"]) / B)
    return {"sweep": {"thresholds": ths.tolist(), "em": em, "searches": searches, "unsafe": unsafe},
            "n_states": int(len(sc)),
            "note": "unsafe = early stops whose answer-only probe is wrong, as a fraction of questions"}

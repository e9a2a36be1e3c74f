"""Several S2G judges side by side on the same recorded states (the study's confirmatory table).

:func:`compare_judges` scores the study's states (0..S-1, :mod:`ragfast.methods.s2g.study`) of the
native trajectories of a ``ragfast study s2g`` directory with each judge, adds the scores to
``s2g_states.jsonl`` and computes ``s2g_judges.json`` from those lines: per judge and label
source (``probe``, ``gold`` where the data has supporting facts), stop AP, Brier, ECE-10 with
its bins, recall at STOP precision 0.90 and 0.95 with their thresholds, the threshold frozen on
the validation states, and the system level on test (early stops safe and unsafe, searches
saved with a paired bootstrap, first-safe-stop delay, EM from the answer-only probe). Beside
them: paired cluster-bootstrap CIs (resampling questions) of ΔAP against the first judge.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError

__all__ = ["cluster_bootstrap_dap", "compare_judges", "render_judges"]


def _ap_fast(y: np.ndarray, s: np.ndarray) -> float:
    from ragfast.methods.s2g.study import stop_ap

    return stop_ap(y, s)


def cluster_bootstrap_dap(labels: np.ndarray, a: np.ndarray, b: np.ndarray, groups: np.ndarray, *,
                          n_resamples: int = 2000, seed: int = 0, confidence: float = 0.95) -> dict[str, float]:
    """Paired bootstrap CI of AP(a) - AP(b), resampling questions (``groups``) with their states."""
    uq, inv = np.unique(groups, return_inverse=True)
    members = [np.flatnonzero(inv == k) for k in range(len(uq))]
    rng = np.random.default_rng(seed)
    d0 = _ap_fast(labels, a) - _ap_fast(labels, b)
    ds = []
    for _ in range(int(n_resamples)):
        pick = np.concatenate([members[k] for k in rng.integers(0, len(uq), len(uq))])
        y = labels[pick]
        if y.sum() == 0 or y.sum() == y.size:
            continue
        ds.append(_ap_fast(y, a[pick]) - _ap_fast(y, b[pick]))
    if not ds:
        return {"delta": d0, "low": float("nan"), "high": float("nan"), "n_resamples": 0}
    lo, hi = np.quantile(ds, [(1 - confidence) / 2, 1 - (1 - confidence) / 2])
    return {"delta": float(d0), "low": float(lo), "high": float(hi), "n_resamples": len(ds)}


def compare_judges(results_dir: str | Path, judges: Sequence[str | tuple[str, Any]], *, labels: str = "probe",
                   min_precision: float = 0.90, min_stops: int = 10, n_resamples: int = 2000, seed: int = 0,
                   judge_dtype: str | None = None, log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Score the recorded states of a ``study s2g`` directory with each judge and compare them.

    Parameters
    ----------
    results_dir : str or Path
        Holds ``native.jsonl`` and ``states.jsonl`` / ``s2g_states.jsonl`` (split ``val``/``test``).
    judges : sequence of str or (name, judge)
        Judge specs for :func:`ragfast.judges.load` (``encoder``, ``head``, a path),
        ``recorded`` (the scores already recorded), or (name, judge object) pairs.
    labels : {"probe", "gold"}
        The label source of the ΔAP intervals and of the rendered tables (``s2g_judges.json``
        holds every source).
    min_precision, min_stops : the frozen threshold's rule.
    judge_dtype : {"fp32", "bf16", "fp16"}, optional
        Weights and compute of the causal-LM judges among ``judges`` (their default otherwise).

    Returns
    -------
    dict
        ``s2g_judges.json``'s content plus ``labels``, ``order`` (the judges as given) and
        ``delta_ap`` (``"<judge> - <first>"``).
    """
    from ragfast.judges import load as load_judge
    from ragfast.methods.s2g.labelling import native_trajectories
    from ragfast.methods.s2g.states import RecordedStates, score_states
    from ragfast.methods.s2g.study import STATES_FILE, state_arrays, write_state_lines
    from ragfast.methods.s2g.study_files import ensure_state_lines, write_judges

    if labels not in ("probe", "gold"):
        raise ConfigError(f"labels must be probe or gold, got {labels!r}")
    if not judges:
        raise ConfigError("give at least one judge")
    d = Path(results_dir)
    lines = ensure_state_lines(d, RecordedStates.load(d / "states.jsonl")) if not (d / STATES_FILE).exists() \
        else ensure_state_lines(d, None)
    recorded = sorted({k for x in lines for k in x["scores"]})
    trs = {t.id: t for t in native_trajectories(d)[0]}
    qids = list(dict.fromkeys(x["question_id"] for x in lines))
    missing = [q for q in qids if q not in trs]
    if missing:
        raise DataError(f"{len(missing)} recorded questions have no native trajectory (e.g. {missing[0]!r})")
    if not any(x["split"] == "test" for x in lines):
        raise DataError(f"{d / STATES_FILE} has no test states")
    order = []
    for spec in judges:
        if isinstance(spec, tuple):
            name, judge = spec
        elif spec == "recorded":
            if not recorded:
                raise DataError(f"{d / STATES_FILE} holds no recorded scores")
            order.append(recorded[0])
            continue
        else:
            name, judge = str(spec), load_judge(str(spec), dtype=judge_dtype)
        per = dict(zip(qids, score_states([trs[q] for q in qids], judge, score_initial=True)))
        for x in lines:
            if x["state"] is not None:
                v = float(per[x["question_id"]][x["state"]])
                x["scores"][name] = None if math.isnan(v) else v
        order.append(name)
    write_state_lines(d / STATES_FILE, lines)
    out = write_judges(d, min_precision=min_precision, min_stops=min_stops, seed=seed)
    out.update(labels=labels, order=order, results_dir=str(d), delta_ap={})
    test = state_arrays([x for x in lines if x["split"] == "test"])
    y = test["labels"].get(labels, np.full(test["lines"], np.nan))
    keep = ~np.isnan(test["state"]) & ~np.isnan(y)
    for nm in order:
        keep &= ~np.isnan(test["scores"][nm])
    for nm in order[1:]:
        out["delta_ap"][f"{nm} - {order[0]}"] = cluster_bootstrap_dap(
            y[keep], test["scores"][nm][keep], test["scores"][order[0]][keep], test["q"][keep],
            n_resamples=n_resamples, seed=seed)
    for nm in order:
        e = out["judges"][nm].get(labels) or {}
        t = e.get("test", {})
        log(f"{nm}: test stop AP {t.get('ap', float('nan')):.4f}, "
            + (f"threshold {e['threshold']['threshold']:.4g}" if "threshold" in e else f"no threshold ({e.get('error')})"))
    return out


def render_judges(cmp: Mapping[str, Any]) -> str:
    """The comparison as markdown: the study's tables (the chosen label source) and the ΔAP CIs."""
    from ragfast.methods.s2g.study_files import fmt_figure as _f, render_study

    lab = cmp["labels"]
    view = {**cmp, "judges": {j: {lab: cmp["judges"][j][lab]} for j in cmp.get("order", cmp["judges"])
                              if lab in cmp["judges"][j]}}
    L = [f"# S2G judges side by side (labels: {lab})", "", render_study(view)]
    if cmp.get("delta_ap"):
        L += ["| ΔAP (stop AP, test, paired bootstrap over questions) | Δ | 95% CI |", "|---|---|---|"]
        for k, v in cmp["delta_ap"].items():
            L.append(f"| {k} | {_f(v['delta'])} | [{_f(v['low'])}, {_f(v['high'])}] |")
    L += ["", "Calibration bins (test; count, mean probability → fraction right):", ""]
    for name, per in view["judges"].items():
        bins = (per[lab].get("test") or {}).get("calibration") or []
        L.append(f"- {name}: " + "; ".join(f"[{b['lo']:.1f},{b['hi']:.1f}{']' if b['hi'] == 1.0 else ')'} "
                                           f"{b['count']}: {_f(b['mean_prob'], 2)}→{_f(b['frac_positive'], 2)}"
                                           for b in bins if b["count"]))
    return "\n".join(L) + "\n"

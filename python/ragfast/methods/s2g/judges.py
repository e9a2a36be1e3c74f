"""Several S2G judges side by side on the same recorded states (the study's confirmatory table).

:func:`compare_judges` scores every state of the native trajectories of a ``ragfast run s2g``
directory with each judge and reports, per judge:

- ranking on the test states: stop AP, Brier and ECE-10 (of ``sigmoid(score)``) with the
  calibration bins, recall at STOP precision 0.90 and 0.95 with the threshold that reaches it
  (per state, on test: what the best threshold could do), and the document-count baseline AP;
- the threshold frozen on the validation states (max first-crossing recall at precision
  ``>= min_precision``), replayed on test: early stops, safe and unsafe, correct->wrong and
  wrong->correct, accepted risk (unsafe / early stops), mean searches saved, first-safe-stop
  delay (states between the first safe eligible state and the stop), EM and searches;
- paired cluster-bootstrap CIs (resampling questions) of ΔAP against the first judge.

Labels: ``probe`` (answer-only probe EM, from ``states.jsonl``) or ``gold`` (all supporting
titles retrieved). Eligible states are the states 1..S-1 before the native stop (stopping
there saves searches); safe-early-stop prevalence is the share of eligible states the label
calls right.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError

__all__ = ["recall_at_precision", "cluster_bootstrap_dap", "judge_metrics", "compare_judges", "render_judges"]


def recall_at_precision(labels: np.ndarray, scores: np.ndarray, min_precision: float) -> tuple[float, float]:
    """(recall, threshold) of the best per-state threshold with precision >= ``min_precision``.

    Returns ``(0.0, inf)`` when no threshold reaches the precision.
    """
    from ragfast.methods.s2g.policy import select_threshold

    th = select_threshold(scores, labels, min_precision)
    if not np.isfinite(th):
        return 0.0, float("inf")
    P = max(1, int(labels.sum()))
    return float(((scores >= th) & (labels > 0)).sum() / P), float(th)


def _ap_fast(y: np.ndarray, s: np.ndarray) -> float:
    from ragfast.stats import average_precision

    return average_precision(y, s) if 0 < y.sum() else float("nan")


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


def _state_arrays(scores: np.ndarray, labels: np.ndarray, lengths: np.ndarray, native_searches: np.ndarray):
    """Flatten states 1..S of each question: (score, label, question row, state index, eligible)."""
    B, T = scores.shape
    t = np.arange(T)[None, :]
    valid = (t >= 1) & (t < lengths[:, None])
    rows = np.broadcast_to(np.arange(B)[:, None], (B, T))
    ts = np.broadcast_to(t, (B, T))
    elig = valid & (t < native_searches[:, None])
    return scores[valid], labels[valid].astype(np.int64), rows[valid], ts[valid], elig[valid]


def judge_metrics(scores: np.ndarray, labels: np.ndarray, lengths: np.ndarray, native_em: np.ndarray,
                  native_searches: np.ndarray, threshold: float, *, n_docs: np.ndarray | None = None) -> dict[str, Any]:
    """Ranking and system-level metrics of one judge on ``[B, T]`` recorded states at a frozen threshold."""
    from ragfast.methods.s2g.policy import first_crossing
    from ragfast.stats import brier, calibration_table, sigmoid

    s, y, g, ts, elig = _state_arrays(scores, labels, lengths, native_searches)
    fin = np.where(np.isnan(s), -np.inf, s)
    out: dict[str, Any] = {"states": int(s.size), "positives": int(y.sum()),
                           "eligible_states": int(elig.sum()),
                           "safe_early_stop_prevalence": float(y[elig].mean()) if elig.any() else float("nan")}
    if s.size and 0 < y.sum() < y.size:
        p = sigmoid(np.nan_to_num(s, nan=-np.inf))
        cal = calibration_table(y, p, n_bins=10)
        out.update(ap=_ap_fast(y, fin), brier=brier(y, p), ece=cal["ece"], calibration=cal["bins"])
        for mp in (0.90, 0.95):
            r, th = recall_at_precision(y, fin, mp)
            out[f"recall_at_p{int(mp * 100)}"] = r
            out[f"threshold_at_p{int(mp * 100)}"] = th
        if n_docs is not None:
            nd = n_docs[(np.arange(T := scores.shape[1])[None, :] >= 1) & (np.arange(T)[None, :] < lengths[:, None])]
            out["ap_ndocs_baseline"] = _ap_fast(y, nd)
    B = scores.shape[0]
    idx = first_crossing(scores, threshold, lengths)
    rows = np.arange(B)
    S = native_searches.astype(np.int64)
    stopped = idx >= 0
    early = stopped & (idx < S)
    at = np.maximum(idx, 0)
    lab_at = labels[rows, at] > 0
    # EM after the policy: the probe's answer (label) where it stopped early, else native.
    em = np.where(early, lab_at.astype(float), native_em)
    searches = np.where(early, idx, S)
    safe_any = np.zeros(B, dtype=bool)
    first_safe = np.full(B, -1)
    for b in range(B):
        e = np.flatnonzero((labels[b, 1:S[b]] > 0)) + 1 if S[b] > 1 else np.zeros(0, dtype=int)
        if e.size:
            safe_any[b] = True
            first_safe[b] = int(e[0])
    stop_at = np.where(early, idx, S)
    delay = (stop_at - first_safe)[safe_any]
    n_early = int(early.sum())
    unsafe = int((early & ~lab_at).sum())
    out.update({
        "threshold": float(threshold), "questions": int(B), "early_stops": n_early, "safe_early_stops": n_early - unsafe,
        "unsafe_early_stops": unsafe, "accepted_risk": unsafe / n_early if n_early else float("nan"),
        "correct_to_wrong": int(((native_em > 0) & (em <= 0)).sum()),
        "wrong_to_correct": int(((native_em <= 0) & (em > 0)).sum()),
        "em": float(em.mean()), "native_em": float(native_em.mean()),
        "searches": float(searches.mean()), "native_searches": float(S.mean()),
        "searches_saved": float((S - searches).mean()),
        "questions_with_safe_early_state": int(safe_any.sum()),
        "first_safe_stop_delay": float(delay.mean()) if delay.size else float("nan"),
    })
    out["_em"], out["_searches"] = em, searches
    return out


def compare_judges(results_dir: str | Path, judges: Sequence[str | tuple[str, Any]], *, labels: str = "probe",
                   min_precision: float = 0.90, n_resamples: int = 2000, seed: int = 0,
                   log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Score the recorded states of a ``run s2g`` directory with each judge and compare them.

    Parameters
    ----------
    results_dir : str or Path
        Holds ``native.jsonl`` and ``states.jsonl`` (split ``val``/``test``).
    judges : sequence of str or (name, judge)
        Judge specs for :func:`ragfast.models.judge.load_judge` (``encoder``, ``head``, a path),
        ``recorded`` (the scores already in ``states.jsonl``), or (name, judge object) pairs.
    labels : {"probe", "gold"}
        What a right stop is.
    min_precision : float
        Threshold freezing rule on the validation states (first crossing per question).

    Returns
    -------
    dict
        ``{"labels", "min_precision", "judges": {name: {"val": ..., "test": ...}}, "delta_ap": {...}}``.
    """
    from ragfast.models.judge import load_judge
    from ragfast.methods.s2g.labelling import gold_labels, native_trajectories
    from ragfast.methods.s2g.loop import RecordedStates, score_states
    from ragfast.methods.s2g.policy import select_threshold
    from ragfast.stats import paired_bootstrap

    if labels not in ("probe", "gold"):
        raise ConfigError(f"labels must be probe or gold, got {labels!r}")
    if not judges:
        raise ConfigError("give at least one judge")
    d = Path(results_dir)
    rec = RecordedStates.load(d / "states.jsonl")
    trs, _ = native_trajectories(d)
    by_id = {t.id: t for t in trs}
    missing = [q for q in rec.ids if q not in by_id]
    if missing:
        raise DataError(f"{len(missing)} recorded questions have no native trajectory (e.g. {missing[0]!r})")
    trs = [by_id[q] for q in rec.ids]
    B, T = rec.scores.shape
    if labels == "probe":
        lab = rec.probe_em
    else:
        from ragfast.methods.s2g.labelling import LabelledState

        lab = np.zeros((B, T))
        for b, tr in enumerate(trs):
            sts, titles, n = [], [], 0
            for turn in tr.turns:
                if turn.action == "search":
                    n += 1
                    titles = titles + list(turn.retrieved_titles)
                    sts.append(LabelledState(tr.id, n, tr.question, [], list(titles)))
            if sts and tr.supporting_titles:
                gold_labels(sts, [tr])
                for st in sts:
                    if st.state < T:
                        lab[b, st.state] = st.labels["gold"] or 0
    n_docs = np.zeros((B, T))
    for b, tr in enumerate(trs):
        n, c = 0, 0
        for turn in tr.turns:
            if turn.action == "search":
                n += 1
                c += len(turn.retrieved_titles)
                if n < T:
                    n_docs[b, n] = c
    split = np.array(rec.split)
    parts = {"val": split == "val", "test": split == "test"}
    if not parts["test"].any():
        raise DataError(f"{d / 'states.jsonl'} has no test states")
    out: dict[str, Any] = {"labels": labels, "min_precision": min_precision, "judges": {}, "results_dir": str(d)}
    flat_scores: dict[str, np.ndarray] = {}
    for spec in judges:
        if isinstance(spec, tuple):
            name, judge = spec
        elif spec == "recorded":
            name, judge = "recorded", None
        else:
            name, judge = str(spec), load_judge(str(spec))
        if judge is None:
            sc = rec.scores.copy()
        else:
            per = score_states(trs, judge)
            sc = np.full((B, T), np.nan)
            for b, row in enumerate(per):
                sc[b, :len(row)] = row[:T]
        res: dict[str, Any] = {"describe": judge.describe() if judge is not None else {"name": "recorded scores"}}
        if parts["val"].any():
            v = parts["val"]
            s_v, y_v, g_v, _, _ = _state_arrays(sc[v], lab[v], rec.lengths[v], rec.native_searches[v])
            th = select_threshold(np.where(np.isnan(s_v), -np.inf, s_v), y_v, min_precision, groups=g_v)
            res["threshold_source"] = f"validation states, first-crossing precision >= {min_precision}"
        else:
            th = float(json.loads((d / "s2g_threshold.json").read_text())["threshold"])
            res["threshold_source"] = "s2g_threshold.json (no validation states recorded)"
        for name_p, m in parts.items():
            if not m.any():
                continue
            jm = judge_metrics(sc[m], lab[m], rec.lengths[m], rec.native_em[m], rec.native_searches[m], th,
                               n_docs=n_docs[m])
            em, srch = jm.pop("_em"), jm.pop("_searches")
            if name_p == "test" and m.sum() >= 2:
                jm["d_em"] = paired_bootstrap(em, rec.native_em[m], n_resamples=10000, seed=seed).to_dict()
                jm["d_searches"] = paired_bootstrap(srch.astype(float), rec.native_searches[m].astype(float),
                                                    n_resamples=10000, seed=seed).to_dict()
            res[name_p] = jm
        out["judges"][name] = res
        s_t, _, _, _, _ = _state_arrays(sc[parts["test"]], lab[parts["test"]], rec.lengths[parts["test"]],
                                        rec.native_searches[parts["test"]])
        flat_scores[name] = np.where(np.isnan(s_t), -np.inf, s_t)
        t = res["test"]
        log(f"{name}: test AP {t.get('ap', float('nan')):.4f}, threshold {th:.4g}, early stops {t['early_stops']} "
            f"({t['unsafe_early_stops']} unsafe), searches saved/q {t['searches_saved']:.3f}")
    names = list(flat_scores)
    m = parts["test"]
    _, y_t, g_t, _, _ = _state_arrays(rec.scores[m], lab[m], rec.lengths[m], rec.native_searches[m])
    out["delta_ap"] = {}
    for nm in names[1:]:
        out["delta_ap"][f"{nm} - {names[0]}"] = cluster_bootstrap_dap(y_t, flat_scores[nm], flat_scores[names[0]], g_t,
                                                                     n_resamples=n_resamples, seed=seed)
    return out


def _f(x: Any, nd: int = 3) -> str:
    if x is None:
        return "n/a"
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(xf):
        return "n/a"
    if math.isinf(xf):
        return "never" if xf > 0 else "-inf"
    return f"{xf:.{nd}f}"


def render_judges(cmp: Mapping[str, Any]) -> str:
    """The comparison as markdown: ranking table, system table, ΔAP CIs, calibration bins."""
    L = [f"# S2G judges side by side (labels: {cmp['labels']}; threshold frozen on validation at first-crossing "
         f"precision >= {cmp['min_precision']})", ""]
    js = cmp["judges"]
    first = next(iter(js.values()))["test"]
    L += [f"Test: {first['questions']} questions, {first['states']} states; safe-early-stop prevalence "
          f"{_f(first['safe_early_stop_prevalence'])} over {first['eligible_states']} eligible states "
          "(states before the native stop).", ""]
    L += ["| judge | stop AP | #docs AP | Brier | ECE-10 | recall @P0.90 (threshold) | recall @P0.95 (threshold) |",
          "|---|---|---|---|---|---|---|"]
    for name, r in js.items():
        t = r["test"]
        L.append(f"| {name} | {_f(t.get('ap'))} | {_f(t.get('ap_ndocs_baseline'))} | {_f(t.get('brier'))} | "
                 f"{_f(t.get('ece'))} | {_f(t.get('recall_at_p90'))} ({_f(t.get('threshold_at_p90'))}) | "
                 f"{_f(t.get('recall_at_p95'))} ({_f(t.get('threshold_at_p95'))}) |")
    L += ["", "| judge | frozen threshold | early stops (unsafe) | correct→wrong | wrong→correct | accepted risk | "
              "searches/q | saved/q [95% CI] | first-safe-stop delay | EM | ΔEM [95% CI] |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in js.items():
        t = r["test"]
        ds, de = t.get("d_searches", {}), t.get("d_em", {})
        saved_ci = (f" [{_f(-ds['high'])}, {_f(-ds['low'])}]" if ds else "")
        L.append(f"| {name} | {_f(t['threshold'])} | {t['early_stops']} ({t['unsafe_early_stops']}) | "
                 f"{t['correct_to_wrong']} | {t['wrong_to_correct']} | {_f(t['accepted_risk'])} | {_f(t['searches'])} | "
                 f"{_f(t['searches_saved'])}{saved_ci} | {_f(t['first_safe_stop_delay'])} | {_f(t['em'], 4)} | "
                 + (f"{_f(de['delta'])} [{_f(de['low'])}, {_f(de['high'])}] |" if de else "n/a |"))
    L += ["", f"Native: {_f(first['native_searches'])} searches/q, EM {_f(first['native_em'], 4)}."]
    if cmp.get("delta_ap"):
        L += ["", "| ΔAP (test, paired bootstrap over questions) | Δ | 95% CI |", "|---|---|---|"]
        for k, v in cmp["delta_ap"].items():
            L.append(f"| {k} | {_f(v['delta'])} | [{_f(v['low'])}, {_f(v['high'])}] |")
    L += ["", "Calibration bins (test; count, mean probability → fraction right):", ""]
    for name, r in js.items():
        bins = r["test"].get("calibration") or []
        L.append(f"- {name}: " + "; ".join(f"[{b['lo']:.1f},{b['hi']:.1f}] {b['count']}: {_f(b['mean_prob'], 2)}→"
                                           f"{_f(b['frac_positive'], 2)}" for b in bins if b["count"]))
    return "\n".join(L) + "\n"

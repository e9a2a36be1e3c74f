"""The S2G study's evaluation, one implementation: states, stop AP, Brier, ECE-10, recall at
precision, the frozen threshold and the system-level metrics.

Every S2G figure that ``ragfast bench``, ``ragfast run s2g``, ``ragfast study s2g`` and ``ragfast report s2g`` print
comes from here, computed on the per-state export ``s2g_states.jsonl`` (:func:`state_lines`).

Definitions
-----------
States
    A question's states are the native run's states whose next action was a search:
    ``0..S-1``, ``S`` = the native search count. State ``s`` holds the evidence after ``s``
    searches. A question that never searched has no state; it still counts in system-level
    figures (its export line has ``state: null``).
Stop AP
    States sorted by score, highest first, ties kept in input order (question order, then
    state order) and never merged; precision summed at each positive's rank, divided by the
    positives. No positive: 0.
Brier, ECE-10
    ``p = sigmoid(clip(score, -40, 40))``. Bins ``[k/10, (k+1)/10)`` for k = 0..8, the last one
    ``[0.9, 1.0]`` closed; ECE = sum over non-empty bins of ``n_k / N * |mean(y) - mean(p)|``.
Recall at precision p
    Over states; a state stops when ``score >= threshold``. Candidates: ``+inf`` (never stop,
    recall 0) and every distinct score. Among candidates with precision ``>= p`` the highest
    recall wins, then the highest precision, then the highest threshold.
Frozen threshold
    Chosen per state on the validation states: the same choice over the distinct scores that
    reach precision ``>= min_precision`` (0.90) with at least ``min_stops`` (10) STOP states.
    Without a feasible candidate the policy never stops: threshold = highest score + 1. One
    label class on validation is an error (:class:`ThresholdError`).
System level
    A question stops at its first state whose score reaches the threshold; its search count is
    that state's index and its EM the answer-only probe's EM there (official normalisation).
    Otherwise it keeps its native searches and EM. An early stop is safe when the label source
    says stopping there is right. Searches saved = native - policy per question (mean, paired
    bootstrap). First-safe-stop delay = stop state - first safe state, averaged over safe
    early stops only.

States without a score (``null``) are left out of the ranking figures and never stop.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ragfast.errors import DataError

__all__ = ["STATES_FILE", "JUDGES_FILE", "ThresholdError", "FrozenThreshold", "probabilities", "stop_ap",
           "brier_score", "ece10", "recall_at_precision", "frozen_threshold", "system_metrics", "ranking_metrics",
           "choose_threshold", "state_lines", "write_state_lines", "read_state_lines", "state_arrays", "evaluate_lines",
           "threshold_record", "json_clean"]

#: The per-state export and the per-judge figures, in every S2G run and bench directory.
STATES_FILE = "s2g_states.jsonl"
JUDGES_FILE = "s2g_judges.json"
#: The study's score clip before the sigmoid (exp(40) is far inside float64).
CLIP = 40.0


class ThresholdError(DataError):
    """No threshold can be chosen: no validation state, or one label class only."""


# -- ranking ----------------------------------------------------------------------------------
def probabilities(scores) -> np.ndarray:
    """``sigmoid(clip(score, -40, 40))``, the study's STOP probability of a log-odds score."""
    s = np.clip(np.asarray(scores, dtype=np.float64), -CLIP, CLIP)
    return 1.0 / (1.0 + np.exp(-s))


def _ys(labels, scores) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64)
    s = np.asarray(scores, dtype=np.float64)
    if y.shape != s.shape or y.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D of one length, got {y.shape} and {s.shape}")
    if y.size and not np.isin(y, (0.0, 1.0)).all():
        raise ValueError("labels must be 0/1 (1 = stopping at this state is right)")
    if np.isnan(s).any():
        raise ValueError("scores must not be NaN (leave unscored states out)")
    return y, s


def stop_ap(labels, scores) -> float:
    """Stop AP: ties in input order, not merged; 0 without a positive."""
    y, s = _ys(labels, scores)
    P = y.sum()
    if P == 0:
        return 0.0
    ys = y[np.argsort(-s, kind="stable")]
    prec = np.cumsum(ys) / np.arange(1, ys.size + 1)
    return float(prec[ys == 1].sum() / P)


def brier_score(labels, scores) -> float:
    """Mean of ``(p - y)^2`` with ``p`` = :func:`probabilities` of the scores (NaN without states)."""
    y, s = _ys(labels, scores)
    return float(np.mean((probabilities(s) - y) ** 2)) if y.size else float("nan")


def ece10(labels, scores) -> tuple[float, list[dict[str, Any]]]:
    """ECE over ten bins ``[k/10, (k+1)/10)``, the last ``[0.9, 1.0]``, and the bins.

    Returns
    -------
    ece : float
        NaN without states.
    bins : list of dict
        ``lo, hi, count, mean_prob, frac_positive`` (NaN means for an empty bin).
    """
    y, s = _ys(labels, scores)
    p = probabilities(s)
    edges = np.arange(11) / 10.0  # k/10, each correctly rounded
    k = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, 9)  # p = 1.0 joins the closed last bin
    cnt = np.bincount(k, minlength=10)
    sp = np.bincount(k, weights=p, minlength=10)
    sy = np.bincount(k, weights=y, minlength=10)
    with np.errstate(invalid="ignore", divide="ignore"):
        mp, fy = sp / cnt, sy / cnt
    bins = [{"lo": float(edges[i]), "hi": float(edges[i + 1]), "count": int(cnt[i]), "mean_prob": float(mp[i]),
             "frac_positive": float(fy[i])} for i in range(10)]
    nz = cnt > 0
    ece = float(np.sum(cnt[nz] / y.size * np.abs(fy[nz] - mp[nz]))) if y.size else float("nan")
    return ece, bins


def _candidates(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct scores (descending) and, at each as threshold, STOP states and right stops."""
    cand = np.unique(s)[::-1]
    ss = np.sort(s)[::-1]
    stops = np.searchsorted(-ss, -cand, side="right")  # states with score >= c
    tp = np.r_[0.0, np.cumsum(y[np.argsort(-s, kind="stable")])][stops]
    return cand, stops, tp


def _choose(cand, stops, tp, feasible) -> int | None:
    """Highest recall (right stops), then highest precision, then highest threshold."""
    if not feasible.any():
        return None
    idx = np.flatnonzero(feasible)
    key = sorted(idx, key=lambda i: (tp[i], tp[i] / stops[i], cand[i]))
    return int(key[-1])


def recall_at_precision(labels, scores, min_precision: float) -> tuple[float, float]:
    """(recall, threshold) at precision ``>= min_precision``, per state; ``(0, inf)`` where only
    "never stop" qualifies, ``(nan, inf)`` without a positive."""
    y, s = _ys(labels, scores)
    P = y.sum()
    if s.size == 0:
        return float("nan"), float("inf")
    cand, stops, tp = _candidates(y, s)
    k = _choose(cand, stops, tp, tp / stops >= float(min_precision))
    if k is None or tp[k] == 0:
        return (0.0 if P else float("nan")), float("inf")
    return float(tp[k] / P), float(cand[k])


@dataclass
class FrozenThreshold:
    """The frozen STOP threshold and how it did on the validation states."""

    threshold: float
    feasible: bool
    precision: float  # NaN where nothing stops
    recall: float
    stops: int
    states: int
    positives: int
    min_precision: float
    min_stops: int


def frozen_threshold(labels, scores, min_precision: float = 0.90, min_stops: int = 10) -> FrozenThreshold:
    """The study's frozen threshold on validation states (see the module's definitions).

    Raises
    ------
    ThresholdError
        No validation state, or one label class only.
    """
    if not 0.0 <= float(min_precision) <= 1.0:
        raise ValueError(f"min_precision must be in [0, 1], got {min_precision}")
    y, s = _ys(labels, scores)
    if y.size == 0:
        raise ThresholdError("no validation state to choose the STOP threshold on (no validation question searched)")
    P = int(y.sum())
    if P in (0, y.size):
        raise ThresholdError(f"the validation states have one label class ({y.size} states, all "
                             f"{'right' if P else 'wrong'} to stop): the study refuses such labels")
    cand, stops, tp = _candidates(y, s)
    k = _choose(cand, stops, tp, (stops >= int(min_stops)) & (tp / stops >= float(min_precision)))
    if k is None:
        return FrozenThreshold(float(s.max() + 1.0), False, float("nan"), 0.0, 0, int(y.size), P,
                               float(min_precision), int(min_stops))
    return FrozenThreshold(float(cand[k]), True, float(tp[k] / stops[k]), float(tp[k] / P), int(stops[k]),
                           int(y.size), P, float(min_precision), int(min_stops))


def ranking_metrics(labels, scores) -> dict[str, Any]:
    """The study's ranking figures of one state set, plus the sklearn-style merged-tie AP beside."""
    from ragfast.scoring.stats import average_precision

    y, s = _ys(labels, scores)
    out: dict[str, Any] = {"states": int(y.size), "positives": int(y.sum()), "ap": stop_ap(y, s),
                           "brier": brier_score(y, s)}
    out["ece10"], out["calibration"] = ece10(y, s)
    for p in (0.90, 0.95):
        out[f"recall_at_p{int(round(p * 100))}"], out[f"threshold_at_p{int(round(p * 100))}"] = recall_at_precision(y, s, p)
    out["extra_ap_merged_ties_sklearn"] = average_precision(y, s) if y.sum() else float("nan")
    return out


# -- system level -----------------------------------------------------------------------------
def system_metrics(arr: Mapping[str, np.ndarray], judge: str, label: str, threshold: float, *,
                   n_resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """What the first-crossing policy at ``threshold`` does to each question (see the definitions).

    Parameters
    ----------
    arr : mapping
        :func:`state_arrays` of the questions' lines.
    judge, label : str
        Which score and which label source (safe / unsafe) to use.
    """
    from ragfast.scoring.stats import paired_bootstrap

    q = arr["q"]
    nq = int(arr["questions"])
    native_s = arr["q_native_searches"].astype(np.float64)
    native_em = arr["q_native_em"].astype(np.float64)
    policy_s, em = native_s.copy(), native_em.copy()
    sc, lab, st, pem = arr["scores"][judge], arr["labels"].get(label), arr["state"], arr["probe_em"]
    stop_state = np.full(nq, -1)
    first_safe = np.full(nq, -1)
    has = ~np.isnan(st)
    for i in np.flatnonzero(has):  # lines are in question order, then state order
        b = q[i]
        if lab is not None and first_safe[b] < 0 and lab[i] == 1:
            first_safe[b] = int(st[i])
        if stop_state[b] < 0 and not np.isnan(sc[i]) and sc[i] >= threshold:
            stop_state[b] = int(st[i])
            policy_s[b], em[b] = st[i], pem[i]
    stop_lab = np.full(nq, np.nan)
    for i in np.flatnonzero(has):
        if stop_state[q[i]] == st[i]:
            stop_lab[q[i]] = lab[i] if lab is not None else np.nan
    early = stop_state >= 0
    safe = early & (stop_lab == 1)
    unsafe = early & (stop_lab == 0)
    # a safe stop is never before the first safe state, so every delay is >= 0
    delay = (stop_state - first_safe)[safe]
    out: dict[str, Any] = {
        "threshold": float(threshold), "questions": nq, "early_stops": int(early.sum()), "safe_early_stops": int(safe.sum()),
        "unsafe_early_stops": int(unsafe.sum()), "unlabelled_early_stops": int((early & np.isnan(stop_lab)).sum()),
        "accepted_risk": float(unsafe.sum() / early.sum()) if early.any() else float("nan"),
        "em": float(em.mean()) if nq else float("nan"), "native_em": float(native_em.mean()) if nq else float("nan"),
        "searches": float(policy_s.mean()) if nq else float("nan"),
        "native_searches": float(native_s.mean()) if nq else float("nan"),
        "searches_saved": float((native_s - policy_s).mean()) if nq else float("nan"),
        "first_safe_stop_delay": float(delay.mean()) if delay.size else float("nan"),
        "correct_to_wrong": int(((native_em > 0) & (em <= 0)).sum()),
        "wrong_to_correct": int(((native_em <= 0) & (em > 0)).sum()),
    }
    if nq >= 2:
        out["searches_saved_ci"] = paired_bootstrap(native_s, policy_s, n_resamples=n_resamples, seed=seed).to_dict()
        out["d_em_ci"] = paired_bootstrap(em, native_em, n_resamples=n_resamples, seed=seed).to_dict()
    return out


def _per_question_precision(arr: Mapping[str, np.ndarray], judge: str, label: str, threshold: float) -> float:
    """Extra view: right first crossings / first crossings, counted over questions."""
    q, st, sc, lab = arr["q"], arr["state"], arr["scores"][judge], arr["labels"][label]
    seen: set[int] = set()
    right = 0
    for i in range(q.size):
        if np.isnan(st[i]) or q[i] in seen or np.isnan(sc[i]) or sc[i] < threshold:
            continue
        seen.add(int(q[i]))
        right += int(lab[i] == 1)
    return right / len(seen) if seen else float("nan")


# -- the export -------------------------------------------------------------------------------
def state_lines(rec: Any, judge: str, *, trajectories: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    """``s2g_states.jsonl`` lines of recorded native states (:class:`~ragfast.methods.s2g.states.RecordedStates`).

    One line per state 0..S-1 (states whose next action was a search), in question order then
    state order; a question with S = 0 gets one line with ``state: null``. ``labels`` holds
    ``probe`` (the answer-only probe's EM) and, where ``trajectories`` carry supporting titles,
    ``gold`` (every supporting title retrieved by that state).
    """
    from ragfast.scoring.metrics import sufficient

    by_id = {t.id: t for t in trajectories or ()}
    out: list[dict[str, Any]] = []
    for b, qid in enumerate(rec.ids):
        S = int(rec.native_searches[b])
        base = {"question_id": qid, "split": rec.split[b], "native_searches": S,
                "native_em": float(rec.native_em[b]), "native_answer": rec.native_answers[b]}
        if S == 0:
            out.append({**base, "state": None, "scores": {}, "labels": {}, "probe_answer": None, "probe_em": None})
            continue
        tr = by_id.get(qid)
        titles: list[list[str]] = [[]]
        if tr is not None:
            for t in tr.turns:
                if t.action == "search":
                    titles.append(titles[-1] + list(t.retrieved_titles))
        for s in range(S):
            x = float(rec.scores[b, s])
            labels = {"probe": int(rec.probe_em[b, s] > 0)}
            if tr is not None and tr.supporting_titles and s < len(titles):
                labels["gold"] = int(sufficient(titles[s], tr.supporting_titles))
            out.append({**base, "state": s, "scores": {judge: None if math.isnan(x) else x}, "labels": labels,
                        "probe_answer": rec.probe_answers[b][s], "probe_em": float(rec.probe_em[b, s])})
    return out


def write_state_lines(path: str | Path, lines: Iterable[Mapping[str, Any]]) -> Path:
    """Write the lines (atomically: a crash leaves the previous file)."""
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for x in lines:
            f.write(json.dumps(x) + "\n")
    tmp.replace(p)
    return p


def read_state_lines(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p} does not exist (written by `ragfast study s2g`, `ragfast run s2g` and `ragfast bench`)")
    out = []
    for n, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            x = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n}: not JSON ({e.msg})") from None
        miss = {"question_id", "split", "state", "native_searches", "native_em", "scores", "labels", "probe_em"} - set(x)
        if miss:
            raise DataError(f"{p}:{n}: missing {', '.join(sorted(miss))}")
        out.append(x)
    return out


def state_arrays(lines: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Column arrays of lines (one split): per line ``q`` (question index), ``state`` (NaN for a
    question without states), ``probe_em``, ``scores[judge]`` and ``labels[source]`` (NaN where
    absent); per question ``q_native_searches``, ``q_native_em``."""
    qidx: dict[str, int] = {}
    for x in lines:
        qidx.setdefault(x["question_id"], len(qidx))
    n = len(lines)
    judges = sorted({k for x in lines for k in x["scores"]})
    sources = sorted({k for x in lines for k in x["labels"]})
    nan = lambda v: np.nan if v is None else float(v)  # noqa: E731
    arr: dict[str, Any] = {
        "q": np.array([qidx[x["question_id"]] for x in lines], dtype=np.int64),
        "state": np.array([nan(x["state"]) for x in lines]),
        "probe_em": np.array([nan(x["probe_em"]) for x in lines]),
        "scores": {j: np.array([nan(x["scores"].get(j)) for x in lines]) for j in judges},
        "labels": {k: np.array([nan(x["labels"].get(k)) for x in lines]) for k in sources},
        "questions": len(qidx), "ids": list(qidx),
        "q_native_searches": np.zeros(len(qidx)), "q_native_em": np.zeros(len(qidx)), "lines": n,
    }
    for x in lines:
        b = qidx[x["question_id"]]
        arr["q_native_searches"][b] = float(x["native_searches"])
        arr["q_native_em"][b] = float(x["native_em"])
    return arr


def _ranked(arr: Mapping[str, Any], judge: str, label: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and scores of the states that have both, in line order."""
    s = arr["scores"].get(judge, np.full(arr["lines"], np.nan))
    y = arr["labels"].get(label, np.full(arr["lines"], np.nan))
    keep = ~np.isnan(arr["state"]) & ~np.isnan(s) & ~np.isnan(y)
    return y[keep], s[keep]


def choose_threshold(lines: Sequence[Mapping[str, Any]], judge: str, label: str = "probe", *,
                     min_precision: float = 0.90, min_stops: int = 10) -> FrozenThreshold:
    """The frozen threshold of ``judge`` on the ``val`` lines (the one definition; see the module).

    Raises
    ------
    ThresholdError
        No scored, labelled validation state, or one label class only.
    """
    val = [x for x in lines if x["split"] == "val"]
    return frozen_threshold(*_ranked(state_arrays(val), judge, label), min_precision=min_precision,
                            min_stops=min_stops)


def threshold_record(ft: FrozenThreshold | None, *, judge: str, label: str = "probe", source: str = "selected",
                     val_questions: int | None = None, reason: str | None = None, given: float | None = None
                     ) -> dict[str, Any]:
    """``s2g_threshold.json``'s one schema (bench, ``run s2g``, ``study s2g`` and ``report s2g`` alike)."""
    rec: dict[str, Any] = {"threshold": float(given) if ft is None else ft.threshold, "source": source,
                           "judge": judge, "labels": label, "val_questions": val_questions,
                           "definition": "per validation state (states 0..S-1): highest recall at precision >= "
                                         "min_precision with >= min_stops STOP states; none: highest score + 1"}
    if ft is not None:
        rec.update({"feasible": ft.feasible, "min_precision": ft.min_precision, "min_stops": ft.min_stops,
                    "val_states": ft.states, "val_positives": ft.positives, "val_precision": ft.precision,
                    "val_recall": ft.recall, "val_stops": ft.stops})
    if reason:
        rec["reason"] = reason
    return rec


def evaluate_lines(lines: Sequence[Mapping[str, Any]], *, min_precision: float = 0.90, min_stops: int = 10,
                   given_threshold: float | None = None, n_resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """``s2g_judges.json``: per judge and label source, the ranking figures on each split, the
    frozen threshold chosen on ``val`` (else ``given_threshold``) and the system level on ``test``.

    A (judge, label) pair whose threshold cannot be chosen (one label class, no validation state)
    holds ``error`` with the reason instead of system-level figures; its ranking figures stay.
    """
    splits = {sp: [x for x in lines if x["split"] == sp] for sp in ("val", "test")}
    arrs = {sp: state_arrays(v) for sp, v in splits.items() if v}
    judges = sorted({k for x in lines for k in x["scores"]})
    sources = sorted({k for x in lines for k in x["labels"]})
    out: dict[str, Any] = {"min_precision": float(min_precision), "min_stops": int(min_stops),
                           "questions": {sp: a["questions"] for sp, a in arrs.items()},
                           "states": {sp: int((~np.isnan(a["state"])).sum()) for sp, a in arrs.items()},
                           "judges": {}}
    for j in judges:
        out["judges"][j] = {}
        for lab in sources:
            e: dict[str, Any] = {}
            for sp, a in arrs.items():
                e[sp] = ranking_metrics(*_ranked(a, j, lab))
            th = given_threshold
            if "val" in arrs:
                try:
                    ft = choose_threshold(splits["val"], j, lab, min_precision=min_precision, min_stops=min_stops)
                    th = ft.threshold
                    e["threshold"] = threshold_record(ft, judge=j, label=lab, val_questions=arrs["val"]["questions"])
                except ThresholdError as err:
                    th = None
                    e["error"] = str(err)
            elif th is not None:
                e["threshold"] = threshold_record(None, judge=j, label=lab, source="given", given=th)
            else:
                e["error"] = "no validation states and no given threshold"
            if th is not None and "test" in arrs:
                e["test"]["system"] = system_metrics(arrs["test"], j, lab, th, n_resamples=n_resamples, seed=seed)
                e["test"]["extra_first_crossing_precision_per_question"] = _per_question_precision(arrs["test"], j,
                                                                                                   lab, th)
            out["judges"][j][lab] = e
    return out


def json_clean(o: Any) -> Any:
    """JSON-safe copy: NaN -> null, +-inf -> "inf"/"-inf", numpy scalars -> Python."""
    if isinstance(o, dict):
        return {k: json_clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_clean(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, (str, bytes)):
        o = o.item()
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None if math.isnan(o) else ("inf" if o > 0 else "-inf")
    return o


"""StepGap's evaluation tooling: agreement with human step labels and the per-stage ablation of the tree.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError
from ragfast.methods.stepgap.checker import (CC, GAP_LABELS, IE, LABELS, MB, NO_GAP, STAGES, CheckResult, as_trajectory,
                                             check, label_fractions)
from ragfast.types import Trajectory

__all__ = ["normalise_label", "load_annotations", "align_annotations", "step_metrics", "ablate"]

# Short spellings accepted in annotation files.
_LABEL_ALIASES = {"no_gap": NO_GAP, "none": NO_GAP, "ok": NO_GAP, "cc": CC, "contradicted_claim": CC,
                  "ie": IE, "irrelevant_evidence": IE, "mb": MB, "missing_bridge": MB}


# ---------------------------------------------------------------------------------------------
# metrics against human labels
# ---------------------------------------------------------------------------------------------
def normalise_label(label: str) -> str:
    """Canonical label name from an annotation spelling ("CC", "ie", "no_gap", ...)."""
    key = str(label).strip().lower()
    if key in _LABEL_ALIASES:
        return _LABEL_ALIASES[key]
    raise DataError(f"unknown StepGap label {label!r}; expected one of {LABELS} (or CC/IE/MB/no_gap)")


def load_annotations(path: Any) -> dict[tuple[str, int], str]:
    """Read human step labels.

    Annotation format: one JSON object per line with ``question_id`` (the trajectory id),
    ``step`` (the step index from :func:`~ragfast.methods.stepgap.checker.segment`), ``label``
    (one of :data:`~ragfast.methods.stepgap.checker.LABELS`, or CC/IE/MB/no_gap) and optionally
    ``claim`` (the step text, checked against the segmentation by :func:`align_annotations` when
    present) and ``note``.

    Returns
    -------
    dict
        (question_id, step) -> canonical label.
    """
    out: dict[tuple[str, int], str] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (str(rec["question_id"]), int(rec["step"]))
                lab = normalise_label(rec["label"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise DataError(f"{path}:{n}: bad annotation line ({exc}); need question_id, step, label") from exc
            if key in out:
                raise DataError(f"{path}:{n}: step {key} annotated twice")
            out[key] = lab
    return out


def align_annotations(gold: Mapping[tuple[str, int], str], result: CheckResult
                      ) -> tuple[list[str], list[str], list[str]]:
    """Gold labels, predicted labels and question ids for the annotated steps of a result.

    Raises
    ------
    DataError
        When an annotated step is not among the checked steps.
    """
    pred = {(lab.trajectory_id, lab.step): lab.label for lab in result.labels}
    missing = [k for k in gold if k not in pred]
    if missing:
        raise DataError(f"{len(missing)} annotated steps are not in the checked trajectories, e.g. {missing[:3]}")
    keys = sorted(gold)
    return [gold[k] for k in keys], [pred[k] for k in keys], [k[0] for k in keys]


def _f1(tp: int, fp: int, fn: int) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def _binary(gold: Sequence[bool], pred: Sequence[bool]) -> dict[str, float]:
    tp = sum(g and p for g, p in zip(gold, pred))
    fp = sum((not g) and p for g, p in zip(gold, pred))
    fn = sum(g and not p for g, p in zip(gold, pred))
    tn = sum((not g) and not p for g, p in zip(gold, pred))
    rates = []
    if tp + fn:
        rates.append(tp / (tp + fn))
    if tn + fp:
        rates.append(tn / (tn + fp))
    return {"f1": _f1(tp, fp, fn), "ba": float(np.mean(rates)) if rates else 0.0, "tp": tp, "fp": fp, "fn": fn, "tn": tn}


def _metrics_core(gold: Sequence[str], pred: Sequence[str], qids: Sequence[str]) -> dict[str, Any]:
    g = [x != NO_GAP for x in gold]
    p = [x != NO_GAP for x in pred]
    step = _binary(g, p)
    qs = list(dict.fromkeys(qids))
    qg = {q: False for q in qs}
    qp = {q: False for q in qs}
    for q, a, b in zip(qids, g, p):
        qg[q] |= a
        qp[q] |= b
    ques = _binary([qg[q] for q in qs], [qp[q] for q in qs])
    typed = {}
    for lab in GAP_LABELS:
        tp = sum(a == lab and b == lab for a, b in zip(gold, pred))
        fp = sum(a != lab and b == lab for a, b in zip(gold, pred))
        fn = sum(a == lab and b != lab for a, b in zip(gold, pred))
        typed[lab] = _f1(tp, fp, fn)
    return {"sF1": step["f1"], "QF1": ques["f1"], "BA": step["ba"], "typed_macro_F1": float(np.mean(list(typed.values()))),
            "typed_F1": typed, "label_mix_pred": label_fractions(pred), "confusion": {k: step[k] for k in ("tp", "fp", "fn", "tn")}}


def step_metrics(gold: Sequence[str], pred: Sequence[str], question_ids: Sequence[str]) -> dict[str, Any]:
    """Step- and question-level agreement of predicted gap labels with human labels.

    Parameters
    ----------
    gold, pred : sequence of str
        Labels per step (any spelling :func:`normalise_label` accepts), aligned.
    question_ids : sequence of str
        The question of each step.

    Returns
    -------
    dict
        ``sF1`` (binary F1 of "the step has a gap"), ``QF1`` (the same per question: flagged
        when any step is), ``BA`` (balanced accuracy of the step decision), ``typed_macro_F1``
        (mean one-vs-rest F1 over the three gap labels) with ``typed_F1``, ``label_mix_gold``,
        ``label_mix_pred``, ``n_steps``, ``n_questions``, and ``flag_all``: the same metrics of
        the baseline that flags every step (with the most frequent gold gap label), which shows
        how far Q-F1 alone can be gamed.
    """
    if not (len(gold) == len(pred) == len(question_ids)):
        raise DataError(f"step_metrics: {len(gold)} gold, {len(pred)} predicted, {len(question_ids)} question ids")
    if not gold:
        raise DataError("step_metrics: no steps to score")
    gold = [normalise_label(x) for x in gold]
    pred = [normalise_label(x) for x in pred]
    qids = [str(q) for q in question_ids]
    out = _metrics_core(gold, pred, qids)
    out["label_mix_gold"] = label_fractions(gold)
    out["n_steps"] = len(gold)
    out["n_questions"] = len(set(qids))
    gaps = Counter(x for x in gold if x != NO_GAP)
    flag_label = gaps.most_common(1)[0][0] if gaps else IE
    base = _metrics_core(gold, [flag_label] * len(gold), qids)
    out["flag_all"] = {k: base[k] for k in ("sF1", "QF1", "BA", "typed_macro_F1")}
    out["flag_all"]["label"] = flag_label
    return out


# ---------------------------------------------------------------------------------------------
# ablations
# ---------------------------------------------------------------------------------------------
class _MemoGenerator:
    """Replays stage outputs already produced for the same prompt (ablation runs re-ask them)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cache: dict[str, str] = {}

    def describe(self) -> dict[str, Any]:
        return self.inner.describe() if hasattr(self.inner, "describe") else {"name": type(self.inner).__name__}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def complete(self, prompts: Sequence[str], **kw: Any) -> list[str]:
        todo = [p for p in dict.fromkeys(prompts) if p not in self.cache]
        if todo:
            for key in ("question_ids", "settled"):  # per prompt
                per = kw.pop(key, None)
                if per is not None:
                    of = {p: q for p, q in zip(prompts, per)}
                    kw[key] = [of[p] for p in todo]
            for p, o in zip(todo, self.inner.complete(todo, **kw)):
                self.cache[p] = o
        return [self.cache[p] for p in prompts]


class _MemoNLI:
    """Replays NLI probabilities already computed for the same pair."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.cache: dict[tuple[str, str], np.ndarray] = {}

    def describe(self) -> dict[str, Any]:
        return self.inner.describe() if hasattr(self.inner, "describe") else {"name": type(self.inner).__name__}

    def score(self, premises: Sequence[str], hypotheses: Sequence[str], **kw: Any) -> np.ndarray:
        pairs = list(zip(premises, hypotheses))
        todo = [p for p in dict.fromkeys(pairs) if p not in self.cache]
        if todo:
            qids = kw.pop("question_ids", None)
            if qids is not None:
                first = {p: q for p, q in zip(pairs, qids)}
                kw["question_ids"] = [first[p] for p in todo]
            probs = self.inner.score([a for a, _ in todo], [b for _, b in todo], **kw)
            for p, row in zip(todo, np.asarray(probs)):
                self.cache[p] = row
        return np.stack([self.cache[p] for p in pairs]) if pairs else np.zeros((0, 3), dtype=np.float32)


def ablate(trajectories: Iterable[Trajectory | Mapping[str, Any]], generator: Any = None, nli: Any = None, *,
           stages: str = STAGES, thresholds: tuple[float, float] = (0.5, 0.5),
           gold: Mapping[tuple[str, int], str] | None = None, ledger: CostLedger | None = None,
           max_new_tokens: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Run the full tree and the tree minus each stage in turn; report what changes.

    LLM outputs and NLI scores are memoised across the runs (the same prompt or pair is
    answered once), so an ablation costs little more than the full check.

    Parameters
    ----------
    trajectories, generator, nli, stages, thresholds, max_new_tokens
        As for :func:`~ragfast.methods.stepgap.checker.check`.
    gold : mapping, optional
        Human labels from :func:`load_annotations`; adds :func:`step_metrics` per variant and
        its difference from the full tree.

    Returns
    -------
    dict
        ``variants``: name ("full", "-A", ...) -> {stages, label_mix, changed_steps (vs full),
        metrics and delta when gold is given}; ``slots`` and ``failures`` of the full run.
    """
    trajs = [as_trajectory(t) for t in trajectories]
    gen = _MemoGenerator(generator) if generator is not None else None
    scorer = _MemoNLI(nli) if nli is not None else None
    runs = {"full": stages.upper()}
    for s in stages.upper():
        runs[f"-{s}"] = stages.upper().replace(s, "")
    out: dict[str, Any] = {"variants": {}}
    full_labels: list[str] | None = None
    full_metrics = None
    for name, st in runs.items():
        res = check(trajs, gen, scorer, st, thresholds, ledger=ledger, max_new_tokens=max_new_tokens)
        labs = [lab.label for lab in res.labels]
        v: dict[str, Any] = {"stages": st, "label_mix": res.label_mix(),
                             "deciding_stage": dict(Counter(lab.stage for lab in res.labels))}
        if full_labels is None:
            full_labels = labs
            out["slots"], out["failures"], out["steps"] = res.slots, dict(res.failures), len(labs)
        v["changed_steps"] = sum(a != b for a, b in zip(labs, full_labels))
        if gold:
            g, p, q = align_annotations(gold, res)
            m = step_metrics(g, p, q)
            v["metrics"] = {k: m[k] for k in ("sF1", "QF1", "BA", "typed_macro_F1")}
            if full_metrics is None:
                full_metrics = v["metrics"]
                out["flag_all"] = m["flag_all"]
            v["delta"] = {k: v["metrics"][k] - full_metrics[k] for k in full_metrics}
        out["variants"][name] = v
    return out

"""StepGap's per-step process rewards (``r_base`` by label, ``r_shape`` by what the reasoner did next) as JSONL.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ragfast.methods.stepgap.checker import CC, GAP_LABELS, IE, MB, NO_GAP, CheckResult, Step, StepLabel, norm_ws
from ragfast.methods.stepgap.repairs import content_words

__all__ = ["RewardConfig", "process_rewards", "write_jsonl"]


@dataclass
class RewardConfig:
    """Magnitudes of the per-step process rewards (GRPO-style trainers read them as JSONL).

    ``r_base`` depends on the step's label. ``r_shape`` looks at the next action (the next
    search or answer step of the same trajectory): the matching repair earns ``match``;
    answering straight after an IE/MB gap, or repeating a contradicted claim in the answer, is
    ``ignore``; a next query that is a near-duplicate (word Jaccard >= ``dup_jaccard``) of an
    earlier query costs ``duplicate``.

    The defaults are PROTOCOLS.md's example values where it gives one (+0.20 no gap, -0.10
    IE, +0.05 for a detected CC: catching the contradiction is what lets the retraction happen;
    the shaping term then rewards or penalises what the model does about it).
    """

    no_gap: float = 0.20
    irrelevant_evidence: float = -0.10
    missing_bridge: float = -0.05
    contradicted_claim: float = 0.05
    match: float = 0.10
    ignore: float = -0.10
    duplicate: float = -0.05
    dup_jaccard: float = 0.8

    def base(self, label: str) -> float:
        return {NO_GAP: self.no_gap, IE: self.irrelevant_evidence, MB: self.missing_bridge,
                CC: self.contradicted_claim}[label]


def _jaccard(a: Sequence[str], b: Sequence[str]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def process_rewards(result: CheckResult, config: RewardConfig | None = None) -> list[dict[str, Any]]:
    """Per-step r_base and r_shape records for every labelled step.

    Parameters
    ----------
    result : CheckResult
        From :func:`~ragfast.methods.stepgap.checker.check`.
    config : RewardConfig, optional

    Returns
    -------
    list of dict
        ``question_id, step, turn, kind, label, stage, repair, next_action, next_content,
        r_base, r_shape, reward`` per step.
    """
    cfg = config or RewardConfig()
    by_traj: dict[str, list[tuple[Step, StepLabel]]] = {}
    for s, lab in zip(result.steps, result.labels):
        by_traj.setdefault(s.trajectory_id, []).append((s, lab))
    out = []
    for tid, rows in by_traj.items():
        for k, (s, lab) in enumerate(rows):
            nxt = next(((t, lt) for t, lt in rows[k + 1:] if t.kind in ("search", "answer", "abstain")
                        and t.index > s.index), None)
            prev_queries = [content_words(t.claim) for t, _ in rows[:k + 1] if t.kind == "search"]
            shape = 0.0
            if nxt is not None:
                ns = nxt[0]
                if ns.kind == "search" and any(_jaccard(content_words(ns.claim), q) >= cfg.dup_jaccard
                                               for q in prev_queries):
                    shape += cfg.duplicate
                elif lab.label in (IE, MB):
                    shape += cfg.match if ns.kind == "search" else cfg.ignore
                elif lab.label == CC:
                    repeats = ns.kind == "answer" and ns.claim and norm_ws(ns.claim) in norm_ws(s.claim) \
                        and s.kind != "answer"
                    shape += cfg.ignore if repeats else cfg.match
            elif lab.label in GAP_LABELS and s.kind != "answer":
                shape += cfg.ignore  # the trajectory ended without acting on the gap
            base = cfg.base(lab.label)
            out.append({"question_id": tid, "step": s.index, "turn": s.turn, "kind": s.kind, "label": lab.label,
                        "stage": lab.stage, "repair": lab.repair,
                        "next_action": nxt[0].kind if nxt else None, "next_content": nxt[0].claim if nxt else None,
                        "r_base": round(base, 6), "r_shape": round(shape, 6), "reward": round(base + shape, 6)})
    return out


def write_jsonl(records: Iterable[Mapping[str, Any]], path: Any) -> int:
    """Write records as JSON lines; returns how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
    return n


"""The judges' labelled training states: one record per state of a native trajectory, with its labels.

``ragfast label-states`` (:mod:`ragfast.methods.s2g.labelling`) writes them as
``labelled_states.jsonl``; ``train-judge --kind causal`` (:mod:`ragfast.judges.train.causal`)
and the study read them back with :func:`load_labelled_states`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ragfast.errors import DataError
from ragfast.types import State

__all__ = ["LabelledState", "load_labelled_states"]


@dataclass
class LabelledState:
    """One state of a native trajectory with its labels (1/0, or None = not labelled) and provenance."""

    id: str
    state: int
    question: str
    evidence: list[str]
    retrieved_titles: list[str]
    split: str = "test"
    labels: dict[str, int | None] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_state(self) -> State:
        return State(self.question, list(self.evidence), self.id, self.state)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_labelled_states(path: str | Path) -> list[LabelledState]:
    """Read a ``labelled_states.jsonl``."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"{p} does not exist (write it with `ragfast label-states`)")
    out = []
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            out.append(LabelledState(**json.loads(line)))
        except (TypeError, ValueError) as exc:
            raise DataError(f"{p}:{i + 1}: not a labelled state ({exc})") from None
    return out

"""The retriever interface the loops use: local indexes and the remote client alike."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

from ragfast.accounting.ledger import CostLedger


@dataclass
class Hit:
    """One retrieved corpus row, as Search-R1's server returns it (``document`` + ``score``)."""

    id: str
    score: float
    document: dict[str, Any] = field(default_factory=dict)  # {"id", "contents", ...}

    @property
    def title(self) -> str:
        return self.document.get("contents", "").split("\n", 1)[0].strip().strip('"')

    @property
    def contents(self) -> str:
        return self.document.get("contents", "")


class Retriever(ABC):
    """Batched top-k search over a corpus.

    ``exclude`` holds per-query corpus ids to skip (e.g. what a trajectory already read).
    Implementations record encoder and search costs on ``ledger`` per question id.
    """

    name: str = "retriever"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "class": type(self).__name__}

    @abstractmethod
    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[str]] | None = None,
               ledger: CostLedger | None = None,
               question_ids: Sequence[str] | None = None) -> list[list[Hit]]:
        """Return up to ``k`` hits per query, best first."""

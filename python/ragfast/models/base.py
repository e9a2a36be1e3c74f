"""The generator interface every pipeline talks to: :class:`Generator` (the judge's is
:class:`ragfast.judges.base.Judge`), and the stop-string cut and session checks every generator
shares.

Each concrete model says what fills its slot (``describe()``) and whether its outputs mean
anything (``meaningful``): a scripted agent or a random-weight model only exercises the compute
path, and every report says so.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

from ragfast.accounting.ledger import CostLedger

__all__ = ["Generator", "complete_ids", "cut_at_stop", "check_sessions", "check_new_sessions"]


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cut ``text`` right after the earliest occurrence of any stop string.

    Returns
    -------
    (text, stopped)
        The text up to and including the stop string, and whether one was found.
    """
    best = -1
    for s in stop:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best < 0 or i + len(s) < best):
            best = i + len(s)
    if best < 0:
        return text, False
    return text[:best], True


def check_sessions(sessions: Mapping[str, Any], ids: Sequence[str], who: str) -> None:
    """Raise unless every id names an open session, once (``who`` names the caller in the message)."""
    missing = [i for i in ids if i not in sessions]
    if missing:
        raise KeyError(f"{who}: no open session for id(s) {missing[:5]} (call start() first)")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{who}: duplicate session ids in one call")


def check_new_sessions(sessions: Mapping[str, Any], ids: Sequence[str], prompts: Sequence[str], who: str) -> None:
    """Raise unless there is one prompt per id and no id is open already or repeated."""
    # Checked before any session opens, so a refused call leaves no half-started batch behind.
    if len(ids) != len(prompts):
        raise ValueError(f"{who}: {len(ids)} ids but {len(prompts)} prompts")
    seen: set[str] = set()
    for i in ids:
        if i in sessions or i in seen:
            raise ValueError(f"{who}: session {i!r} is already open")
        seen.add(i)


def complete_ids(n: int) -> list[str]:
    """The session ids :meth:`Generator.complete` gives its ``n`` prompts, in order."""
    return [f"_complete_{i}" for i in range(n)]


class Generator(ABC):
    """A batched text generator (the reasoner slot, and the LLM stages of StepGap/RELOOP).

    Sessions let a multi-turn loop continue each trajectory from its previous state (a KV
    cache, where the backend has one) instead of re-encoding the whole prompt every turn:
    ``start`` opens one session per id, ``generate`` appends generated text to each session and
    returns it, ``append`` adds observation text, ``end`` frees the session.
    ``complete`` is the stateless one-shot call.
    """

    #: Short name of what fills the slot, e.g. "scripted evidence oracle" or a model path.
    name: str = "generator"
    #: False when the outputs only exercise the compute path (scripted, random weights).
    meaningful: bool = True

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "meaningful": self.meaningful, "class": type(self).__name__}

    @abstractmethod
    def start(self, ids: Sequence[str], prompts: Sequence[str]) -> None:
        """Open one session per id with its (already templated) prompt text."""

    @abstractmethod
    def generate(self, ids: Sequence[str], *, stop: Sequence[str], max_new_tokens: int,
                 ledger: CostLedger | None = None) -> list[str]:
        """Continue each session greedily until a stop string, EOS or the token budget.

        The returned text includes the stop string that ended it, and is appended to the
        session.
        """

    @abstractmethod
    def append(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        """Append text (e.g. an ``<information>`` observation) to each session."""

    @abstractmethod
    def end(self, ids: Sequence[str]) -> None:
        """Close sessions and free their caches."""

    def complete(self, prompts: Sequence[str], *, stop: Sequence[str] = (), max_new_tokens: int = 256,
                 ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None,
                 settled: Sequence[Callable[[str], bool] | None] | None = None) -> list[str]:
        """Stateless batched completion of raw prompts.

        ``settled``, one per prompt (or None), says of a completion so far that what its caller
        makes of it can no longer change: a generator may stop that completion there
        (``HFGenerator`` does; this default ignores it), and the caller's outcome is the same either way.
        """
        ids = complete_ids(len(prompts))
        self.start(ids, prompts)
        try:
            return self.generate(ids, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger)
        finally:
            self.end(ids)

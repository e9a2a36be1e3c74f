"""Small records shared by every pipeline: questions, passages, turns, states, trajectories."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


@dataclass
class Question:
    """One QA item. ``supporting_titles`` is empty where the source has no supporting facts."""

    id: str
    question: str
    golden_answers: list[str]
    supporting_titles: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Passage:
    """One corpus row in the wiki-18 layout: ``contents`` = '"Title"\\ntext'."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        return f"{self.title}\n{self.text}"

    @classmethod
    def from_contents(cls, id: str, contents: str) -> "Passage":
        title, _, text = contents.partition("\n")
        return cls(id=str(id), title=title, text=text)

    def to_row(self) -> dict[str, str]:
        """The corpus row as Search-R1's retriever returns it."""
        return {"id": self.id, "contents": self.contents}


@dataclass
class Turn:
    """One reasoner turn: what it generated, the parsed action, and what retrieval returned."""

    index: int
    generated: str
    action: str  # "search" | "answer" | "invalid" | "none"
    content: str | None = None  # the query or the answer
    retrieved_ids: list[str] = field(default_factory=list)
    retrieved_titles: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    observation: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class State:
    """An intermediate retrieval state: the question plus the evidence read so far.

    State t of a trajectory holds the information blocks of turns ``0..t-1``; the states of
    one trajectory are nested prefixes of each other, which the judge exploits.
    """

    question: str
    evidence: list[str] = field(default_factory=list)
    trajectory_id: str | None = None
    index: int = 0

    @classmethod
    def coerce(cls, s: "State | tuple[str, list[str]]") -> "State":
        if isinstance(s, State):
            return s
        if isinstance(s, tuple) and len(s) == 2:
            return cls(question=s[0], evidence=list(s[1]))
        raise TypeError(f"expected a State or a (question, [evidence, ...]) pair, got {type(s).__name__}")


@dataclass
class Trajectory:
    """A whole multi-round run for one question, written as one JSONL line."""

    id: str
    question: str
    golden_answers: list[str]
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    em: float = 0.0
    f1: float = 0.0
    stop_reason: str = ""
    cost: dict[str, Any] = field(default_factory=dict)
    supporting_titles: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def searches(self) -> int:
        return sum(1 for t in self.turns if t.action == "search")

    def states(self) -> list[State]:
        """States 0..S: state t holds the observations of the first t searches."""
        out = [State(self.question, [], self.id, 0)]
        ev: list[str] = []
        for t in self.turns:
            if t.action == "search":
                ev = ev + [t.observation]
                out.append(State(self.question, list(ev), self.id, len(out)))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["searches"] = self.searches
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        d = dict(d)
        d.pop("searches", None)
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        known = {f for f in cls.__dataclass_fields__}
        extra = {k: v for k, v in d.items() if k not in known}
        d = {k: v for k, v in d.items() if k in known}
        d.setdefault("extra", {}).update(extra)
        return cls(**d)


def check_questions(questions: Iterable[Any], who: str) -> list[Question]:
    """The questions as a list, refused unless each is a :class:`Question` with a unique id and gold answers.

    Parameters
    ----------
    who : str
        The caller, for the message (``"SearchR1Loop.run"``).

    Raises
    ------
    ragfast.errors.DataError
    """
    from ragfast.errors import DataError

    qs = list(questions)
    seen: set[str] = set()
    for q in qs:
        if not isinstance(q, Question):
            raise DataError(f"{who} expects ragfast.types.Question items, got {type(q).__name__}")
        if q.id in seen:
            raise DataError(f"duplicate question id {q.id!r}: ids key sessions, costs and results")
        seen.add(q.id)
        if not q.golden_answers:
            raise DataError(f"question {q.id!r} has no golden answers")
    return qs

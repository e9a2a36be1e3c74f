"""Guidance plans: what a question asks for (entities, hops, answer type), from its wording alone.

The plan is the stopping cue of a budgeted evidence loop: :class:`~ragfast.methods.reloop.sufficiency.HeuristicSufficiency`
judges a state against it, and RELOOP's planners (template, knowledge-graph path, LLM) produce it.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ragfast.text import EXTENDED_STOPWORDS, NAME_SPAN_PATTERN, QUOTED_PATTERN, content_words

__all__ = ["ANSWER_TYPES", "Plan", "answer_type_of", "heuristic_plan"]

#: The stopping cues a plan may carry.
ANSWER_TYPES = ("year", "number", "percent", "money", "person", "yes/no", "entity", "span")


@dataclass
class Plan:
    """A guidance plan for one question.

    ``answer_type`` is the stopping cue: year, number, percent, money, person, yes/no, entity or
    span. ``path`` (KG plans) is a list of ``(relation, inverse)`` hops from ``topic``.
    """

    question: str
    entities: list[str] = field(default_factory=list)
    hops: int = 1
    answer_type: str = "span"
    keywords: list[str] = field(default_factory=list)
    path: list[tuple[str, bool]] = field(default_factory=list)
    topic: str | None = None
    exclude_topic: bool = False
    source: str = "heuristic"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (hops of ``path`` as ``[relation, inverse]`` lists)."""
        d = asdict(self)
        d["path"] = [[r, inv] for r, inv in self.path]
        return d

    def query(self, covered: Sequence[str] = (), bridge: Sequence[str] = ()) -> str:
        """The guided query of a step: the question, the plan entities not yet covered, and
        (multi-hop plans) bridge entities met in the evidence read so far."""
        todo = [e for e in self.entities if e not in covered] + [b for b in bridge if b not in self.entities]
        return self.question if not todo else f"{self.question} {' ; '.join(todo)}"


def answer_type_of(question: str) -> str:
    """The stopping cue of a question from its wording."""
    q = question.strip().lower()
    if re.match(r"^(is|are|was|were|do|does|did|can|could|has|have|had|will|would|should)\b", q):
        return "yes/no"
    if re.search(r"\b(what|which) (year|decade)\b|\bwhen\b|\bwhat date\b|\bin what year\b", q):
        return "year"
    if re.search(r"\bpercentage\b|\bpercent\b|\bratio\b|\bproportion\b|%", q):
        return "percent"
    if re.search(r"\bhow (many|much|long|old|far|tall|big)\b|\bnumber of\b|\bwhat is the (total|amount|average|change|"
                 r"difference|value)\b|\baverage\b|\bchange in\b|\bdifference\b", q):
        return "number"
    if re.match(r"^(who|whom|whose)\b", q) or re.search(r"\bwhich (person|actor|actress|director|writer|author|"
                                                         r"singer|player|musician)\b", q):
        return "person"
    if re.match(r"^(which|what|where|name)\b", q):
        return "entity"
    return "span"


def heuristic_plan(question: str, *, multi_doc: bool = True) -> Plan:
    """A plan from templates of the question alone.

    Entities are quoted titles and capitalised spans (the first word counts only inside a
    longer span); hops are 2 for multi-document questions with a bridge or comparison cue
    ("both", "which ... first", a relative clause after an entity), else 1.

    Parameters
    ----------
    question : str
    multi_doc : bool
        Whether the evidence spans several documents (HotpotQA) or one (a TAT-QA report).
    """
    ents: list[str] = []
    for m in QUOTED_PATTERN.finditer(question):
        ents.append(m.group(1).strip())
    for m in NAME_SPAN_PATTERN.finditer(question):
        span = m.group(0).strip(" .,")
        if not span or span.lower() in EXTENDED_STOPWORDS:
            continue
        if m.start() == 0 and " " not in span:
            continue  # a single sentence-initial word is rarely an entity ("Which", "Who")
        if m.start() == 0:
            span = span.split(" ", 1)[1] if span.split(" ", 1)[0].lower() in EXTENDED_STOPWORDS else span
        if any(span in e for e in ents):
            continue
        ents.append(span)
    q = question.lower()
    hops = 1
    if multi_doc and (re.search(r"\bboth\b|\bwhich (one|came|was|is) (first|older|younger|larger|longer)\b|"
                                r"\b(older|younger|earlier|later|first)\b.*\bor\b", q)
                      # a relative clause or a second question after the first word: a bridge
                      or re.search(r"\b(that|who|which|whose|where)\b|\band (when|where|who|what|which|how)\b",
                                   q.split(" ", 1)[-1])
                      or len(ents) >= 2):
        hops = 2
    return Plan(question=question, entities=ents, hops=hops, answer_type=answer_type_of(question),
                keywords=content_words(question, EXTENDED_STOPWORDS, min_len=2), source="heuristic")

"""A rule-based sufficiency judge: is the evidence read so far enough to answer (not a trained model)."""
from __future__ import annotations

import re
import time
from typing import Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.judges.base import Judge
from ragfast.methods.reloop.plan import Plan, heuristic_plan
from ragfast.text import EXTENDED_STOPWORDS, NUMBER_PATTERN, YEAR_PATTERN, content_words, whitespace_tokens, words
from ragfast.types import State

__all__ = ["HeuristicSufficiency"]


def _has_type(text: str, answer_type: str) -> bool:
    if answer_type == "year":
        return bool(YEAR_PATTERN.search(text))
    if answer_type in ("number", "percent", "money"):
        return bool(NUMBER_PATTERN.search(text))
    if answer_type in ("person", "entity"):
        return bool(re.search(r"\b[A-Z][a-z]+", text))
    return bool(text.strip())


class HeuristicSufficiency(Judge):
    """Rule-based sufficiency (not a trained judge).

    A state is sufficient when (a) every plan entity is covered (at least 60% of its content
    words appear in the evidence), (b) some evidence can carry the answer type of the stopping
    cue (a year for "when", a number for "how many", a capitalised name for "who"), and (c) a
    multi-hop plan has evidence from at least ``hops`` distinct sources (evidence blocks start
    with their source title and a colon) and has taken at least ``hops`` steps
    (``State.index``; measured on the first 150 HotpotQA dev questions with the lexical encoder,
    this raised supporting-title recall 0.60 -> 0.66 for 1.8 -> 2.2 steps per question).
    Score +1 when sufficient, -1 otherwise, so the default threshold 0 separates them.
    """

    name = "heuristic sufficiency (entity coverage + answer-type cue + hop count; rule, not trained)"
    meaningful = True

    def __init__(self, multi_doc: bool = True):
        self.multi_doc = multi_doc
        self._plans: dict[str, Plan] = {}

    def plan_for(self, question: str) -> Plan:
        p = self._plans.get(question)
        if p is None:
            p = self._plans[question] = heuristic_plan(question, multi_doc=self.multi_doc)
        return p

    def set_plan(self, question: str, plan: Plan) -> None:
        """Use this plan (e.g. an LLM's) for the question instead of the heuristic one."""
        self._plans[question] = plan

    def sufficient(self, question: str, evidence: Sequence[str]) -> bool:
        plan = self.plan_for(question)
        if not evidence:
            return False
        text = " ".join(evidence)
        seen = set(words(text))
        for e in plan.entities:
            ew = content_words(e, EXTENDED_STOPWORDS, min_len=2) or words(e)
            if ew and sum(w in seen for w in ew) < 0.6 * len(ew):
                return False
        qwords = set(words(question))
        if not any(_has_type(ev, plan.answer_type) and (set(words(ev)) - qwords) for ev in evidence):
            return False
        if self.multi_doc and plan.hops >= 2:
            sources = {ev.split(":", 1)[0] for ev in evidence if ":" in ev}
            if len(sources) < plan.hops:
                return False
        return True

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        t0 = time.perf_counter()
        sts = [State.coerce(s) for s in states]
        # a multi-hop plan needs at least one step per hop (State.index = steps taken)
        out = np.asarray([1.0 if self.sufficient(s.question, s.evidence)
                          and (not self.multi_doc or self.plan_for(s.question).hops < 2
                               or s.index >= self.plan_for(s.question).hops) else -1.0
                          for s in sts], dtype=np.float64)
        if ledger is not None and sts:
            ledger.add_batch("judge", list(question_ids) if question_ids is not None else [None] * len(sts),
                             seconds=time.perf_counter() - t0,
                             input_tokens=[whitespace_tokens(s.question) + sum(map(whitespace_tokens, s.evidence)) for s in sts])
        return out

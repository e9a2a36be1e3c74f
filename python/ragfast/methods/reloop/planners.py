"""RELOOP's planners beyond the question templates: the MetaQA relation-path parser and the LLM planner."""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError
from ragfast.models.base import Generator
from ragfast.methods.reloop.plan import ANSWER_TYPES, Plan, heuristic_plan

__all__ = ["kg_path_plan", "LLM_PLAN_PROMPT", "lm_complete", "llm_plans"]


# -- MetaQA template parser ----------------------------------------------------------------
# Keyword -> relation lexicon for MetaQA's question templates (written from the nine relation
# names and the template wording; the longest alternatives come first so "screenwriter" wins
# over "writ").
_REL_LEXICON = [
    ("directed_by", r"co-direct\w*|direct\w*"),
    ("written_by", r"co-writ\w*|screenwriter\w*|scriptwriter\w*|screenplay|writ\w*|wrote|author\w*|script|story"),
    ("starred_actors", r"co-star\w*|star\w*|act\w*|appear\w*"),
    ("release_year", r"release\w*|years?|when"),
    ("in_language", r"languages?"),
    ("has_genre", r"genres?|types?|sort of|kind of"),
    ("has_tags", r"words?|describ\w*|topics?|about|terms|tags?"),
    ("has_imdb_votes", r"votes?|popular\w*"),
    ("has_imdb_rating", r"rat(?:ed|ing|ings)|famous"),
]
_REL_RX = re.compile("|".join(f"(?P<{n}>\\b(?:{p})\\b)" for n, p in _REL_LEXICON))
_CO_CUE = re.compile(r"\bco-|\btogether\b|\bsame movie\b")  # actor -> movie -> (other) actor
_SHARE_CUE = re.compile(r"\b(same|share|shares|also)\b")     # movie -> x -> (other) movie
_ASKS_MOVIE = re.compile(r"\b(what|which) (movies|films)\b|\bwhat does\b|\bname a\b|\bwhat is a\b|"
                         r"\bwhich (movies|films)$")
_BRACKET = re.compile(r"\[([^\]]+)\]")


def kg_path_plan(question: str, kg: Any, topic: str | None = None) -> Plan:
    """Parse a MetaQA question into a relation path from its topic entity (deterministic).

    Every MetaQA head is a movie, so a path alternates movie -> value (forward) and value ->
    movie (inverse) hops. The parser finds the relation keywords of the question (the topic
    entity masked out), reads from the knowledge graph whether the topic is a movie (it heads
    triples) or a value (it ends them), and picks the template:

    - value topic, one relation: ``[r^-1]`` ("what movies did [X] direct"); with a "co-" /
      "together" cue ``[r^-1, r]`` minus the topic ("who co-starred with [X]");
    - value topic, two relations: ``[r0^-1, t]`` where ``r0`` is the relation next to the topic
      and ``t`` the asked one ("who directed the films written by [X]");
    - movie topic, one relation: ``[r]``; with a "same/share/also" cue ``[r, r^-1]`` minus the
      topic ("which movies share the same director of [X]");
    - movie topic, two relations: ``[b, b^-1, t]`` (the movies other than the topic that share
      the bridge ``b`` with it, then the asked relation ``t``): the 3-hop templates.

    The asked relation is the one after the topic when a wh-word follows the topic ("the films
    ... of [X] were in which genres"), else the first one in the question. The topic entity
    itself is never an answer of a multi-hop path.

    Parameters
    ----------
    question : str
        The question with its topic entity in ``[brackets]`` (MetaQA's raw form), or plain text
        with ``topic`` given.
    kg : KGraph
    topic : str, optional
        The topic entity when the question has no brackets.
    """
    m = _BRACKET.search(question)
    if m is not None:
        ent, es, ee = m.group(1), m.start(), m.end()
    elif topic is not None and topic in question:
        es = question.index(topic)
        ent, ee = topic, es + len(topic)
    else:
        raise DataError(f"kg-path planner: no topic entity in {question!r} (MetaQA marks it with [brackets])")
    low = question.lower()
    ms = [(mm.lastgroup, mm.start(), mm.end()) for mm in _REL_RX.finditer(low) if mm.end() <= es or mm.start() >= ee]
    plain = (question[:es] + ent + question[ee:]).strip()
    plan = Plan(question=plain, entities=[ent], topic=ent, answer_type="entity", source="kg-path",
                keywords=[r for r, _, _ in ms])
    e = kg.entity_id.get(ent, -1)
    if e < 0 or not ms:
        plan.hops = 0
        return plan  # nothing to follow: the run reports stop_reason "no path"
    out_r, in_r = set(kg.out_relations(e)), set(kg.in_relations(e))
    rels = list(dict.fromkeys(r for r, _, _ in ms))

    def dist(mm: tuple[str, int, int]) -> int:
        return es - mm[2] if mm[2] <= es else mm[1] - ee

    def asked() -> str:
        if re.search(r"\b(who|which|what)\b", low[ee:]):
            after = [mm for mm in ms if mm[1] >= ee]
            if after:
                return after[-1][0]
        return ms[0][0]

    fits_movie = any(r in out_r for r in rels)
    fits_value = any(r in in_r for r in rels)
    # A name that is both a movie and a value (rare) is read as a value when the question asks
    # for movies about it and does not call it "the movie [X]".
    is_movie = fits_movie and not (fits_value and len(rels) == 1 and not _SHARE_CUE.search(low)
                                   and not re.search(r"\b(movie|film) \[", low) and _ASKS_MOVIE.search(low))
    if is_movie:
        if len(rels) >= 2:
            t = asked()
            b = min((mm for mm in ms if mm[0] != t), key=dist)[0]
            plan.path, plan.exclude_topic = [(b, False), (b, True), (t, False)], True
        elif _SHARE_CUE.search(low):
            plan.path, plan.exclude_topic = [(rels[0], False), (rels[0], True)], True
        else:
            plan.path = [(rels[0], False)]
    else:
        if len(rels) >= 2:
            t = asked()
            rest = [mm for mm in ms if mm[0] != t]
            r0 = min([mm for mm in rest if mm[0] in in_r] or rest, key=dist)[0]
            plan.path, plan.exclude_topic = [(r0, True), (t, False)], True
        elif _CO_CUE.search(low):
            plan.path, plan.exclude_topic = [(rels[0], True), (rels[0], False)], True
        else:
            plan.path = [(rels[0], True)]
    plan.hops = len(plan.path)
    return plan


# -- LLM planner ---------------------------------------------------------------------------
LLM_PLAN_PROMPT = (
    "Plan the evidence search for a question. Reply with one JSON object and nothing else:\n"
    '{{"entities": [names the evidence must mention], "hops": number of documents or facts to chain '
    '(1-3), "answer_type": one of "year", "number", "percent", "money", "person", "yes/no", "entity", '
    '"span"}}\nQuestion: {question}\nJSON:'
)


def lm_complete(gen: Generator, prompts: Sequence[str], question_ids: Sequence[str], *, stop: Sequence[str],
                max_new_tokens: int, ledger: CostLedger | None = None) -> list[str]:
    """One batched stateless generation whose sessions are named by the question ids.

    ``Generator.complete`` names its sessions ``_complete_i``, so a backend that records its
    cost per session would book it to no question; opening the sessions under the question ids
    puts the reasoner cost on the right question in the ledger.
    """
    qids = [str(q) for q in question_ids]
    if len(set(qids)) != len(qids):
        return gen.complete(prompts, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger, question_ids=qids)
    gen.start(qids, list(prompts))
    try:
        return gen.generate(qids, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger)
    finally:
        gen.end(qids)


def _parse_plan_json(text: str, question: str, base: Plan) -> Plan:
    m = re.search(r"\{.*\}", text, re.DOTALL)
    if not m:
        raise ValueError("no JSON object")
    obj = json.loads(m.group(0))
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    ents = obj.get("entities", [])
    if not isinstance(ents, list) or not all(isinstance(x, str) for x in ents):
        raise ValueError("entities must be a list of strings")
    hops = int(obj.get("hops", base.hops))
    at = obj.get("answer_type", base.answer_type)
    if at not in ANSWER_TYPES:
        at = base.answer_type
    return Plan(question=question, entities=[x.strip() for x in ents if x.strip()][:6], hops=max(1, min(3, hops)),
                answer_type=at, keywords=base.keywords, source="llm")


def llm_plans(questions: Sequence[str], generator: Generator, *, ledger: CostLedger | None = None,
              question_ids: Sequence[str] | None = None, multi_doc: bool = True,
              max_new_tokens: int = 96) -> list[Plan]:
    """Ask a generator for one JSON plan per question (one batched call).

    An output that does not parse falls back to :func:`heuristic_plan`, marked
    ``source="llm-fallback"`` so the report can count them.
    """
    prompts = [LLM_PLAN_PROMPT.format(question=q) for q in questions]
    qids = list(question_ids) if question_ids is not None else [f"_plan{i}" for i in range(len(prompts))]
    outs = lm_complete(generator, prompts, qids, stop=["\n\n"], max_new_tokens=max_new_tokens, ledger=ledger)
    plans = []
    for q, o in zip(questions, outs):
        base = heuristic_plan(q, multi_doc=multi_doc)
        try:
            plans.append(_parse_plan_json(o, q, base))
        except (ValueError, TypeError, json.JSONDecodeError):
            base.source = "llm-fallback"
            plans.append(base)
    return plans

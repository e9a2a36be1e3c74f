"""Knowledge-graph runs (MetaQA, planner ``kg-path``): the relation-path walk and its evidence pack."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError, blame
from ragfast.methods.reloop.hseq import METAQA_RELATIONS, HSeq, from_triples
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.methods.reloop.planners import kg_path_plan, lm_complete
from ragfast.scoring.metrics import exact_match, f1
from ragfast.models.base import Generator
from ragfast.models.extractive import ExtractiveHead, render_pack
from ragfast.methods.reloop.plan import Plan
from ragfast.text import whitespace_tokens
from ragfast.types import Question

__all__ = ["KGPathResult", "walk_path", "set_scores", "run_kg_path", "metaqa_kg"]


@dataclass
class KGPathResult:
    """What one kg-path walk produced."""

    answers: list[str]
    steps: int
    stop_reason: str
    pack: list[dict[str, Any]]
    step_log: list[dict[str, Any]]
    tokens: int


def walk_path(plan: Plan, seq: HSeq, cfg: ReloopConfig) -> KGPathResult:
    kg = seq.kg
    e = kg.entity_id.get(plan.topic, -1) if plan.topic else -1
    if e < 0:
        return KGPathResult([], 0, "unknown topic entity", [], [], 0)
    if not plan.path:
        return KGPathResult([], 0, "no path", [], [], 0)
    w = np.zeros(len(kg.entities))
    w[e] = 1.0
    log: list[dict[str, Any]] = []
    first = np.zeros(0, dtype=np.int64)
    steps = 0
    for i, (rel, inv) in enumerate(plan.path):
        if steps >= cfg.max_steps:
            return KGPathResult([], steps, "step budget", [], log, 0)
        src = np.nonzero(w)[0]
        t, owner = kg.hop_triples(src, rel, inverse=inv)
        dst = (kg.head if inv else kg.tail)[t]
        w = np.bincount(dst, weights=w[src][owner], minlength=len(kg.entities))
        # earliest KB line supporting each reached entity: the deterministic tie-break
        first = np.full(len(kg.entities), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first, dst, t)
        if plan.exclude_topic:
            w[e] = 0.0
        steps += 1
        log.append({"step": steps, "relation": rel, "inverse": inv, "frontier": int(len(src)),
                    "triples": int(len(t)), "reached": int(np.count_nonzero(w))})
        if not np.any(w):
            return KGPathResult([], steps, "dead end", [], log, 0)
    reached = np.nonzero(w)[0]
    order = reached[np.lexsort((first[reached], -w[reached]))]
    answers = [kg.entities[i] for i in order]
    # evidence pack: for the best answers, the earliest triple of the last hop that reached them
    pack, tokens = [], 0
    for rank, ent in enumerate(order[: cfg.max_pack_triples], 1):
        ti = int(first[ent])
        h, r, tl = kg.entities[kg.head[ti]], kg.relations[kg.rel[ti]], kg.entities[kg.tail[ti]]
        snippet = f"{h}|{r}|{tl}"
        c = whitespace_tokens(snippet.replace("|", " "))
        if tokens + c > cfg.max_tokens:
            break
        tokens += c
        # from_triples puts the entities first, then the triples in input order
        pack.append({"rank": rank, "segment_id": seq.ids[len(kg.entities) + ti],
                     "doc_id": seq.sources[0]["id"], "kind": "triple", "triple_index": ti, "head": h,
                     "relation": r, "tail": tl, "reached": kg.entities[ent], "paths": float(w[ent]),
                     "snippet": snippet, "role": "read"})
    return KGPathResult(answers, steps, "path complete", pack, log, tokens)


def set_scores(pred: Iterable[str], golds: Sequence[str]) -> dict[str, float]:
    """Set-level precision, recall and F1 of a predicted answer set against the gold set (normalised)."""
    from ragfast.scoring.metrics import normalize_answer

    p = {normalize_answer(x) for x in pred}
    g = {normalize_answer(x) for x in golds}
    if not p or not g:
        return {"precision": 0.0, "recall": 0.0, "set_f1": 0.0}
    tp = len(p & g)
    prec, rec = tp / len(p), tp / len(g)
    return {"precision": prec, "recall": rec, "set_f1": 2 * prec * rec / (prec + rec) if tp else 0.0}


def run_kg_path(questions: Sequence[Question], seq: HSeq, *, cfg: ReloopConfig, generator: Generator | None = None,
                ledger: CostLedger | None = None, on_result: Callable[[dict[str, Any]], None] | None = None
                ) -> list[dict[str, Any]]:
    """Run the kg-path planner on MetaQA questions over a triple HSEQ (``seq.kg`` set).

    The answer comes from the evidence pack through ``generator`` (default :class:`ExtractiveHead`,
    which returns the entity the best-ranked triple reached).
    """
    if seq.kg is None:
        raise DataError("run_kg_path needs a knowledge-graph HSEQ (from ragfast.methods.reloop.hseq.from_triples)")
    ledger = ledger if ledger is not None else CostLedger()
    generator = generator or ExtractiveHead()
    rows = []
    for b0 in range(0, len(questions), cfg.batch_size):
        batch = questions[b0:b0 + cfg.batch_size]
        t_start = time.perf_counter()
        walks, plans = [], []
        for q in batch:
            t0 = time.perf_counter()
            raw = q.metadata.get("raw_question") or q.question
            plan = kg_path_plan(raw, seq.kg, topic=q.metadata.get("topic_entity"))
            res = walk_path(plan, seq, cfg)
            ledger.add("search", q.id, seconds=time.perf_counter() - t0,
                       bytes_scanned=int(sum(s["triples"] for s in res.step_log) * 24))
            plans.append(plan)
            walks.append(res)
        prompts = [render_pack(p.question, r.pack, "entity") for p, r in zip(plans, walks)]
        with blame("head", [q.id for q in batch]):
            outs = lm_complete(generator, prompts, [q.id for q in batch], stop=["\n"],
                               max_new_tokens=cfg.answer_max_new_tokens, ledger=ledger)
        wall = time.perf_counter() - t_start
        for q, plan, res, out in zip(batch, plans, walks, outs):
            em, f1v = exact_match(out.strip(), q.golden_answers), f1(out.strip(), q.golden_answers)
            row = {"id": q.id, "question": q.question, "golden_answers": list(q.golden_answers), "answer": out.strip(),
                   "em": em, "f1": f1v, "searches": res.steps, "steps": res.steps, "stop_reason": res.stop_reason,
                   "evidence_tokens": res.tokens, "turns": res.step_log, "evidence": res.pack, "plan": plan.to_dict(),
                   "answer_set_size": len(res.answers), **set_scores(res.answers, q.golden_answers),
                   "refined": False, "seconds": wall / len(batch), "cost": ledger.for_question(q.id),
                   "dataset_kind": "kg"}
            rows.append(row)
            if on_result is not None:
                on_result(row)
    return rows


_KG_CACHE: dict[tuple[str, int, float], HSeq] = {}


def metaqa_kg(path: Any = None) -> HSeq:
    """The MetaQA knowledge base as a triple HSEQ (default: the bundled ``metaqa-kb`` sample).

    Built once per file (path, size, mtime) and process: the 129k-triple KB takes about a
    second to index, and several runs in one process (tests, benchmarks) share it.
    """
    from pathlib import Path

    from ragfast.data import load_triples, sample

    p = Path(path) if path is not None else sample("metaqa-kb")
    if not p.is_file():
        raise DataError(f"knowledge base not found: {p}")
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime)
    seq = _KG_CACHE.get(key)
    if seq is None:
        seq = _KG_CACHE[key] = from_triples(load_triples(p), relations=METAQA_RELATIONS)
    return seq

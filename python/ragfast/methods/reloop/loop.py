"""RELOOP's head, verifier and drivers: answer from the pack, check it, refine once; batched text/table runs
and the end-to-end run with results on disk."""
from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, blame
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.methods.reloop.head_prompt import evidence_span, head_messages
from ragfast.methods.reloop.iterate import CachedEncoding, Track, iterate
from ragfast.methods.reloop.kg import run_kg_path
from ragfast.methods.reloop.pack import canonicalise
from ragfast.methods.reloop.planners import llm_plans, lm_complete
from ragfast.methods.reloop.workspace import Workspace, tatqa_workspace, text_workspace, workspace_key
from ragfast.scoring.metrics import exact_match, f1
from ragfast.judges.base import Judge
from ragfast.models.base import Generator
from ragfast.models.extractive import render_pack
from ragfast.methods.reloop.plan import Plan, heuristic_plan
from ragfast.methods.reloop.sufficiency import HeuristicSufficiency
from ragfast.text import YEAR_PATTERN, parse_number, words

__all__ = ["verify", "answer", "run_text", "run_questions", "check_setup", "dataset_kind", "summarise_rows"]


def verify(plan: Plan, answer_text: str, pack: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """Check an answer against the pack; ``(ok, reason)``.

    Contradictions: an empty answer; an answer of the wrong type for the stopping cue (no year
    for "when", no number for "how many"); an answer whose content words are mostly absent from
    the pack (not supported by the evidence). Computed answers (TAT-QA arithmetic) are checked
    for type only.
    """
    a = (answer_text or "").strip()
    if not a:
        return False, "empty answer"
    if plan.answer_type == "yes/no":
        return (a.lower() in ("yes", "no")), "not yes/no"
    if plan.answer_type == "year" and not YEAR_PATTERN.search(a):
        return False, "no year in the answer"
    if plan.answer_type in ("number", "percent", "money") and not re.search(r"\d", a):
        return False, "no number in the answer"
    text = " ".join(it["snippet"] for it in pack).lower()
    aw = words(a)
    if aw and parse_number(a) is None and sum(w in text for w in aw) < 0.5 * len(aw):
        return False, "answer not supported by the evidence pack"
    return True, "ok"


def answer(tracks: Sequence[Track], generator: Generator, *, ledger: CostLedger | None = None,
           max_new_tokens: int = 32) -> list[tuple[str, list[dict[str, Any]]]]:
    """Canonicalise each track's evidence and answer from the pack only (one batched call)."""
    packs = [canonicalise(t.ws, t.selected, t.context) for t in tracks]
    chat = getattr(generator, "format_chat", None)
    if chat is not None:
        # A chat LLM head: the short-answer rule as the system turn, the answer cut to a span
        # (head_prompt.py: smollm2 answered in sentences from the bare pack).
        prompts = [chat(head_messages(t.ws.question, p, t.plan.answer_type)) for t, p in zip(tracks, packs)]
    else:
        prompts = [render_pack(t.ws.question, p, t.plan.answer_type) for t, p in zip(tracks, packs)]
        # Other instruction-tuned heads read the pack as a user message through their chat
        # template; the extractive head and base LMs read it raw.
        fmt = getattr(generator, "format_prompt", None)
        if fmt is not None:
            prompts = [fmt(x) for x in prompts]
    with blame("head", [t.ws.qid for t in tracks]):
        outs = lm_complete(generator, prompts, [t.ws.qid for t in tracks], stop=["\n"],
                           max_new_tokens=max_new_tokens, ledger=ledger)
    if chat is None:
        return [(o.strip(), p) for o, p in zip(outs, packs)]
    return [(evidence_span(o, t.ws.question, p, t.plan.answer_type), p) for o, t, p in zip(outs, tracks, packs)]


def run_text(workspaces: Sequence[Workspace], *, encoder: Any, judge: Judge, generator: Generator,
             cfg: ReloopConfig, ledger: CostLedger | None = None, planner_generator: Generator | None = None,
             emb_cache: dict[str, CachedEncoding] | None = None, on_result: Callable[[dict[str, Any]], None] | None = None,
             topk_backend: str | None = None) -> list[dict[str, Any]]:
    """Run RELOOP on text/table workspaces in batches; returns one result row per question.

    Each row carries the Search-R1 loop's fields (id, question, golden_answers, answer, em, f1,
    searches = iterator steps, stop_reason, cost) plus ``steps``, ``turns`` (the step log),
    ``evidence`` (the pack with provenance), ``plan``, ``refined``, ``verifier`` and
    ``seconds`` (the question's share of its batch's wall time).
    ``on_result`` is called as soon as a row is final (results are written as they finish).
    ``emb_cache`` shares candidate embeddings between questions over one document (see
    :func:`~ragfast.methods.reloop.iterate.iterate`); a question's recorded cost is the same with
    or without it.
    """
    ledger = ledger if ledger is not None else CostLedger()
    rows: list[dict[str, Any]] = []
    for b0 in range(0, len(workspaces), cfg.batch_size):
        batch = list(workspaces[b0:b0 + cfg.batch_size])
        t_start = time.perf_counter()
        multi = batch[0].kind == "text"
        if cfg.planner == "llm":
            if planner_generator is None:
                raise ConfigError("planner 'llm' needs a generator for the plans (--planner-model)")
            with blame("planner", [w.qid for w in batch]):
                plans = llm_plans([w.question for w in batch], planner_generator, ledger=ledger,
                                  question_ids=[w.qid for w in batch], multi_doc=multi,
                                  max_new_tokens=cfg.plan_max_new_tokens)
        elif cfg.planner == "heuristic":
            plans = [heuristic_plan(w.question, multi_doc=multi) for w in batch]
        else:
            raise ConfigError("planner 'kg-path' follows knowledge-graph relation paths; it runs on MetaQA questions "
                              "(use heuristic or llm for text and tables)")
        if isinstance(judge, HeuristicSufficiency):
            for w, p in zip(batch, plans):
                judge.set_plan(w.question, p)
        tracks = [Track(w, p) for w, p in zip(batch, plans)]
        iterate(tracks, encoder, judge, cfg, ledger=ledger, emb_cache=emb_cache, topk_backend=topk_backend)
        results = answer(tracks, generator, ledger=ledger, max_new_tokens=cfg.answer_max_new_tokens)
        refined = [False] * len(tracks)
        checks: list[tuple[bool, str]] = [(True, "not run")] * len(tracks)
        if cfg.verify:
            checks = [verify(t.plan, a, p) for t, (a, p) in zip(tracks, results)]
            redo = [i for i, (ok, _) in enumerate(checks) if not ok and tracks[i].steps < cfg.max_steps]
            if redo:
                sub = [tracks[i] for i in redo]
                for t in sub:
                    t.done = False  # resume the same track: read segments stay excluded, the window moves on
                iterate(sub, encoder, judge, cfg, ledger=ledger,
                        max_steps=max(1, int(round(cfg.max_steps * cfg.refine_fraction))),
                        extra_tokens=max(1, int(cfg.max_tokens * cfg.refine_fraction)), emb_cache=emb_cache,
                        topk_backend=topk_backend)
                again = answer(sub, generator, ledger=ledger, max_new_tokens=cfg.answer_max_new_tokens)
                for i, res in zip(redo, again):
                    results[i] = res
                    refined[i] = True
                    tracks[i].stop_reason = f"refined: {tracks[i].stop_reason}"
                    checks[i] = verify(tracks[i].plan, res[0], res[1])
        wall = time.perf_counter() - t_start
        for t, (a, pack), ref, chk in zip(tracks, results, refined, checks):
            em, f1v = exact_match(a, t.ws.golden_answers), f1(a, t.ws.golden_answers)
            row = {"id": t.ws.qid, "question": t.ws.question, "golden_answers": t.ws.golden_answers, "answer": a,
                   "em": em, "f1": f1v, "searches": t.steps, "steps": t.steps, "stop_reason": t.stop_reason,
                   "evidence_tokens": t.tokens, "turns": t.step_log, "evidence": pack, "plan": t.plan.to_dict(),
                   "refined": ref, "verifier": {"ok": chk[0], "reason": chk[1]},
                   "seconds": wall / len(tracks), "cost": ledger.for_question(t.ws.qid), "dataset_kind": t.ws.kind}
            row.update({k: v for k, v in t.ws.meta.items() if k != "cache_key"})
            rows.append(row)
            if on_result is not None:
                on_result(row)
    return rows

def dataset_kind(layout: str) -> str:
    """What RELOOP walks for a data layout: ``kg`` (MetaQA), ``tatqa`` (table + text) or ``text``."""
    return "kg" if layout == "metaqa" else "tatqa" if layout == "tatqa" else "text"


def check_setup(kind: str, cfg: ReloopConfig, questions: Sequence[Any], source: str = "data") -> None:
    """Refuse a planner that cannot walk this kind of source, or text questions without context documents.

    Raises
    ------
    ConfigError, DataError
    """
    if kind == "kg" and cfg.planner != "kg-path":
        raise ConfigError(f"MetaQA questions run with --planner kg-path (got {cfg.planner!r}): the knowledge-graph "
                          "walk follows parsed relation paths; heuristic/llm plans are for text and tables")
    if kind != "kg" and cfg.planner == "kg-path":
        raise ConfigError("planner 'kg-path' follows knowledge-graph relation paths; it runs on MetaQA questions "
                          "(use heuristic or llm for text and tables)")
    if kind == "text" and not all(isinstance(q.metadata.get("context"), dict) for q in questions[:1]):
        raise DataError(f"{source}: has no per-question context documents to read; RELOOP text runs need "
                        "HotpotQA-style metadata['context']")


def run_questions(questions: Sequence[Any], kind: str, cfg: ReloopConfig, *, head: Generator, ledger: CostLedger,
                  encoder: Any = None, judge: Judge | None = None, planner_generator: Generator | None = None,
                  kg: Any = None, tatqa_docs: Sequence[dict[str, Any]] | None = None,
                  on_result: Callable[[dict[str, Any]], None] | None = None,
                  topk_backend: str | None = None) -> None:
    """RELOOP over ``questions`` of one kind, with built components; ``on_result(row)`` per finished question.

    Parameters
    ----------
    kind : {"kg", "tatqa", "text"}
        From :func:`dataset_kind`.
    kg : HSeq, optional
        The knowledge graph for ``kg`` (:func:`~ragfast.methods.reloop.kg.metaqa_kg`).
    tatqa_docs : sequence of dict, optional
        The TAT-QA documents ``question.metadata["doc_index"]`` points into.
    """
    if kind == "kg":
        run_kg_path(questions, kg, cfg=cfg, generator=head, ledger=ledger, on_result=on_result)
        return
    if kind == "tatqa":
        wss = []
        for q in questions:
            doc = tatqa_docs[q.metadata["doc_index"]]
            w = tatqa_workspace(q, doc)
            w.meta["cache_key"] = workspace_key(doc)  # questions of one document share its embeddings
            wss.append(w)
    else:
        wss = [text_workspace(q) for q in questions]
    run_text(wss, encoder=encoder, judge=judge, generator=head, cfg=cfg, ledger=ledger,
             planner_generator=planner_generator, emb_cache={}, on_result=on_result, topk_backend=topk_backend)


def summarise_rows(rows: Sequence[dict[str, Any]], wall: float) -> dict[str, Any]:
    """Means over finished questions (EM, F1, steps, evidence tokens...) plus summed costs."""
    from ragfast.accounting.ledger import sum_cost_dicts

    n = len(rows)
    if n == 0:
        return {"questions": 0}
    out = {
        "questions": n,
        "em": float(np.mean([r["em"] for r in rows])),
        "f1": float(np.mean([r["f1"] for r in rows])),
        "steps_per_question": float(np.mean([r["steps"] for r in rows])),
        "evidence_tokens_per_question": float(np.mean([r.get("evidence_tokens", 0) for r in rows])),
        "refined": int(sum(bool(r.get("refined")) for r in rows)),
        "seconds_per_question": float(np.mean([r.get("seconds", 0.0) for r in rows])),
        "wall_seconds_this_run": wall,
        "stop_reasons": dict(sorted({s: sum(r["stop_reason"] == s for r in rows)
                                     for s in {r["stop_reason"] for r in rows}}.items())),
        "cost": sum_cost_dicts(r.get("cost", {}) for r in rows),
    }
    if any("set_f1" in r for r in rows):
        for k in ("precision", "recall", "set_f1"):
            out[k] = float(np.mean([r.get(k, 0.0) for r in rows]))
    return out

"""RELOOP's head, verifier and drivers: answer from the pack, check it, refine once; batched text/table runs
and the end-to-end run with results on disk."""
from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.cost import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.methods.reloop.iterate import CachedEncoding, Track, iterate
from ragfast.methods.reloop.kg import metaqa_kg, run_kg_path
from ragfast.methods.reloop.pack import canonicalise
from ragfast.methods.reloop.planners import llm_plans, lm_complete
from ragfast.methods.reloop.workspace import Workspace, tatqa_workspace, text_workspace, workspace_key
from ragfast.metrics import exact_match, f1
from ragfast.models.base import Generator, Judge
from ragfast.models.extractive import ExtractiveHead, render_pack
from ragfast.models.plan import Plan, heuristic_plan
from ragfast.models.sufficiency import HeuristicSufficiency
from ragfast.retrieval.hashing import default_encoder
from ragfast.text import YEAR_PATTERN, parse_number, words

__all__ = ["verify", "answer", "run_text", "run"]


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
    prompts = [render_pack(t.ws.question, p, t.plan.answer_type) for t, p in zip(tracks, packs)]
    outs = lm_complete(generator, prompts, [t.ws.qid for t in tracks], stop=["\n"], max_new_tokens=max_new_tokens,
                       ledger=ledger)
    return [(o.strip(), p) for o, p in zip(outs, packs)]


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

def _judge_for(kind: str, spec: str) -> Judge:
    """``heuristic``, ``encoder`` (the trained EncoderJudge) or ``auto``.

    ``auto`` uses the EncoderJudge on text when it loads (it was trained on HotpotQA text
    states) and the heuristic rule on tables, where no trained judge exists.
    """
    if spec not in ("auto", "heuristic", "encoder"):
        raise ConfigError(f"unknown judge {spec!r}; expected auto, heuristic or encoder")
    if spec == "heuristic" or (spec == "auto" and kind != "text"):
        return HeuristicSufficiency(multi_doc=(kind == "text"))
    try:
        from ragfast.models.judge import EncoderJudge

        return EncoderJudge()
    except Exception as exc:  # not trained / not bundled yet
        if spec == "encoder":
            raise ConfigError(f"the trained EncoderJudge is not available: {exc}") from exc
        return HeuristicSufficiency(multi_doc=(kind == "text"))


def _generator_for(spec: "str | Generator | None", device: str = "cpu") -> Generator:
    if isinstance(spec, Generator):
        return spec
    if spec in (None, "", "extractive"):
        return ExtractiveHead()
    from ragfast.models.generator import HFGenerator

    return HFGenerator(spec, device=device)


def _spec_name(spec: Any) -> str:
    if isinstance(spec, Generator):
        return getattr(spec, "name", type(spec).__name__)
    return spec or "extractive"


def _summary(rows: Sequence[dict[str, Any]], wall: float, ledger: CostLedger) -> dict[str, Any]:
    from ragfast.cost import sum_cost_dicts

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


def run(data: str, out_dir: str, cfg: ReloopConfig, *, kb: str | None = None, limit: int | None = None,
        resume: bool = False, encoder: str = "minilm", judge: str = "auto", generator: "str | Generator | None" = None,
        planner_model: "str | Generator | None" = None, device: str = "cpu", progress: bool = True,
        topk_backend: str | None = None) -> dict[str, Any]:
    """Run RELOOP on a QA file or sample and write ``results.jsonl``, ``manifest.json``, ``summary.json``.

    The dataset kind comes from the file's layout: MetaQA questions run on the knowledge graph
    (``kb`` or the bundled MetaQA KB), TAT-QA on each document's table and paragraphs, HotpotQA
    (and any layout with ``metadata["context"]``) on the question's context documents.

    Parameters
    ----------
    data : str
        A QA file path or a bundled sample name (``hotpotqa-dev``, ``tatqa-dev``, ``metaqa-3hop``...).
    out_dir : str
        Output directory; results are appended as questions finish.
    cfg : ReloopConfig
    kb : str, optional
        Triple file for MetaQA questions (default: the bundled ``metaqa-kb``).
    limit : int, optional
        First ``limit`` questions only.
    resume : bool
        Continue an interrupted run in ``out_dir`` (finished questions are skipped).
    encoder : {"minilm", "hashing"}
        Dense scorer of the iterator.
    judge : {"auto", "heuristic", "encoder"}
    generator : str or Generator, optional
        ``extractive`` (default, not an LLM), a local causal-LM directory, or a Generator instance
        for the head.
    planner_model : str or Generator, optional
        Local causal-LM directory (or Generator) for ``--planner llm``.

    Returns
    -------
    dict
        The summary (also written to ``summary.json``).
    """
    from pathlib import Path

    from ragfast.data import SAMPLES, detect_layout, load_qa, sample
    from ragfast.results import ResultsWriter, read_results, slot_entry, write_manifest

    path = sample(data) if data in SAMPLES else Path(data)
    if not Path(path).exists():
        raise DataError(f"no such data file or sample: {data!r} (samples: {', '.join(SAMPLES)})")
    layout = detect_layout(path)
    questions = load_qa(path, limit=limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ledger = CostLedger()
    head = _generator_for(generator, device)
    if layout == "metaqa":
        kind = "kg"
        if cfg.planner != "kg-path":
            raise ConfigError(f"MetaQA questions run with --planner kg-path (got {cfg.planner!r}): the knowledge-graph "
                              "walk follows parsed relation paths; heuristic/llm plans are for text and tables")
        slots = {"planner": {"name": "kg-path template parser (deterministic)", "meaningful": True},
                 "iterator": {"name": "CSR relation hops over the MetaQA KB", "meaningful": True},
                 "head": head}
    else:
        kind = "tatqa" if layout == "tatqa" else "text"
        if cfg.planner == "kg-path":
            raise ConfigError("planner 'kg-path' follows knowledge-graph relation paths; it runs on MetaQA questions "
                              "(use heuristic or llm for text and tables)")
        if kind == "text" and not all(isinstance(q.metadata.get("context"), dict) for q in questions[:1]):
            raise DataError(f"{path}: layout {layout!r} has no per-question context documents to read; RELOOP text "
                            "runs need HotpotQA-style metadata['context']")
        enc = default_encoder(encoder)
        jd = _judge_for(kind, judge)
        # one model instance when the planner and the head are the same checkpoint
        plan_gen = (head if planner_model is not None and planner_model == generator else
                    _generator_for(planner_model, device)) if cfg.planner == "llm" else None
        if cfg.planner == "llm" and planner_model is None:
            raise ConfigError("--planner llm needs --planner-model PATH (a local causal LM); none is bundled")
        slots = {"planner": plan_gen if plan_gen is not None else
                 {"name": f"{cfg.planner} question templates", "meaningful": True},
                 "encoder": enc, "judge": jd, "head": head}
    write_manifest(out, pipeline="reloop", slots=slots, config={**asdict(cfg), "kind": kind, "encoder": encoder,
                                                                   "judge": judge,
                                                                   "generator": _spec_name(generator)},
                   seed=0, extra={"data": str(path), "layout": layout, "limit": limit, "kb": kb})
    res_path = out / "results.jsonl"
    t0 = time.perf_counter()
    with ResultsWriter(res_path, resume=resume) as writer:
        todo = [q for q in questions if q.id not in writer.done]
        bar = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"reloop {kind}", total=len(todo))

        def on_result(row: dict[str, Any]) -> None:
            writer.write(row)
            if bar is not None:
                bar.advance(task)

        try:
            if kind == "kg":
                seq = metaqa_kg(kb)
                run_kg_path(todo, seq, cfg=cfg, generator=head, ledger=ledger, on_result=on_result)
            else:
                if kind == "tatqa":
                    docs = json.loads(Path(path).read_text(encoding="utf-8"))
                    docs = docs if isinstance(docs, list) else docs["data"]
                    wss = []
                    for q in todo:
                        doc = docs[q.metadata["doc_index"]]
                        w = tatqa_workspace(q, doc)
                        w.meta["cache_key"] = workspace_key(doc)
                        wss.append(w)
                else:
                    wss = [text_workspace(q) for q in todo]
                run_text(wss, encoder=enc, judge=jd, generator=head, cfg=cfg, ledger=ledger,
                         planner_generator=plan_gen, emb_cache={}, on_result=on_result, topk_backend=topk_backend)
        finally:
            if bar is not None:
                bar.stop()
    wall = time.perf_counter() - t0
    rows = read_results(res_path)
    summary = {"data": str(path), "kind": kind, "planner": cfg.planner,
               "slots": {k: (v if isinstance(v, dict) else slot_entry(v)) for k, v in slots.items()},
               **_summary(rows, wall, ledger)}
    summary["answers_meaningful"] = bool(getattr(head, "meaningful", True))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    # this run's records only (a resumed run adds a second file rather than overwriting)
    ledger.save(out / ("ledger.jsonl" if not resume else f"ledger.resume-{int(time.time())}.jsonl"))
    return summary

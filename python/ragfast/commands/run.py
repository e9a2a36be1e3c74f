"""``ragfast run ...``: run a multi-round RAG pipeline over a QA file and write its trajectories.

``run_app`` is the shared ``ragfast run`` group: other pipelines add their commands to it from
their own modules (``from ragfast.commands.run import run_app; run_app.command("reloop")(fn)``).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from ragfast.errors import ConfigError

run_app = typer.Typer(help="Run a multi-round RAG pipeline over a QA file (results as JSONL, resumable).",
                      no_args_is_help=True)

__all__ = ["run_app", "register", "make_generator", "make_retriever", "run_searchr1_command", "summarise"]


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def make_generator(model: str, *, seed: int = 0, device: str = "cpu", dtype: str | None = None,
                   batch_size: int = 64, max_context: int | None = None, served_model: str | None = None,
                   tokenizer: str | None = None, api_key: str | None = None, concurrency: int = 16,
                   max_turns: int = 4) -> Any:
    """The reasoner for ``--model``: ``scripted``, ``tiny``, a local directory, or a server URL.

    Raises
    ------
    ConfigError
        When ``model`` is none of these.
    """
    from ragfast.models.generator import HFGenerator, OpenAIGenerator, ScriptedGenerator

    if model == "scripted":
        return ScriptedGenerator(seed=seed, max_searches=max_turns)
    if model == "tiny":
        from ragfast.models.tiny import tiny_path

        return HFGenerator(tiny_path("qwen2"), device=device, dtype=dtype, max_batch=batch_size,
                           max_context=max_context)
    if _is_url(model):
        if not served_model:
            raise ConfigError("--model URL needs --served-model NAME (the model name the server serves)")
        return OpenAIGenerator(model, served_model, api_key=api_key, concurrency=concurrency, tokenizer=tokenizer,
                               seed=seed)
    p = Path(model)
    if p.is_dir():
        return HFGenerator(p, device=device, dtype=dtype, max_batch=batch_size, max_context=max_context)
    raise ConfigError(f"--model {model!r} is not 'scripted', 'tiny', an http(s) URL or a local model directory")


def make_retriever(spec: str, questions: Sequence[Any], *, corpus: str | None = None, device: str = "cpu",
                   progress: bool = True) -> Any:
    """The retriever for ``--retriever``: ``default``, ``bm25``, an index path, or a server URL.

    ``default`` is MiniLM over the corpus built from the questions' contexts (or ``corpus``),
    embedded once and cached on disk.
    """
    if _is_url(spec):
        from ragfast.retrieval import RemoteRetriever

        return RemoteRetriever(spec)

    def _corpus():
        from ragfast.data import corpus_from_contexts, load_corpus

        return load_corpus(corpus) if corpus else corpus_from_contexts(questions)

    if spec == "default":
        from ragfast.retrieval import build_default_retriever

        return build_default_retriever(_corpus(), device=device, progress=progress)
    if spec == "bm25":
        from ragfast.retrieval.server import load_retriever

        return load_retriever(_corpus(), None, "bm25", device=device, progress=progress)
    p = Path(spec)
    if p.exists():
        from ragfast.retrieval.server import load_retriever

        return load_retriever(_corpus(), p, device=device, progress=progress)
    raise ConfigError(f"--retriever {spec!r} is not 'default', 'bm25', an existing index path or an http(s) URL")


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """EM, F1, searches/question and question count over finished results records."""
    n = len(records)
    if n == 0:
        return {"questions": 0, "em": 0.0, "f1": 0.0, "searches_per_question": 0.0}
    return {"questions": n, "em": sum(float(r["em"]) for r in records) / n,
            "f1": sum(float(r["f1"]) for r in records) / n,
            "searches_per_question": sum(int(r["searches"]) for r in records) / n}


def run_searchr1_command(*, model: str, retriever: str, data: str, out: str, limit: int | None = None,
                         resume: bool = False, batch_size: int = 64, max_turns: int = 4, topk: int = 3,
                         seed: int = 0, max_new_tokens: int = 500, max_obs_tokens: int = 500,
                         prompt_budget: int = 4096, corpus: str | None = None, served_model: str | None = None,
                         tokenizer: str | None = None, device: str = "cpu", dtype: str | None = None,
                         threads: int | None = None, refill: bool = False, progress: bool = True,
                         console: Any = None) -> dict[str, Any]:
    """What ``ragfast run searchr1`` does; returns the summary it prints.

    Writes ``OUT/results.jsonl`` (one trajectory per line, as questions finish),
    ``OUT/manifest.json`` (which model filled each slot, config, seed) and
    ``OUT/summary.json``. With ``resume`` the finished ids are skipped; a partial last line from
    a crash is cut off first.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ragfast.cost import CostLedger
    from ragfast.data import load_qa
    from ragfast.pipelines.searchr1 import SearchR1Config, SearchR1Loop
    from ragfast.results import ResultsWriter, read_results, slot_entry, write_manifest

    con = console or Console(stderr=True)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = SearchR1Config(max_turns=max_turns, topk=topk, max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens,
                         prompt_budget=prompt_budget, batch_size=batch_size, seed=seed, refill=refill)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    all_questions = load_qa(data)
    questions = all_questions[:limit] if limit else all_questions
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    if results_path.exists() and results_path.stat().st_size > 0 and not resume:
        raise ConfigError(f"{results_path} already holds results: pass --resume to continue, or another --out")

    gen = make_generator(model, seed=seed, device=device, dtype=dtype, batch_size=batch_size,
                         max_context=prompt_budget, served_model=served_model, tokenizer=tokenizer,
                         max_turns=max_turns)
    # The corpus comes from every question of the file, not just the first --limit ones, so the
    # document ids and the distractors do not depend on --limit.
    ret = make_retriever(retriever, all_questions, corpus=corpus, device=device, progress=progress)
    slots = {"reasoner": slot_entry(gen), "retriever": slot_entry(ret)}
    write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed,
                   extra={"data": str(data), "model_arg": model, "retriever_arg": retriever})
    for name, d in slots.items():
        verdict = "yes" if d["meaningful"] else "NO"
        con.print(f"{name}: {d.get('name')} ({d.get('class')})  meaningful: {verdict}"
                  + (f"  [{d['note']}]" if d.get("note") else ""))

    ledger = CostLedger()
    loop = SearchR1Loop(gen, ret, cfg, ledger=ledger)
    t0 = time.perf_counter()
    with ResultsWriter(results_path, resume=resume) as writer:
        if writer.repaired_bytes:
            con.print(f"[yellow]cut a partial last line ({writer.repaired_bytes} bytes) left by an interrupted run[/]")
        todo = [q for q in questions if q.id not in writer.done]
        if resume:
            con.print(f"resume: {len(questions) - len(todo)} of {len(questions)} questions already done")
        with Progress(TextColumn("searchr1"), BarColumn(), MofNCompleteColumn(), TextColumn("EM {task.fields[em]:.3f}"),
                      TimeRemainingColumn(), console=con, disable=not progress) as bar:
            task = bar.add_task("searchr1", total=len(todo), em=0.0)
            ems: list[float] = []

            def on_finish(traj):
                writer.write(traj.to_dict())
                ems.append(traj.em)
                bar.update(task, advance=1, em=sum(ems) / len(ems))

            loop.run(todo, on_finish=on_finish)
        done_now = writer.written
    wall = time.perf_counter() - t0
    want = {q.id for q in questions}
    records = [r for r in read_results(results_path) if r["id"] in want]
    s = summarise(records)
    tot = ledger.totals()
    summary = {
        **s, "this_run_questions": done_now, "seconds": wall,
        "questions_per_second": done_now / wall if wall > 0 and done_now else 0.0,
        "seconds_per_component": {c: row["seconds"] for c, row in tot.items() if c != "total"},
        "cost": tot, "slots": slots,
        "answers_meaningful": all(d["meaningful"] for d in slots.values()),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    ledger.save(out_dir / f"ledger-{int(time.time())}.jsonl")
    comp = "  ".join(f"{c} {sec:.2f}s" for c, sec in summary["seconds_per_component"].items())
    line = (f"searchr1: {s['questions']} questions ({done_now} this run)  {summary['questions_per_second']:.2f} q/s  "
            f"{s['searches_per_question']:.2f} searches/q  EM {s['em']:.4f}  F1 {s['f1']:.4f}  |  {comp}")
    print(line)
    if not summary["answers_meaningful"]:
        bad = [f"{k} = {d.get('name')}" for k, d in slots.items() if not d["meaningful"]]
        print("NOTE: answers are NOT meaningful (" + "; ".join(bad) + ")"
              + (": scripted evidence oracle, EM measures evidence reachability, not reasoning"
                 if model == "scripted" else ""))
    return summary


@run_app.command("searchr1")
def searchr1_cmd(
    model: str = typer.Option(..., "--model", help="scripted | tiny | a local model directory | an http(s) "
                                                    "URL of an OpenAI-compatible server (vLLM, SGLang)."),
    data: str = typer.Option(..., "--data", help="QA file (HotpotQA, FlashRAG, Search-R1 parquet...) or a "
                                                  "sample name such as hotpotqa-dev."),
    out: str = typer.Option(..., "--out", help="Output directory: results.jsonl, manifest.json, summary.json."),
    retriever: str = typer.Option("default", "--retriever",
                                  help="default (MiniLM over the data's contexts) | bm25 | an index path | "
                                       "an http(s) URL of a Search-R1 retrieval server."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N questions."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT/results.jsonl, skipping finished ids."),
    batch_size: int = typer.Option(64, "--batch-size", help="Questions run together through the loop."),
    max_turns: int = typer.Option(4, "--max-turns", help="Search-enabled turns (reference: 4)."),
    topk: int = typer.Option(3, "--topk", help="Documents per search (reference: 3)."),
    seed: int = typer.Option(0, "--seed"),
    max_new_tokens: int = typer.Option(500, "--max-new-tokens", help="New tokens per turn (reference: 500)."),
    max_obs_tokens: int = typer.Option(500, "--max-obs-tokens", help="Observation cap in tokens (reference: 500)."),
    prompt_budget: int = typer.Option(4096, "--prompt-budget", help="Context cap in tokens (reference: 4096)."),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="Corpus jsonl for the retriever "
                                                                "(default: the data's own contexts)."),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="Model name on the server (URL models)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Local tokenizer of a served model "
                                                                      "(chat template, token-exact truncation)."),
    device: str = typer.Option("cpu", "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: checkpoint's)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
    refill: bool = typer.Option(False, "--refill", help="Continuous batching: start a queued question as soon as "
                                                         "one finishes (same trajectories, fuller batches)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
) -> None:
    """Run Search-R1 (exact prompt, 4 search turns + a final answer-only turn, top-3) and write trajectories."""
    run_searchr1_command(model=model, retriever=retriever, data=data, out=out, limit=limit, resume=resume,
                         batch_size=batch_size, max_turns=max_turns, topk=topk, seed=seed,
                         max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens, prompt_budget=prompt_budget,
                         corpus=corpus, served_model=served_model, tokenizer=tokenizer, device=device, dtype=dtype,
                         threads=threads, refill=refill, progress=not no_progress)


def register(app: typer.Typer) -> None:
    """Add the shared ``run`` group (with every command other modules put on ``run_app``)."""
    app.add_typer(run_app, name="run")

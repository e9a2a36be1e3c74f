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
from ragfast.results import summarise

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
        from ragfast.retrieval.remote import check_reachable

        check_reachable(model, "--model server")
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
        from ragfast.retrieval.remote import check_reachable

        check_reachable(spec, "--retriever server")
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


def _abs_if_path(spec: str | None) -> str | None:
    """``spec`` made absolute when it names an existing local path (Ray actors may run elsewhere)."""
    if spec is None or _is_url(spec):
        return spec
    p = Path(spec)
    return str(p.resolve()) if p.exists() else spec


def _ordered(records: Sequence[dict[str, Any]], questions: Sequence[Any]) -> list[dict[str, Any]]:
    """The records of ``questions``, in question order (the summary must not depend on finish order)."""
    by_id = {str(r["id"]): r for r in records}
    return [by_id[q.id] for q in questions if q.id in by_id]


def _print_slots(con: Any, slots: dict[str, Any]) -> None:
    for name, d in slots.items():
        verdict = "yes" if d["meaningful"] else "NO"
        con.print(f"{name}: {d.get('name')} ({d.get('class')})  meaningful: {verdict}"
                  + (f"  [{d['note']}]" if d.get("note") else ""))


def _finish(*, out_dir: Path, model: str, s: dict[str, Any], done_now: int, wall: float, ledger: Any,
            slots: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``summary.json`` and the ledger, print the summary line; shared by both run paths."""
    tot = ledger.totals()
    summary = {
        **s, "this_run_questions": done_now, "seconds": wall,
        "questions_per_second": done_now / wall if wall > 0 and done_now else 0.0,
        "seconds_per_component": {c: row["seconds"] for c, row in tot.items() if c != "total"},
        "cost": tot, "slots": slots,
        "answers_meaningful": bool(slots) and all(d["meaningful"] for d in slots.values()),
        **(extra or {}),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    ledger.save(out_dir / f"ledger-{int(time.time())}.jsonl")
    comp = "  ".join(f"{c} {sec:.2f}s" for c, sec in summary["seconds_per_component"].items())
    line = (f"searchr1: {s['questions']} questions ({done_now} this run)  {summary['questions_per_second']:.2f} q/s  "
            f"{s['searches_per_question']:.2f} searches/q  EM {s['em']:.4f}  F1 {s['f1']:.4f}  |  {comp}")
    print(line)
    if not slots:
        print(f"NOTE: {out_dir / 'manifest.json'} is missing, so which models filled the slots is unknown")
    elif not summary["answers_meaningful"]:
        bad = [f"{k} = {d.get('name')}" for k, d in slots.items() if not d["meaningful"]]
        print("NOTE: answers are NOT meaningful (" + "; ".join(bad) + ")"
              + (": scripted evidence oracle, EM measures evidence reachability, not reasoning"
                 if model == "scripted" else ""))
    return summary


def run_searchr1_command(*, model: str, retriever: str, data: str, out: str, limit: int | None = None,
                         resume: bool = False, batch_size: int = 64, max_turns: int = 4, topk: int = 3,
                         seed: int = 0, max_new_tokens: int = 500, max_obs_tokens: int = 500,
                         prompt_budget: int = 4096, corpus: str | None = None, served_model: str | None = None,
                         tokenizer: str | None = None, device: str | None = None, dtype: str | None = None,
                         threads: int | None = None, refill: bool = False, progress: bool = True,
                         console: Any = None, ray: str | None = None, ray_workers: int | None = None
                         ) -> dict[str, Any]:
    """What ``ragfast run searchr1`` does; returns the summary it prints.

    Writes ``OUT/results.jsonl`` (one trajectory per line, as questions finish),
    ``OUT/manifest.json`` (which model filled each slot, config, seed), ``OUT/summary.json``
    and ``OUT/ledger-<time>.jsonl`` (this run's cost records). With ``resume`` the finished ids
    are skipped; a partial last line from a crash is cut off first.

    Parameters
    ----------
    model, retriever, corpus, served_model, tokenizer, dtype
        The slots, as for :func:`make_generator` and :func:`make_retriever`.
    data : str
        QA file or sample name. The retriever's corpus is built from all of its questions.
    out : str
        Output directory.
    limit : int, optional
        Run only the first ``limit`` questions.
    resume : bool
        Continue ``OUT/results.jsonl``.
    batch_size, max_turns, topk, seed, max_new_tokens, max_obs_tokens, prompt_budget, refill
        :class:`~ragfast.methods.searchr1.loop.SearchR1Config` settings.
    device : str, optional
        Device of this process's models (default ``"cpu"``). Not allowed with ``ray``: each
        Ray actor uses ``cuda`` when Ray gives it a GPU, else ``cpu``.
    threads : int, optional
        torch CPU threads of this process. Not allowed with ``ray`` (an actor's threads follow
        its Ray CPUs).
    progress : bool
        Show a progress bar.
    console : rich.console.Console, optional
        Where messages go (default: stderr).
    ray : str, optional
        Run on Ray (:func:`ragfast.distributed.run_on_ray`): ``"local"`` starts a local cluster
        and shuts it down afterwards; anything else is a cluster address. The questions are cut
        into batches of ``batch_size``, run by ``ray_workers`` reasoner replicas against one
        shared retriever actor; the files written and the per-question records are the same as
        a single-process run's (timing aside), with results in question order.
    ray_workers : int, optional
        Reasoner replicas (Ray worker actors) with ``ray``; default 2.

    Returns
    -------
    dict
        What ``summary.json`` holds.

    Raises
    ------
    ConfigError
        Bad options, or ``OUT`` holds results and ``resume`` is False.
    DataError
        Bad data, or ``resume`` with a configuration other than the manifest's.
    """
    from rich.console import Console

    from ragfast.data import load_qa
    from ragfast.methods.searchr1.loop import SearchR1Config

    con = console or Console(stderr=True)
    if ray is None:
        if ray_workers is not None:
            raise ConfigError("--ray-workers needs --ray ADDRESS ('local' or a Ray cluster address)")
    else:
        if not isinstance(ray, str) or not ray.strip():
            raise ConfigError(f"--ray must be 'local' or a Ray cluster address, got {ray!r}")
        if ray_workers is None:
            ray_workers = 2
        if isinstance(ray_workers, bool) or not isinstance(ray_workers, int) or ray_workers < 1:
            raise ConfigError(f"--ray-workers must be an integer >= 1, got {ray_workers!r}")
        if device is not None:
            raise ConfigError("--device cannot be used with --ray: Ray places each actor, and an actor that "
                              "holds a GPU runs on cuda, any other on cpu")
        if threads is not None:
            raise ConfigError("--threads cannot be used with --ray: each Ray actor's torch threads follow the "
                              "CPUs Ray gives it")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    cfg = SearchR1Config(max_turns=max_turns, topk=topk, max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens,
                         prompt_budget=prompt_budget, batch_size=batch_size, seed=seed, refill=refill)
    all_questions = load_qa(data)
    questions = all_questions[:limit] if limit else all_questions
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    if results_path.exists() and results_path.stat().st_size > 0 and not resume:
        raise ConfigError(f"{results_path} already holds results: pass --resume to continue, or another --out")
    common = dict(model=model, retriever=retriever, data=data, out_dir=out_dir, resume=resume, seed=seed,
                  dtype=dtype, batch_size=batch_size, prompt_budget=prompt_budget, served_model=served_model,
                  tokenizer=tokenizer, max_turns=max_turns, corpus=corpus, progress=progress, con=con, cfg=cfg,
                  all_questions=all_questions, questions=questions)
    if ray is not None:
        return _run_on_ray(ray=ray, ray_workers=ray_workers, **common)
    return _run_here(device=device or "cpu", **common)


def _progress_bar(con: Any, progress: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("searchr1"), BarColumn(), MofNCompleteColumn(), TextColumn("EM {task.fields[em]:.3f}"),
                    TimeRemainingColumn(), console=con, disable=not progress)


def _run_here(*, model: str, retriever: str, data: str, out_dir: Path, resume: bool, seed: int, dtype: str | None,
              batch_size: int, prompt_budget: int, served_model: str | None, tokenizer: str | None, max_turns: int,
              corpus: str | None, progress: bool, con: Any, cfg: Any, all_questions: list[Any],
              questions: list[Any], device: str) -> dict[str, Any]:
    """The single-process run: both models in this process, one :class:`SearchR1Loop`."""
    from ragfast.cost import CostLedger
    from ragfast.methods.searchr1.loop import SearchR1Loop
    from ragfast.results import ResultsWriter, read_results, slot_entry, write_manifest

    results_path = out_dir / "results.jsonl"
    gen = make_generator(model, seed=seed, device=device, dtype=dtype, batch_size=batch_size,
                         max_context=prompt_budget, served_model=served_model, tokenizer=tokenizer,
                         max_turns=max_turns)
    # The corpus comes from every question of the file, not just the first --limit ones, so the
    # document ids and the distractors do not depend on --limit.
    ret = make_retriever(retriever, all_questions, corpus=corpus, device=device, progress=progress)
    slots = {"reasoner": slot_entry(gen), "retriever": slot_entry(ret)}
    write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed,
                   extra={"data": str(data), "model_arg": model, "retriever_arg": retriever})
    _print_slots(con, slots)

    ledger = CostLedger()
    loop = SearchR1Loop(gen, ret, cfg, ledger=ledger)
    t0 = time.perf_counter()
    with ResultsWriter(results_path, resume=resume) as writer:
        if writer.repaired_bytes:
            con.print(f"[yellow]cut a partial last line ({writer.repaired_bytes} bytes) left by an interrupted run[/]")
        todo = [q for q in questions if q.id not in writer.done]
        if resume:
            con.print(f"resume: {len(questions) - len(todo)} of {len(questions)} questions already done")
        with _progress_bar(con, progress) as bar:
            task = bar.add_task("searchr1", total=len(todo), em=0.0)
            ems: list[float] = []

            def on_finish(traj):
                writer.write(traj.to_dict())
                ems.append(traj.em)
                bar.update(task, advance=1, em=sum(ems) / len(ems))

            loop.run(todo, on_finish=on_finish)
        done_now = writer.written
    wall = time.perf_counter() - t0
    s = summarise(_ordered(read_results(results_path), questions))
    return _finish(out_dir=out_dir, model=model, s=s, done_now=done_now, wall=wall, ledger=ledger, slots=slots)


def _manifest_slot(info: dict[str, Any]) -> dict[str, Any]:
    """A slot entry (as :func:`ragfast.results.slot_entry` makes) from an actor's describe()."""
    d = {k: v for k, v in info.items() if k != "pid"}  # the pid changes from run to run
    d.setdefault("meaningful", True)
    d["answers_meaningful"] = "yes" if d["meaningful"] else "NO (exercises the compute path only)"
    return d


def _check_resumable(out_dir: Path, cfg: Any, seed: int) -> None:
    """Refuse, before any Ray actor starts, to resume a run made with another configuration."""
    from ragfast.errors import DataError
    from ragfast.results import _json_default, read_manifest

    path = out_dir / "manifest.json"
    if not path.exists():
        return
    old = read_manifest(out_dir)
    new = {"pipeline": "searchr1", "config": json.loads(json.dumps(cfg.to_dict(), default=_json_default)),
           "seed": int(seed)}
    for key, value in new.items():
        if old.get(key) != value:
            raise DataError(f"{path}: {key} differs from the run being resumed ({old.get(key)!r} != {value!r}); "
                            "use a new --out directory")


def _run_on_ray(*, model: str, retriever: str, data: str, out_dir: Path, resume: bool, seed: int, dtype: str | None,
                batch_size: int, prompt_budget: int, served_model: str | None, tokenizer: str | None,
                max_turns: int, corpus: str | None, progress: bool, con: Any, cfg: Any, all_questions: list[Any],
                questions: list[Any], ray: str, ray_workers: int) -> dict[str, Any]:
    """The Ray run: :func:`ragfast.distributed.run_on_ray` with this module's slot factories.

    The factories are ``functools.partial`` objects of the module-level :func:`make_generator`
    and :func:`make_retriever`, so Ray ships them by reference; each actor calls them with its
    own ``device``. Local paths are made absolute first, since actors need not share this
    process's working directory.
    """
    import functools
    import warnings

    from ragfast.distributed import run_on_ray
    from ragfast.results import finished_ids, read_manifest, repair_tail, write_manifest

    results_path = out_dir / "results.jsonl"
    if resume:
        _check_resumable(out_dir, cfg, seed)
        cut = repair_tail(results_path)
        if cut:
            con.print(f"[yellow]cut a partial last line ({cut} bytes) left by an interrupted run[/]")
    done_before = finished_ids(results_path) if resume else set()
    n_todo = sum(q.id not in done_before for q in questions)
    if resume:
        con.print(f"resume: {len(questions) - n_todo} of {len(questions)} questions already done")

    model_arg = model if model in ("scripted", "tiny") else _abs_if_path(model)
    retriever_arg = retriever if retriever in ("default", "bm25") else _abs_if_path(retriever)
    gen_f = functools.partial(make_generator, model_arg, seed=seed, dtype=dtype, batch_size=batch_size,
                              max_context=prompt_budget, served_model=served_model,
                              tokenizer=_abs_if_path(tokenizer), max_turns=max_turns)
    # As in the single-process run, the corpus comes from every question of the file.
    ret_f = functools.partial(make_retriever, retriever_arg, all_questions, corpus=_abs_if_path(corpus),
                              progress=False)
    slots: dict[str, Any] = {}
    ray_info: dict[str, Any] = {"address": ray, "workers_requested": ray_workers}
    clock: dict[str, float] = {}
    ems: list[float] = []

    def show_warning(message, category, filename, lineno, file=None, line=None):
        con.print(f"[yellow]warning:[/] {str(message).replace('config.batch_size', '--batch-size')}")

    with _progress_bar(con, progress) as bar:
        task = bar.add_task("searchr1", total=n_todo, em=0.0)

        def on_start(info: dict[str, Any]) -> None:
            # The actors are up: write the manifest before any batch runs, as the single-process run does.
            slots.update(reasoner=_manifest_slot(info["reasoner"]), retriever=_manifest_slot(info["retriever"]))
            ray_info.update(workers=info["workers"], worker_gpus=info["worker_gpus"], batches=info["batches"])
            write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed,
                           extra={"data": str(data), "model_arg": model, "retriever_arg": retriever,
                                  "ray": {"address": ray, "workers": info["workers"],
                                          "worker_gpus": info["worker_gpus"]}})
            _print_slots(con, slots)
            con.print(f"ray: {info['workers']} worker(s) at {ray!r}, {info['batches']} batch(es) of up to "
                      f"{batch_size} questions")
            clock["start"] = time.perf_counter()

        def on_result(rec: dict[str, Any]) -> None:
            ems.append(float(rec["em"]))
            bar.update(task, advance=1, em=sum(ems) / len(ems))
            clock["last"] = time.perf_counter()

        with warnings.catch_warnings():
            # run_on_ray's RuntimeWarnings (idle workers, a cluster too small) as one line each.
            warnings.simplefilter("always", RuntimeWarning)
            warnings.showwarning = show_warning
            res = run_on_ray(questions, make_generator=gen_f, make_retriever=ret_f, config=cfg,
                             out_path=results_path, address=ray, num_workers=ray_workers, resume=resume,
                             on_result=on_result, on_start=on_start)
    if not slots and (out_dir / "manifest.json").exists():
        slots = dict(read_manifest(out_dir).get("slots", {}))  # nothing was left to run
    # Throughput over the batches (actors up to last result), comparable with the single-process
    # run's loop time; the whole distributed part, actor start-up included, is kept as well.
    wall = clock["last"] - clock["start"] if "last" in clock and "start" in clock else 0.0
    ray_info.update(batches_run=res.batches, retried_batches=res.retried_batches,
                    restarted_batches=res.restarted_batches, rpc_seconds=res.rpc_seconds,
                    seconds_with_startup=res.seconds)
    if res.batches:
        con.print(f"ray: {res.batches} batch(es) on {ray_info.get('workers')} worker(s), "
                  f"{res.retried_batches} resubmitted after a lost actor, {res.restarted_batches} finished by "
                  f"an actor Ray restarted; {res.seconds:.1f}s with actor start-up")
    return _finish(out_dir=out_dir, model=model, s=dict(res.summary), done_now=res.questions_done, wall=wall,
                   ledger=res.ledger, slots=slots, extra={"ray": ray_info})


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
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue OUT/results.jsonl, skipping finished ids."),
    batch_size: int = typer.Option(64, "--batch-size", help="Questions run together through the loop."),
    max_turns: int = typer.Option(4, "--max-turns", help="Search-enabled turns (reference: 4)."),
    topk: int = typer.Option(3, "--topk", help="Documents per search (reference: 3)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the scripted reasoner, the bootstrap and sampling."),
    max_new_tokens: int = typer.Option(500, "--max-new-tokens", help="New tokens per turn (reference: 500)."),
    max_obs_tokens: int = typer.Option(500, "--max-obs-tokens", help="Observation cap in tokens (reference: 500)."),
    prompt_budget: int = typer.Option(4096, "--prompt-budget", help="Context cap in tokens (reference: 4096)."),
    corpus: Optional[str] = typer.Option(None, "--corpus", help="Corpus jsonl for the retriever "
                                                                "(default: the data's own contexts)."),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="Model name on the server (URL models)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Local tokenizer of a served model "
                                                                      "(chat template, token-exact truncation)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default cpu). Not with --ray: there an "
                                                                 "actor holding a GPU uses cuda, any other cpu."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: checkpoint's)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
    refill: bool = typer.Option(False, "--refill", help="Continuous batching: start a queued question as soon as "
                                                         "one finishes (same trajectories, fuller batches)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS",
                                      help="Run on Ray: 'local' starts a local cluster (shut down afterwards), "
                                           "anything else is a cluster address (auto, ray://HOST:10001). Batches "
                                           "of --batch-size questions go to --ray-workers reasoner replicas that "
                                           "share one retriever actor; local paths must exist on the Ray nodes."),
    ray_workers: Optional[int] = typer.Option(None, "--ray-workers", metavar="N",
                                              help="Reasoner replicas (Ray worker actors) with --ray; default 2. "
                                                   "Each runs whole batches: keep --batch-size <= questions / N."),
) -> None:
    """Run Search-R1 (exact prompt, 4 search turns + a final answer-only turn, top-3) and write trajectories.

    With --ray the questions run on Ray actors; the files and per-question records are the same.
    """
    from ragfast.outdir import output_dir

    with output_dir(out):
        run_searchr1_command(model=model, retriever=retriever, data=data, out=out, limit=limit, resume=resume,
                             batch_size=batch_size, max_turns=max_turns, topk=topk, seed=seed,
                             max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens, prompt_budget=prompt_budget,
                             corpus=corpus, served_model=served_model, tokenizer=tokenizer, device=device, dtype=dtype,
                             threads=threads, refill=refill, progress=not no_progress, ray=ray,
                             ray_workers=ray_workers)


def register(app: typer.Typer) -> None:
    """Add the shared ``run`` group (with every command other modules put on ``run_app``)."""
    app.add_typer(run_app, name="run")

"""``ragfast run ...``: run a multi-round RAG pipeline over a QA file and write its trajectories.

``run_app`` is the shared ``ragfast run`` group: other pipelines add their commands to it from
their own modules (``from ragfast.commands.run import run_app; run_app.command("reloop")(fn)``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from ragfast.commands import options as opt
from ragfast.errors import ConfigError
from ragfast.results import summarise
from ragfast.runner.slots import DEFAULTS

run_app = typer.Typer(help="Run a multi-round RAG pipeline over a QA file (results as JSONL, resumable).",
                      no_args_is_help=True)

__all__ = ["run_app", "register", "run_searchr1_command", "summarise"]


def _ordered(records: Sequence[dict[str, Any]], questions: Sequence[Any]) -> list[dict[str, Any]]:
    """The records of ``questions``, in question order (the summary must not depend on finish order)."""
    by_id = {str(r["id"]): r for r in records}
    return [by_id[q.id] for q in questions if q.id in by_id]


#: The run's cost ledger: every finished question's records, appended as each one finishes.
RUN_LEDGER = "ledger-searchr1.jsonl"


def _finish(*, out_dir: Path, model: str, s: dict[str, Any], done_now: int, wall: float, ledger: Any,
            slots: dict[str, Any], finished: set[str], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``summary.json`` and print the summary line; shared by both run paths.

    ``cost`` covers the same questions as the EM (every finished question of this run and of the
    runs it resumes, read back from the ledger file), so a resumed run's summary is the clean
    run's; ``this_run`` holds what this process spent (its wall seconds and batches).
    """
    from ragfast.results import dumps
    from ragfast.runner.drive import load_ledger

    now = ledger.totals()
    full = load_ledger(out_dir / RUN_LEDGER, finished).totals()
    for comp, row in full.items():  # batches are this process's grouping, not a cost of the questions
        row.pop("batches", None)
    summary = {
        **s, "this_run_questions": done_now, "seconds": wall,
        "questions_per_second": done_now / wall if wall > 0 and done_now else 0.0,
        "seconds_per_component": {c: row["seconds"] for c, row in now.items() if c != "total"},
        "cost": full, "cost_scope": f"every finished question ({s['questions']}), from {RUN_LEDGER}",
        "this_run_cost": now, "slots": slots,
        "answers_meaningful": bool(slots) and all(d["meaningful"] for d in slots.values()),
        **(extra or {}),
    }
    (out_dir / "summary.json").write_text(dumps(summary, indent=2) + "\n")
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


def run_searchr1_command(*, model: str, data: str, out: str, retriever: str = "default", limit: int | None = None,
                         offset: int = 0, resume: bool = False, batch_size: int = 64, max_turns: int = 4, topk: int = 3,
                         seed: int = 0, max_new_tokens: int = 500, max_obs_tokens: int = 500,
                         prompt_budget: int = 4096, corpus: str | Sequence[str] | None = None,
                         encoder: str = "minilm", encoder_backend: str = "auto", served_model: str | None = None,
                         tokenizer: str | None = None, model_config: str | None = None, device: str | None = None,
                         dtype: str | None = None, threads: int | None = None, refill: bool = False,
                         progress: bool = True, console: Any = None, ray: str | None = None,
                         ray_workers: int | None = None) -> dict[str, Any]:
    """What ``ragfast run searchr1`` does; returns the summary it prints.

    Writes ``OUT/results.jsonl`` (one trajectory per line, as questions finish),
    ``OUT/manifest.json`` (which model filled each slot, config, seed and the run's fingerprint),
    ``OUT/summary.json`` and ``OUT/ledger-searchr1.jsonl`` (the cost records of every finished
    question, appended as each finishes). With
    ``resume`` the finished ids are skipped; a partial last line from a crash is cut off first,
    and a run whose data, questions, slots or config differ from the manifest's is refused.

    Parameters
    ----------
    model, retriever, corpus, encoder, encoder_backend, served_model, tokenizer, model_config, dtype
        The slots, as :mod:`ragfast.runner.slots` reads them (``corpus`` default: the
        questions' contexts plus the bundled wiki sample, as in ``ragfast bench``).
    data : str
        QA file or sample name. The retriever's corpus is built from all of its questions.
    out : str
        Output directory.
    offset, limit : int, optional
        Run ``data[offset:offset + limit]``.
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
        Run on Ray (:func:`ragfast.runner.distributed.run_on_ray`): ``"local"`` starts a local
        cluster and shuts it down afterwards; anything else is a cluster address. The questions
        are cut into batches of ``batch_size``, run by ``ray_workers`` reasoner replicas against
        one shared retriever actor; the files written and the per-question records are the same
        as a single-process run's (timing aside), with results in question order.
    ray_workers : int, optional
        Reasoner replicas (Ray worker actors) with ``ray``; default 2.

    Returns
    -------
    dict
        What ``summary.json`` holds.

    Raises
    ------
    ConfigError
        Bad options, ``OUT`` holds results and ``resume`` is False, or ``resume`` with settings
        other than the manifest's.
    """
    from rich.console import Console

    from ragfast.data import load_qa
    from ragfast.methods.searchr1.loop import SearchR1Config
    from ragfast.runner.drive import check_resume, data_identity, fingerprint, prepare_out

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
    if offset >= len(all_questions):
        raise ConfigError(f"--offset {offset} is past the {len(all_questions)} questions of {data}")
    questions = all_questions[offset: offset + limit if limit else None]
    corpus_parts = list(DEFAULTS["corpus"]) if corpus is None else [corpus] if isinstance(corpus, str) else list(corpus)
    out_dir = prepare_out(out, "results.jsonl", resume)
    spec = {"reasoner": model, "retriever": retriever, "corpus": corpus_parts, "encoder": encoder,
            "served_model": served_model}
    fp = fingerprint(method="searchr1", data={"test": data_identity(data)}, questions=questions, slots=spec,
                     config=cfg.to_dict())
    if resume:
        check_resume(out_dir, fp)  # before any model loads: a mismatch is one line, at once
        from ragfast.runner.drive import load_ledger

        load_ledger(out_dir / RUN_LEDGER, None, allow_partial_tail=True)  # a corrupt line: refused now
    common = dict(model=model, retriever=retriever, data=data, out_dir=out_dir, resume=resume, seed=seed,
                  dtype=dtype, batch_size=batch_size, prompt_budget=prompt_budget, served_model=served_model,
                  tokenizer=tokenizer, model_config=model_config, max_turns=max_turns, corpus_parts=corpus_parts,
                  encoder=encoder, encoder_backend=encoder_backend, progress=progress, con=con, cfg=cfg,
                  all_questions=all_questions, questions=questions, fp=fp)
    if ray is not None:
        return _run_on_ray(ray=ray, ray_workers=ray_workers, **common)
    return _run_here(device=device or "cpu", **common)


def _manifest_extra(data: str, model: str, retriever: str, fp: dict[str, Any], slots: dict[str, Any],
                    **more: Any) -> dict[str, Any]:
    from ragfast.runner.drive import fingerprint

    full = fingerprint(method=fp["method"], data=fp["data"], questions=[], slots=fp["slots"], config=fp["config"],
                       identities=slots)
    full["questions"] = fp["questions"]
    return {"data": str(data), "model_arg": model, "retriever_arg": retriever, "fingerprint": full, **more}


def _run_here(*, model: str, retriever: str, data: str, out_dir: Path, resume: bool, seed: int, dtype: str | None,
              batch_size: int, prompt_budget: int, served_model: str | None, tokenizer: str | None,
              model_config: str | None, max_turns: int, corpus_parts: list[str], encoder: str, encoder_backend: str,
              progress: bool, con: Any, cfg: Any, all_questions: list[Any], questions: list[Any], fp: dict[str, Any],
              device: str) -> dict[str, Any]:
    """The single-process run: both models in this process, one :class:`SearchR1Loop`."""
    from ragfast.methods.searchr1.loop import SearchR1Loop
    from ragfast.results import read_results, slot_entry, write_manifest
    from ragfast.runner import slots as build
    from ragfast.runner.drive import MethodRecorder, check_resume, progress_bar, slot_lines

    results_path = out_dir / "results.jsonl"
    gen = build.reasoner(model, seed=seed, device=device, dtype=dtype, batch_size=batch_size,
                         max_context=prompt_budget, served_model=served_model, tokenizer=tokenizer,
                         model_config=model_config, max_turns=max_turns)
    # The corpus comes from every question of the file, not just the --offset/--limit slice, so
    # the document ids and the distractors do not depend on the slice.
    ret = build.retriever_over(retriever, all_questions, corpus_parts=corpus_parts, encoder_spec=encoder,
                               encoder_backend=encoder_backend, device=device, progress=progress)
    slots = {"reasoner": slot_entry(gen), "retriever": slot_entry(ret)}
    extra = _manifest_extra(data, model, retriever, fp, slots)
    if resume:
        check_resume(out_dir, {"models": extra["fingerprint"]["models"]})
    write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed, extra=extra)
    for line in slot_lines(slots):
        con.print(line)

    t0 = time.perf_counter()
    # Trajectories and their cost records are both written as each question finishes, so a
    # killed run keeps the costs of what it finished (and a resume drops those of what it did not).
    with MethodRecorder(results_path, out_dir / RUN_LEDGER, resume) as rec:
        writer, ledger = rec.writer, rec.ledger
        loop = SearchR1Loop(gen, ret, cfg, ledger=ledger)
        if writer.repaired_bytes:
            con.print(f"[yellow]cut a partial last line ({writer.repaired_bytes} bytes) left by an interrupted run[/]")
        todo = [q for q in questions if q.id not in writer.done]
        if resume:
            con.print(f"resume: {len(questions) - len(todo)} of {len(questions)} questions already done")
        with progress_bar(con, "searchr1", progress) as bar:
            task = bar.add_task("searchr1", total=len(todo), em=0.0)
            ems: list[float] = []

            def on_finish(traj):
                rec.finish(traj)
                ems.append(traj.em)
                bar.update(task, advance=1, em=sum(ems) / len(ems))

            loop.run(todo, on_finish=on_finish)
        done_now = writer.written
    wall = time.perf_counter() - t0
    # The entry written before the first call cannot say what the calls used (token source,
    # call count, latencies for a URL reasoner): write it again now that they ran.
    slots["reasoner"] = slot_entry(gen)
    write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed, extra=extra)
    recs = _ordered(read_results(results_path), questions)
    return _finish(out_dir=out_dir, model=model, s=summarise(recs), done_now=done_now, wall=wall, ledger=ledger,
                   slots=slots, finished={str(r["id"]) for r in recs})


def _manifest_slot(info: dict[str, Any]) -> dict[str, Any]:
    """A slot entry (as :func:`ragfast.results.slot_entry` makes) from an actor's describe()."""
    d = {k: v for k, v in info.items() if k != "pid"}  # the pid changes from run to run
    d.setdefault("meaningful", True)
    d["answers_meaningful"] = "yes" if d["meaningful"] else "NO (exercises the compute path only)"
    return d


def _run_on_ray(*, model: str, retriever: str, data: str, out_dir: Path, resume: bool, seed: int, dtype: str | None,
                batch_size: int, prompt_budget: int, served_model: str | None, tokenizer: str | None,
                model_config: str | None, max_turns: int, corpus_parts: list[str], encoder: str,
                encoder_backend: str, progress: bool, con: Any, cfg: Any, all_questions: list[Any],
                questions: list[Any], fp: dict[str, Any], ray: str, ray_workers: int) -> dict[str, Any]:
    """The Ray run: :func:`ragfast.runner.distributed.run_on_ray` with the runner's slot factories.

    The factories are ``functools.partial`` objects of module-level functions of
    :mod:`ragfast.runner.slots`, so Ray ships them by reference; each actor calls them with its
    own ``device``. Local paths are made absolute first, since actors need not share this
    process's working directory.
    """
    import functools
    import warnings

    from ragfast.results import finished_ids, read_manifest, repair_tail, write_manifest
    from ragfast.runner import slots as build
    from ragfast.runner.distributed import run_on_ray
    from ragfast.runner.drive import LedgerFile, progress_bar, slot_lines

    results_path = out_dir / "results.jsonl"
    ledger_path = out_dir / RUN_LEDGER
    if resume:
        cut = repair_tail(results_path)
        if cut:
            con.print(f"[yellow]cut a partial last line ({cut} bytes) left by an interrupted run[/]")
    done_before = finished_ids(results_path) if resume else set()
    if ledger_path.exists() and ledger_path.stat().st_size and not resume:
        raise ConfigError(f"{ledger_path} already holds records: pass --resume to continue, or another --out")
    n_todo = sum(q.id not in done_before for q in questions)
    if resume:
        con.print(f"resume: {len(questions) - n_todo} of {len(questions)} questions already done")

    gen_f = functools.partial(build.reasoner, build.absolute(model), seed=seed, dtype=dtype, batch_size=batch_size,
                              max_context=prompt_budget, served_model=served_model,
                              tokenizer=build.absolute(tokenizer), model_config=build.absolute(model_config),
                              max_turns=max_turns)
    # As in the single-process run, the corpus comes from every question of the file.
    ret_f = functools.partial(build.retriever_over, build.absolute(retriever), all_questions,
                              corpus_parts=[build.absolute(c) for c in corpus_parts],
                              encoder_spec=build.absolute(encoder), encoder_backend=encoder_backend, progress=False)
    slots: dict[str, Any] = {}
    ray_info: dict[str, Any] = {"address": ray, "workers_requested": ray_workers}
    clock: dict[str, float] = {}
    ems: list[float] = []

    def show_warning(message, category, filename, lineno, file=None, line=None):
        con.print(f"[yellow]warning:[/] {str(message).replace('config.batch_size', '--batch-size')}")

    with progress_bar(con, "searchr1", progress) as bar:
        task = bar.add_task("searchr1", total=n_todo, em=0.0)

        def on_start(info: dict[str, Any]) -> None:
            # The actors are up: write the manifest before any batch runs, as the single-process run does.
            slots.update(reasoner=_manifest_slot(info["reasoner"]), retriever=_manifest_slot(info["retriever"]))
            ray_info.update(workers=info["workers"], worker_gpus=info["worker_gpus"], batches=info["batches"])
            extra = _manifest_extra(data, model, retriever, fp, slots,
                                    ray={"address": ray, "workers": info["workers"],
                                         "worker_gpus": info["worker_gpus"]})
            write_manifest(out_dir, pipeline="searchr1", slots=slots, config=cfg.to_dict(), seed=seed, extra=extra)
            for line in slot_lines(slots):
                con.print(line)
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
            # The driver gets a worker's cost records with its batch's results: they are appended
            # to the run's ledger (records of unfinished questions dropped first on resume) before
            # the batch's results, so a killed run keeps the records of what it finished.
            with LedgerFile(ledger_path, resume, done_before) as lf:
                res = run_on_ray(questions, make_generator=gen_f, make_retriever=ret_f, config=cfg,
                                 out_path=results_path, address=ray, num_workers=ray_workers, resume=resume,
                                 on_result=on_result, on_start=on_start, on_records=lf.append)
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
    ids = {str(q.id) for q in questions}
    return _finish(out_dir=out_dir, model=model, s=dict(res.summary), done_now=res.questions_done, wall=wall,
                   ledger=res.ledger, slots=slots, finished=finished_ids(results_path) & ids, extra={"ray": ray_info})


@run_app.command("searchr1")
@opt.with_flags(*opt.LOOP_FLAGS)
def searchr1_cmd(
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue OUT/results.jsonl, skipping finished "
                                                                     "ids; refused when data, questions, slots or "
                                                                     "settings differ."),
    served_model: Optional[str] = typer.Option(None, "--served-model", help="URL model: the served model name "
                                                                            "(default: the server's only model)."),
    tokenizer: Optional[str] = typer.Option(None, *opt.spellings("tokenizer"),
                                            help="Local tokenizer of a served model (chat template, token-exact "
                                                 "truncation)."),
    model_config: Optional[str] = typer.Option(None, *opt.spellings("model_config"),
                                               help="URL model: config.json or model dir, for analytic FLOPs."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16 (default: checkpoint's)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch CPU threads."),
    refill: bool = typer.Option(False, "--refill", help="Continuous batching: start a queued question as soon as "
                                                         "one finishes (same trajectories, fuller batches)."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS",
                                      help="Run on Ray: 'local' starts a local cluster (shut down afterwards), "
                                           "anything else is a cluster address (auto, ray://HOST:10001). Batches "
                                           "of --batch-size questions go to --ray-workers reasoner replicas that "
                                           "share one retriever actor; local paths must exist on the Ray nodes."),
    ray_workers: Optional[int] = typer.Option(None, "--ray-workers", metavar="N",
                                              help="Reasoner replicas (Ray worker actors) with --ray; default 2. "
                                                   "Each runs whole batches: keep --batch-size <= questions / N."),
    **flags: Any,
) -> None:
    """Run Search-R1 (exact prompt, 4 search turns + a final answer-only turn, top-3) and write trajectories.

    With --ray the questions run on Ray actors; the files and per-question records are the same.
    --val-data/--val-offset are accepted for a shared --config file; Search-R1 itself has no
    validation split.
    """
    from ragfast.devices import resolve_device
    from ragfast.outdir import output_dir

    config, no_progress = flags.pop("config"), flags.pop("no_progress")
    s = opt.resolve(config, {**flags, "served_model": served_model, "tokenizer": tokenizer,
                             "model_config": model_config})
    opt.require(s, "out")
    # With --ray each actor picks its device; a device typed or set in --config is refused there.
    dev = (None if s["device"] == "auto" else s["device"]) if ray is not None else resolve_device(s["device"])
    with output_dir(s["out"]):
        run_searchr1_command(model=s["model"], retriever=s["retriever"], data=s["data"], out=s["out"],
                             limit=s["limit"], offset=s["offset"], resume=resume, batch_size=s["batch_size"],
                             max_turns=s["max_turns"], topk=s["topk"], seed=s["seed"],
                             max_new_tokens=s["max_new_tokens"], max_obs_tokens=s["max_obs_tokens"],
                             prompt_budget=s["prompt_budget"], corpus=s["corpus"], encoder=s["encoder"],
                             served_model=s["served_model"], tokenizer=s["tokenizer"], model_config=s["model_config"],
                             device=dev, dtype=dtype, threads=threads, refill=refill, progress=not no_progress,
                             ray=ray, ray_workers=ray_workers)


def register(app: typer.Typer) -> None:
    """Add the shared ``run`` group (with every command other modules put on ``run_app``)."""
    app.add_typer(run_app, name="run")

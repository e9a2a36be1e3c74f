"""The one runner: :func:`run_methods` runs registered methods on the same questions into one folder.

It owns everything a method does not: data selection, the run's fingerprint and ``--resume``,
building the slots once, the recorder of each method (trajectories and ledger written as each
question finishes), progress, and Ray. ``ragfast bench`` (every method) and ``ragfast run M``
(one) both call it, so they write the same layout::

    manifest.json                 slots, settings, fingerprint
    trajectories/<method>.jsonl   one line per finished question
    ledgers/<method>.jsonl        every cost record of that method
    s2g_threshold.json ...        what a method's prepare() / after_run() writes
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ragfast.errors import ConfigError
from ragfast.outputs.failures import answered, failure_of
from ragfast.infra.http import is_url
from ragfast.methods.base import Method, Slots, get
from ragfast.methods.s2g.method import select_questions
from ragfast.infra.progress import turn_reporting
from ragfast.runner import slots as build
from ragfast.runner.recording import MethodRecorder, check_resume, data_identity, fingerprint, load_ledger
from ragfast.runner.settings import RunSettings

log = logging.getLogger(__name__)

__all__ = ["RunOutcome", "run_methods", "check_resumable", "build_slots", "run_fingerprint", "run_config",
           "slot_entries", "reasoner_kwargs", "in_question_order", "TRAJECTORIES", "LEDGERS", "SLOT_SPECS"]

TRAJECTORIES = "trajectories"
LEDGERS = "ledgers"

#: The settings that name a slot's component (the fingerprint compares them as slots).
SLOT_SPECS = ("reasoner", "judge", "nli", "encoder", "index", "corpus", "served_model")

#: How a run executes (Ray or not, where it writes, which backend, whether failures run again, how
#: many sessions share a forward pass under the memory budget) is not part of what it computes.
NOT_IN_CONFIG = ("ray", "ray_workers", "out", "encoder_backend", "nli_backend", "threads", "retry_failed",
                 "memory_budget")


@dataclass
class RunOutcome:
    """What :func:`run_methods` leaves for the summary: every method's records in question order.

    Attributes
    ----------
    records : dict
        method -> its trajectory records (this run's and the resumed ones), in question order;
        a failed question's record has a ``failure`` (:func:`ragfast.outputs.failures.failure_of`).
    slot_info : dict
        slot -> its manifest entry (with the device it ran on).
    slots : Slots
    fingerprint : dict
    this_run : dict
        method -> questions this process finished (the rest were read back on resume).
    ray : dict
        method -> what its Ray run did (address, workers, batches run and resubmitted); empty
        without ``ray``.
    """

    records: dict[str, list[Mapping[str, Any]]]
    slot_info: dict[str, Any]
    slots: Slots
    fingerprint: dict[str, Any]
    this_run: dict[str, int] = dataclasses.field(default_factory=dict)
    ray: dict[str, Any] = dataclasses.field(default_factory=dict)


def reasoner_kwargs(cfg: RunSettings) -> dict[str, Any]:
    """The reasoner factory's keyword arguments for the run's settings."""
    return dict(seed=cfg.seed, max_turns=cfg.budget, device=cfg.slot_device["reasoner"], dtype=cfg.dtype,
                weights=cfg.weights, batch_size=cfg.batch_size, max_context=cfg.prompt_budget,
                served_model=cfg.served_model, tokenizer=cfg.reasoner_tokenizer, model_config=cfg.reasoner_config,
                memory_budget=cfg.memory_budget, draft_tokens=cfg.draft_tokens)


def _generator_factory(cfg: RunSettings) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The reasoner as a factory: a fresh scripted oracle per method (its state is per run), else one shared model."""
    from ragfast.outputs.results import slot_entry

    kw = reasoner_kwargs(cfg)
    if cfg.reasoner == "scripted":
        def make() -> Any:
            return build.reasoner(cfg.reasoner, **kw)
    else:
        shared = build.reasoner(cfg.reasoner, check=False, **kw)

        def make() -> Any:
            return shared
    return make, slot_entry(make())


def _needs(cfg: RunSettings, slot: str) -> bool:
    return any(slot in get(m).slots for m in cfg.methods)


def build_slots(cfg: RunSettings, components: Mapping[str, Any] | None = None) -> Slots:
    """Load data and build every slot the run's methods ask for (encoder/index, reasoner, judge, NLI, StepGap's
    checker, RELOOP's head and planner) once; ``components`` (slot -> built object, Python API only) fill
    slots with objects the caller already holds instead."""
    from ragfast.data import load_qa

    given = dict(components or {})
    bad = sorted(set(given) - {"judge", "nli", "checker", "head", "planner"})
    if bad:
        raise ConfigError(f"components: only judge, nli, checker, head and planner may be given, got {bad}")
    dev = cfg.slot_device
    all_q = load_qa(cfg.data)
    questions = select_questions(all_q, cfg.offset, cfg.limit)
    encoder = None if is_url(cfg.index) else build.encoder(cfg.encoder, backend=cfg.encoder_backend,
                                                           device=dev["encoder"])
    corpus = retriever = None
    if _needs(cfg, "retriever"):  # RELOOP alone reads each question's own sources (MetaQA and TAT-QA have no corpus)
        corpus = build.corpus(cfg.corpus, all_q)
        index = "default" if cfg.index == "flat" else cfg.index
        retriever = build.retriever(index, corpus, shared_encoder=encoder, device=dev["encoder"], check=False)
    make_gen, gen_info = _generator_factory(cfg)

    def slot(name: str, make: Callable[[], Any]) -> Any:
        return given[name] if name in given else make() if _needs(cfg, name) else None

    judge = slot("judge", lambda: build.judge(cfg.judge, device=dev["judge"], shared_encoder=encoder,
                                              encoder_device=dev["encoder"], check=False))
    nli = slot("nli", lambda: build.nli(cfg.nli, backend=cfg.nli_backend, device=dev["nli"]))
    checker = slot("checker", lambda: build.checker(cfg.checker_llm, make_gen(), device=dev["reasoner"]))
    # "reasoner": the reasoner when it is a language model, else RELOOP's extractive span picker.
    head_spec = ("extractive" if cfg.reasoner == "scripted" else None) if cfg.head == "reasoner" else cfg.head
    head = slot("head", lambda: make_gen() if head_spec is None else build.head(head_spec, device=dev["reasoner"]))
    planner = slot("planner", lambda: None if cfg.planner != "llm" else head if cfg.planner_model == cfg.head
                   else build.head(cfg.planner_model, device=dev["reasoner"]))
    return Slots(questions, corpus, retriever, make_gen, gen_info, judge, nli, checker, head, planner, encoder)


def run_config(cfg: RunSettings) -> dict[str, Any]:
    """The settings that decide what a run computes (the manifest's ``config``)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_CONFIG}


def run_fingerprint(cfg: RunSettings, run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a run's results (:func:`ragfast.runner.recording.fingerprint`): data hashes, test question ids, slots, settings."""
    from ragfast.data import load_qa

    data = {"test": data_identity(cfg.data)}
    if cfg.threshold is None:  # the validation split decides the S2G threshold (whichever methods run now)
        data["val"] = data_identity(cfg.val_data)
    specs = {k: run_cfg[k] for k in SLOT_SPECS}
    # limit/offset are in the question ids; data files in their hashes; methods may be added on resume.
    config = {k: v for k, v in run_cfg.items()
              if k not in specs and k not in ("data", "val_data", "methods", "limit", "offset")}
    return fingerprint(method="bench", data=data, questions=select_questions(load_qa(cfg.data), cfg.offset, cfg.limit),
                       slots=specs, config=config)


def slot_entries(cfg: RunSettings, slots: Slots) -> dict[str, Any]:
    """slot -> its manifest entry, with the device it ran on (``remote`` for a URL slot)."""
    from ragfast.outputs.results import empty_slot, slot_entry

    def retriever_slot(r: Any) -> dict[str, Any]:
        d = slot_entry(r)
        enc, idx = d.get("encoder"), d.get("index")
        if isinstance(enc, Mapping) and isinstance(idx, Mapping):
            d["name"] = (f"{enc.get('name')} encoder ({enc.get('model')}) + {idx.get('backend')} index "
                         f"({idx.get('factory')}, {idx.get('storage')}) over {d.get('passages', idx.get('ntotal'))} "
                         "passages")
        return d

    info = {
        "reasoner": slots.generator_info,
        **({"retriever": retriever_slot(slots.retriever)} if slots.retriever is not None else {}),
        "judge": slot_entry(slots.judge) if slots.judge is not None else empty_slot(),
        "nli": slot_entry(slots.nli) if slots.nli is not None else empty_slot(),
    }
    # StepGap's checker and RELOOP's head and planner appear when a method of the run asks for them.
    for name in ("checker", "head", "planner"):
        if _needs(cfg, name) and (name != "planner" or cfg.planner == "llm"):
            obj = getattr(slots, name)
            info[name] = slot_entry(obj) if obj is not None else empty_slot()
    devs = {"reasoner": "reasoner", "retriever": "encoder", "judge": "judge", "nli": "nli", "checker": "reasoner",
            "head": "reasoner", "planner": "reasoner"}
    for slot in info:
        remote = info[slot].get("class") in ("OpenAIGenerator", "RemoteRetriever", "RemoteJudge")
        info[slot]["device"] = "remote" if remote else cfg.slot_device[devs[slot]]
    return info


class _ProgressRecorder:
    """A :class:`MethodRecorder` whose ``finish`` also advances the method's progress bar."""

    def __init__(self, rec: MethodRecorder, advance: Callable[[int], None]):
        self._rec, self._advance = rec, advance
        self.ledger = rec.ledger

    @property
    def done(self) -> set[str]:
        return self._rec.done

    def finish(self, traj: Any) -> None:
        self._rec.finish(traj)
        self._advance(1)


def in_question_order(records: Sequence[Mapping[str, Any]], questions: Sequence[Any]) -> list[Mapping[str, Any]]:
    """``records`` in the order of ``questions``, not the order they finished in.

    A resumed run writes its questions in another order than a clean one, and the bootstrap
    intervals resample by position: sorting makes them the same for the same results.
    """
    pos = {q.id: i for i, q in enumerate(questions)}
    return sorted(records, key=lambda r: pos.get(r["id"], len(pos)))


def check_resumable(out: Path, fp: Mapping[str, Any], methods: Sequence[str]) -> None:
    """Refuse a ``--resume`` of ``out`` (one :class:`ConfigError` line) whose fingerprint is not
    ``fp`` (:func:`run_fingerprint`) or whose ledger of a method has a corrupt line."""
    check_resume(out, fp)
    for m in methods:
        if (out / LEDGERS / f"{m}.jsonl").exists():
            load_ledger(out / LEDGERS / f"{m}.jsonl", None, allow_partial_tail=True)


def run_methods(cfg: RunSettings, methods: Sequence[str], out: Path, *, resume: bool = False,
                console: Any = None, progress: bool = True, fingerprint: Mapping[str, Any] | None = None,
                components: Mapping[str, Any] | None = None) -> RunOutcome:
    """Run ``methods`` (registered names) on the questions of ``cfg`` into ``out``.

    Parameters
    ----------
    cfg : RunSettings
    methods : sequence of str
        In the order they run; each one's files are ``trajectories/<m>.jsonl`` and ``ledgers/<m>.jsonl``.
    out : Path
        The results directory (it exists; the caller checked it may be written).
    resume : bool
        Read back what is on disk and run only the questions each method has not finished; a
        fingerprint other than the one on disk is refused before any model loads.
    console : rich.console.Console, optional
    progress : bool
        Show progress (False: messages only).
    fingerprint : mapping, optional
        The run's :func:`run_fingerprint` when the caller computed it already (the bench checks a
        ``resume`` before it opens the run's log, so a refused one leaves the directory as it was).
    components : mapping, optional
        Slots filled with objects the caller built (:func:`build_slots`; the Python API's way to
        run a method with a model of its own).

    Returns
    -------
    RunOutcome
        Every method's records in question order, the slots and their manifest entries.
    """
    from ragfast.infra.progress import RunProgress
    from ragfast.outputs.results import answers_label, read_results, slot_entry, write_manifest

    out = Path(out)
    run_cfg = run_config(cfg)
    fp = fingerprint if fingerprint is not None else run_fingerprint(cfg, run_cfg)
    if resume:
        check_resumable(out, fp, methods)  # before any model loads
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    with RunProgress(console, enabled=progress) as prog:
        setup = prog.task("loading slots", None)
        slots = build_slots(cfg, components)
        setup.update(total=1, completed=1)
        setup.set_status(f"{len(slots.questions)} questions, {len(slots.corpus or ())} passages")
        slot_info = slot_entries(cfg, slots)
        # --limit and the slot specs are beside the config, not in it: a resume may add questions,
        # and a URL may be spelt another way (localhost, 127.0.0.1); the fingerprint, checked
        # above, says which questions and which slots are the same. Every other setting must be.
        beside = ("limit", *SLOT_SPECS)
        man_cfg = {k: v for k, v in run_cfg.items() if k not in beside}
        extra = {"data": cfg.data, **{k: run_cfg[k] for k in beside}, "n_questions": len(slots.questions),
                 "corpus_size": len(slots.corpus or ()), "fingerprint": fp}
        write_manifest(out, pipeline="bench", slots=slot_info, config=man_cfg, seed=cfg.seed, extra=extra)
        for k, v in slot_info.items():
            label = v.get("answers_meaningful") or answers_label(v)
            if k == "judge" and label == "yes" and "s2g" in methods and cfg.threshold is None:
                label = "measured below (validation ranking vs counting documents)"
            prog.print(f"slot [bold]{k}[/]: {v.get('name')} on {v['device']}  (answers meaningful: {label})")
            log.debug("slot %s: %s", k, v)
        instances = {m: get(m)(cfg) for m in methods}
        this_run: dict[str, int] = {}
        ray_info: dict[str, Any] = {}
        for m, method in instances.items():
            pipeline = method.ray_pipeline() if cfg.ray else None
            if cfg.ray and pipeline is not None:
                method.prepare(slots, out, prog)
                ray_info[m] = _run_on_ray(cfg, method, slots, out, resume, prog, slot_info, man_cfg, extra)
                this_run[m] = ray_info[m].pop("questions_done")
                if "manifest" in ray_info[m]:  # absent when nothing was left to run
                    extra["ray"] = ray_info[m].pop("manifest")
                continue
            # Prepared before the method's recorder opens, so a failed preparation leaves no empty files.
            method.prepare(slots, out, prog)
            rec = MethodRecorder(out / TRAJECTORIES / f"{m}.jsonl", out / LEDGERS / f"{m}.jsonl", resume,
                                 cfg.retry_failed)
            todo = [q for q in slots.questions if q.id not in rec.done]
            _say_resumed(prog, m, resume, rec.writer.repaired_bytes, len(slots.questions) - len(todo),
                         len(slots.questions), rec.traj_path, len(rec.retried))
            task = prog.task(m, len(slots.questions), completed=len(slots.questions) - len(todo), unit="questions")
            t_m = time.perf_counter()
            ok = False
            try:
                if todo:
                    gen_slots = dataclasses.replace(slots, make_generator=turn_reporting(slots.make_generator, task,
                                                                                         cfg.budget + 1))
                    with _shelving(m, instances, slots):
                        _run_isolating(method, todo, gen_slots, _ProgressRecorder(rec, task.advance))
                ok = True
            finally:
                this_run[m] = rec.written
                rec.close()
                task.set_status("")
                task.done(failed=not ok)  # an error is never printed as "done"
            log.info("%s: %d questions in %.1f s", m, len(todo), time.perf_counter() - t_m)
        if cfg.reasoner != "scripted":
            # the shared reasoner's entry after its calls (a URL one counts its calls and token sources, a
            # local one its memory budget and peaks), in the manifest too: the entry written before the
            # first call cannot say what the calls used
            slot_info["reasoner"].update(slot_entry(slots.make_generator()))
        from ragfast.models.memory_budget import rss_peak_bytes

        # this process's peak resident size (on Ray, the driver's; each actor's reasoner entry has its own budget)
        extra["memory"] = {"memory_budget": cfg.memory_budget, "rss_peak_bytes": rss_peak_bytes()}
        write_manifest(out, pipeline="bench", slots=slot_info, config=man_cfg, seed=cfg.seed, extra=extra)
        records = {m: in_question_order(read_results(out / TRAJECTORIES / f"{m}.jsonl"), slots.questions)
                   for m in methods}
        ok_records = {m: answered(r) for m, r in records.items()}  # a failed question has no trajectory to analyse
        for method in instances.values():
            method.after_run(slots, ok_records, out, prog)
    return RunOutcome(records, slot_info, slots, fp, this_run, ray_info)


def _shelving(m: str, instances: Mapping[str, Method], slots: Slots) -> Any:
    """The block ``m`` runs in: its ended sessions shelved for a later method that reads them
    (:attr:`Method.reads_sessions_of`) on a generator that keeps them, else nothing."""
    if not any(m in type(o).reads_sessions_of for o in instances.values()):
        return contextlib.nullcontext()
    keep = getattr(slots.make_generator(), "keep_ended", None)
    return keep(shelve=m) if keep is not None else contextlib.nullcontext()


def _run_isolating(method: Method, questions: Sequence[Any], slots: Slots, rec: _ProgressRecorder) -> None:
    """``method.run`` over ``questions``, where a question whose component fails is recorded as
    failed (its trajectory line names the component and the error) and the others go on
    (:func:`ragfast.outputs.failures.isolate`)."""
    from ragfast.outputs.failures import FailureStreak, failure_record, isolate

    def record(q: Any, exc: BaseException) -> None:
        # the failed attempt's costs go with its record (the ledger file gets them in finish)
        rec.finish(failure_record(q, exc, rec.ledger.for_question(q.id)))

    isolate(lambda qs: method.run(qs, slots, rec), questions, done=lambda: rec.done, record=record,
            forget=rec.ledger.drop, streak=FailureStreak(method.name))


def _say_resumed(prog: Any, m: str, resume: bool, cut: int, done: int, total: int, traj: Path,
                 retried: int = 0) -> None:
    """Say what a resume found: a torn last line cut off, how many questions were already done,
    and how many of them failed (kept, or dropped to run again with ``--retry-failed``)."""
    from ragfast.outputs.results import read_results

    if cut:
        prog.print(f"[yellow]{m}: cut a partial last line ({cut} bytes) left by an interrupted run[/]")
    if not resume:
        return
    failed = sum(1 for r in read_results(traj) if failure_of(r) is not None) if done and traj.exists() else 0
    note = (f" ({failed} of them recorded as failed: --retry-failed runs them again)" if failed else "")
    prog.print(f"{m}: resume: {done} of {total} questions already done{note}")
    if retried:
        prog.print(f"{m}: --retry-failed: {retried} question(s) recorded as failed run again")


def _actor_slot(driver: Mapping[str, Any], info: Mapping[str, Any]) -> dict[str, Any]:
    """A slot's manifest entry: the driver's, updated with its Ray actor's ``describe()`` (without
    the pid, which changes from run to run)."""
    return {**driver, **{k: v for k, v in info.items() if k != "pid"}}


def _run_on_ray(cfg: RunSettings, method: Method, slots: Slots, out: Path, resume: bool, prog: Any,
                slot_info: dict[str, Any], manifest_cfg: dict[str, Any], manifest_extra: dict[str, Any]
                ) -> dict[str, Any]:
    """One method on Ray: the driver writes trajectories (question order) and each batch's ledger
    records as the batch comes back, before its results, so a killed run keeps the costs of what
    it finished. The actors' slot entries replace the driver's in the manifest once they are up.

    Returns what the Ray run did (``address``, ``workers``, ``batches_run``, ...) and
    ``questions_done`` (this run's).
    """
    import warnings

    from ragfast.data import load_qa
    from ragfast.outputs.failures import drop_failures
    from ragfast.outputs.results import finished_ids, repair_tail, write_manifest
    from ragfast.runner.distributed import GENERATOR, PipelineLoop, run_on_ray
    from ragfast.runner.recording import LedgerFile

    m = method.name
    traj = out / TRAJECTORIES / f"{m}.jsonl"
    traj.parent.mkdir(parents=True, exist_ok=True)
    cut = repair_tail(traj) if resume and traj.exists() else 0
    retried = drop_failures(traj) if resume and cfg.retry_failed else set()
    done = (finished_ids(traj) if traj.exists() else set()) if resume else set()
    n_done = len(done & {q.id for q in slots.questions})
    _say_resumed(prog, m, resume, cut, n_done, len(slots.questions), traj, len(retried))
    task = prog.task(m, len(slots.questions), completed=n_done, unit="questions")
    pipe = method.ray_pipeline()
    make_loop = None
    if pipe.fn is not None:
        factories = {"judge": build.judge, "nli": build.nli, "checker": build.checker}
        actor_slots = {k: GENERATOR if v == "reasoner" else
                       functools.partial(factories[v[0]], build.absolute(v[1]), **v[2])
                       for k, v in pipe.slots.items()}
        make_loop = PipelineLoop(pipe.fn, slots=actor_slots, **pipe.kwargs)
    # one unit of work per worker at least, else workers sit idle
    bs = max(1, min(cfg.batch_size, -(-len(slots.questions) // cfg.workers)))
    kw = {k: v for k, v in reasoner_kwargs(cfg).items() if k != "device"}  # each actor picks its device
    kw.update(tokenizer=build.absolute(cfg.reasoner_tokenizer), model_config=build.absolute(cfg.reasoner_config))
    make_gen = functools.partial(build.reasoner, build.absolute(cfg.reasoner), **kw)
    # The retriever actor builds from the on-disk embedding cache the driver already filled.
    make_ret = functools.partial(build.retriever_over, "default" if cfg.index == "flat" else build.absolute(cfg.index),
                                 load_qa(cfg.data), corpus_parts=[build.absolute(c) for c in cfg.corpus],
                                 encoder_spec=build.absolute(cfg.encoder), encoder_backend=cfg.encoder_backend,
                                 progress=False, check=False)
    info: dict[str, Any] = {"address": cfg.ray, "workers_requested": cfg.workers}

    def on_start(actors: dict[str, Any]) -> None:
        slot_info.update(reasoner=_actor_slot(slot_info["reasoner"], actors["reasoner"]),
                         retriever=_actor_slot(slot_info["retriever"], actors["retriever"]))
        info.update(workers=actors["workers"], worker_gpus=actors["worker_gpus"], batches=actors["batches"])
        # The actors are up: the manifest says which slots they hold before any batch runs.
        info["manifest"] = {k: info[k] for k in ("address", "workers", "worker_gpus")}
        write_manifest(out, pipeline="bench", slots=slot_info, config=manifest_cfg, seed=cfg.seed,
                       extra={**manifest_extra, "ray": info["manifest"]})
        prog.print(f"ray: {actors['workers']} worker(s) at {cfg.ray!r}, {actors['batches']} batch(es) of up to {bs} "
                   "questions")

    def show_warning(message, category, filename, lineno, file=None, line=None):
        prog.print(f"[yellow]warning:[/] {str(message).replace('config.batch_size', '--batch-size')}")

    ok = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always", RuntimeWarning)  # run_on_ray's (idle workers...) as one line each
            warnings.showwarning = show_warning
            with LedgerFile(out / LEDGERS / f"{m}.jsonl", resume, done) as lf:
                res = run_on_ray(slots.questions, make_generator=make_gen, make_retriever=make_ret, config=pipe.config,
                                 out_path=traj, address=cfg.ray, num_workers=cfg.workers, resume=resume,
                                 make_loop=make_loop, batch_size=bs, on_result=lambda r: task.advance(1),
                                 on_start=on_start, on_records=lf.append)
        ok = True
    finally:
        task.done(failed=not ok)
    info.update(batches_run=res.batches, retried_batches=res.retried_batches, restarted_batches=res.restarted_batches,
                rpc_seconds=res.rpc_seconds, seconds_with_startup=res.seconds, questions_done=res.questions_done)
    if res.batches:
        prog.print(f"ray: {res.batches} batch(es) on {info.get('workers')} worker(s), {res.retried_batches} "
                   f"resubmitted after a lost actor, {res.restarted_batches} finished by an actor Ray restarted; "
                   f"{res.seconds:.1f}s with actor start-up")
    return info

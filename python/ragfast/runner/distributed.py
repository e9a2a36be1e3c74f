"""Scale-out on Ray: question sharding over generator actors and a shared retriever actor.

ragfast does not run its own cluster: everything here is a Ray actor, an ObjectRef or a Ray
retry setting, so it runs wherever its users already operate Ray (``address="local"`` starts a
throw-away local cluster).

Batch evaluation (:func:`run_on_ray`)
-------------------------------------
- The questions still to do (after ``resume`` skips the finished ids) are cut into batches of
  ``config.batch_size`` consecutive questions, exactly the batches a single-process
  :meth:`~ragfast.methods.searchr1.loop.SearchR1Loop.run` forms. A batch is the unit of work: a
  worker actor runs the whole multi-turn loop over it and returns its trajectories and cost
  records in one reply. Because the batches are the same, every per-question record (answers,
  retrieved ids, scores, tokens, bytes scanned) equals the single-process one; only wall and
  device seconds differ (:func:`ragfast.outputs.results.strip_timing`). Workers run batches in
  parallel, so W workers need at least W batches: ``batch_size <= len(questions) / W``.
- Each worker actor builds its own generator replica from a picklable factory, on a GPU when
  the cluster has GPUs (``num_gpus`` per actor; the factory is told ``device="cuda"``).
- Retrieval is ONE shared actor (:class:`RayRetriever` proxies to it), so the corpus and index
  are loaded once, not once per worker. Every worker call is one batched ``search`` with the
  same queries a single-process loop would send.
- Only the driver writes results (:class:`~ragfast.outputs.results.ResultsWriter`, fsynced per line),
  as batches complete; at the end the file is rewritten atomically in question order (ids of
  earlier runs that are not among ``questions`` keep their place after them).
- Fault tolerance: worker actors are created with Ray's ``max_restarts`` and
  ``max_task_retries``, so a worker process that dies mid-batch is restarted by Ray and the
  batch re-run on it. If Ray gives up (restarts exhausted, actor killed with ``no_restart``,
  node lost), the driver replaces the actor and resubmits the batch, up to ``max_attempts``
  times. A batch's results reach the driver only in the reply of a successful attempt, and
  the driver writes each batch once, so no question is lost or written twice; cost records of
  failed attempts die with them and are never counted.
- A question whose component fails (a refusal, a bad input only it triggers) is not a failed
  batch: the worker isolates it as the single process does
  (:func:`ragfast.outputs.failures.isolate`) and returns its failure record with the batch.

The flat index sharded over Ray actors (``RayShardedIndex``) is a component: it lives in
:mod:`ragfast.retrieval.ray_index`.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ragfast.checks import positive_int
from ragfast.accounting.ledger import CostLedger, CostRecord
from ragfast.errors import ConfigError, DataError, RagfastError
from ragfast.outputs.results import summarise
from ragfast.types import Question, check_questions

from ragfast.runner.ray_actors import (GENERATOR, PipelineLoop, RayRetriever, Worker, check_picklable,
                                       merge_records, ray_session, retryable)

__all__ = [
    "run_on_ray",
    "RayRunResult",
    "ray_session",
    "RayRetriever",
    "sort_results",
    "gpus_per_worker",
    "PipelineLoop",
    "GENERATOR",
]


# ---------------------------------------------------------------------------------------------
# Results file
# ---------------------------------------------------------------------------------------------

def sort_results(path: str | os.PathLike, order: Sequence[str]) -> int:
    """Rewrite a results file in a deterministic order, atomically.

    Records whose id is in ``order`` come first, in that order; any others (e.g. questions of
    an earlier, longer run) follow in the order they are in the file. The rewrite goes to a
    temporary file that replaces the original in one ``os.replace``: a crash leaves either the
    old or the new file, never a mix.

    Parameters
    ----------
    path : path
        A JSONL results file (a partial last line from a crash is dropped).
    order : sequence of str
        Question ids in the wanted order.

    Returns
    -------
    int
        Number of records in the file.

    Raises
    ------
    DataError
        When an id occurs twice in the file.
    """
    from ragfast.outputs.results import json_default, read_results

    path = Path(path)
    if not path.exists():
        return 0
    recs = read_results(path)
    seen: set[str] = set()
    for r in recs:
        rid = str(r["id"])
        if rid in seen:
            raise DataError(f"{path}: question {rid!r} occurs twice")
        seen.add(rid)
    pos = {str(q): i for i, q in enumerate(order)}
    big = len(pos)
    keyed = sorted(enumerate(recs), key=lambda t: (pos.get(str(t[1]["id"]), big), t[0]))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.sorting")
    with open(tmp, "wb") as f:
        for _, r in keyed:
            f.write((json.dumps(r, ensure_ascii=False, default=json_default) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(recs)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------

@dataclass
class RayRunResult:
    """What :func:`run_on_ray` did.

    Attributes
    ----------
    summary : dict
        ``questions``, ``em``, ``f1``, ``searches_per_question`` over every finished record of
        ``questions`` (earlier runs' included), as the single-process ``ragfast run`` reports.
    records : list of dict
        Those records, in question order (as in the final file).
    ledger : CostLedger
        Cost records of the batches run now (successful attempts only).
    questions_done : int
        Questions run (and written) by this call.
    batches : int
        Batches run by this call.
    retried_batches : int
        Batches the driver resubmitted after Ray gave up on their actor.
    restarted_batches : int
        Batches completed by an actor that Ray had restarted (its own fault tolerance).
    workers : list of dict
        What each worker actor holds (generator describe, device, pid).
    retriever : dict
        The shared retriever's describe.
    seconds : float
        Wall time of the distributed part (actors started to last batch written).
    rpc_seconds : float
        Summed retrieval round-trip time beyond the retriever actor's own time.
    """

    summary: dict[str, Any]
    records: list[dict[str, Any]]
    ledger: CostLedger
    questions_done: int = 0
    batches: int = 0
    retried_batches: int = 0
    restarted_batches: int = 0
    workers: list[dict[str, Any]] = field(default_factory=list)
    retriever: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    rpc_seconds: float = 0.0

    @property
    def questions_per_second(self) -> float:
        return self.questions_done / self.seconds if self.seconds > 0 and self.questions_done else 0.0


def gpus_per_worker(cluster_gpus: float, num_workers: int, retriever_gpus: float = 0.0) -> float:
    """The ``worker_gpus="auto"`` rule: GPUs each generator actor asks Ray for.

    One whole GPU per worker when the cluster has at least one per worker (after the
    retriever's share); otherwise an equal fraction, so every replica still lands on a GPU
    (several small models can share one); 0 on a cluster without GPUs.

    Parameters
    ----------
    cluster_gpus : float
        ``ray.cluster_resources()["GPU"]`` (0 when absent).
    num_workers : int
        Worker actors that will run.
    retriever_gpus : float
        GPUs held by the shared retriever actor.
    """
    free = float(cluster_gpus) - float(retriever_gpus)
    if free <= 0 or num_workers < 1:
        return 0.0
    return 1.0 if free >= num_workers else free / num_workers


def _fit_workers(ray: Any, want: int, worker_cpus: float, worker_gpus: float, retriever_cpus: float,
                 retriever_gpus: float) -> int:
    """How many workers the cluster can hold next to the retriever (Ray would leave the rest pending)."""
    res = ray.cluster_resources()
    cpu, gpu = float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))
    fit = want
    if worker_cpus > 0:
        fit = min(fit, int(math.floor((cpu - retriever_cpus) / worker_cpus + 1e-9)))
    if worker_gpus > 0:
        fit = min(fit, int(math.floor((gpu - retriever_gpus) / worker_gpus + 1e-9)))
    if fit < 1:
        raise ConfigError(f"the Ray cluster ({cpu:g} CPU, {gpu:g} GPU) cannot hold the retriever actor "
                          f"({retriever_cpus:g} CPU, {retriever_gpus:g} GPU) plus one worker "
                          f"({worker_cpus:g} CPU, {worker_gpus:g} GPU); lower worker_cpus/retriever_cpus "
                          "or add nodes")
    if fit < want:
        warnings.warn(f"the Ray cluster holds only {fit} of the {want} requested workers "
                      f"({cpu:g} CPU, {gpu:g} GPU); running with {fit}", RuntimeWarning, stacklevel=3)
    return fit


def run_on_ray(
    questions: Sequence[Question],
    *,
    make_generator: Callable[..., Any],
    make_retriever: Callable[..., Any],
    out_path: str | os.PathLike,
    config: Any = None,
    address: str | None = "local",
    num_workers: int = 2,
    resume: bool = False,
    make_loop: Callable[..., Any] | None = None,
    worker_cpus: float = 1.0,
    worker_gpus: float | str = "auto",
    retriever_cpus: float = 1.0,
    retriever_gpus: float = 0.0,
    max_restarts: int = 2,
    max_task_retries: int = 2,
    max_attempts: int = 3,
    batch_timeout_s: float | None = None,
    local_cpus: int | None = None,
    runtime_env: dict[str, Any] | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    batch_size: int | None = None,
    on_records: Callable[[list[CostRecord]], None] | None = None,
) -> RayRunResult:
    """Run a multi-round RAG loop over ``questions`` on Ray actors; results go to one JSONL file.

    Parameters
    ----------
    questions : sequence of Question
        Unique ids, each with gold answers.
    make_generator : callable
        Picklable factory of the reasoner (a :class:`~ragfast.models.Generator`), called once in
        each worker actor as ``make_generator(device=...)`` when it takes ``device``, else
        ``make_generator()``. ``device`` is ``"cuda"`` when the actor holds a GPU, else ``"cpu"``.
        E.g. ``functools.partial(ragfast.runner.slots.reasoner, "scripted", max_turns=4)``.
    make_retriever : callable
        Picklable factory of the retriever, called once, in the shared retriever actor.
    out_path : path
        The results JSONL file. Written by this (driver) process only.
    config : SearchR1Config, optional
        Loop settings (default ``SearchR1Config()``); ``config.batch_size`` is the unit of work.
    address : str or None
        ``"local"`` (start a local cluster, shut it down after) or a Ray cluster address. An
        existing connection of this process (``ray.is_initialized()``) is used as it is.
    num_workers : int
        Generator replicas (worker actors); fewer are started when there are fewer batches or
        the cluster cannot hold them all (with a RuntimeWarning).
    resume : bool
        Keep the finished ids in ``out_path`` and run only the others.
    make_loop : callable, optional
        Picklable ``make_loop(generator, retriever, config, ledger)`` returning an object with
        ``run(questions) -> list[Trajectory]``; default :class:`~ragfast.methods.searchr1.loop.SearchR1Loop`
        (pass one that adds hooks to run S2G-style pipelines).
    worker_cpus, retriever_cpus : float
        CPUs each worker / the retriever actor holds (fractions allowed).
    worker_gpus : float or "auto"
        GPUs per worker; ``"auto"``: one each when the cluster has as many GPUs as workers,
        else an equal fraction; 0 without GPUs.
    retriever_gpus : float
        GPUs of the retriever actor (e.g. for the query encoder).
    max_restarts, max_task_retries : int
        Ray's own fault tolerance for worker actors (restart the process, re-run the batch).
    max_attempts : int
        Attempts per batch counting the driver's resubmissions to a fresh actor after Ray
        gives up on one.
    batch_timeout_s : float, optional
        A batch running longer than this has its actor killed and is resubmitted (a hung
        worker); ``None`` waits forever.
    local_cpus : int, optional
        Logical CPUs of a local cluster (default: enough for the actors, at least the cores).
    runtime_env : dict, optional
        Ray runtime environment for a cluster this call connects to.
    on_result : callable, optional
        Called in the driver with each record right after it is written (progress bars).
    on_start : callable, optional
        Called in the driver once the actors are up, before any batch runs, with
        ``{"reasoner": describe(), "retriever": describe(), "workers", "worker_gpus", "batches"}``
        (e.g. to write the run manifest). Not called when there is nothing left to run.
    batch_size : int, optional
        Questions per unit of work; default ``config.batch_size`` (or ``config.searchr1.batch_size``
        for configs that wrap a SearchR1Config, like StepGap's). Keep it equal to the batch
        size the pipeline itself uses, or a batch will not run as the single-process one does.
    on_records : callable, optional
        Called in the driver with each finished batch's cost records (``CostRecord`` s), before
        its results are written, so a caller can append them to a ledger file as they arrive.

    Returns
    -------
    RayRunResult

    Raises
    ------
    DataError
        Bad questions, or ``out_path`` holds results and ``resume`` is False.
    ConfigError
        Bad settings, unpicklable factories, a cluster too small, a retriever that fails to build.
    RuntimeError
        A batch failed ``max_attempts`` times (the message names its question ids).
    """
    from ragfast.methods.searchr1.loop import SearchR1Config
    from ragfast.outputs.results import ResultsWriter, read_results

    qs = check_questions(questions, "run_on_ray")
    cfg = config if config is not None else SearchR1Config()
    if batch_size is None:
        batch_size = getattr(cfg, "batch_size", None)
        if batch_size is None:
            batch_size = getattr(getattr(cfg, "searchr1", None), "batch_size", None)
        if batch_size is None:
            raise ConfigError(f"{type(cfg).__name__} has no batch_size; pass batch_size= to run_on_ray")
    bs = positive_int(batch_size, "batch_size")
    num_workers = positive_int(num_workers, "num_workers")
    max_attempts = positive_int(max_attempts, "max_attempts")
    max_restarts = positive_int(max_restarts, "max_restarts", 0)
    max_task_retries = positive_int(max_task_retries, "max_task_retries", 0)
    for name, v in (("worker_cpus", worker_cpus), ("retriever_cpus", retriever_cpus),
                    ("retriever_gpus", retriever_gpus)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    if not (worker_gpus == "auto" or (isinstance(worker_gpus, (int, float)) and not isinstance(worker_gpus, bool)
                                      and worker_gpus >= 0)):
        raise ConfigError(f"worker_gpus must be 'auto' or a number >= 0, got {worker_gpus!r}")
    if batch_timeout_s is not None and not batch_timeout_s > 0:
        raise ConfigError(f"batch_timeout_s must be > 0, got {batch_timeout_s!r}")
    for name, f in (("make_generator", make_generator), ("make_retriever", make_retriever)):
        if not callable(f):
            raise ConfigError(f"{name} must be callable, got {type(f).__name__}")
    for name, f in (("make_loop", make_loop), ("on_result", on_result), ("on_start", on_start),
                    ("on_records", on_records)):
        if f is not None and not callable(f):
            raise ConfigError(f"{name} must be callable, got {type(f).__name__}")
    check_picklable(make_generator, "make_generator")
    check_picklable(make_retriever, "make_retriever")
    if make_loop is not None:
        check_picklable(make_loop, "make_loop")

    out_path = Path(out_path)
    order = [q.id for q in qs]
    want = set(order)
    ledger = CostLedger()
    result = RayRunResult(summary={}, records=[], ledger=ledger)
    with ResultsWriter(out_path, resume=resume) as writer:
        todo = [q for q in qs if q.id not in writer.done]
        batches = [todo[i:i + bs] for i in range(0, len(todo), bs)]
        if batches and len(batches) < num_workers:
            # The batch is the unit of work (and what makes results equal the single-process
            # run), so fewer batches than workers leaves workers idle.
            warnings.warn(f"{len(todo)} questions in batches of {bs} make {len(batches)} batch(es) for {num_workers} "
                          f"workers; lower config.batch_size to about {max(1, len(todo) // num_workers)} to use "
                          "them all", RuntimeWarning, stacklevel=2)
        if batches:
            need = int(math.ceil(retriever_cpus + min(num_workers, len(batches)) * worker_cpus))
            cpus = local_cpus if local_cpus is not None else max(os.cpu_count() or 1, need)
            with ray_session(address, num_cpus=cpus, runtime_env=runtime_env) as ray:
                _drive(ray, result, writer, batches, cfg, make_generator=make_generator,
                       make_retriever=make_retriever, make_loop=make_loop, num_workers=num_workers,
                       worker_cpus=float(worker_cpus), worker_gpus=worker_gpus, retriever_cpus=float(retriever_cpus),
                       retriever_gpus=float(retriever_gpus), max_restarts=max_restarts,
                       max_task_retries=max_task_retries, max_attempts=max_attempts,
                       batch_timeout_s=batch_timeout_s, on_result=on_result, on_start=on_start,
                       on_records=on_records)
    sort_results(out_path, order)
    result.records = [r for r in read_results(out_path) if str(r["id"]) in want] if out_path.exists() else []
    result.summary = summarise(result.records)
    return result


def _drive(ray: Any, result: RayRunResult, writer: Any, batches: list[list[Question]], cfg: Any, *,
           make_generator: Callable[..., Any], make_retriever: Callable[..., Any], make_loop: Any,
           num_workers: int, worker_cpus: float, worker_gpus: float | str, retriever_cpus: float,
           retriever_gpus: float, max_restarts: int, max_task_retries: int, max_attempts: int,
           batch_timeout_s: float | None, on_result: Callable[[dict[str, Any]], None] | None,
           on_start: Callable[[dict[str, Any]], None] | None,
           on_records: Callable[[list[CostRecord]], None] | None = None) -> None:
    t_start = time.perf_counter()
    if worker_gpus == "auto":
        worker_gpus = gpus_per_worker(float(ray.cluster_resources().get("GPU", 0.0)),
                                      min(num_workers, len(batches)), retriever_gpus)
    n_workers = _fit_workers(ray, min(num_workers, len(batches)), worker_cpus, float(worker_gpus),
                             retriever_cpus, retriever_gpus)
    retriever = RayRetriever.launch(make_retriever, num_cpus=retriever_cpus, num_gpus=retriever_gpus,
                                    max_restarts=max(max_restarts, 1), max_task_retries=max(max_task_retries, 1))
    result.retriever = retriever.describe()
    worker_cls = ray.remote(Worker).options(num_cpus=worker_cpus, num_gpus=float(worker_gpus),
                                             max_restarts=max_restarts, max_task_retries=max_task_retries)

    # Held until the run ends: Ray restarts a worker from these constructor arguments.
    gen_ref, loop_ref = ray.put(make_generator), ray.put(make_loop)

    def new_worker():
        return worker_cls.remote(gen_ref, retriever.actor, retriever._info, loop_ref)

    workers = [new_worker() for _ in range(n_workers)]
    try:
        infos = ray.get([w.describe.remote() for w in workers])
    except ray.exceptions.RayError as exc:
        for w in workers:
            ray.kill(w, no_restart=True)
        ray.kill(retriever.actor, no_restart=True)
        raise ConfigError(f"a worker actor failed to build its generator: {exc}") from None
    result.workers = infos
    if on_start is not None:
        on_start({"reasoner": dict(infos[0]), "retriever": dict(result.retriever), "workers": n_workers,
                  "worker_gpus": float(worker_gpus), "batches": len(batches)})

    pending = list(range(len(batches)))[::-1]  # pop() takes batch 0 first
    attempts = [0] * len(batches)
    done_batches: set[int] = set()
    in_flight: dict[Any, tuple[int, int, float]] = {}  # ref -> (batch, worker slot, start time)
    timed_out: set[Any] = set()
    # Poll often enough that a hung batch is noticed within a quarter of its timeout.
    poll = None if batch_timeout_s is None else max(0.1, min(batch_timeout_s / 4, 5.0))

    def submit(slot: int) -> None:
        if not pending:
            return
        b = pending.pop()
        attempts[b] += 1
        ref = workers[slot].run_batch.remote(b, batches[b], cfg)
        in_flight[ref] = (b, slot, time.perf_counter())

    try:
        for slot in range(n_workers):
            submit(slot)
        while in_flight:
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=poll)
            if not ready:
                now = time.perf_counter()
                for ref, (b, slot, t0) in list(in_flight.items()):
                    if now - t0 > batch_timeout_s and ref not in timed_out:
                        # A hung batch: kill its actor for good; its reply becomes an actor error
                        # below, and the batch goes to a fresh actor.
                        timed_out.add(ref)
                        ray.kill(workers[slot], no_restart=True)
                continue
            ref = ready[0]
            b, slot, _ = in_flight.pop(ref)
            timed_out.discard(ref)
            try:
                reply = ray.get(ref)
            except ray.exceptions.RayError as exc:
                if not retryable(exc):
                    cause = exc.as_instanceof_cause() if isinstance(exc, ray.exceptions.RayTaskError) else exc
                    raise cause from None
                if attempts[b] >= max_attempts:
                    ids = [q.id for q in batches[b]]
                    raise RuntimeError(f"batch {b} (questions {ids[:8]}{' ...' if len(ids) > 8 else ''}) failed "
                                       f"{attempts[b]} times; last error: {type(exc).__name__}: {exc}") from None
                # Ray gave up on this actor: replace it and send the batch again (first in line).
                with contextlib.suppress(Exception):
                    ray.kill(workers[slot], no_restart=True)
                workers[slot] = new_worker()
                try:
                    # Wait until the replacement has built its generator, so that its start-up
                    # time never counts against the batch timeout.
                    ray.get(workers[slot].describe.remote())
                except ray.exceptions.RayError as start_exc:
                    raise ConfigError(f"a replacement worker actor failed to build its generator: "
                                      f"{start_exc}") from None
                result.retried_batches += 1
                pending.append(b)
                submit(slot)
                continue
            if b in done_batches:  # cannot happen (one reply per attempt); never write twice
                continue
            got = [str(r["id"]) for r in reply["records"]]
            expect = [q.id for q in batches[b]]
            if sorted(got) != sorted(expect):
                raise RuntimeError(f"batch {b}: the worker returned ids {got} for questions {expect}")
            by_id = {str(r["id"]): r for r in reply["records"]}
            if on_records is not None:
                # the batch's cost records before its results: a kill in between leaves records
                # of unfinished questions, which a resume drops, never results without records
                on_records([CostRecord(**r) for r in reply["ledger"][0]])
            for qid in expect:  # question order within the batch
                rec = by_id[qid]
                writer.write(rec)
                if on_result is not None:
                    on_result(rec)
            merge_records(result.ledger, *reply["ledger"])
            done_batches.add(b)
            result.batches += 1
            result.questions_done += len(expect)
            result.rpc_seconds += float(reply["rpc_seconds"])
            result.restarted_batches += int(reply["reconstructed"])
            submit(slot)
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                ray.kill(w, no_restart=True)
        with contextlib.suppress(Exception):
            ray.kill(retriever.actor, no_restart=True)
    result.seconds = time.perf_counter() - t_start
    if len(done_batches) != len(batches):  # pragma: no cover - the loop above only exits when all are done
        raise RagfastError(f"only {len(done_batches)} of {len(batches)} batches finished")

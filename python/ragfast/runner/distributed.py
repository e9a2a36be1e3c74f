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
  device seconds differ (:func:`ragfast.results.strip_timing`). Workers run batches in
  parallel, so W workers need at least W batches: ``batch_size <= len(questions) / W``.
- Each worker actor builds its own generator replica from a picklable factory, on a GPU when
  the cluster has GPUs (``num_gpus`` per actor; the factory is told ``device="cuda"``).
- Retrieval is ONE shared actor (:class:`RayRetriever` proxies to it), so the corpus and index
  are loaded once, not once per worker. Every worker call is one batched ``search`` with the
  same queries a single-process loop would send.
- Only the driver writes results (:class:`~ragfast.results.ResultsWriter`, fsynced per line),
  as batches complete; at the end the file is rewritten atomically in question order (ids of
  earlier runs that are not among ``questions`` keep their place after them).
- Fault tolerance: worker actors are created with Ray's ``max_restarts`` and
  ``max_task_retries``, so a worker process that dies mid-batch is restarted by Ray and the
  batch re-run on it. If Ray gives up (restarts exhausted, actor killed with ``no_restart``,
  node lost), the driver replaces the actor and resubmits the batch, up to ``max_attempts``
  times. A batch's results reach the driver only in the reply of a successful attempt, and
  the driver writes each batch once, so no question is lost or written twice; cost records of
  failed attempts die with them and are never counted.

The flat index sharded over Ray actors (``RayShardedIndex``) is a component: it lives in
:mod:`ragfast.retrieval.ray_index`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ragfast.checks import positive_int
from ragfast.cost import CostLedger, CostRecord
from ragfast.errors import ConfigError, DataError, RagfastError
from ragfast.ray_support import actor_device, require_ray
from ragfast.results import summarise
from ragfast.retrieval.base import Hit, Retriever
from ragfast.types import Question, check_questions

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
# Ray plumbing
# ---------------------------------------------------------------------------------------------

def _retryable(exc: BaseException) -> bool:
    """Errors that mean "the process running the batch is gone", not "the batch is wrong"."""
    ex = require_ray().exceptions
    kinds = tuple(getattr(ex, n) for n in ("RayActorError", "WorkerCrashedError", "NodeDiedError",
                                           "OutOfMemoryError", "ObjectLostError", "OwnerDiedError",
                                           "LocalRayletDiedError") if hasattr(ex, n))
    return isinstance(exc, kinds)


@contextlib.contextmanager
def ray_session(address: str | None = "local", *, num_cpus: int | None = None, num_gpus: int | None = None,
                runtime_env: dict[str, Any] | None = None) -> Iterator[Any]:
    """Connect to Ray for the duration of a ``with`` block.

    Parameters
    ----------
    address : str or None
        ``"local"`` starts a local cluster (``ray.init(num_cpus=...)``) that is shut down on
        exit; any other value (``"auto"``, ``"ray://host:10001"``, ``"10.0.0.1:6379"``) connects
        to an existing cluster and disconnects on exit. When this process is already connected
        (``ray.is_initialized()``), that connection is used as it is and left open.
    num_cpus, num_gpus : int, optional
        Logical resources of a local cluster (default: what Ray detects).
    runtime_env : dict, optional
        Passed to ``ray.init`` (e.g. ``{"env_vars": {...}}``).

    Yields
    ------
    module
        The ``ray`` module.
    """
    ray = require_ray()
    if ray.is_initialized():
        yield ray
        return
    import logging

    kw: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if runtime_env:
        kw["runtime_env"] = runtime_env
    if address in (None, "local"):
        ray.init(num_cpus=num_cpus, num_gpus=num_gpus, **kw)
    else:
        if not isinstance(address, str) or not address.strip():
            raise ConfigError(f"Ray address must be 'local' or a cluster address, got {address!r}")
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            # Ray wraps the real reason (e.g. a missing auth token) as the cause: show it.
            cause = exc.__cause__
            why = f"; cause: {type(cause).__name__}: {str(cause)[:400]}" if cause is not None else ""
            raise ConfigError(f"cannot connect to the Ray cluster at {address!r}: {exc}{why}") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def _call_factory(factory: Callable[..., Any], device: str) -> Any:
    """Call a slot factory, telling it the device when it takes a ``device`` argument."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes = "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return factory(device=device) if takes else factory()


def _check_picklable(obj: Any, what: str) -> None:
    ray = require_ray()
    try:
        ray.cloudpickle.dumps(obj)
    except Exception as exc:
        raise ConfigError(f"{what} cannot be sent to Ray actors ({type(exc).__name__}: {exc}); use a "
                          "module-level function, a functools.partial of one, or a small dataclass") from None


def _records_of(ledger: CostLedger) -> tuple[list[dict[str, Any]], dict[str, int]]:
    # CostLedger holds a lock (not picklable): ship plain records between processes.
    return [dataclasses.asdict(r) for r in ledger.records], dict(ledger.batches)


def _merge_records(ledger: CostLedger, records: list[dict[str, Any]], batches: dict[str, int]) -> None:
    part = CostLedger()
    part.records = [CostRecord(**r) for r in records]
    for k, v in batches.items():
        part.batches[k] += int(v)
    ledger.merge(part)


# ---------------------------------------------------------------------------------------------
# Shared retriever actor
# ---------------------------------------------------------------------------------------------

class _RetrieverActor:
    """Holds one Retriever (corpus + index loaded once) and answers batched searches."""

    def __init__(self, make_retriever: Callable[..., Any]):
        self.device = actor_device()
        self.retriever = _call_factory(make_retriever, self.device)
        if not isinstance(self.retriever, Retriever) and not hasattr(self.retriever, "search"):
            raise ConfigError(f"make_retriever returned {type(self.retriever).__name__}, not a Retriever")
        self.calls = 0

    def describe(self) -> dict[str, Any]:
        d = self.retriever.describe() if hasattr(self.retriever, "describe") else {
            "name": type(self.retriever).__name__}
        return {**d, "meaningful": bool(getattr(self.retriever, "meaningful", d.get("meaningful", True))),
                "pid": os.getpid(), "device": self.device}

    def search(self, queries: list[str], k: int, exclude: list[list[str]] | None,
               question_ids: list[str] | None, kwargs: dict[str, Any]):
        led = CostLedger()
        t0 = time.perf_counter()
        hits = self.retriever.search(queries, k, exclude=exclude, ledger=led, question_ids=question_ids, **kwargs)
        self.calls += 1
        return hits, _records_of(led), time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "pid": os.getpid()}


class RayRetriever(Retriever):
    """A :class:`~ragfast.retrieval.base.Retriever` whose searches run in a shared Ray actor.

    The actor holds the real retriever (encoder, index, corpus), built once by a factory; any
    number of workers hold this proxy (it pickles as the actor handle) and send it whole
    batches. Cost records the real retriever makes (encoder tokens, search seconds, bytes
    scanned) come back with the hits and land on the caller's ledger under the caller's
    question ids, exactly as a local retriever's would. The round trip beyond the actor's own
    time is kept in :attr:`rpc_seconds` (not on the ledger: it is transport, not retrieval).

    Parameters
    ----------
    actor : ray.actor.ActorHandle
        A retriever actor, as made by :meth:`launch`.
    info : dict, optional
        Its ``describe()`` (fetched from the actor when not given).

    Examples
    --------
    >>> ret = RayRetriever.launch(functools.partial(build_default_retriever, corpus))  # doctest: +SKIP
    >>> SearchR1Loop(generator, ret, config).run(questions)  # doctest: +SKIP
    """

    name = "ray-retriever"

    def __init__(self, actor: Any, info: dict[str, Any] | None = None):
        self.actor = actor
        self._info = dict(info) if info is not None else require_ray().get(actor.describe.remote())
        self.name = str(self._info.get("name", "ray-retriever"))
        self.meaningful = bool(self._info.get("meaningful", True))
        self.rpc_seconds = 0.0
        self._factory_ref = None  # set by launch(): keeps the factory alive for restarts
        self.remote_seconds = 0.0
        self.calls = 0

    @classmethod
    def launch(cls, make_retriever: Callable[..., Any], *, num_cpus: float = 1.0, num_gpus: float = 0.0,
               max_restarts: int = 3, max_task_retries: int = 3, max_concurrency: int = 1) -> "RayRetriever":
        """Start the shared retriever actor and wait until its retriever is built.

        Parameters
        ----------
        make_retriever : callable
            Picklable factory returning a Retriever; called inside the actor, as
            ``make_retriever(device=...)`` when it takes ``device``.
        num_cpus, num_gpus : float
            Resources the actor holds.
        max_restarts, max_task_retries : int
            Ray fault tolerance: a crashed actor is rebuilt and the interrupted search re-sent
            (searches have no side effects, so a retry is safe).
        max_concurrency : int
            Searches served at once. 1 (default) serves worker batches one after another, each
            exactly as a single-process loop would run it.

        Raises
        ------
        ConfigError
            When the factory cannot be pickled or the actor fails to build its retriever.
        """
        ray = require_ray()
        _check_picklable(make_retriever, "make_retriever")
        actor_cls = ray.remote(_RetrieverActor)
        # A restarted actor re-reads its constructor arguments from the object store: hold a
        # reference to the factory for as long as this proxy lives, so a restart can find it.
        factory_ref = ray.put(make_retriever)
        actor = actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts,
                                  max_task_retries=max_task_retries, max_concurrency=max_concurrency
                                  ).remote(factory_ref)
        try:
            info = ray.get(actor.describe.remote())
        except ray.exceptions.RayError as exc:
            ray.kill(actor, no_restart=True)
            raise ConfigError(f"the retriever actor failed to build its retriever: {exc}") from None
        proxy = cls(actor, info)
        proxy._factory_ref = factory_ref
        return proxy

    def describe(self) -> dict[str, Any]:
        return {**{k: v for k, v in self._info.items() if k != "pid"}, "via": "ray actor", "proxy": type(self).__name__}

    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[str]] | None = None,
               ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None,
               **kwargs: Any) -> list[list[Hit]]:
        """Up to ``k`` hits per query, best first, computed by the shared actor in one call."""
        queries = list(queries)
        if not queries:
            return []
        if exclude is not None and len(exclude) != len(queries):
            raise ValueError(f"exclude has {len(exclude)} lists for {len(queries)} queries")
        if question_ids is not None and len(question_ids) != len(queries):
            raise ValueError(f"{len(question_ids)} question ids for {len(queries)} queries")
        ray = require_ray()
        t0 = time.perf_counter()
        ex = [list(map(str, e)) for e in exclude] if exclude is not None else None
        qids = list(question_ids) if question_ids is not None else None
        ref = self.actor.search.remote(queries, int(k), ex, qids, dict(kwargs))
        try:
            hits, (records, batches), remote = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            # The retriever raised (bad k, bad input): re-raise the original error type.
            raise exc.as_instanceof_cause() from None
        wall = time.perf_counter() - t0
        self.calls += 1
        self.remote_seconds += remote
        self.rpc_seconds += max(0.0, wall - remote)
        if ledger is not None:
            _merge_records(ledger, records, batches)
        return hits

    def stats(self) -> dict[str, float]:
        """Calls made through this proxy, seconds inside the actor, and round-trip overhead."""
        return {"calls": self.calls, "remote_seconds": self.remote_seconds, "rpc_seconds": self.rpc_seconds}


# ---------------------------------------------------------------------------------------------
# Worker actors
# ---------------------------------------------------------------------------------------------

def _default_loop(generator: Any, retriever: Any, config: Any, ledger: CostLedger) -> Any:
    from ragfast.methods.searchr1.loop import SearchR1Loop

    return SearchR1Loop(generator, retriever, config, ledger=ledger)


#: In :class:`PipelineLoop` slots: pass the worker's own generator (e.g. StepGap's checker LLM).
GENERATOR = "<worker generator>"


class PipelineLoop:
    """``make_loop`` for pipelines written as functions (``run_s2g``, ``run_stepgap``, ...).

    Each batch calls ``fn(questions, generator, retriever, config=config, ledger=ledger,
    **slots, **kwargs)``. The extra slots (a judge, an NLI model) are built from their
    factories once per worker actor, on its device, the first time it runs a batch; the
    string :data:`GENERATOR` as a slot passes the worker's generator itself.

    Parameters
    ----------
    fn : callable
        Module-level pipeline function returning the batch's list of Trajectory.
    slots : dict, optional
        keyword -> picklable factory (called as ``factory(device=...)`` when it takes a device)
        or :data:`GENERATOR`.
    **kwargs
        Plain keyword arguments for ``fn`` (e.g. ``threshold=0.7``).

    Examples
    --------
    >>> from ragfast.methods.s2g.loop import run_s2g  # doctest: +SKIP
    >>> make_loop = PipelineLoop(run_s2g, slots={"judge": EncoderJudge}, threshold=0.7)  # doctest: +SKIP
    >>> run_on_ray(questions, make_loop=make_loop, ...)  # doctest: +SKIP
    """

    def __init__(self, fn: Callable[..., Any], slots: dict[str, Any] | None = None, **kwargs: Any):
        if not callable(fn):
            raise ConfigError(f"PipelineLoop needs a callable pipeline function, got {type(fn).__name__}")
        self.fn = fn
        self.slots = dict(slots or {})
        for name, f in self.slots.items():
            if not (isinstance(f, str) and f == GENERATOR) and not callable(f):
                raise ConfigError(f"PipelineLoop slot {name!r} must be a factory or GENERATOR, got {type(f).__name__}")
        clash = set(self.slots) & set(kwargs) | ({"config", "ledger"} & (set(self.slots) | set(kwargs)))
        if clash:
            raise ConfigError(f"PipelineLoop: {sorted(clash)} given twice (config and ledger are passed by the loop)")
        self.kwargs = kwargs
        self._built: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ship the factories, never models built in this process.
        return {**self.__dict__, "_built": None}

    def __call__(self, generator: Any, retriever: Any, config: Any, ledger: CostLedger) -> "_BoundPipeline":
        if self._built is None:
            device = actor_device() if require_ray().is_initialized() else "cpu"
            self._built = {name: (None if isinstance(f, str) else _call_factory(f, device))
                           for name, f in self.slots.items()}
        built = {name: (generator if isinstance(self.slots[name], str) else v) for name, v in self._built.items()}
        return _BoundPipeline(self.fn, generator, retriever, config, ledger, {**built, **self.kwargs})


class _BoundPipeline:
    def __init__(self, fn, generator, retriever, config, ledger, kwargs):
        self.fn, self.generator, self.retriever = fn, generator, retriever
        self.config, self.ledger, self.kwargs = config, ledger, kwargs

    def run(self, questions: list[Question]) -> list[Any]:
        return self.fn(list(questions), self.generator, self.retriever, config=self.config, ledger=self.ledger,
                       **self.kwargs)


class _Worker:
    """One generator replica; runs whole batches through the multi-turn loop."""

    def __init__(self, make_generator: Callable[..., Any], retriever_actor: Any, retriever_info: dict[str, Any],
                 make_loop: Callable[..., Any] | None):
        self.device = actor_device()
        self.generator = _call_factory(make_generator, self.device)
        self.retriever = RayRetriever(retriever_actor, retriever_info)
        self.make_loop = make_loop or _default_loop
        self.batches = 0
        # Asked once per life: True when Ray restarted this actor after its process died.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray's own property uses a deprecated accessor
            try:
                self.reconstructed = bool(require_ray().get_runtime_context().was_current_actor_reconstructed)
            except Exception:
                self.reconstructed = False

    def describe(self) -> dict[str, Any]:
        g = self.generator
        d = g.describe() if hasattr(g, "describe") else {"name": type(g).__name__}
        return {**d, "meaningful": bool(getattr(g, "meaningful", d.get("meaningful", True))),
                "pid": os.getpid(), "device": self.device}

    def run_batch(self, batch_id: int, questions: list[Question], config: Any) -> dict[str, Any]:
        ledger = CostLedger()
        before = self.retriever.stats()
        t0 = time.perf_counter()
        loop = self.make_loop(self.generator, self.retriever, config, ledger)
        trajs = loop.run(list(questions))
        after = self.retriever.stats()
        self.batches += 1
        return {
            "batch": batch_id,
            "records": [t.to_dict() if hasattr(t, "to_dict") else dict(t) for t in trajs],
            "ledger": _records_of(ledger),
            "seconds": time.perf_counter() - t0,
            "rpc_seconds": after["rpc_seconds"] - before["rpc_seconds"],
            "pid": os.getpid(),
            "device": self.device,
            "reconstructed": self.reconstructed,
        }


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
    from ragfast.results import json_default, read_results

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
        E.g. ``functools.partial(ragfast.commands.run.make_generator, "scripted", max_turns=4)``.
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
    from ragfast.results import ResultsWriter, read_results

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
    _check_picklable(make_generator, "make_generator")
    _check_picklable(make_retriever, "make_retriever")
    if make_loop is not None:
        _check_picklable(make_loop, "make_loop")

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
    worker_cls = ray.remote(_Worker).options(num_cpus=worker_cpus, num_gpus=float(worker_gpus),
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
                if not _retryable(exc):
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
            _merge_records(result.ledger, *reply["ledger"])
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

"""Ray's side of the scale-out: the session, the shared retriever actor, the worker actors and pipelines.

:func:`ragfast.runner.distributed.run_on_ray` drives them; see that module for the design
(batches as units of work, one retriever actor, retries and restarts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

from ragfast.accounting.ledger import CostLedger, CostRecord
from ragfast.errors import ConfigError
from ragfast.infra.ray_support import actor_device, require_ray
from ragfast.outputs.failures import FailureStreak, failure_record, isolate
from ragfast.retrieval.base import Hit, Retriever
from ragfast.types import Question

__all__ = ["ray_session", "RayRetriever", "PipelineLoop", "GENERATOR", "Worker", "retryable", "check_picklable",
           "merge_records"]


# ---------------------------------------------------------------------------------------------
# Ray plumbing
# ---------------------------------------------------------------------------------------------

def retryable(exc: BaseException) -> bool:
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


def check_picklable(obj: Any, what: str) -> None:
    ray = require_ray()
    try:
        ray.cloudpickle.dumps(obj)
    except Exception as exc:
        raise ConfigError(f"{what} cannot be sent to Ray actors ({type(exc).__name__}: {exc}); use a "
                          "module-level function, a functools.partial of one, or a small dataclass") from None


def _records_of(ledger: CostLedger) -> tuple[list[dict[str, Any]], dict[str, int]]:
    # CostLedger holds a lock (not picklable): ship plain records between processes.
    return [dataclasses.asdict(r) for r in ledger.records], dict(ledger.batches)


def merge_records(ledger: CostLedger, records: list[dict[str, Any]], batches: dict[str, int]) -> None:
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
        check_picklable(make_retriever, "make_retriever")
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
            merge_records(ledger, records, batches)
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


class Worker:
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
        records: dict[str, dict[str, Any]] = {}

        def run(qs: list[Question]) -> None:
            for t in loop.run(qs):
                rec = t.to_dict() if hasattr(t, "to_dict") else dict(t)
                records[str(rec["id"])] = rec

        def record(q: Question, exc: BaseException) -> None:
            records[q.id] = failure_record(q, exc, ledger.for_question(q.id))

        # As in one process: a question whose component fails is recorded as failed and the
        # batch's other questions are answered (a component failing every question still stops
        # the run, as an error of this task).
        isolate(run, list(questions), done=lambda: set(records), record=record, forget=ledger.drop,
                streak=FailureStreak(f"batch {batch_id}"))
        after = self.retriever.stats()
        self.batches += 1
        return {
            "batch": batch_id,
            "records": [records[q.id] for q in questions],
            "ledger": _records_of(ledger),
            "seconds": time.perf_counter() - t0,
            "rpc_seconds": after["rpc_seconds"] - before["rpc_seconds"],
            "pid": os.getpid(),
            "device": self.device,
            "reconstructed": self.reconstructed,
        }

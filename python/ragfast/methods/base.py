"""What a method is, and the registry the runner and the command line read.

A method is one :class:`Method` subclass plus one :func:`register` call in its package's
``method.py``. The runner (:func:`ragfast.runner.run_methods.run_methods`) builds the slots once,
calls :meth:`Method.prepare` once (S2G chooses its threshold there), then :meth:`Method.run` on
the questions not finished yet; ``ragfast bench`` runs every registered method, ``ragfast run M``
one of them, through that same runner, so both write the same files.

A method only sees its settings, its slots and a recorder: it never imports the runner or the
commands (``tests/test_layers.py``), so the same class runs in a local process and, for methods
that declare :meth:`Method.ray_pipeline`, on Ray worker actors.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Protocol, Sequence

from ragfast.errors import ConfigError
from ragfast.types import Question, Trajectory

__all__ = ["Slots", "Recorder", "RayPipeline", "Method", "register", "get", "names", "registered",
           "unknown", "BUILTIN_PACKAGES", "SLOT_NAMES"]

#: The slots a method may ask for (:attr:`Method.slots`); the runner builds only those asked for.
SLOT_NAMES: tuple[str, ...] = ("reasoner", "retriever", "judge", "nli", "checker", "head", "planner")

#: The packages whose ``method.py`` registers a built-in method, in the bench's order.
BUILTIN_PACKAGES: tuple[str, ...] = ("searchr1", "s2g", "stepgap", "reloop")


@dataclass
class Slots:
    """The components that fill each slot of a run, built once by the runner and shared by the methods.

    Attributes
    ----------
    questions : list of Question
        The test questions of the run (after ``offset``/``limit``).
    corpus : Corpus or None
        The passages the retriever searches (None when no method of the run searches).
    retriever : Retriever or None
    make_generator : callable
        A reasoner for one method: a fresh scripted oracle each call (its state is per run), else
        the one shared model.
    generator_info : dict
        The reasoner's slot entry (:func:`ragfast.outputs.results.slot_entry`).
    judge, nli : object or None
        Built only when a method of the run asks for them.
    checker : object or None
        StepGap's LLM of stages A-C (``checker_llm``; None: those stages are skipped).
    head, planner : object or None
        RELOOP's answer head (``head``) and its LLM planner (``planner_model``, with ``planner llm``).
    encoder : object or None
        The run's retrieval encoder (shared by the retriever and the judges; None for a URL index).
    """

    questions: list[Question]
    corpus: Any
    retriever: Any
    make_generator: Callable[[], Any]
    generator_info: dict[str, Any]
    judge: Any
    nli: Any
    checker: Any = None
    head: Any = None
    planner: Any = None
    encoder: Any = None


class Recorder(Protocol):
    """Where a method puts each finished question (:class:`ragfast.runner.recording.MethodRecorder`)."""

    ledger: Any

    @property
    def done(self) -> set[str]: ...

    def finish(self, traj: Trajectory | Mapping[str, Any]) -> None: ...


@dataclass
class RayPipeline:
    """How a method runs on Ray worker actors (:class:`ragfast.runner.distributed.PipelineLoop`).

    Attributes
    ----------
    fn : callable or None
        A module-level ``fn(questions, generator, retriever, config=..., ledger=..., **slots,
        **kwargs)``; None runs the plain Search-R1 loop.
    config : object
        The loop's config (picklable).
    slots : dict
        keyword -> ``(slot, spec, options)`` built on each actor by the runner's factory
        (``("judge", "encoder", {})``), or the string ``"reasoner"`` for the actor's own reasoner.
    kwargs : dict
        Plain keyword arguments for ``fn`` (S2G's ``threshold``).
    """

    fn: Callable[..., Any] | None
    config: Any
    slots: dict[str, Any]
    kwargs: dict[str, Any]


class Method:
    """One multi-round method: subclass, set :attr:`name` and :attr:`slots`, write :meth:`run`, :func:`register`.

    An instance holds the run's settings (:class:`ragfast.runner.settings.RunSettings`); its own
    config dataclass is built from them by :meth:`config`, so every method reads one name per
    setting.

    Attributes
    ----------
    name : str
        The name on the command line (``ragfast run NAME``, ``ragfast bench --method NAME``) and
        of its files (``trajectories/NAME.jsonl``, ``ledgers/NAME.jsonl``).
    slots : tuple of str
        The slots it needs, from :data:`SLOT_NAMES`.
    config_type : type or None
        Its config dataclass (documentation and ``--help``; :meth:`config` builds it).
    validation : bool
        Its :meth:`prepare` runs the validation questions (``val_data``...), so ``--limit``
        caps them too (S2G); a method that never reads them keeps them out of its run's settings.
    reads_sessions_of : tuple of str
        Methods whose sessions its :meth:`after_run` continues (S2G's probes of native Search-R1's
        states): on a generator that can keep ended sessions' keys/values, the runner shelves
        theirs under the method's name (``keep_ended(shelve=...)``) for it to reuse.
    """

    name: ClassVar[str] = ""
    slots: ClassVar[tuple[str, ...]] = ("reasoner", "retriever")
    config_type: ClassVar[type | None] = None
    validation: ClassVar[bool] = False
    reads_sessions_of: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: Any):
        self.settings = settings

    def config(self) -> Any:
        """This method's config dataclass, from the run's settings (None when it has none)."""
        return None

    def prepare(self, slots: Slots, out: Path, console: Any = None) -> None:
        """Work done once before the questions run, its result written under ``out`` (default: none).

        Called on resume too, so it must read back what it wrote rather than redo it.
        """

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        """Run the questions; hand each finished one to ``recorder.finish`` as it finishes.

        Returns the trajectories (or trajectory records: mappings with the trajectory's fields).
        The cost records go to ``recorder.ledger``. Each call to a component is wrapped in
        :func:`ragfast.errors.blame` with its component and questions, so that a failure is
        recorded for those questions and the run goes on (:mod:`ragfast.outputs.failures`): the runner
        may then call ``run`` again in the same run with some of the questions, so it keeps no
        state between calls beyond what :meth:`prepare` set.
        """
        raise NotImplementedError

    def ray_pipeline(self) -> RayPipeline | None:
        """How to run on Ray, or None: then the runner runs it in the driver process (RELOOP)."""
        return None

    def report(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
        """This method's own section of ``summary.json`` (``methods.<name>.report``), from its
        finished records in question order; None (default) when it has none."""
        return None

    def after_run(self, slots: Slots, records: Mapping[str, Sequence[Mapping[str, Any]]], out: Path,
                  progress: Any = None) -> None:
        """Analyses over the finished records of every method of the run (S2G's threshold sweep)."""

    def check(self) -> None:
        """Refuse settings this method cannot run with (one :class:`ConfigError` line)."""


_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Add a method class to the registry (usable as a class decorator); returns it.

    Raises
    ------
    ConfigError
        No name, an unknown slot, or a name another class already holds.
    """
    if not isinstance(cls, type) or not issubclass(cls, Method):
        raise ConfigError(f"register() takes a Method subclass, got {cls!r}")
    if not cls.name or not cls.name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"{cls.__name__}.name must be a word, got {cls.name!r}")
    bad = [s for s in cls.slots if s not in SLOT_NAMES]
    if bad:
        raise ConfigError(f"{cls.__name__}.slots: unknown slot(s) {bad}; choose from {list(SLOT_NAMES)}")
    old = _REGISTRY.get(cls.name)
    if old is not None and old is not cls and old.__qualname__ != cls.__qualname__:
        raise ConfigError(f"method {cls.name!r} is registered twice ({old.__module__}.{old.__qualname__} and "
                          f"{cls.__module__}.{cls.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    import importlib

    for pkg in BUILTIN_PACKAGES:
        importlib.import_module(f"ragfast.methods.{pkg}.method")


def registered() -> dict[str, type[Method]]:
    """name -> class of every registered method: the built-in four first, in the bench's order."""
    _load_builtins()
    first = {n: _REGISTRY[n] for n in BUILTIN_PACKAGES if n in _REGISTRY}
    return {**first, **{n: c for n, c in _REGISTRY.items() if n not in first}}


def names() -> tuple[str, ...]:
    """The registered methods' names (the bench runs them in this order)."""
    return tuple(registered())


def get(name: str) -> type[Method]:
    """The method class registered as ``name``.

    Raises
    ------
    ConfigError
        No method has that name (the message lists the registered ones).
    """
    reg = registered()
    if name not in reg:
        raise ConfigError(f"unknown method {name!r}; choose from {list(reg)}")
    return reg[name]


def unknown(methods: Iterable[str]) -> list[str]:
    """The names in ``methods`` no method is registered under."""
    reg = registered()
    return [m for m in methods if m not in reg]

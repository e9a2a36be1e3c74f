"""ragfast's one progress system: rich bars on a terminal, plain lines otherwise.

Everything that reports progress (corpus embedding, the methods of a bench, the S2G validation
pass) asks for the active :class:`RunProgress` with :func:`current`; only the outermost caller
opens one. So there is one live display at a time, and nothing interleaves.

When stdout or stderr is not a terminal (CI logs, ``| tee``), each task prints a plain line at its start,
then at most every ``interval`` seconds, and at its end::

    [progress] embedding minilm: 1024/3967 passages (26%) 0:00:41
"""
from __future__ import annotations

import contextvars
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["RunProgress", "Task", "current", "progress_task", "TurnReporter", "turn_reporting"]

log = logging.getLogger("ragfast.infra.progress")

_ACTIVE: contextvars.ContextVar["RunProgress | None"] = contextvars.ContextVar("ragfast_progress", default=None)


@dataclass
class Task:
    """One progress bar: ``advance`` it, and set a ``status`` (e.g. "turn 2 · 64 active")."""

    owner: "RunProgress"
    description: str
    total: int | None
    completed: int = 0
    unit: str = ""
    status: str = ""
    started: float = field(default_factory=time.perf_counter)
    rich_id: Any = None
    last_line: float = 0.0

    def advance(self, n: int = 1) -> None:
        self.completed += n
        self.owner.refresh(self)

    def set_status(self, status: str) -> None:
        self.status = status
        self.owner.refresh(self)

    def update(self, *, total: int | None = None, completed: int | None = None) -> None:
        if total is not None:
            self.total = total
        if completed is not None:
            self.completed = completed
        self.owner.refresh(self)

    def done(self, *, failed: bool = False) -> None:
        """End the task; ``failed``: it was cut short by an error (never reported as done)."""
        self.owner.finish(self, failed=failed)


class RunProgress:
    """A progress display for one run; use as a context manager.

    Parameters
    ----------
    console : rich.console.Console, optional
        Where bars go (default: stderr).
    plain : bool, optional
        Force line-based output (default: when the console is not a terminal).
    interval : float
        Seconds between plain progress lines of one task.
    enabled : bool
        False shows nothing (tasks still count).
    """

    def __init__(self, console: Any = None, *, plain: bool | None = None, interval: float = 10.0,
                 enabled: bool = True):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        if plain is None:
            # Bars only when a person watches both streams; a piped or redirected run (CI logs,
            # `| tee`) gets lines that read well in a file.
            plain = not (self.console.is_terminal and _isatty(sys.stdout))
        self.plain = plain
        self.interval = interval
        self.enabled = enabled
        self._rich = None
        self._token = None

    def __enter__(self) -> "RunProgress":
        if self.enabled and not self.plain:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self._rich = Progress(TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[unit]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                  TextColumn("{task.fields[status]}"), console=self.console)
            self._rich.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None
        if self._rich is not None:
            self._rich.__exit__(*exc)
            self._rich = None

    def print(self, *args: Any, **kw: Any) -> None:
        """Print above the bars (never through them)."""
        self.console.print(*args, **kw)

    def task(self, description: str, total: int | None, *, completed: int = 0, unit: str = "") -> Task:
        """Start a bar of ``total`` steps (``None``: unknown)."""
        t = Task(self, description, total, completed, unit)
        if self._rich is not None:
            t.rich_id = self._rich.add_task(description, total=total, completed=completed, unit=unit, status="")
        elif self.enabled and self.plain:
            self._line(t, force=True)
        return t

    def refresh(self, t: Task) -> None:
        if self._rich is not None:
            self._rich.update(t.rich_id, completed=t.completed, total=t.total, status=t.status)
        elif self.enabled and self.plain:
            self._line(t)

    def finish(self, t: Task, *, failed: bool = False) -> None:
        if failed:
            t.status = (t.status + " " if t.status else "") + "stopped by an error"
        if self._rich is not None:
            self._rich.update(t.rich_id, completed=t.completed, total=t.total, status=t.status)
        elif self.enabled and self.plain:
            self._line(t, force=True, end=not failed)

    def _line(self, t: Task, force: bool = False, end: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - t.last_line < self.interval:
            return
        t.last_line = now
        el = int(now - t.started)
        frac = f" ({100 * t.completed / t.total:.0f}%)" if t.total else ""
        of = f"/{t.total}" if t.total is not None else ""
        status = f" {t.status}" if t.status else ""
        unit = f" {t.unit}" if t.unit else ""
        msg = (f"[progress] {t.description}: {t.completed}{of}{unit}{frac} {el // 3600}:{el // 60 % 60:02d}:{el % 60:02d}"
               f"{status}{' done' if end else ''}")
        print(msg, file=sys.stderr if self.console.stderr else sys.stdout, flush=True)
        log.debug(msg)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def current() -> RunProgress | None:
    """The active progress display, if a caller up the stack opened one."""
    return _ACTIVE.get()


class progress_task:  # noqa: N801 - used like a function in a with statement
    """A task on the active display, or on a display of its own when none is active.

    >>> with progress_task("embedding", 100, unit="passages") as t:  # doctest: +SKIP
    ...     t.advance(10)
    """

    def __init__(self, description: str, total: int | None, *, completed: int = 0, unit: str = "",
                 enabled: bool = True):
        self.args = (description, total)
        self.kw = {"completed": completed, "unit": unit}
        self.enabled = enabled
        self._own: RunProgress | None = None

    def __enter__(self) -> Task:
        run = current()
        if not self.enabled:
            run = RunProgress(enabled=False)  # counts, shows nothing, and hides no one else's bars
        elif run is None:
            self._own = RunProgress(enabled=self.enabled).__enter__()
            run = self._own
        self.task = run.task(*self.args, **self.kw)
        return self.task

    def __exit__(self, *exc: Any) -> None:
        # "reloop: 0/10 ... done" just before a traceback misleads: an error is not done
        self.task.done(failed=bool(exc) and exc[0] is not None)
        if self._own is not None:
            self._own.__exit__(*exc)


class TurnReporter:
    """Wraps a reasoner so each batched generation (one loop turn) updates a progress task.

    Everything else is delegated untouched; the status reads ``turn k · m active (≤n
    turns/question)``, where a turn is one batched ``generate`` call over the running trajectories
    and ``n`` the most generations one question can take (budget + the answer turn), followed by
    the generator's ``budget_note`` when its memory budget split the turn into smaller chunks.
    """

    def __init__(self, generator: Any, task: Any, max_turns: int):
        self._gen = generator
        self._task = task
        self._max = max_turns
        self._calls = 0

    def generate(self, ids: Sequence[str], *args: Any, **kw: Any) -> Any:
        self._calls += 1
        # batches refill as questions finish, so the loop's turn count can pass one question's maximum
        status = f"turn {self._calls} · {len(ids)} active (≤{self._max} turns/question)"
        self._task.set_status(status)
        out = self._gen.generate(ids, *args, **kw)
        note = getattr(self._gen, "budget_note", "")
        if note:
            self._task.set_status(f"{status} · {note}")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._gen, name)


def turn_reporting(make_generator: Callable[[], Any], task: Any, max_turns: int) -> Callable[[], Any]:
    """A generator factory whose generators report their turns on ``task``."""
    def make() -> Any:
        return TurnReporter(make_generator(), task, max_turns)

    return make

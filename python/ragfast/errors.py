"""Errors that name the problem. The CLI prints them as one line instead of a traceback.

Beside the error types, what a failure of one component call says about the questions it
carried: :func:`blame` marks an exception raised inside a call with the component and the
questions that call was for, and :func:`mark_transient` says whether a retry might pass (a
connection reset, a 5xx, a timeout) or not (a 4xx, a refused input). The runner reads both to
record a failing question as data and go on with the others (:mod:`ragfast.outputs.failures`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator


class RagfastError(Exception):
    """Base class of every error ragfast raises on purpose."""


class DataError(RagfastError, ValueError):
    """Bad input data: a missing file, an unknown layout, a line that does not parse."""


class ModelError(RagfastError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""


class ConfigError(RagfastError, ValueError):
    """A bad option, preset or configuration file."""


class MemoryBudgetError(RagfastError, MemoryError):
    """A memory budget too small for the work (one session's turn, say): it depends on the batch and the
    budget, not on a question, so it stops the run instead of failing a question."""


@dataclass(frozen=True)
class Blame:
    """Where an exception was raised: the component called (``"reasoner"``, ``"retriever"``,
    ``"judge"``...; None when only the questions are known) and the questions of that call."""

    component: str | None
    question_ids: tuple[str, ...]


_BLAME = "ragfast_blame"
_TRANSIENT = "ragfast_transient"


@contextlib.contextmanager
def blame(component: str | None, question_ids: Iterable[str]) -> Iterator[None]:
    """Mark an :class:`Exception` raised inside the block as a failure of ``component`` on ``question_ids``.

    The innermost mark knows most: a component already named inside is kept, and so are
    question ids already named inside when they are among ``question_ids`` (one request of a
    batched call names its own session). Anything else propagates unmarked.

    Examples
    --------
    >>> with blame("reasoner", ["q1", "q2"]):  # doctest: +SKIP
    ...     texts = generator.generate(["q1", "q2"], ...)
    """
    try:
        yield
    except Exception as exc:
        ids = tuple(str(q) for q in question_ids)
        old = blame_of(exc)
        comp = old.component if old is not None and old.component is not None else component
        keep = old is not None and old.question_ids and set(old.question_ids) <= set(ids)
        setattr(exc, _BLAME, Blame(comp, old.question_ids if keep else ids))
        raise


def blame_of(exc: BaseException) -> Blame | None:
    """The :class:`Blame` of an exception (None when no :func:`blame` block marked it)."""
    b = getattr(exc, _BLAME, None)
    return b if isinstance(b, Blame) else None


def mark_transient(exc: BaseException, transient: bool) -> BaseException:
    """Say whether ``exc`` may pass on a retry (a reset, a 5xx, 408, 429, a timeout); returns ``exc``."""
    setattr(exc, _TRANSIENT, bool(transient))
    return exc


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` was marked transient (:func:`mark_transient`), else False."""
    return bool(getattr(exc, _TRANSIENT, False))


# Optional packages by import name: (what to pip install, the ragfast extra that brings it).
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "fastapi": ("fastapi", "serve"), "uvicorn": ("uvicorn", "serve"), "httpx": ("httpx", "serve"),
    "starlette": ("fastapi", "serve"), "ray": ("ray", "dist"), "sklearn": ("scikit-learn", "train"),
    "optimum": ("optimum", "optimum"), "triton": ("triton", "gpu"),
    "gguf": ("gguf", "models"),
}


def missing_dependency_message(exc: ModuleNotFoundError) -> str | None:
    """One line naming the missing package and the extra to install; None for ragfast's own modules.

    A missing module of ragfast itself is a broken install or a bug, not bad input: the caller
    lets that one through as a traceback.
    """
    name = (exc.name or "").split(".")[0]
    if not name or name == "ragfast":
        return None
    pkg, extra = OPTIONAL_PACKAGES.get(name, (name, ""))
    how = f"pip install 'ragfast[{extra}]' (or pip install {pkg})" if extra else f"pip install {pkg}"
    return f"this command needs the Python package {pkg!r}, which is not installed: {how}"

"""A question whose component failed, as data: its record, and a run that goes on without it.

A component call that fails inside a :func:`ragfast.errors.blame` block names its component
and the questions it carried. :func:`isolate` runs questions so that such a failure costs only
the question that causes it: a call that failed for one named question records that question
(:func:`failure_record`, a trajectory line with ``stop_reason`` ``"failed: <component>:
<error>: <message>"`` and a ``failure`` field) and runs the others again; a deterministic
failure of a call over several questions is narrowed by running each half of them on its own;
a transient one (retries spent on a reset, a 5xx, 408, 429 or a timeout) records every question
of the call, since none of them caused it. Anything not raised inside a component call (a
setting, a full disk, a bug in a loop) still stops the run.

Readers treat a failed question as answered wrong (EM and F1 0, in every mean and paired
delta) and count failures per component (:func:`failure_counts`); ``--resume`` keeps the
records, ``--retry-failed`` drops them first (:func:`drop_failures`) so the questions run again.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ragfast.errors import ConfigError, RagfastError, blame_of, is_transient
from ragfast.types import Question, Trajectory

__all__ = ["failure_record", "failure_of", "answered", "failure_counts", "is_question_failure", "isolate",
           "FailureStreak", "drop_failures", "MAX_FAILED_IN_A_ROW", "FAILED_SCORE"]

log = logging.getLogger(__name__)

#: How every mean and paired delta treats a failed question (summary.json says it beside each method).
FAILED_SCORE = ("a failed question scores 0 in EM and F1, in every mean and paired delta; its cost is what it "
                "spent before failing")

#: Questions failing in a row, none answered between them and over at least two calls, that stop
#: the run: a component failing every question is down or misconfigured, and each further
#: question would spend its retries (up to --total-timeout) for nothing. With 1% of questions
#: refused independently, ten in a row come up with probability 1e-20.
MAX_FAILED_IN_A_ROW = 10


def failure_record(question: Question, exc: BaseException, cost: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The trajectory line of a question whose component failed: no turns, no answer, EM and F1 0.

    Parameters
    ----------
    question : Question
    exc : Exception
        The failure, marked by :func:`ragfast.errors.blame` (its component; ``unknown`` without one).
    cost : mapping, optional
        What the failed attempt spent, by component (the trajectory's ``cost`` field).
    """
    b = blame_of(exc)
    component = (b.component if b is not None else None) or "unknown"
    message = " ".join(str(exc).split()) or type(exc).__name__
    failure = {"component": component, "error": type(exc).__name__, "message": message,
               "transient": is_transient(exc)}
    traj = Trajectory(id=question.id, question=question.question, golden_answers=list(question.golden_answers),
                      stop_reason=f"failed: {component}: {type(exc).__name__}: {message}", cost=dict(cost or {}),
                      supporting_titles=list(question.supporting_titles))
    return {**traj.to_dict(), "failure": failure}


def failure_of(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``failure`` of a trajectory record (None for an answered question)."""
    f = record.get("failure")
    return f if isinstance(f, Mapping) else None


def answered(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of questions that were answered (failed ones left out)."""
    return [r for r in records if failure_of(r) is None]


def failure_counts(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """component -> failed questions, sorted by component."""
    out: dict[str, int] = {}
    for r in records:
        f = failure_of(r)
        if f is not None:
            out[str(f.get("component"))] = out.get(str(f.get("component")), 0) + 1
    return dict(sorted(out.items()))


def is_question_failure(exc: BaseException) -> bool:
    """True for an exception a component call raised (:func:`ragfast.errors.blame`) that a question
    may be recorded for; a bad setting and running out of memory stop the run instead."""
    b = blame_of(exc)
    if b is None or b.component is None:
        return False
    # Out of memory depends on the batch, not on a question (the runner's memory budget owns it).
    return not isinstance(exc, (ConfigError, MemoryError)) and type(exc).__name__ != "OutOfMemoryError"


class FailureStreak:
    """Stops a run whose component fails every question (:data:`MAX_FAILED_IN_A_ROW`).

    Parameters
    ----------
    label : str
        Who runs (a method's name), for the message.
    limit : int
    """

    def __init__(self, label: str, limit: int = MAX_FAILED_IN_A_ROW):
        self.label, self.limit = label, limit
        self.questions = self.calls = 0

    def answered(self) -> None:
        """A question was answered: the streak is broken."""
        self.questions = self.calls = 0

    def failed(self, n: int, exc: BaseException) -> None:
        """``n`` questions of one call were recorded as failed with ``exc``.

        Raises
        ------
        RagfastError
            The streak reached the limit: one line naming the last failure.
        """
        self.questions += n
        self.calls += 1
        if self.questions >= self.limit and self.calls >= 2:
            b = blame_of(exc)
            raise RagfastError(
                f"{self.label}: {self.questions} questions in a row failed, none answered between them (last: "
                f"{(b.component if b else None) or 'unknown'}: {type(exc).__name__}: {' '.join(str(exc).split())}); "
                "the failures are recorded: fix the component, then rerun with --resume --retry-failed")


def isolate(run: Callable[[list[Question]], Any], questions: Sequence[Question], *,
            done: Callable[[], set[str]], record: Callable[[Question, BaseException], None],
            forget: Callable[[list[str]], None], streak: FailureStreak) -> None:
    """Run ``questions`` through ``run`` so that a component failure stops only the questions it is about.

    Parameters
    ----------
    run : callable
        ``run(questions)`` runs them in one go (a method's batched loop); each question it
        finishes lands in ``done()``.
    questions : sequence of Question
    done : callable
        The ids finished so far, failures recorded by ``record`` included.
    record : callable
        ``record(question, exc)`` writes a failed question's record (then it is in ``done()``).
    forget : callable
        ``forget(ids)`` drops what the questions ``ids`` had recorded (their costs) before they
        run again.
    streak : FailureStreak
        Stops the run when every question fails.

    Notes
    -----
    On a failure, the questions the failed call named and not finished yet are the suspects:
    one suspect, or a transient failure, records them; several after a deterministic failure
    are halved and each half runs on its own (one failing question among 64 costs about 12
    extra runs of a few questions each, not 63 runs of one). The questions the failed call did
    not carry run again together.
    """
    todo = list(questions)
    while todo:
        try:
            run(todo)
        except Exception as exc:
            if not is_question_failure(exc):
                raise
            fin = done()
            left = [q for q in todo if q.id not in fin]
            if not left:
                raise
            if len(left) < len(todo):
                streak.answered()
            named = set(blame_of(exc).question_ids)  # type: ignore[union-attr]
            suspects = [q for q in left if q.id in named] or left
            sus = {q.id for q in suspects}
            others = [q.id for q in left if q.id not in sus]
            if len(suspects) == 1 or is_transient(exc):
                for q in suspects:
                    record(q, exc)
                    log.warning("%s: question %s failed and is recorded; the run goes on (%s)", streak.label, q.id,
                                " ".join(str(exc).split())[:300])
                forget(others)
                streak.failed(len(suspects), exc)
            else:
                forget([q.id for q in left])
                half = len(suspects) // 2
                for part in (suspects[:half], suspects[half:]):
                    isolate(run, part, done=done, record=record, forget=forget, streak=streak)
            fin = done()
            todo = [q for q in left if q.id not in fin]
        else:
            if todo:
                streak.answered()
            return


def drop_failures(path: str | Path) -> set[str]:
    """Remove the records of failed questions from a trajectories file (``--retry-failed``).

    Every other line, a torn last line included, is kept byte for byte (the writer cuts a torn
    line itself, and says so); the file is replaced in one step.

    Returns
    -------
    set of str
        The ids of the questions dropped (they run again).
    """
    path = Path(path)
    if not path.exists():
        return set()
    kept: list[bytes] = []
    dropped: set[str] = set()
    with open(path, "rb") as f:
        for raw in f:
            if raw.endswith(b"\n") and raw.strip():
                try:
                    rec = json.loads(raw)
                except ValueError:
                    rec = None  # the reader names a corrupt line; it is not ours to drop
                if isinstance(rec, dict) and failure_of(rec) is not None:
                    dropped.add(str(rec.get("id")))
                    continue
            kept.append(raw)
    if dropped:
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped

"""Recording a run: its directory prepared, the manifest's fingerprint, the resume check, progress and writers.

Every command that runs methods goes through these, so a run directory means the same thing
whichever command wrote it:

- :func:`prepare_out` refuses to write over finished results unless ``--resume``;
- :func:`fingerprint` names everything that decides a result (data file hash, question ids,
  slot specs, model identities, config) and :func:`check_resume` refuses to continue a run made
  with anything else, in one line that names the difference;
- :class:`MethodRecorder` writes each finished question's trajectory and cost records at once,
  so a crash loses no finished work and a resume never double counts.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ragfast.accounting.ledger import CostLedger, CostRecord
from ragfast.errors import ConfigError, DataError
from ragfast.types import Trajectory

__all__ = ["prepare_out", "fingerprint", "check_resume", "data_identity", "slot_lines", "progress_bar",
           "MethodRecorder", "LedgerFile", "load_ledger", "results_without_manifest", "first_difference"]


def prepare_out(out_dir: str | Path, results: str | Path, resume: bool) -> Path:
    """Create ``out_dir``; refuse when ``results`` there already holds lines and ``resume`` is off.

    Raises
    ------
    ConfigError
        Results exist and ``resume`` is False.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / results
    if path.exists() and path.stat().st_size > 0 and not resume:
        raise ConfigError(f"{path} already holds results: pass --resume to continue, or another --out")
    return out


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_identity(data: str | Path) -> dict[str, str]:
    """``{"source", "sha256"}`` of a QA file or bundled sample (the content decides, not the name)."""
    from ragfast.data import SAMPLES, sample

    path = Path(sample(str(data))) if str(data) in SAMPLES else Path(data)
    if path.is_dir():  # a dataset directory: hash the sorted file hashes
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f.relative_to(path).as_posix().encode() + _file_sha256(f).encode())
        return {"source": str(data), "sha256": h.hexdigest()}
    return {"source": str(data), "sha256": _file_sha256(path) if path.exists() else "missing"}


def fingerprint(*, method: str, data: Mapping[str, Any], questions: Sequence[Any], slots: Mapping[str, Any],
                config: Mapping[str, Any], identities: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything that decides a run's results, as one JSON-able mapping (kept in ``manifest.json``).

    Parameters
    ----------
    method : str
        The method (or ``bench``).
    data : mapping
        Role -> :func:`data_identity` (``{"test": ..., "val": ...}``).
    questions : sequence of Question
        The questions this run answers: their ids (a resume may add questions, never drop one).
    slots : mapping
        Slot -> the spec the user gave (``"bm25"``, a path, a URL).
    identities : mapping, optional
        Left out before the models are loaded (resume is checked early, then again with them).
        Slot -> the component's manifest entry (:func:`ragfast.outputs.results.slot_entry`); its ``name``
        and ``fingerprint``/``revision`` fields identify the model.
    config : mapping
        The method's settings.
    """
    from ragfast.infra.http import is_url
    from ragfast.models.openai_generator import canonical_url

    ids = [str(q.id) for q in questions]
    fp: dict[str, Any] = {
        "method": method,
        "data": dict(data),
        "questions": {"count": len(ids), "sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest(), "ids": ids},
        # localhost and 127.0.0.1 are one server: a resume may spell it either way
        "slots": {k: canonical_url(v) if is_url(v) else v for k, v in slots.items()},
        "config": dict(config),
    }
    if identities is not None:
        fp["models"] = {k: {f: v[f] for f in ("name", "class", "fingerprint", "revision", "model") if f in v}
                        for k, v in identities.items() if isinstance(v, Mapping)}
    return json.loads(json.dumps(fp, default=str, sort_keys=True))


def first_difference(old: Any, new: Any, path: str = "") -> str | None:
    """The first field where two JSON-like mappings differ, as ``"a.b: <old> in the run on disk, <new> now"``.

    None when they are equal. Keys are visited in sorted order, so the message is stable.
    """
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for k in sorted(set(old) | set(new), key=str):
            d = first_difference(old.get(k), new.get(k), f"{path}.{k}" if path else str(k))
            if d:
                return d
        return None
    if old != new:
        def short(v: Any) -> str:
            s = json.dumps(v, default=str)
            return s if len(s) <= 70 else s[:67] + "..."
        return f"{path}: {short(old)} in the run on disk, {short(new)} now"
    return None


def check_resume(out_dir: str | Path, fp: Mapping[str, Any]) -> None:
    """Refuse to resume ``out_dir`` when its manifest's fingerprint differs from ``fp``.

    A directory without a manifest is accepted only when it holds no results (nothing ran
    yet); with results but no manifest it is refused, never reinterpreted as this run's. A
    manifest without a fingerprint is accepted. Only the keys of ``fp`` are
    compared, so a command can check the data, questions, slot specs and config before it loads
    any model, and the model identities once they are built.

    Raises
    ------
    ConfigError
        Naming the first difference, e.g. ``data.test.sha256`` or ``slots.retriever``.
    """
    path = Path(out_dir) / "manifest.json"
    if not path.exists():
        held = results_without_manifest(out_dir)
        if held is not None:
            raise ConfigError(f"--resume: {path} is missing but {held} holds results; the settings they were made "
                              "with are unknown, so they are not reinterpreted: use another --out")
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8")).get("fingerprint")
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg})") from None
    if old is None:
        return
    new = json.loads(json.dumps(fp, default=str))
    # Data, slots and settings first: they name the cause; the question ids follow from them.
    diff = first_difference({k: old.get(k) for k in new if k != "questions"},
                             {k: v for k, v in new.items() if k != "questions"}, "")
    if diff:
        raise ConfigError(f"--resume: {diff}; resume with the same settings, or use another --out")
    old_q, new_q = old.get("questions") or {}, new.get("questions") or {}
    # More questions than before (a larger --limit) is fine: what finished stays valid.
    if "questions" in new and old_q != new_q and not (
            old_q.get("ids") is not None and set(old_q["ids"]) <= set(new_q.get("ids", []))):
        raise ConfigError(f"--resume: questions: the run on disk asked {old_q.get('count')} questions that are not "
                          f"all among the {new_q.get('count')} asked now (--data/--offset/--limit); resume with "
                          "the same settings, or use another --out")


def results_without_manifest(out_dir: str | Path) -> Path | None:
    """A non-empty results or ledger file (``*.jsonl``, also under sub-directories) in ``out_dir``, or None."""
    out = Path(out_dir)
    if not out.is_dir():
        return None
    # results files first: they are what the message should name
    for f in sorted(out.rglob("*.jsonl"), key=lambda f: ("ledger" in f.as_posix(), f.as_posix())):
        if f.is_file() and f.stat().st_size > 0:
            return f
    return None


def slot_lines(slots: Mapping[str, Any]) -> list[str]:
    """One line per slot: which component fills it and whether its outputs mean anything."""
    out = []
    for name, d in slots.items():
        if d is None:
            out.append(f"{name}: none (its stages are skipped)")
            continue
        verdict = "yes" if d.get("meaningful", True) else "NO"
        out.append(f"{name}: {d.get('name')} ({d.get('class', '')})  meaningful: {verdict}"
                   + (f"  [{d['note']}]" if d.get("note") else ""))
    return out


def progress_bar(console: Any, label: str, enabled: bool, *, em: bool = True) -> Any:
    """A rich progress bar: label, bar, done/total, running EM (``task.fields['em']``), time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    cols = [TextColumn(label), BarColumn(), MofNCompleteColumn()]
    if em:
        cols.append(TextColumn("EM {task.fields[em]:.3f}"))
    return Progress(*cols, TimeRemainingColumn(), console=console, disable=not enabled)


def _write_records(f: Any, records: Iterable[CostRecord]) -> None:
    for r in records:
        f.write(json.dumps(dataclasses.asdict(r)) + "\n")


class LedgerFile:
    """A run's cost ledger file, appended (and flushed to disk) as each question finishes.

    Parameters
    ----------
    path : Path
        The JSONL ledger.
    resume : bool
        Continue the file, first dropping the records of questions not in ``finished`` (they
        run again now, so a crash between a question's ledger lines and its result line never
        double counts). Without it a file that already holds records is refused.
    finished : set of str
        Ids of the questions whose results are kept (with ``resume``).
    """

    def __init__(self, path: Path, resume: bool, finished: set[str] | None = None):
        from ragfast.outputs.results import repair_tail

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not resume and self.path.stat().st_size:
            raise DataError(f"{self.path} already holds records; pass --resume or use a new --out")
        if resume and self.path.exists():
            repair_tail(self.path)
            kept = load_ledger(self.path, set(finished or ()))
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                _write_records(f, kept.records)
            os.replace(tmp, self.path)
        self._f: Any = None  # opened at the first append: a run that fails first leaves no file

    def append(self, records: Iterable[CostRecord]) -> None:
        """Append ``records`` and flush them to disk, so a kill after this loses none of them."""
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")
        _write_records(self._f, records)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        """Close the file (nothing to do if nothing was appended)."""
        if self._f is not None:
            self._f.close()

    def __enter__(self) -> "LedgerFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class MethodRecorder:
    """Writes a method's trajectories and ledger records as each question finishes.

    Parameters
    ----------
    traj_path, ledger_path : Path
        Where the trajectories (one JSON line per finished question) and the cost records go.
    resume : bool
        Continue both files; records of questions that did not finish are dropped first.
    retry_failed : bool
        With ``resume``: drop the records of questions that failed too, so they run again.
    """

    def __init__(self, traj_path: Path, ledger_path: Path, resume: bool, retry_failed: bool = False):
        from ragfast.outputs.failures import drop_failures
        from ragfast.outputs.results import ResultsWriter

        self.traj_path, self.ledger_path = Path(traj_path), Path(ledger_path)
        if self.ledger_path.exists() and not resume and self.ledger_path.stat().st_size:
            raise DataError(f"{self.ledger_path} already holds records; pass --resume or use a new --out")
        #: questions recorded as failed before, dropped now to run again (``retry_failed``)
        self.retried = drop_failures(self.traj_path) if resume and retry_failed else set()
        self.writer = ResultsWriter(self.traj_path, resume=resume)
        self.ledger = CostLedger()
        self._lf = LedgerFile(self.ledger_path, resume, self.writer.done)

    @property
    def done(self) -> set[str]:
        """Ids of the questions finished (this run or before a resume)."""
        return self.writer.done

    @property
    def written(self) -> int:
        """Questions finished by this run."""
        return self.writer.written

    def finish(self, traj: Trajectory | Mapping[str, Any]) -> None:
        """Persist one finished question: its ledger records first, then its trajectory line.

        A crash between the two leaves ledger records of an unfinished question; they are
        dropped on resume, so totals never double count.
        """
        d = traj.to_dict() if isinstance(traj, Trajectory) else dict(traj)
        qid = d["id"]
        self._lf.append(r for r in self.ledger.records if r.question_id == qid)
        self.writer.write(d)

    def add_records(self, records: Iterable[CostRecord]) -> None:
        """Append records computed elsewhere (a Ray worker's) straight to the ledger file."""
        self._lf.append(records)

    def close(self) -> None:
        """Write the records that belong to no question (set-up, shared work) and close both files."""
        self._lf.append(r for r in self.ledger.records if r.question_id is None)
        self._lf.close()
        self.writer.close()

    def __enter__(self) -> "MethodRecorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_ledger(path: Path, finished: set[str] | None, *, allow_partial_tail: bool = False) -> CostLedger:
    """A ledger file read back, keeping records of finished questions (and those of no question).

    Parameters
    ----------
    path : Path
        A JSONL ledger; a missing file is an empty ledger.
    finished : set of str or None
        Ids whose records are kept (records of no question always are); None keeps every record.
    allow_partial_tail : bool
        Skip a last line without its newline (a crash mid-write; a resume cuts it) instead of
        refusing it.

    Raises
    ------
    DataError
        A line that is not a whole cost record: a corrupt line is refused, never dropped, since
        the ledger would then no longer add up to the summary. A torn last line left by a crash
        is cut with :func:`ragfast.outputs.results.repair_tail` before this is called.
    """
    led = CostLedger()
    if not Path(path).exists():
        return led
    names = {f.name for f in dataclasses.fields(CostRecord)}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if allow_partial_tail and not raw.endswith(b"\n"):
                break
            try:
                line = raw.decode("utf-8").strip()
                if not line:
                    continue
                d = json.loads(line)
                if not isinstance(d, dict) or "component" not in d:
                    raise ValueError("not a cost record")
                rec = CostRecord(**{k: v for k, v in d.items() if k in names})
            except (ValueError, TypeError) as exc:
                what = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                raise DataError(f"{path}:{n}: corrupt ledger line ({what}); refusing to drop it, since the "
                                "ledger would no longer add up: repair or remove the line, or use another "
                                "--out") from None
            if finished is None or rec.question_id is None or rec.question_id in finished:
                led.records.append(rec)
    return led

"""Crash-safe JSONL results: one line per finished question, plus a small run manifest.

Every pipeline writes its trajectories through :class:`ResultsWriter`. A line is written in one
``write`` call, then flushed and fsynced, so after a crash (SIGKILL, power loss) the file holds
every finished question plus at most one partial last line. Opening the file again in resume
mode cuts that partial line off before anything new is appended, so a resumed run neither loses
nor duplicates a question.

The manifest (``manifest.json`` next to the results) says which model filled each slot and
whether its answers mean anything, with the configuration and the seed.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ragfast.errors import DataError

__all__ = [
    "ResultsWriter",
    "read_results",
    "finished_ids",
    "trajectories_path",
    "repair_tail",
    "write_manifest",
    "read_manifest",
    "slot_entry",
    "TIMING_FIELDS",
    "strip_timing",
    "json_safe",
    "dumps",
]

#: Record fields that hold wall or device time; they differ between two otherwise identical
#: runs, so comparisons of results files leave them out (see :func:`strip_timing`).
TIMING_FIELDS = ("seconds", "device_seconds")


def repair_tail(path: str | Path) -> int:
    """Cut off a partial last line (one without its newline) left by a crash.

    Parameters
    ----------
    path : str or Path
        A JSONL results file; a missing file is left alone.

    Returns
    -------
    int
        The number of bytes removed (0 when the file was whole).
    """
    path = Path(path)
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        # Read backwards in blocks until the last newline: lines can be long (whole trajectories).
        end = size
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        pos = size
        block = 1 << 16
        cut = 0
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            i = chunk.rfind(b"\n")
            if i >= 0:
                cut = start + i + 1
                break
            pos = start
        f.truncate(cut)
        f.flush()
        os.fsync(f.fileno())
    return end - cut


def _iter_lines(path: Path) -> Iterator[tuple[int, str, bool]]:
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            yield n, raw.decode("utf-8"), raw.endswith(b"\n")


def read_results(path: str | Path, *, allow_partial_tail: bool = True) -> list[dict[str, Any]]:
    """Read every complete record of a results file.

    Parameters
    ----------
    path : str or Path
        The JSONL file.
    allow_partial_tail : bool
        Skip a last line without its newline (a crash mid-write) instead of failing.

    Raises
    ------
    DataError
        When the file is missing or a complete line is not a JSON object with an ``id``.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"results file not found: {path}")
    out = []
    for n, line, whole in _iter_lines(path):
        if not whole:
            if allow_partial_tail:
                break
            raise DataError(f"{path}:{n}: partial last line (crash during a write?)")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or "id" not in rec:
            raise DataError(f"{path}:{n}: a results line must be a JSON object with an 'id'")
        out.append(rec)
    return out


def finished_ids(path: str | Path) -> set[str]:
    """Ids of every question with a complete line in ``path`` (empty when there is no file)."""
    path = Path(path)
    if not path.exists():
        return set()
    return {str(r["id"]) for r in read_results(path)}


def trajectories_path(run_dir: str | Path, method: str = "searchr1") -> Path:
    """The file of ``method``'s trajectories in a run directory, in either layout.

    ``ragfast bench`` and the ``ragfast run M`` commands generated from the registry write
    ``trajectories/<method>.jsonl``; the older hand-written run commands write ``results.jsonl``.
    A reader takes a directory of either kind, so moving a command to the bench's layout does
    not break the commands that read its output.

    Parameters
    ----------
    run_dir : str or Path
        A run directory (or a trajectories file itself, returned as it is).
    method : str
        Which method's trajectories, in the bench's layout.

    Raises
    ------
    DataError
        Neither file is there.
    """
    d = Path(run_dir)
    if d.is_file() and d.suffix == ".jsonl":
        return d
    for p in (d / "trajectories" / f"{method}.jsonl", d / "results.jsonl"):
        if p.is_file():
            return p
    raise DataError(f"{d / 'results.jsonl'} does not exist: not a `ragfast run {method}` output directory "
                    f"(nor trajectories/{method}.jsonl of `ragfast bench`)")


class ResultsWriter:
    """Append-only JSONL writer that survives crashes.

    Parameters
    ----------
    path : str or Path
        The results file.
    resume : bool
        True: keep what is there (after cutting a partial last line) and remember its ids, so
        :meth:`write` refuses duplicates. False: the file must not exist yet, or must be empty,
        so that results of two runs are never mixed by accident.

    Examples
    --------
    >>> with ResultsWriter(out / "results.jsonl", resume=True) as w:  # doctest: +SKIP
    ...     todo = [q for q in questions if q.id not in w.done]
    ...     for traj in run(todo):
    ...         w.write(traj.to_dict())
    """

    def __init__(self, path: str | Path, *, resume: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0 and not resume:
            raise DataError(f"{self.path} already holds results; pass resume=True (--resume) to continue it, "
                            "or choose another output directory")
        self.repaired_bytes = repair_tail(self.path) if resume else 0
        self.done: set[str] = finished_ids(self.path) if resume else set()
        self.written = 0
        self._f = open(self.path, "ab")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one finished question (one line, flushed and fsynced before returning).

        Raises
        ------
        DataError
            When the record has no ``id`` or its id is already in the file.
        """
        if "id" not in record:
            raise DataError("a results record needs an 'id'")
        qid = str(record["id"])
        if qid in self.done:
            raise DataError(f"question {qid!r} is already in {self.path}; refusing to write it twice")
        data = (json.dumps(record, ensure_ascii=False, default=json_default) + "\n").encode("utf-8")
        # One write call per line: a crash leaves at most one partial line, which repair_tail cuts.
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())
        self.done.add(qid)
        self.written += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "ResultsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def json_default(o: Any) -> Any:
    """JSON for numpy scalars and arrays, sets and paths (``json.dumps(..., default=json_default)``)."""
    # numpy scalars and arrays show up in scores; write them as plain JSON numbers and lists.
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def json_safe(obj: Any) -> Any:
    """A copy of ``obj`` with every NaN or infinite float replaced by None.

    Python's ``json`` writes them as bare ``NaN``/``Infinity``, which is not JSON: JavaScript's
    ``JSON.parse`` and most other parsers refuse the whole file. An undefined statistic (an
    interval over one question, a precision with no positives) is written as ``null``.
    """
    import math

    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    try:
        import numpy as np

        if isinstance(obj, np.ndarray):
            return json_safe(obj.tolist())
        if isinstance(obj, np.generic):
            return json_safe(obj.item())
    except ImportError:
        pass
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` for ragfast's JSON outputs: NaN and infinities as null, numpy as plain JSON.

    Raises ``ValueError`` rather than write a non-standard token (``allow_nan=False``).
    """
    kwargs.setdefault("default", json_default)
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def slot_entry(component: Any) -> dict[str, Any]:
    """What fills one slot, for the manifest: its ``describe()`` plus an explicit verdict.

    Parameters
    ----------
    component : object
        A generator, judge, retriever...; anything with ``describe()`` or a ``name``.
    """
    if hasattr(component, "describe"):
        d = dict(component.describe())
    else:
        d = {"name": getattr(component, "name", type(component).__name__), "class": type(component).__name__}
    d.setdefault("meaningful", bool(getattr(component, "meaningful", True)))
    d["answers_meaningful"] = answers_label(d)
    return d


def empty_slot() -> dict[str, Any]:
    """The manifest entry of a slot nothing fills."""
    d: dict[str, Any] = {"name": "none", "meaningful": False}
    d["answers_meaningful"] = answers_label(d)
    return d


def answers_label(d: Mapping[str, Any]) -> str:
    """The slot's human verdict: a measured or stated ``verdict`` wins, else from ``meaningful``.

    A scripted oracle says it knows the answers; a random-weight model says so; an empty slot
    (``none``) says it is empty; anything else not meaningful exercises the compute path only.
    """
    from ragfast.outputs.slot_labels import EMPTY_LABEL, ORACLE_LABEL, RANDOM_LABEL

    if d.get("verdict"):
        return str(d["verdict"])
    if str(d.get("name")) == "none":
        return EMPTY_LABEL
    if d.get("meaningful", True):
        return "yes"
    if d.get("class") == "ScriptedGenerator":
        return ORACLE_LABEL
    note = " ".join(str(d.get(k, "")) for k in ("note", "why", "name")).lower()
    if "random" in note or "tiny" in note:
        return RANDOM_LABEL
    return "NO (exercises the compute path only)"


def write_manifest(out_dir: str | Path, *, pipeline: str, slots: Mapping[str, Any], config: Mapping[str, Any],
                   seed: int, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``manifest.json``: the pipeline, which model filled each slot, config and seed.

    A resumed run must use the same configuration; when ``manifest.json`` already exists with a
    different pipeline, config or seed, this raises instead of mixing two runs in one file.

    Parameters
    ----------
    out_dir : str or Path
        The run's output directory.
    pipeline : str
        E.g. ``"searchr1"``.
    slots : mapping
        slot name -> component (anything :func:`slot_entry` takes) or an already built dict.
    config : mapping
        The pipeline's configuration (JSON-serialisable).
    seed : int
        The run's seed.
    extra : mapping, optional
        Anything else worth keeping (data path, limit, versions).

    Raises
    ------
    DataError
        When an existing manifest disagrees on pipeline, config or seed.
    """
    import ragfast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "manifest.json"
    entry = {
        "pipeline": pipeline,
        "slots": {k: (dict(v) if isinstance(v, Mapping) else slot_entry(v)) for k, v in slots.items()},
        "config": json.loads(json.dumps(dict(config), default=json_default)),
        "seed": int(seed),
        "ragfast_version": ragfast.__version__,
        **(json.loads(json.dumps(dict(extra), default=json_default)) if extra else {}),
    }
    if path.exists():
        old = read_manifest(out_dir)
        for key in ("pipeline", "config", "seed"):
            if old.get(key) != entry[key]:
                what = _first_change(old.get(key), entry[key], key)
                raise DataError(f"{path}: {what}; resume with the same settings, or use a new --out directory")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entry, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a crash never leaves half a manifest
    return path


def _first_change(old: Any, new: Any, path: str) -> str:
    """``"config.methods: [...] in the run on disk, [...] now"``: the first differing field, short."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        for k in sorted(set(old) | set(new), key=str):
            if old.get(k) != new.get(k):
                return _first_change(old.get(k), new.get(k), f"{path}.{k}")

    def short(v: Any) -> str:
        t = json.dumps(v, default=str)
        return t if len(t) <= 70 else t[:67] + "..."

    return f"{path}: {short(old)} in the run on disk, {short(new)} now"


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """Read ``manifest.json`` from a run directory."""
    path = Path(out_dir) / "manifest.json"
    if not path.exists():
        raise DataError(f"no manifest.json in {out_dir}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: not valid JSON ({exc.msg})") from None


def strip_timing(obj: Any, fields: Iterable[str] = TIMING_FIELDS) -> Any:
    """A deep copy of ``obj`` without timing fields, for comparing two runs' results."""
    drop = set(fields)
    if isinstance(obj, Mapping):
        return {k: strip_timing(v, drop) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [strip_timing(v, drop) for v in obj]
    return obj


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """EM, F1, searches per question and question count over finished results records."""
    n = len(records)
    if n == 0:
        return {"questions": 0, "em": 0.0, "f1": 0.0, "searches_per_question": 0.0}
    return {"questions": n, "em": sum(float(r["em"]) for r in records) / n,
            "f1": sum(float(r["f1"]) for r in records) / n,
            "searches_per_question": sum(int(r["searches"]) for r in records) / n}

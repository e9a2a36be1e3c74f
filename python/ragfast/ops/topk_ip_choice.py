"""Which implementation :func:`ragfast.ops.topk_ip` runs by default: compiled kernels or torch.

The compiled kernels are not faster than ``torch.mm`` + ``topk`` everywhere (the portable
``generic`` level never is; large batches on AVX2 may not be), and the default must never be
slower than that baseline. So per (ISA level, storage, batch class) a table says which path to
take, and a table is true only on the machine it was measured on (the AMD EPYC's picks the
compiled kernels at B <= 16 where an Intel Xeon's torch bf16 runs on AMX tiles). So tables are
keyed by machine: CPU model name and the CPU features ragfast detects (``_C.isa_info()["cpu"]``).

* ``topk_ip_choice.json`` next to this module ships the tables measured by ``python
  bench/bench_topk_ip.py --calibrate`` (compiled kernels forced vs the torch path on the same
  storage, timed round-robin), one per machine, each naming its machine and command;
* on a machine with no shipped table, the first default ``topk_ip`` call runs a calibration
  (:func:`calibrate` over random 384-d unit vectors as large as the last-level cache, 20,000 to
  400,000 rows: a few seconds on a desktop CPU, about 30 on a 300 MiB-L3 Xeon; every storage
  and batch class, round-robin medians), logs one line, and caches the table under
  ``$RAGFAST_CACHE/topk_ip_choice/`` (default ``~/.cache/ragfast``); ``RAGFAST_CALIBRATE=0``
  turns that off. ``ragfast backends`` shows which table is in use;
* ``ragfast calibrate`` runs the same calibration on demand (progress per cell) and caches it
  as *explicit*: preferred, for the levels it measured, to a shipped table for this CPU.

Cells the table does not have fall back to: torch for ``generic``, the compiled kernels otherwise.

Both paths give the reference's results (the torch path is :func:`topk_ip_ref`'s arithmetic
with a cheaper selection), so the choice changes speed only.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ragfast.ops.machine import cache_file as machine_cache_file
from ragfast.ops.machine import cpu_model, machine_key, match_table, write_table

__all__ = ["BATCH_CLASSES", "Choice", "batch_class", "cache_file", "calibrate", "choose", "cpu_model", "load_table",
           "machine_key", "machine_table", "save_calibration", "shipped_tables", "TABLE_PATH"]

log = logging.getLogger(__name__)

BATCH_CLASSES = (1, 4, 16, 64, 256)
TABLE_PATH = Path(__file__).with_name("topk_ip_choice.json")
PATHS = ("cpp", "torch", "torch_bf16")
# torch_bf16 (a bf16 matmul pass, re-scored exactly: ragfast.ops.topk_ip_bf16) reads bf16 rows only
_BF16_ONLY = ("torch_bf16",)


@dataclass(frozen=True)
class Choice:
    """One decision of the chooser.

    Attributes
    ----------
    path : str
        ``"cpp"`` (compiled kernels at ``isa``), ``"torch"`` (fp32 mm + topk) or, for bf16
        storage, ``"torch_bf16"`` (torch's bf16 mm, oneDNN, then an exact re-score).
    isa : str
        The ISA level the compiled kernels run at.
    storage : str
        ``fp32``, ``fp16``, ``bf16`` or ``int8``.
    batch_class : int
        The measured batch size the call's batch was rounded to (nearest in log scale).
    source : str
        ``"table"`` (a measured cell) or ``"default"`` (no cell for this level/storage/batch).
    """

    path: str
    isa: str
    storage: str
    batch_class: int
    source: str


@functools.lru_cache(maxsize=1024)  # on every default topk_ip call: 0.3 us cached, 2 us not
def batch_class(B: int) -> int:
    """The batch class of ``B``: the nearest of :data:`BATCH_CLASSES` in log scale."""
    if B < 1:
        raise ValueError(f"batch size must be >= 1, got {B}")
    return min(BATCH_CLASSES, key=lambda c: (abs(math.log(B) - math.log(c)), c))


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict[str, Any]:
    """A table file: ``{"machine": ..., "command": ..., "runs": {isa: provenance}, "cells": {isa:
    {storage: {B: path}}}}`` (``runs`` says which run measured each level). A file of several
    machines' tables (``{"machines": [...]}``) gives this machine's (:func:`machine_table`
    without calibrating). A missing file gives an empty table (every cell falls back to the
    default)."""
    p = Path(path) if path else TABLE_PATH
    if not p.exists():
        return {"cells": {}}
    table = json.loads(p.read_text())
    if "machines" in table:
        return match_table(shipped_tables(str(p)), machine_key()) or {"cells": {}}
    _validate(table, p)
    return table


def shipped_tables(path: str | None = None) -> list[dict[str, Any]]:
    """Every machine's table in the shipped file (validated), each ``{"cpu", "features",
    "machine", "command", "runs", "cells"}``."""
    p = Path(path) if path else TABLE_PATH
    if not p.exists():
        return []
    raw = json.loads(p.read_text())
    tables = raw.get("machines", [raw] if "cells" in raw else [])
    for t in tables:
        _validate(t, p)
    return tables


def _validate(table: dict[str, Any], where: Any) -> None:
    for isa, per_storage in table.get("cells", {}).items():
        for storage, per_batch in per_storage.items():
            for b, choice in per_batch.items():
                if choice not in PATHS:
                    raise ValueError(f"{where}: cell {isa}/{storage}/{b} is {choice!r}, not one of {PATHS}")
                if choice in _BF16_ONLY and storage != "bf16":
                    raise ValueError(f"{where}: cell {isa}/{storage}/{b} is {choice!r}, a path for bf16 storage only")


def cache_file(key: dict[str, Any] | None = None) -> Path:
    """Where this machine's (or ``key``'s) calibrated table is cached:
    ``$RAGFAST_CACHE/topk_ip_choice/<hash of the machine key>.json``."""
    return machine_cache_file("topk_ip_choice", machine_key() if key is None else key)


# Timings of one calibration cell: path -> a callable that runs one search.
Calls = Callable[[str, int], dict[str, Callable[[], Any]]]

_MACHINE: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}


# progress(storage, B, {path: median seconds}, chosen path), once per measured cell
Progress = Callable[[str, int, dict[str, float], str], None]


def calibrate(calls: Calls, level: str, reps: int = 3, progress: Progress | None = None) -> dict[str, Any]:
    """Measure this machine's cells at ``level``: for every storage and batch class, the path
    (``cpp``, ``torch``, for bf16 also ``torch_bf16``) with the lower median of ``reps``
    round-robin calls. ``calls(storage, B)`` gives ``{path: fn}`` over the calibration corpus;
    ``progress``, when given, is called after each cell with its medians and choice."""
    cells: dict[str, dict[str, str]] = {}
    for storage in ("fp32", "fp16", "bf16", "int8"):
        for B in BATCH_CLASSES:
            fns = calls(storage, B)
            times: dict[str, list[float]] = {name: [] for name in fns}
            for name, fn in fns.items():
                fn()  # warm-up
            for _ in range(reps):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            med = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            best = min(med, key=med.get)
            cells.setdefault(storage, {})[str(B)] = best
            if progress is not None:
                progress(storage, B, med, best)
    return {level: cells}


def save_calibration(cells: dict[str, Any], command: str, *, explicit: bool = False,
                     key: dict[str, Any] | None = None) -> tuple[dict[str, Any], Path]:
    """Cache a calibrated table for this machine (or ``key``'s) and return it with its path.

    ``cells`` is :func:`calibrate`'s ``{level: {storage: {B: path}}}``; levels already cached
    and not re-measured are kept (a calibration measures the level in use only). An
    ``explicit`` table (``ragfast calibrate``) is preferred to a shipped one for this CPU: it
    was measured here, on purpose, and the shipped one on a machine of the same name.

    Raises
    ------
    OSError
        The cache directory cannot be written.
    """
    key = machine_key() if key is None else key
    path = cache_file(key)
    merged: dict[str, Any] = {}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            _validate(old, path)
            merged = dict(old.get("cells", {}))
        except (OSError, ValueError):
            merged = {}  # an unreadable cache is replaced, not merged
    merged.update(cells)
    table = dict(key, machine=f"{key['cpu']}, {os.cpu_count()} logical CPUs, features: {' '.join(key['features'])}",
                 command=command, measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 explicit=bool(explicit), cells=merged)
    write_table(path, table)
    _MACHINE.pop(_tag(key), None)  # this process re-reads it
    return table, path


def _tag(key: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    # the in-process cache's key, looked up on every default topk_ip call: a tuple, not the
    # json.dumps of the key (a few microseconds less per call)
    return key["cpu"], tuple(key["features"])


def machine_table(calibrate_with: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The table for this machine: one cached by ``ragfast calibrate`` (levels it did not
    measure filled from the shipped one), else the shipped one measured on it, else one cached
    by an earlier first-use calibration, else (when ``calibrate_with`` is given and ``RAGFAST_CALIBRATE`` is not 0) one
    calibrated now and cached, else an empty table. ``source`` says which."""
    key = machine_key()
    tag = _tag(key)
    allowed = calibrate_with is not None and os.environ.get("RAGFAST_CALIBRATE", "1") != "0"
    cached = _MACHINE.get(tag)
    if cached is not None and (cached["cells"] or not allowed or cached.get("calibration_tried")):
        return cached
    cache = cache_file(key)
    calibrated = None
    if cache.exists():
        try:
            t = json.loads(cache.read_text())
            _validate(t, cache)
            calibrated = dict(t, source=f"calibrated on this machine ({cache})")
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable topk_ip calibration %s: %s", cache, exc)
    table = match_table(shipped_tables(), key)
    if table is not None:
        table = dict(table, source=f"shipped ({TABLE_PATH.name}: {table.get('machine')})")
    if calibrated is not None and (table is None or calibrated.get("explicit")):
        # `ragfast calibrate` measured some levels here: its cells win, the shipped ones fill the rest
        table = dict(calibrated, cells={**(table or {}).get("cells", {}), **calibrated["cells"]})
    if table is None and allowed:
        t0 = time.perf_counter()
        try:
            cells = calibrate_with()
        except Exception as exc:  # never fail a search over its speed table: use the defaults
            log.warning("topk_ip: calibration failed (%s); compiled kernels by default", exc)
            _MACHINE[tag] = dict(key, cells={}, calibration_tried=True, source=f"none: calibration failed ({exc})")
            return _MACHINE[tag]
        try:
            table, where = save_calibration(cells, "ragfast.ops.topk_ip_choice.calibrate (first use on this machine)",
                                            key=key)
        except OSError as exc:
            table = dict(key, command="ragfast.ops.topk_ip_choice.calibrate (first use on this machine)", cells=cells)
            where = f"not cached: {exc}"
        log.info("topk_ip: no measured table for this CPU (%s); calibrated the default path in %.1f s -> %s",
                 key["cpu"], time.perf_counter() - t0, where)
        table = dict(table, source=f"calibrated on this machine ({where})")
    if table is None:
        table = dict(key, cells={}, source="none: no table for this CPU (calibrates at the first default topk_ip call)")
    _MACHINE[tag] = table
    return table


def choose(isa: str, storage: str, B: int, table: dict[str, Any] | None = None) -> Choice:
    """The path for one call: ``isa`` level in use, corpus ``storage``, batch size ``B``; the
    table defaults to :func:`machine_table` (this machine's, without calibrating)."""
    c = batch_class(B)
    cells = (table if table is not None else machine_table()).get("cells", {})
    path = cells.get(isa, {}).get(storage, {}).get(str(c))
    if path is not None:
        return Choice(path, isa, storage, c, "table")
    return Choice("torch" if isa == "generic" else "cpp", isa, storage, c, "default")

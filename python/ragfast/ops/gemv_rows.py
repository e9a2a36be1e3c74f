"""Up to how many rows a linear layer runs ragfast's gemv instead of torch's matmul, per machine.

gemv beats torch's matmul at one row on every machine measured, but where it stops winning
depends on the CPU and its BLAS: on a Zen 4 EPYC it won at 1-8 rows in fp32 and bf16, on an
Emerald Rapids Xeon (AMX, MKL) bf16 stopped winning at 3 rows (0.72x torch at 8) and fp32 lost
from one row on (MKL's sgemv read at the memory's full rate). So, as for topk_ip's path
(:mod:`ragfast.ops.topk_ip_choice`), the rows come from a table measured on the machine:

* ``gemv_rows.json`` next to this module ships the tables written by ``python
  bench/bench_gemv.py --write-table`` (one decode step of a real model's layer shapes, gemv
  against torch round-robin), one per machine (CPU model and features), per ISA level;
* on a machine with no shipped table, the first layer prepared for gemv runs
  :func:`calibrate_rows` (weights as large as the last-level cache, so that they stream from
  memory as a model's do; 6 s on a 300 MiB-L3 Xeon), logs one line and caches the result under
  ``$RAGFAST_CACHE/gemv_rows/``; ``RAGFAST_CALIBRATE=0`` turns that off and takes
  :data:`FALLBACK`.

The rows of a storage are the largest ``M`` such that gemv beat torch at every measured row
count up to ``M`` (:func:`rows_from_ratios`); 0 where it lost at one row.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from ragfast.ops.machine import cache_file, last_level_cache_bytes, machine_key, match_table, write_table

__all__ = ["FALLBACK", "ROW_COUNTS", "STORAGES", "TABLE_PATH", "calibrate_rows", "machine_rows",
           "rows_from_ratios", "shipped_tables"]

log = logging.getLogger(__name__)

TABLE_PATH = Path(__file__).with_name("gemv_rows.json")
STORAGES = ("fp32", "bf16", "int8")
#: Row counts a calibration measures.
ROW_COUNTS = (1, 2, 3, 4, 6, 8)
#: Rows without a table or a calibration (``RAGFAST_CALIBRATE=0``): bf16 2 and int8 1, the least
#: that the tables of the two machines measured give (a Zen 4 EPYC: fp32 8, bf16 8, int8 2; an
#: Emerald Rapids Xeon: fp32 0, bf16 2, int8 1-3 by level), and fp32 8 from the EPYC (on the Xeon
#: MKL's sgemv was 1.05-1.11x gemv at one row, so its table says 0).
FALLBACK = {"fp32": 8, "bf16": 2, "int8": 1}

_MACHINE: dict[str, dict[str, int]] = {}  # ISA level -> rows, this process


def rows_from_ratios(ratios: dict[int, float]) -> int:
    """The largest measured ``M`` such that gemv was faster than torch (``ratio = torch's time /
    gemv's > 1``) at every measured row count up to ``M``; 0 when it lost at the smallest."""
    rows = 0
    for m in sorted(ratios):
        if ratios[m] <= 1.0:
            break
        rows = m
    return rows


def shipped_tables(path: str | None = None) -> list[dict[str, Any]]:
    """Every machine's table in the shipped file: ``{"cpu", "features", "machine", "runs": {level:
    provenance}, "rows": {level: {storage: rows}}}``."""
    p = Path(path) if path else TABLE_PATH
    if not p.exists():
        return []
    tables = json.loads(p.read_text()).get("machines", [])
    for t in tables:
        for level, per in t.get("rows", {}).items():
            for st, n in per.items():
                if st not in STORAGES or not isinstance(n, int) or n < 0:
                    raise ValueError(f"{p}: rows {level}/{st} = {n!r}: not a storage {STORAGES} with rows >= 0")
    return tables


def calibrate_rows(prepare: Callable[..., Callable[[Any], Any]], reps: int = 5,
                   progress: Callable[[str, int, float], None] | None = None) -> dict[str, int]:
    """Measure this machine's rows at the ISA level in use: for each storage, gemv against torch's
    matmul (fp32 / bf16: ``F.linear``; int8: ``_weight_int8pack_mm``, what a layer runs without
    gemv) over layers of Qwen2.5-0.5B's MLP shapes whose weights together are as large as the
    last-level cache (at least 64 MiB), at each of :data:`ROW_COUNTS`; round-robin, medians of
    ``reps``. ``prepare(weight, scales)`` makes a layer's gemv (:class:`ragfast.ops.gemv.GemvWeight`,
    passed in: that module reads this one); ``progress(storage, M, ratio)`` after each cell."""
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = [(4864, 896), (896, 4864)]
    per_layer = 4864 * 896 * 4
    n_layers = max(2, -(-max(64 << 20, last_level_cache_bytes()) // per_layer))
    base = [torch.randn(*shapes[i % 2], generator=g) * 0.03 for i in range(n_layers)]
    out: dict[str, int] = {}
    for st in STORAGES:
        layers = []
        for w in base:
            if st == "int8":
                scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
                codes = torch.round(w / scales[:, None]).to(torch.int8)
                layers.append((prepare(codes, scales), codes, scales.to(torch.bfloat16)))
            else:
                wt = w.to(torch.float32 if st == "fp32" else torch.bfloat16)
                layers.append((prepare(wt), wt, None))
        xdt = torch.float32 if st == "fp32" else torch.bfloat16

        def step(M: int, who: str) -> float:
            xs = {k: torch.randn(M, k, generator=g).to(xdt) for k in (896, 4864)}
            t0 = time.perf_counter()
            for gw, w, s in layers:
                x = xs[gw.K]
                if who == "gemv":
                    gw(x)
                elif s is not None:
                    torch.ops.aten._weight_int8pack_mm(x, w, s)
                else:
                    torch.nn.functional.linear(x, w)
            return time.perf_counter() - t0

        ratios = {}
        for M in ROW_COUNTS:
            step(M, "gemv"), step(M, "torch")  # warm-up (and the weights faulted in)
            ts: dict[str, list[float]] = {"gemv": [], "torch": []}
            for _ in range(reps):
                for who in ts:
                    ts[who].append(step(M, who))
            ratios[M] = statistics.median(ts["torch"]) / statistics.median(ts["gemv"])
            if progress is not None:
                progress(st, M, ratios[M])
        out[st] = rows_from_ratios(ratios)
        layers.clear()  # before the next storage's copies are made
    return out


def machine_rows(level: str, calibrate_with: Callable[[], dict[str, int]] | None = None) -> dict[str, int]:
    """This machine's rows per storage at ISA ``level``: the shipped table's, else a cached
    calibration's, else one made now by ``calibrate_with`` (:func:`calibrate_rows` bound to the
    kernel) and cached, else (none given, or ``RAGFAST_CALIBRATE=0``) :data:`FALLBACK`."""
    got = _MACHINE.get(level)
    if got is not None:
        return got
    key = machine_key()
    shipped = match_table(shipped_tables(), key)
    rows = (shipped or {}).get("rows", {}).get(level)
    cache = cache_file("gemv_rows", key)
    if rows is None and cache.exists():
        try:
            rows = json.loads(cache.read_text()).get("rows", {}).get(level)
        except (OSError, ValueError) as exc:
            log.warning("ignoring the unreadable gemv calibration %s: %s", cache, exc)
    if rows is None and calibrate_with is not None and os.environ.get("RAGFAST_CALIBRATE", "1") != "0":
        t0 = time.perf_counter()
        try:
            rows = calibrate_with()
        except Exception as exc:  # never fail a model load over a speed table
            log.warning("gemv: calibration failed (%s); fallback rows %s", exc, FALLBACK)
        else:
            where = _save(cache, key, level, rows)
            log.info("gemv: no measured rows for this CPU (%s) at %s; calibrated %s in %.1f s -> %s",
                     key["cpu"], level, rows, time.perf_counter() - t0, where)
    _MACHINE[level] = dict(FALLBACK) if rows is None else {st: int(rows.get(st, FALLBACK[st])) for st in STORAGES}
    return _MACHINE[level]


def _save(cache: Path, key: dict[str, Any], level: str, rows: dict[str, int]) -> str:
    try:
        old = json.loads(cache.read_text()) if cache.exists() else {}
    except (OSError, ValueError):
        old = {}
    table = dict(key, rows={**old.get("rows", {}), level: rows},
                 measured=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    try:
        write_table(cache, table)
    except OSError as exc:
        return f"not cached: {exc}"
    return str(cache)

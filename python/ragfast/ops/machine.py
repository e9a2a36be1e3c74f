"""Which machine this is, for the per-machine speed tables (topk_ip's path, gemv's rows).

A speed table holds only on the machine it was measured on, so tables are keyed by the CPU's
model name and the CPU features ragfast detects, and a cached calibration lives under
``$RAGFAST_CACHE/<kind>/<hash of the key>.json`` (default ``~/.cache/ragfast``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["cache_file", "cpu_model", "cpu_features", "last_level_cache_bytes", "machine_key", "match_table",
           "write_table"]


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def cpu_features() -> tuple[str, ...]:
    """``ragfast._C.isa_info()["cpu"]``: the features the ISA levels need, the OS's AMX
    permission included; empty without the compiled module. Fixed for the process, so looked
    up once (tables are consulted on every default call)."""
    try:
        from ragfast import _C

        return tuple(_C.isa_info()["cpu"])
    except ImportError:
        return ()


def machine_key(features: list[str] | None = None) -> dict[str, Any]:
    """What a table is keyed by: ``{"cpu": model name, "features": sorted CPU features}``
    (``features`` default to :func:`cpu_features`)."""
    return {"cpu": cpu_model(), "features": sorted(cpu_features() if features is None else features)}


def match_table(tables: list[dict[str, Any]], key: dict[str, Any]) -> dict[str, Any] | None:
    """The first of ``tables`` measured on the machine ``key`` names, else None."""
    for t in tables:
        if t.get("cpu") == key["cpu"] and sorted(t.get("features", [])) == key["features"]:
            return t
    return None


def cache_file(kind: str, key: dict[str, Any]) -> Path:
    """Where a table of ``kind`` calibrated on the machine ``key`` is cached."""
    root = Path(os.environ.get("RAGFAST_CACHE") or Path.home() / ".cache" / "ragfast").expanduser()
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return root / kind / f"{digest}.json"


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Write a table as JSON through a temporary file, so that a reader never sees half of it.

    Raises
    ------
    OSError
        The directory cannot be made or written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size in bytes (Linux sysfs), 32 MiB where it cannot be read."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)

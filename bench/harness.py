"""One benchmark harness and one CSV schema for every script in bench/.

Schema: op, provider, params, metric, unit, p20, p50, p80, device, git_sha, timestamp.
Every script runs its anchor (faiss, torch, a naive path) in the same process on the same data
and reports speed as a ratio against it, from medians of several repetitions: the machines are
noisy, so absolute times only travel with their anchor.
"""
from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np


@dataclass
class Row:
    op: str
    provider: str
    params: str
    metric: str
    unit: str
    p20: float
    p50: float
    p80: float
    device: str = ""
    git_sha: str = ""
    timestamp: str = ""


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except Exception:
        return ""


def device_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"{platform.processor() or platform.machine()} x{os.cpu_count()}"


def time_fn(fn: Callable[[], Any], reps: int = 7, warmup: int = 1, sync: Callable[[], None] | None = None) -> np.ndarray:
    """Seconds of ``reps`` calls after ``warmup`` unmeasured ones."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        out.append(time.perf_counter() - t0)
    return np.asarray(out)


def row(op: str, provider: str, params: str, metric: str, unit: str, samples: Iterable[float]) -> Row:
    s = np.asarray(list(samples), dtype=np.float64)
    p20, p50, p80 = np.percentile(s, [20, 50, 80])
    return Row(op, provider, params, metric, unit, float(p20), float(p50), float(p80), device_name(), git_sha(),
               _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))


def write_csv(rows: list[Row], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[fl.name for fl in fields(Row)])
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(asdict(r))
    return path


def print_table(rows: list[Row], title: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for h in ("op", "provider", "params", "metric", "p50", "unit"):
        t.add_column(h)
    for r in rows:
        t.add_row(r.op, r.provider, r.params, r.metric, f"{r.p50:.4g}", r.unit)
    Console().print(t)

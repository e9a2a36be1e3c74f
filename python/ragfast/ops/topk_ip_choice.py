"""Which implementation :func:`ragfast.ops.topk_ip` runs by default: compiled kernels or torch.

The compiled kernels are not faster than ``torch.mm`` + ``topk`` everywhere (the portable
``generic`` level never is; large batches on AVX2 may not be), and the default must never be
slower than that baseline. So per (ISA level, storage, batch class) a table says which path to
take. The table (``topk_ip_choice.json`` next to this module) is measured by
``python bench/bench_topk_ip.py --calibrate`` (compiled kernels forced vs the torch path on the
same storage, timed round-robin) and records the machine it was measured on. Cells the table
does not have fall back to: torch for ``generic``, the compiled kernels otherwise.

Both paths give the reference's results (the torch path is :func:`topk_ip_ref`'s arithmetic
with a cheaper selection), so the choice changes speed only.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BATCH_CLASSES", "Choice", "batch_class", "choose", "load_table", "TABLE_PATH"]

BATCH_CLASSES = (1, 4, 16, 64, 256)
TABLE_PATH = Path(__file__).with_name("topk_ip_choice.json")
PATHS = ("cpp", "torch")


@dataclass(frozen=True)
class Choice:
    """One decision of the chooser.

    Attributes
    ----------
    path : str
        ``"cpp"`` (compiled kernels at ``isa``) or ``"torch"`` (mm + topk).
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


def batch_class(B: int) -> int:
    """The batch class of ``B``: the nearest of :data:`BATCH_CLASSES` in log scale."""
    if B < 1:
        raise ValueError(f"batch size must be >= 1, got {B}")
    return min(BATCH_CLASSES, key=lambda c: (abs(math.log(B) - math.log(c)), c))


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict[str, Any]:
    """The measured table: ``{"machine": ..., "command": ..., "runs": {isa: provenance},
    "cells": {isa: {storage: {B: path}}}}`` (``runs`` says which run measured each level).

    A missing file gives an empty table (every cell falls back to the default)."""
    p = Path(path) if path else TABLE_PATH
    if not p.exists():
        return {"cells": {}}
    table = json.loads(p.read_text())
    for isa, per_storage in table.get("cells", {}).items():
        for storage, per_batch in per_storage.items():
            for b, choice in per_batch.items():
                if choice not in PATHS:
                    raise ValueError(f"{p}: cell {isa}/{storage}/{b} is {choice!r}, not one of {PATHS}")
    return table


def choose(isa: str, storage: str, B: int, table: dict[str, Any] | None = None) -> Choice:
    """The path for one call: ``isa`` level in use, corpus ``storage``, batch size ``B``."""
    c = batch_class(B)
    cells = (table if table is not None else load_table()).get("cells", {})
    path = cells.get(isa, {}).get(storage, {}).get(str(c))
    if path is not None:
        return Choice(path, isa, storage, c, "table")
    return Choice("torch" if isa == "generic" else "cpp", isa, storage, c, "default")

"""The ``meta.json`` that names the format of a saved ragfast index directory."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ragfast.errors import DataError

__all__ = ["read_index_meta"]


def read_index_meta(path: Path, fmt: str, kind: str) -> dict[str, Any]:
    """Read ``path/meta.json`` and check it declares format ``fmt``.

    Parameters
    ----------
    path : Path
        The index directory.
    fmt : str
        The expected ``format`` value, e.g. ``"ragfast-bm25/1"``.
    kind : str
        How messages name the index, e.g. ``"BM25 index"``.

    Raises
    ------
    DataError
        ``"<path> is not a ragfast <kind> (no meta.json)"`` or ``"<path>: unknown <kind> format ..."``.
    """
    meta_path = path / "meta.json"
    if not meta_path.exists():
        raise DataError(f"{path} is not a ragfast {kind} (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != fmt:
        raise DataError(f"{path}: unknown {kind} format {meta.get('format')!r}")
    return meta

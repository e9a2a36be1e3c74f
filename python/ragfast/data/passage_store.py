"""Passage stores that open without reading: uncompressed Arrow IPC files, memory-mapped.

A wiki-18-size corpus (21M passages) read from JSONL costs minutes and gigabytes of private
memory in every server process. Written once as an uncompressed Arrow IPC file, its ``id`` and
``contents`` buffers *are* the file's pages: :func:`map_arrow_table` maps them (zero copy, no
per-row Python object), every process that maps the file shares one copy in the page cache, and
a row lookup touches only that row's pages. :func:`ragfast.data.load_corpus` opens ``.arrow``
files this way and ``Corpus.save(".../x.arrow")`` writes them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from ragfast.errors import DataError

__all__ = ["SCHEMA", "write_arrow_corpus", "map_arrow_table"]

#: The corpus columns, in order.
SCHEMA = pa.schema([("id", pa.string()), ("contents", pa.string())])


def write_arrow_corpus(path: str | os.PathLike, batches: Iterable[Any]) -> Path:
    """Stream corpus rows to an uncompressed Arrow IPC file, one batch in memory at a time.

    Parameters
    ----------
    path : path
        The ``.arrow`` file; written under a temporary name and renamed when complete, so an
        interrupted write never leaves a truncated corpus behind.
    batches : iterable
        ``pyarrow.RecordBatch`` with ``id`` and ``contents`` columns, or ``(ids, contents)``
        pairs of string lists.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as w:
            for b in batches:
                if isinstance(b, pa.RecordBatch):
                    b = pa.record_batch([b.column("id").cast(pa.string()), b.column("contents").cast(pa.string())],
                                        schema=SCHEMA)
                else:
                    ids, cont = b
                    b = pa.record_batch([pa.array(ids, pa.string()), pa.array(cont, pa.string())], schema=SCHEMA)
                w.write_batch(b)
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    return p


def map_arrow_table(path: str | os.PathLike) -> pa.Table:
    """The table of an Arrow IPC file, its buffers memory-mapped (read-only, nothing copied).

    Raises
    ------
    DataError
        Not an Arrow IPC file, or no ``id`` / ``contents`` columns.
    """
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not an Arrow IPC corpus file ({exc})") from None
    missing = {"id", "contents"} - set(table.column_names)
    if missing:
        raise DataError(f"{path}: corpus rows need 'id' and 'contents'; found columns {table.column_names}")
    return table

"""A saved quantised flat index: int8 codes (or fp16/bf16 storage) as ``.npy`` files, mapped on load.

``DenseIndex.load(storage="int8")`` on an fp32 directory quantises at load time, which needs the
fp32 matrix and a private copy of the codes in memory: 64.6 GB and 16.3 GB at paper scale
(21,015,324 x 768). This format stores what :func:`ragfast.ops.topk_ip.quantize` makes, once:

* ``codes.npy``: ``[N, d]`` int8 codes (or fp16 / bf16 storage as int16 bit patterns);
* ``scale.npy``: ``[N]`` float32 per-row scale (int8);
* ``rowsum.npy``: ``[N]`` int32 sums of each row's codes (int8; the VNNI kernel needs them);
* ``rescore.npy``: optional ``[N, d]`` fp16 / bf16 (int16 bit patterns) / fp32 re-score copy;
* ``meta.json``: ``{"format": "ragfast-dense-index/1", "layout": "quantized", ...}``, written
  last, so a directory whose build was interrupted never loads as an index.

:func:`open_quantized` maps every file read-only and wraps the maps in torch tensors without a
copy, so a server holds no private copy of the index: its pages live in the page cache, shared
by every process that maps them, and the compiled kernels read the mapped buffers in place.
:class:`QuantizedWriter` builds the directory chunk by chunk (any N, bounded memory) and can
resume an interrupted build.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from ragfast.checks import load_npy
from ragfast.errors import DataError

__all__ = ["QuantizedWriter", "open_quantized", "save_quantized", "is_quantized_dir", "LAYOUT"]

LAYOUT = "quantized"
_FORMAT = "ragfast-dense-index/1"
#: numpy dtype each torch storage dtype is written as (bf16 has no numpy dtype: its bits as int16).
_NP = {"int8": np.int8, "fp16": np.float16, "bf16": np.int16, "fp32": np.float32, "int32": np.int32}


def is_quantized_dir(path: str | os.PathLike) -> bool:
    """True when ``path/meta.json`` declares the quantised layout."""
    meta = Path(path) / "meta.json"
    if not meta.exists():
        return False
    try:
        return json.loads(meta.read_text()).get("layout") == LAYOUT
    except (OSError, ValueError):
        return False


def _to_np(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.detach().cpu().numpy()


def _to_torch(a: np.ndarray, kind: str):
    import torch

    with warnings.catch_warnings():
        # the maps are read-only: torch warns that it cannot write them; nothing here writes
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if kind == "bf16" else t


class QuantizedWriter:
    """Write a quantised flat index directory chunk by chunk.

    Parameters
    ----------
    path : path
        The index directory (created).
    rows, dim : int
        Final shape ``[rows, dim]``.
    storage : {"int8", "fp16", "bf16"}
        What :func:`ragfast.ops.topk_ip.quantize` makes of each chunk.
    rescore : {"fp16", "bf16", "fp32", None}
        int8 only: the re-score copy kept beside the codes.
    oversample : int, optional
        Recorded for search (default: ``quantize``'s).
    extra_meta : dict, optional
        Kept in ``meta.json`` (e.g. how the vectors were made).

    Notes
    -----
    Files are created at full size (sparse) and filled by :meth:`write`; :meth:`finish` flushes
    them and writes ``meta.json``. Each ``write`` may be followed by :meth:`flush`, after which
    the rows written so far survive a crash: a new writer on the same directory with
    ``resume=True`` reopens the files in place (the caller knows from its own progress record
    which rows are done).
    """

    def __init__(self, path: str | os.PathLike, rows: int, dim: int, *, storage: str = "int8",
                 rescore: str | None = "fp16", oversample: int | None = None,
                 extra_meta: dict[str, Any] | None = None, resume: bool = False):
        if storage not in ("int8", "fp16", "bf16"):
            raise ValueError(f"storage must be 'int8', 'fp16' or 'bf16', got {storage!r}")
        if storage != "int8":
            rescore = None
        if rescore not in (None, "fp16", "bf16", "fp32"):
            raise ValueError(f"rescore must be 'fp16', 'bf16', 'fp32' or None, got {rescore!r}")
        if rows < 1 or dim < 1:
            raise ValueError(f"rows and dim must be positive, got {rows} x {dim}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.rows, self.dim, self.storage, self.rescore = int(rows), int(dim), storage, rescore
        self.oversample = oversample
        self.extra_meta = dict(extra_meta or {})
        meta = self.path / "meta.json"
        if meta.exists():
            meta.unlink()  # being (re)written: not an index until finish()
        mode = "r+" if resume else "w+"
        shapes = {"codes": ((rows, dim), _NP[storage])}
        if storage == "int8":
            shapes["scale"] = ((rows,), np.float32)
            shapes["rowsum"] = ((rows,), np.int32)
            if rescore is not None:
                shapes["rescore"] = ((rows, dim), _NP[rescore])
        self._maps: dict[str, np.memmap] = {}
        for name, (shape, dt) in shapes.items():
            f = self.path / f"{name}.npy"
            if resume:
                m = np.lib.format.open_memmap(f, mode=mode)
                if m.shape != shape or m.dtype != np.dtype(dt):
                    raise DataError(f"{f}: shape {m.shape} {m.dtype} does not match the build's {shape} "
                                    f"{np.dtype(dt)}; cannot resume")
            else:
                m = np.lib.format.open_memmap(f, mode=mode, dtype=dt, shape=shape)
            self._maps[name] = m

    def write(self, start: int, vectors: Any) -> None:
        """Quantise ``vectors`` (``[c, dim]`` float) and store them as rows ``start .. start + c``."""
        from ragfast.ops.topk_ip import quantize

        c = int(vectors.shape[0])
        if start < 0 or start + c > self.rows or vectors.shape[1] != self.dim:
            raise ValueError(f"chunk [{start}, {start + c}) x {vectors.shape[1]} outside the index "
                             f"{self.rows} x {self.dim}")
        qc = quantize(vectors, self.storage, rescore=self.rescore if self.storage == "int8" else None)
        self._maps["codes"][start:start + c] = _to_np(qc.data)
        if self.storage == "int8":
            self._maps["scale"][start:start + c] = _to_np(qc.scale)
            self._maps["rowsum"][start:start + c] = _to_np(qc.rowsum)
            if self.rescore is not None:
                self._maps["rescore"][start:start + c] = _to_np(qc.rescore)
        if self.oversample is None:
            self.oversample = qc.oversample

    def flush(self) -> None:
        """Write the rows so far to disk (the page cache's dirty pages)."""
        for m in self._maps.values():
            m.flush()

    def finish(self) -> Path:
        """Flush, close the maps and write ``meta.json``: the directory is now a loadable index."""
        from ragfast.ops.topk_ip import quantize

        self.flush()
        self._maps.clear()
        if self.oversample is None:
            self.oversample = quantize(np.zeros((1, self.dim), np.float32), self.storage).oversample
        meta = {"format": _FORMAT, "backend": "flat", "layout": LAYOUT, "storage": self.storage,
                "factory": "flat", "ntotal": self.rows, "dim": self.dim, "rescore": self.rescore,
                "oversample": int(self.oversample), "search_params": {}, **self.extra_meta}
        tmp = self.path / f".meta.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, self.path / "meta.json")
        return self.path


def save_quantized(stored: Any, path: str | os.PathLike, extra_meta: dict[str, Any] | None = None) -> Path:
    """Write an in-memory :class:`~ragfast.ops.topk_ip.QuantizedCorpus` in the quantised layout."""
    n, d = stored.shape
    names = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32"}
    rescore = None if stored.rescore is None else names[str(stored.rescore.dtype)]
    w = QuantizedWriter(path, n, d, storage=stored.dtype, rescore=rescore, oversample=stored.oversample,
                        extra_meta=extra_meta)
    w._maps["codes"][:] = _to_np(stored.data)
    if stored.dtype == "int8":
        w._maps["scale"][:] = _to_np(stored.scale)
        w._maps["rowsum"][:] = _to_np(stored.rowsum)
        if rescore is not None:
            w._maps["rescore"][:] = _to_np(stored.rescore)
    return w.finish()


def open_quantized(path: str | os.PathLike, mmap: bool = True):
    """Map a quantised index directory as a :class:`~ragfast.ops.topk_ip.QuantizedCorpus` (no copy).

    Parameters
    ----------
    path : path
        A directory written by :class:`QuantizedWriter` or :func:`save_quantized`.
    mmap : bool
        Map the files (default) or read them into private memory.

    Returns
    -------
    (QuantizedCorpus, dict)
        The corpus, its tensors backed by the read-only maps, and ``meta.json``.

    Raises
    ------
    DataError
        A missing or mis-shaped file.
    """
    from ragfast.ops.topk_ip import QuantizedCorpus

    p = Path(path)
    meta = json.loads((p / "meta.json").read_text())
    storage, n, d = meta["storage"], int(meta["ntotal"]), int(meta["dim"])
    if storage not in ("int8", "fp16", "bf16"):
        raise DataError(f"{p}: quantised index with unknown storage {storage!r}")

    def arr(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        a = load_npy(p / f"{name}.npy", mmap)
        if a.shape != shape or a.dtype != np.dtype(_NP[kind]):
            raise DataError(f"{p / (name + '.npy')}: shape {a.shape} {a.dtype}, expected {shape} "
                            f"{np.dtype(_NP[kind])} (meta.json says {n} x {d} {storage})")
        return a

    data = _to_torch(arr("codes", (n, d), storage), storage)
    if storage != "int8":
        return QuantizedCorpus(data, storage, oversample=int(meta.get("oversample", 1))), meta
    scale = _to_torch(arr("scale", (n,), "fp32"), "fp32")
    rowsum = _to_torch(arr("rowsum", (n,), "int32"), "int32")
    rescore = None
    if meta.get("rescore"):
        rescore = _to_torch(arr("rescore", (n, d), meta["rescore"]), meta["rescore"])
    return QuantizedCorpus(data, "int8", scale=scale, rowsum=rowsum, rescore=rescore,
                           oversample=int(meta.get("oversample", 4))), meta

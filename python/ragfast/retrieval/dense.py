"""Dense indexes (ragfast's flat kernel, faiss), sharding, and the dense retriever.

``DenseIndex`` has one interface over two backends:

* ``flat``: exact inner-product search with :func:`ragfast.ops.topk_ip.topk_ip`, the corpus
  stored as fp32, fp16, bf16 or int8 (:func:`ragfast.ops.topk_ip.quantize`). Saved as one
  ``.npy`` matrix that loads memory-mapped, so processes serving the same index share the
  page cache instead of each holding a copy.
* ``faiss``: any index-factory string (``Flat``, ``HNSW32``, ``IVF4096,PQ64`` ...) with the
  inner-product metric, trained when it needs training, sharded over all GPUs when faiss-gpu
  sees GPUs. A plain faiss file, e.g. Search-R1's ``e5_Flat.index``, loads as it is.

``ShardedIndex`` splits a flat index into row ranges and merges their top-k exactly.
``DenseRetriever`` joins an :class:`~ragfast.encoders.encoder.Encoder`, an index and a corpus
into a :class:`~ragfast.retrieval.base.Retriever`.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.checks import as_matrix, check_exclude, check_positive_k, check_search, load_npy
from ragfast.infra.deps import faiss as load_faiss
from ragfast.errors import ConfigError, DataError
from ragfast.retrieval.base import Hit, Retriever
from ragfast.retrieval.index_meta import read_index_meta
from ragfast.retrieval.merge import merge_topk, shard_exclude
from ragfast.retrieval.search_cost import record_search, split_evenly

__all__ = ["DenseIndex", "ShardedIndex", "DenseRetriever", "build_default_retriever", "STORAGE_BYTES"]

#: Bytes per stored element of each flat storage dtype (int8 adds per-row scale and sums).
STORAGE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}
_FORMAT = "ragfast-dense-index/1"


class DenseIndex:
    """Top-k inner-product search over a matrix of vectors.

    Build with :meth:`build`, or :meth:`load` a saved index (a ragfast directory or any faiss
    index file). Row ids are positions ``0..N-1`` in the order the vectors were given (the
    corpus order).

    Parameters
    ----------
    backend : {"flat", "faiss"}
    vectors : np.ndarray, optional
        float32 ``[N, d]`` (flat backend; may be a memory map).
    stored : QuantizedCorpus, optional
        Flat backend without fp32 vectors: search this quantised corpus as it is (what
        :meth:`load` gives for a directory saved with ``save(..., codes=True)``; ``vectors`` is
        then None).
    faiss_index : faiss.Index, optional
        (faiss backend).
    storage : {"fp32", "fp16", "bf16", "int8"}
        Flat storage dtype.
    kernel_backend : str, optional
        ``ref`` / ``cpp`` / ``triton`` for :func:`~ragfast.ops.topk_ip.topk_ip` (default: its own choice).
    """

    def __init__(self, backend: str, *, vectors: np.ndarray | None = None, faiss_index: Any = None,
                 storage: str = "fp32", kernel_backend: str | None = None, factory: str | None = None,
                 search_params: dict[str, Any] | None = None, gpus: bool | str = "auto", stored: Any = None):
        if backend not in ("flat", "faiss"):
            raise ConfigError(f"unknown index backend {backend!r}; expected 'flat' or 'faiss'")
        self.backend = backend
        self.kernel_backend = kernel_backend
        self.search_params = dict(search_params or {})
        self._gpu_index = None
        if backend == "flat":
            if storage not in STORAGE_BYTES:
                raise ConfigError(f"unknown storage {storage!r}; expected one of {', '.join(STORAGE_BYTES)}")
            if stored is not None:
                # an already quantised corpus (a mapped saved index): searched as it is; there
                # are no fp32 vectors behind it
                self.storage, self.vectors = stored.dtype, None
                self.ntotal, self.dim = stored.shape
                self.factory = "flat"
                self._stored = stored
                return
            if vectors is None:
                raise ValueError("the flat backend needs vectors")
            self.storage = storage
            self.vectors = vectors
            self.ntotal, self.dim = int(vectors.shape[0]), int(vectors.shape[1])
            self.factory = "flat"
            self._stored = self._make_stored()
        else:
            if faiss_index is None:
                raise ValueError("the faiss backend needs a faiss index")
            faiss = load_faiss()

            self.storage = "faiss"
            self.vectors = None
            self.faiss_index = faiss_index
            self.ntotal, self.dim = int(faiss_index.ntotal), int(faiss_index.d)
            self.factory = factory or type(faiss.downcast_index(faiss_index)).__name__
            if faiss_index.metric_type != faiss.METRIC_INNER_PRODUCT:
                raise ConfigError(f"faiss index metric is {faiss_index.metric_type}, expected inner product "
                                  f"(METRIC_INNER_PRODUCT={faiss.METRIC_INNER_PRODUCT})")
            if self.search_params:
                ps = faiss.ParameterSpace()
                for key, val in self.search_params.items():
                    try:
                        ps.set_index_parameter(faiss_index, key, val)
                    except RuntimeError as exc:
                        raise ConfigError(f"faiss index {self.factory} has no search parameter {key!r}") from exc
            self._maybe_gpu(gpus)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, embeddings: Any, backend: str = "flat", *, storage: str = "fp32", factory: str = "Flat",
              search_params: dict[str, Any] | None = None, kernel_backend: str | None = None,
              train_size: int = 262144, gpus: bool | str = "auto", progress: bool = False,
              seed: int = 0) -> "DenseIndex":
        """Index a ``[N, d]`` float32 matrix.

        Parameters
        ----------
        embeddings : np.ndarray or torch.Tensor
            One row per corpus passage, in corpus order.
        backend : {"flat", "faiss"}
            ``flat`` is ragfast's exact kernel; ``faiss`` builds ``factory``.
        storage : {"fp32", "fp16", "bf16", "int8"}
            Flat storage dtype.
        factory : str
            faiss index-factory string (``Flat``, ``HNSW32``, ``IVF4096,PQ64``, ...).
        search_params : dict, optional
            faiss search-time parameters, e.g. ``{"nprobe": 64}`` or ``{"efSearch": 128}``.
        train_size : int
            Vectors sampled to train a faiss index that needs training.
        gpus : bool or "auto"
            Shard a faiss index over all GPUs (needs faiss-gpu); "auto" does so when GPUs exist.
        progress : bool
            Show a progress bar while adding to a faiss index.
        """
        emb = as_matrix(embeddings)
        if backend == "flat":
            return cls("flat", vectors=emb, storage=storage, kernel_backend=kernel_backend)
        if backend != "faiss":
            raise ConfigError(f"unknown index backend {backend!r}; expected 'flat' or 'faiss'")
        faiss = load_faiss()

        n, d = emb.shape
        try:
            index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        except RuntimeError as exc:
            raise ConfigError(f"faiss cannot build index factory {factory!r}: {str(exc).splitlines()[0]}") from exc
        if not index.is_trained:
            rng = np.random.default_rng(seed)
            sel = np.sort(rng.choice(n, size=min(n, train_size), replace=False))
            try:
                index.train(np.ascontiguousarray(emb[sel], dtype=np.float32))
            except RuntimeError as exc:
                raise ConfigError(f"training faiss {factory!r} on {len(sel)} vectors failed: "
                                  f"{str(exc).splitlines()[0]} (too few vectors for this many centroids?)") from exc
        from rich.progress import Progress

        step = 65536
        from rich.console import Console

        with Progress(disable=not progress, console=Console(stderr=True)) as bar:
            task = bar.add_task(f"adding to faiss {factory}", total=n)
            for s in range(0, n, step):
                index.add(np.ascontiguousarray(emb[s:s + step], dtype=np.float32))
                bar.advance(task, min(step, n - s))
        return cls("faiss", faiss_index=index, factory=factory, search_params=search_params, gpus=gpus)

    def _make_stored(self):
        import torch

        import warnings

        with warnings.catch_warnings():
            # A read-only memory map: torch warns it is not writable; the index never writes it.
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(np.asarray(self.vectors))
        if self.storage == "fp32":
            return t
        from ragfast.ops.topk_ip import quantize

        return quantize(t, dtype=self.storage)

    def _maybe_gpu(self, gpus: bool | str) -> None:
        faiss = load_faiss()

        if gpus is False or not hasattr(faiss, "index_cpu_to_all_gpus"):
            if gpus is True:
                raise ConfigError("gpus=True needs faiss-gpu; this faiss build has no GPU support")
            return
        ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
        if ngpu == 0:
            if gpus is True:
                raise ConfigError("gpus=True but faiss sees no GPU")
            return
        co = faiss.GpuMultipleClonerOptions()
        co.shard = True  # split rows over the GPUs: each holds 1/G of the vectors
        co.useFloat16 = False  # keep exact fp32 scores, as the methods were measured
        self._gpu_index = faiss.index_cpu_to_all_gpus(self.faiss_index, co=co)

    # -- facts -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.ntotal

    @property
    def stored(self) -> Any:
        """What the flat kernel scans: the fp32 tensor or a ``QuantizedCorpus`` (None for faiss)."""
        return getattr(self, "_stored", None)

    def bytes_per_search(self) -> int:
        """Bytes one query's search reads from the stored vectors (flat: the whole corpus; IVF: its lists)."""
        if self.backend == "flat":
            if self.storage == "fp32":
                return self.ntotal * self.dim * 4
            return int(self._stored.scan_bytes)  # codes plus per-row scale/sums
        faiss = load_faiss()

        idx = faiss.downcast_index(self.faiss_index)
        code = getattr(idx, "code_size", 4 * self.dim)
        if isinstance(idx, faiss.IndexIVF):
            # Each query visits nprobe of nlist lists: the expected share of codes it reads.
            return int(self.ntotal * idx.code_size * min(1.0, idx.nprobe / max(1, idx.nlist)))
        if "HNSW" in type(idx).__name__:
            return 0  # a graph walk touches a data-dependent set of vectors; not estimated
        return int(self.ntotal * code)

    def describe(self) -> dict[str, Any]:
        """Backend, factory/storage, size and dimension."""
        d = {"backend": self.backend, "factory": self.factory, "storage": self.storage, "ntotal": self.ntotal,
             "dim": self.dim}
        if self.backend == "faiss":
            d["gpu_sharded"] = self._gpu_index is not None
            if self.search_params:
                d["search_params"] = self.search_params
        else:
            d["kernel_backend"] = self.kernel_backend or "auto"
        return d

    # -- search ------------------------------------------------------------------------------
    def search(self, queries: Any, k: int, *, exclude: Sequence[Sequence[int]] | None = None,
               min_score: float | None = None, ledger=None, question_ids: Sequence[str] | None = None):
        """Top-k rows by inner product.

        Parameters
        ----------
        queries : torch.Tensor or np.ndarray
            float ``[B, d]`` (a single ``[d]`` vector is treated as B=1).
        k : int
            1 <= k <= N.
        exclude : list of B lists of int, optional
            Row ids each query must skip (e.g. passages a trajectory already read).
        min_score : float, optional
            Hits scoring below it come back as id -1, score -inf.
        ledger : CostLedger, optional
            Receives ``search`` records (seconds, bytes scanned) split over ``question_ids``.

        Returns
        -------
        (scores, ids) : (torch.Tensor, torch.Tensor)
            float32 ``[B, k]`` best first and int64 ``[B, k]`` row ids; empty slots are -inf / -1.
        """
        import torch

        q, k, ex = check_search(queries, k, exclude, min_score, dim=self.dim, n=self.ntotal)
        b = q.shape[0]
        if b == 0:
            return torch.zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.int64)
        t0 = time.perf_counter()
        if self.backend == "flat":
            from ragfast.ops.topk_ip import topk_ip

            scores, ids = topk_ip(q, self._stored, k, min_score=min_score, exclude=ex, backend=self.kernel_backend)
        else:
            scores, ids = self._faiss_search(q.numpy(), k, ex, min_score)
        seconds = time.perf_counter() - t0
        record_search(ledger, question_ids, b, seconds, self.bytes_per_search(), self.flops_per_query())
        return scores, ids

    def flops_per_query(self) -> float:
        """Multiply-adds x2 of an exhaustive scan (flat, faiss Flat); 0 where not estimated."""
        if self.backend == "flat":
            return 2.0 * self.ntotal * self.dim
        faiss = load_faiss()

        if isinstance(self._downcast(), faiss.IndexFlat):
            return 2.0 * self.ntotal * self.dim
        return 0.0

    def _downcast(self):
        faiss = load_faiss()

        return faiss.downcast_index(self.faiss_index)

    def _faiss_search(self, q: np.ndarray, k: int, ex: list[list[int]] | None, min_score: float | None):
        import torch

        index = self._gpu_index if self._gpu_index is not None else self.faiss_index
        extra = max((len(e) for e in ex), default=0) if ex else 0
        # faiss has no per-query exclusion: over-fetch by the longest exclude list, then drop.
        kk = min(self.ntotal, k + extra)
        D, I = index.search(q, kk)
        D = np.where(I < 0, -np.inf, D).astype(np.float32)
        if ex or min_score is not None:
            out_d = np.full((q.shape[0], k), -np.inf, dtype=np.float32)
            out_i = np.full((q.shape[0], k), -1, dtype=np.int64)
            for r in range(q.shape[0]):
                keep = I[r] >= 0
                if ex and ex[r]:
                    keep &= ~np.isin(I[r], np.asarray(ex[r], dtype=np.int64))
                if min_score is not None:
                    keep &= D[r] >= min_score
                sel = np.flatnonzero(keep)[:k]
                out_d[r, :len(sel)] = D[r, sel]
                out_i[r, :len(sel)] = I[r, sel]
            D, I = out_d, out_i
        else:
            D, I = D[:, :k], I[:, :k].astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(D)), torch.from_numpy(np.ascontiguousarray(I))

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, *, codes: bool = False) -> Path:
        """Write the index.

        flat: a directory with ``vectors.npy`` (fp32, memory-mappable) and ``meta.json``; with
        ``codes=True`` (or when there are no fp32 vectors) the quantised storage itself
        (:mod:`ragfast.retrieval.quantized_store`: codes, scales, row sums, re-score copy), which
        :meth:`load` maps without quantising or copying anything.
        faiss: a directory with ``index.faiss`` and ``meta.json`` (the CPU copy is written).
        """
        if self.backend == "flat" and self.storage != "fp32" and (codes or self.vectors is None):
            from ragfast.retrieval.quantized_store import save_quantized

            return save_quantized(self._stored, path)
        if codes:
            raise ConfigError(f"save(codes=True) needs a quantised flat index; this one is {self.backend} "
                              f"{self.storage}")
        faiss = load_faiss()

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"format": _FORMAT, "backend": self.backend, "storage": self.storage, "factory": self.factory,
                "ntotal": self.ntotal, "dim": self.dim, "search_params": self.search_params}
        if self.backend == "flat":
            tmp = out / f".vectors.{os.getpid()}.tmp.npy"
            np.save(tmp, np.ascontiguousarray(self.vectors, dtype=np.float32))
            os.replace(tmp, out / "vectors.npy")
        else:
            faiss.write_index(self.faiss_index, str(out / "index.faiss"))
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, mmap: bool = True, storage: str | None = None,
             kernel_backend: str | None = None, search_params: dict[str, Any] | None = None,
             gpus: bool | str = "auto") -> "DenseIndex":
        """Load a saved index: a ragfast directory, or a bare faiss index file.

        Parameters
        ----------
        path : path
            A directory written by :meth:`save`, a faiss file such as Search-R1's
            ``e5_Flat.index``, or a ``.npy`` matrix (indexed flat).
        mmap : bool
            Memory-map the vectors (flat), the saved quantised storage, or the codes (faiss
            ``IO_FLAG_MMAP``) instead of reading them into private memory.
        storage : str, optional
            Override the saved flat storage dtype (fp32 / fp16 / bf16 / int8).
        """
        p = Path(path)
        if not p.exists():
            raise DataError(f"no index at {p}")
        if p.is_dir():
            meta = read_index_meta(p, _FORMAT, "index directory")
            if meta.get("layout") == "quantized":
                from ragfast.retrieval.quantized_store import open_quantized

                if storage not in (None, meta["storage"]):
                    raise ConfigError(f"{p} holds {meta['storage']} codes; it cannot be loaded as {storage} "
                                      "(re-quantising needs the fp32 vectors)")
                stored, _ = open_quantized(p, mmap)
                return cls("flat", stored=stored, kernel_backend=kernel_backend)
            if meta["backend"] == "flat":
                vec = load_npy(p / "vectors.npy", mmap)
                return cls("flat", vectors=vec, storage=storage or meta["storage"], kernel_backend=kernel_backend)
            idx = _read_faiss(p / "index.faiss", mmap)
            return cls("faiss", faiss_index=idx, factory=meta.get("factory"),
                       search_params=search_params if search_params is not None else meta.get("search_params"),
                       gpus=gpus)
        if p.suffix == ".npy":
            vec = load_npy(p, mmap)
            return cls("flat", vectors=as_matrix(vec), storage=storage or "fp32", kernel_backend=kernel_backend)
        return cls("faiss", faiss_index=_read_faiss(p, mmap), search_params=search_params, gpus=gpus)


def _read_faiss(path: Path, mmap: bool):
    faiss = load_faiss()

    # MMAP_IFC maps the codes of flat indexes (e5_Flat.index is 60 GB at wiki-18 scale: mapping
    # it lets several server workers share one copy); MMAP maps IVF inverted lists. Not every
    # index type takes every flag (faiss 1.15 refuses MMAP_IFC for IVF lists), so try them in
    # turn and fall back to a plain read.
    attempts = [getattr(faiss, "IO_FLAG_MMAP_IFC", None), faiss.IO_FLAG_MMAP, 0] if mmap else [0]
    try:
        with open(path, "rb") as f:
            fourcc = f.read(4)
    except OSError as exc:
        raise DataError(f"cannot read faiss index {path}: {exc}") from exc
    if mmap and fourcc.startswith((b"Iw", b"Iv")):  # IVF family: map the inverted lists first
        attempts = [faiss.IO_FLAG_MMAP, 0]
    last: Exception | None = None
    for flags in [f for f in attempts if f is not None]:
        try:
            return faiss.read_index(str(path), flags)
        except RuntimeError as exc:
            last = exc
    raise DataError(f"{path} is not a readable faiss index: {str(last).splitlines()[0]}") from last


def _shard_worker(path: str, storage: str | None, kernel_backend: str | None, threads: int | None, conn) -> None:
    """Child process: map one saved shard and answer search requests over a pipe."""
    try:
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        idx = DenseIndex.load(path, storage=storage, kernel_backend=kernel_backend)
        conn.send(("ready", idx.ntotal, idx.dim, idx.describe(), idx.bytes_per_search(), idx.flops_per_query()))
    except Exception as exc:  # report, don't hang the parent
        conn.send(("err", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        q, k, ex, ms = msg
        try:
            sc, ids = idx.search(q, k, exclude=ex, min_score=ms)
            conn.send(("ok", sc.numpy(), ids.numpy()))
        except Exception as exc:
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class _ProcessShard:
    """A saved flat shard served by its own process (memory-mapped there, never copied here)."""

    def __init__(self, path: str | os.PathLike, *, storage: str | None = None, kernel_backend: str | None = None,
                 threads: int | None = None):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # fork after torch has started threads is unsafe
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_shard_worker, args=(str(path), storage, kernel_backend, threads, child),
                                 daemon=True)
        self._proc.start()
        child.close()
        msg = self._conn.recv()
        if msg[0] != "ready":
            self._proc.join(5)
            raise DataError(f"shard process for {path} failed to start: {msg[1]}")
        _, self.ntotal, self.dim, self._describe, self._bytes, self._flops = msg
        self.path = str(path)

    def __len__(self) -> int:
        return self.ntotal

    def describe(self) -> dict[str, Any]:
        return {**self._describe, "process": self._proc.pid, "path": self.path}

    def bytes_per_search(self) -> int:
        return self._bytes

    def flops_per_query(self) -> float:
        return self._flops

    def submit(self, q, k: int, exclude, min_score) -> None:
        self._conn.send((q.numpy(), k, exclude, min_score))

    def result(self):
        import torch

        msg = self._conn.recv()
        if msg[0] != "ok":
            raise RuntimeError(f"shard {self.path}: {msg[1]}")
        return torch.from_numpy(msg[1]), torch.from_numpy(msg[2])

    def search(self, q, k: int, *, exclude=None, min_score=None):
        self.submit(q, k, exclude, min_score)
        return self.result()

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
        self._conn.close()


class ShardedIndex:
    """A flat index split into S row ranges, searched shard by shard and merged exactly.

    Each shard returns its own top-k; the union of the shards' top-k holds the global top-k,
    so sorting it by (score desc, row id asc) gives the unsharded answer. In-process shards are
    searched in a thread pool (the compiled kernel releases the GIL); shards loaded with
    ``processes=True`` each live in their own process, which maps its shard from disk, and are
    searched in parallel over pipes (only the queries and the k results per shard travel).

    Parameters
    ----------
    shards : list of DenseIndex
        In row order; shard s covers rows ``offsets[s] .. offsets[s] + len(shards[s])``.
    """

    def __init__(self, shards: Sequence[DenseIndex], *, threads: int | None = None):
        if not shards:
            raise ValueError("ShardedIndex needs at least one shard")
        dims = {s.dim for s in shards}
        if len(dims) != 1:
            raise DataError(f"shards have different dimensions: {sorted(dims)}")
        self.shards = list(shards)
        self.dim = dims.pop()
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)
        self.ntotal = int(self.offsets[-1])
        self.threads = threads or len(shards)

    @classmethod
    def split(cls, embeddings: Any, num_shards: int, *, storage: str = "fp32",
              kernel_backend: str | None = None, threads: int | None = None) -> "ShardedIndex":
        """Split a ``[N, d]`` matrix (or a flat :class:`DenseIndex`) into ``num_shards`` flat shards.

        Row slices of a memory-mapped matrix stay memory-mapped: no copy is made.
        """
        if isinstance(embeddings, DenseIndex):
            if embeddings.backend != "flat":
                raise ConfigError("only flat indexes can be split; faiss shards over GPUs itself")
            storage = embeddings.storage if storage == "fp32" else storage
            if embeddings.vectors is None:
                raise ConfigError("a saved quantised index has no fp32 vectors to split; save it in shards")
            embeddings = embeddings.vectors
        emb = as_matrix(embeddings)
        n = emb.shape[0]
        if not 1 <= num_shards <= n:
            raise ValueError(f"num_shards must be in 1..{n}, got {num_shards}")
        bounds = np.cumsum([0] + split_evenly(n, num_shards))
        shards = [DenseIndex("flat", vectors=emb[bounds[s]:bounds[s + 1]], storage=storage,
                             kernel_backend=kernel_backend) for s in range(num_shards)]
        return cls(shards, threads=threads)

    def save(self, path: str | os.PathLike) -> Path:
        """Write each shard as a flat index directory ``shard-000`` ... plus ``sharded.json``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        for i, sh in enumerate(self.shards):
            if not isinstance(sh, DenseIndex) or sh.backend != "flat":
                raise ConfigError("only in-process flat shards can be saved")
            sh.save(out / f"shard-{i:03d}")
        (out / "sharded.json").write_text(json.dumps({"format": "ragfast-sharded/1", "shards": len(self.shards),
                                                      "offsets": self.offsets.tolist()}, indent=1))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, processes: bool = False, storage: str | None = None,
             kernel_backend: str | None = None, threads_per_shard: int | None = None) -> "ShardedIndex":
        """Load a saved sharded index; every shard is memory-mapped (no copy).

        Parameters
        ----------
        processes : bool
            Serve each shard from its own process (which maps only its own rows).
        threads_per_shard : int, optional
            torch threads of each shard process.
        """
        p = Path(path)
        meta = p / "sharded.json"
        if not meta.exists():
            raise DataError(f"{p} is not a sharded index (no sharded.json)")
        n = json.loads(meta.read_text())["shards"]
        dirs = [p / f"shard-{i:03d}" for i in range(n)]
        if processes:
            shards: list[Any] = []
            try:
                for d in dirs:
                    shards.append(_ProcessShard(d, storage=storage, kernel_backend=kernel_backend,
                                                threads=threads_per_shard))
            except Exception:
                for sh in shards:
                    sh.close()
                raise
        else:
            shards = [DenseIndex.load(d, storage=storage, kernel_backend=kernel_backend) for d in dirs]
        return cls(shards)

    def close(self) -> None:
        """Stop shard processes (no-op for in-process shards)."""
        for sh in self.shards:
            if isinstance(sh, _ProcessShard):
                sh.close()

    def __enter__(self) -> "ShardedIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return self.ntotal

    def describe(self) -> dict[str, Any]:
        return {"backend": "sharded", "shards": [s.describe() for s in self.shards], "ntotal": self.ntotal,
                "dim": self.dim}

    def bytes_per_search(self) -> int:
        return sum(s.bytes_per_search() for s in self.shards)

    def search(self, queries: Any, k: int, *, exclude: Sequence[Sequence[int]] | None = None,
               min_score: float | None = None, ledger=None, question_ids: Sequence[str] | None = None):
        """Same contract as :meth:`DenseIndex.search`, over all shards."""
        import torch

        q, k, ex = check_search(queries, k, exclude, min_score, dim=self.dim, n=self.ntotal)
        b = q.shape[0]
        t0 = time.perf_counter()

        def one(s: int):
            shard, lo = self.shards[s], int(self.offsets[s])
            local_ex = shard_exclude(ex, lo, lo + len(shard))
            return shard.search(q, min(k, len(shard)), exclude=local_ex, min_score=min_score)

        if isinstance(self.shards[0], _ProcessShard):
            for s_, shard in enumerate(self.shards):  # send to every process, then collect
                lo, hi = int(self.offsets[s_]), int(self.offsets[s_ + 1])
                shard.submit(q, min(k, len(shard)), shard_exclude(ex, lo, hi), min_score)
            parts, errors = [], []
            for shard in self.shards:  # drain every pipe, even after a failure, to stay in step
                try:
                    parts.append(shard.result())
                except RuntimeError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        elif len(self.shards) == 1:
            parts = [one(0)]
        else:
            with ThreadPoolExecutor(max_workers=min(self.threads, len(self.shards))) as pool:
                parts = list(pool.map(one, range(len(self.shards))))
        out_s, out_i = merge_topk([(p[0].numpy(), p[1].numpy()) for p in parts], self.offsets[:-1], k)
        record_search(ledger, question_ids, b, time.perf_counter() - t0, self.bytes_per_search(),
                      sum(s.flops_per_query() for s in self.shards))
        return torch.from_numpy(out_s), torch.from_numpy(out_i)


class DenseRetriever(Retriever):
    """Encoder + dense index + corpus: the :class:`~ragfast.retrieval.base.Retriever` the loops use.

    Parameters
    ----------
    encoder : Encoder
        Embeds the queries (with its preset's query prefix).
    index : DenseIndex or ShardedIndex
        Row ids are corpus row positions.
    corpus : ragfast.data.Corpus
        Supplies the returned rows ``{"id", "contents"}`` and maps excluded ids to rows.
    """

    name = "dense"

    def __init__(self, encoder: Any, index: DenseIndex | ShardedIndex, corpus: Any):
        if len(index) != len(corpus):
            raise DataError(f"index has {len(index)} vectors but the corpus has {len(corpus)} passages")
        if getattr(encoder, "dim", index.dim) != index.dim:
            raise DataError(f"encoder dimension {encoder.dim} does not match the index dimension {index.dim}")
        self.encoder, self.index, self.corpus = encoder, index, corpus

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "class": type(self).__name__, "encoder": self.encoder.describe(),
                "index": self.index.describe(), "passages": len(self.corpus)}

    def _rows_of(self, ids: Sequence[str]) -> list[int]:
        rows = []
        for i in ids:
            try:
                rows.append(self.corpus.index_of(str(i)))
            except KeyError:
                continue  # an id outside this corpus can never be returned, so nothing to skip
        return rows

    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[str]] | None = None,
               ledger=None, question_ids: Sequence[str] | None = None, min_score: float | None = None
               ) -> list[list[Hit]]:
        """Up to ``k`` hits per query, best first; ``exclude`` holds corpus ids per query."""
        queries = list(queries)
        if not queries:
            return []
        check_exclude(exclude, len(queries), as_int=False)
        k = check_positive_k(k)
        qv = self.encoder.encode_queries(queries, ledger=ledger, question_ids=question_ids)
        ex = [self._rows_of(e) for e in exclude] if exclude is not None else None
        scores, ids = self.index.search(qv, min(int(k), len(self.index)), exclude=ex, min_score=min_score,
                                        ledger=ledger, question_ids=question_ids)
        out: list[list[Hit]] = []
        for srow, irow in zip(scores.tolist(), ids.tolist()):
            hits = []
            for s, i in zip(srow, irow):
                if i < 0:
                    continue
                row = self.corpus.row(i)
                hits.append(Hit(id=row["id"], score=float(s), document=row))
            out.append(hits)
        return out


def build_default_retriever(corpus: Any, encoder: Any = "minilm", cache_dir: str | os.PathLike | None = None,
                            storage: str = "fp32", *, device: str = "cpu", batch_size: int = 64,
                            chunk_size: int = 4096, progress: bool = True,
                            kernel_backend: str | None = None, use_shipped: bool = True) -> DenseRetriever:
    """Embed a corpus (cached on disk) and return a flat :class:`DenseRetriever` over it.

    Passages bundled with ragfast come with shipped MiniLM vectors
    (:mod:`ragfast.retrieval.shipped`, checked against the encoder's identity and a hash); a
    corpus made only of them is not embedded at all unless ``use_shipped=False``.

    The embeddings live under ``cache_dir`` (default ``$RAGFAST_CACHE/emb`` or
    ``~/.cache/ragfast/emb``) in a directory keyed by a hash of the corpus ids and contents and
    the encoder's fingerprint, so a second call, or another process, reuses them (memory-mapped)
    and an interrupted embedding resumes.

    Parameters
    ----------
    corpus : ragfast.data.Corpus, path or sample name
    encoder : Encoder, preset name or checkpoint path
        Default ``"minilm"`` (the bundled all-MiniLM-L6-v2).
    storage : {"fp32", "fp16", "bf16", "int8"}
    """
    from ragfast.encoders.encoder import Encoder, cache_root, corpus_fingerprint, encode_corpus, load_embeddings

    if isinstance(corpus, (str, os.PathLike)):
        from ragfast.data import load_corpus

        corpus = load_corpus(corpus)
    if len(corpus) == 0:
        raise DataError("cannot build a retriever over an empty corpus")
    enc = encoder if isinstance(encoder, Encoder) else Encoder(encoder, device=device, batch_size=batch_size)
    if use_shipped and hasattr(corpus, "contents"):
        from ragfast.retrieval.shipped import lookup

        shipped = lookup(enc, corpus.contents(range(len(corpus))))
        if shipped is not None:
            index = DenseIndex("flat", vectors=shipped, storage=storage, kernel_backend=kernel_backend)
            return DenseRetriever(enc, index, corpus)
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "emb"
    key = corpus_fingerprint(corpus)
    out = root / f"{key}-{enc.fingerprint()}"
    meta = out / "meta.json"
    if meta.exists():
        # The cache is keyed by corpus and encoder only: resume with the chunking it was started with.
        chunk_size = int(json.loads(meta.read_text()).get("chunk_size", chunk_size))
    emb = encode_corpus(enc, corpus, out, chunk_size=chunk_size, progress=progress, corpus_key=key)
    whole = out / "vectors.npy"
    if emb.chunks_total > 1 and not whole.exists():
        # Several chunks would be concatenated (copied) by every process that loads them; one
        # consolidated matrix is memory-mapped instead, so server workers share the page cache.
        tmp = out / f".vectors.{os.getpid()}.tmp.npy"
        np.save(tmp, np.ascontiguousarray(load_embeddings(emb.path), dtype=np.float32))
        os.replace(tmp, whole)
    vectors = np.load(whole, mmap_mode="r") if whole.exists() else load_embeddings(emb.path)
    index = DenseIndex("flat", vectors=vectors, storage=storage, kernel_backend=kernel_backend)
    return DenseRetriever(enc, index, corpus)

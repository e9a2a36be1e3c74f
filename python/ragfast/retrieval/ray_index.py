"""A flat inner-product index sharded over Ray actors, merged exactly.

One ``.npy`` matrix written once (:func:`write_vectors`); S shard actors each memory-map it and
search only their own row range (a view of the map: no copy in fp32), and the driver merges the
S partial top-k exactly (:func:`~ragfast.retrieval.merge.merge_topk`: score descending, row id
ascending), which equals the unsharded answer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.checks import as_matrix, check_exclude_range, check_search, positive_int
from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.infra.ray_support import actor_device, require_ray
from ragfast.retrieval.dense import STORAGE_BYTES
from ragfast.retrieval.merge import merge_topk, shard_exclude
from ragfast.retrieval.search_cost import record_search, split_evenly

__all__ = ["RayShardedIndex", "write_vectors", "sharded_dense_retriever"]


def write_vectors(embeddings: Any, path: str | os.PathLike) -> Path:
    """Write a ``[N, d]`` float32 matrix once as ``.npy`` (atomically), for :class:`RayShardedIndex`.

    Parameters
    ----------
    embeddings : np.ndarray or torch.Tensor
        One row per corpus passage, in corpus order.
    path : path
        Target file; ``.npy`` is appended when missing.

    Returns
    -------
    Path
        The written file.
    """
    emb = as_matrix(embeddings)
    p = Path(path)
    if p.suffix != ".npy":
        p = p.with_name(p.name + ".npy")
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, np.ascontiguousarray(emb, dtype=np.float32))
    os.replace(tmp, p)
    return p


def _resolve_vectors(path: str | os.PathLike) -> tuple[Path, str | None]:
    p = Path(path)
    if p.is_dir():
        meta = p / "meta.json"
        if not (p / "vectors.npy").exists():
            raise DataError(f"{p} holds no vectors.npy (a flat ragfast index directory or a .npy file is needed)")
        storage = json.loads(meta.read_text()).get("storage") if meta.exists() else None
        return p / "vectors.npy", storage
    if not p.exists():
        raise DataError(f"no vectors at {p}")
    if p.suffix != ".npy":
        raise DataError(f"{p} is not a .npy matrix (write one with ragfast.retrieval.ray_index.write_vectors)")
    return p, None


class _ShardActor:
    """Maps rows [lo, hi) of one .npy file and answers top-k searches over them."""

    def __init__(self, path: str, lo: int, hi: int, storage: str, kernel_backend: str | None, threads: int | None):
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        self.device = actor_device()
        whole = np.load(path, mmap_mode="r")
        view = whole[lo:hi]  # a view of the map: the shard's pages are read on demand, never copied
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only map; the kernel never writes it
            t = torch.from_numpy(view)
        self.zero_copy = bool(storage == "fp32" and t.data_ptr() == view.ctypes.data)
        if storage == "fp32":
            stored: Any = t
            self.scan_bytes = int(view.nbytes)
        else:
            from ragfast.ops.topk_ip import quantize

            stored = quantize(t, dtype=storage)  # quantised codes are a new (smaller) array
            self.scan_bytes = int(stored.scan_bytes)
        if self.device == "cuda":
            stored = stored.to("cuda") if isinstance(stored, torch.Tensor) else dataclasses.replace(
                stored, **{f.name: getattr(stored, f.name).to("cuda") for f in dataclasses.fields(stored)
                           if isinstance(getattr(stored, f.name), torch.Tensor)})
        self.stored = stored
        self.kernel_backend = kernel_backend
        self.info = {"path": path, "lo": int(lo), "hi": int(hi), "rows": int(hi - lo), "dim": int(view.shape[1]),
                     "storage": storage, "mmap": isinstance(whole, np.memmap), "zero_copy": self.zero_copy,
                     "scan_bytes": self.scan_bytes,
                     "offset_bytes": (int(whole.offset + lo * view.shape[1] * 4)
                                      if isinstance(whole, np.memmap) else None),
                     "device": self.device, "pid": os.getpid()}

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def search(self, q: np.ndarray, k: int, exclude: list[list[int]] | None, min_score: float | None):
        import torch

        from ragfast.ops.topk_ip import topk_ip

        qt = torch.from_numpy(q)
        if self.device == "cuda":
            qt = qt.to("cuda")
        scores, ids = topk_ip(qt, self.stored, k, min_score=min_score, exclude=exclude, backend=self.kernel_backend)
        return scores.cpu().numpy(), ids.cpu().numpy()


class RayShardedIndex:
    """A flat inner-product index split over S Ray actors, merged exactly.

    The vectors are one ``.npy`` file (:func:`write_vectors`, or a flat index directory saved by
    :meth:`ragfast.retrieval.DenseIndex.save`). Shard s is an actor that memory-maps the file
    and searches rows ``offsets[s] .. offsets[s+1]``: with fp32 storage the shard is a view of
    the map (no copy; the page cache is shared by every shard on a node), with bf16/int8 the
    shard quantises its own rows. A search sends the queries to every shard once (one object in
    Ray's store), each returns its top-k, and the union is sorted by (score descending, row id
    ascending), which is the unsharded answer: the global top-k is contained in the union of
    the per-shard top-k.

    Has the same ``search`` contract as :class:`~ragfast.retrieval.DenseIndex`, so it can stand
    in for one inside :class:`~ragfast.retrieval.DenseRetriever`. Needs a Ray connection
    (:func:`ragfast.runner.distributed.ray_session` or ``ray.init``).

    Parameters
    ----------
    path : path
        The ``.npy`` matrix, or a flat ragfast index directory.
    num_shards : int
        S, 1 <= S <= N.
    storage : {"fp32", "fp16", "bf16", "int8"}, optional
        Default: the index directory's, else fp32.
    kernel_backend : str, optional
        ``ref`` / ``cpp`` / ``triton`` for :func:`~ragfast.ops.topk_ip.topk_ip`.
    shard_cpus, shard_gpus : float
        Resources per shard actor (a shard with a GPU moves its rows to it and searches there).
    threads_per_shard : int, optional
        torch threads in each shard actor (default: Ray's, i.e. its CPUs).
    max_restarts, max_task_retries : int
        A shard actor that dies is rebuilt and the search re-sent (searches are read-only).
    """

    def __init__(self, path: str | os.PathLike, num_shards: int, *, storage: str | None = None,
                 kernel_backend: str | None = None, shard_cpus: float = 1.0, shard_gpus: float = 0.0,
                 threads_per_shard: int | None = None, max_restarts: int = 3, max_task_retries: int = 3):
        ray = require_ray()
        if not ray.is_initialized():
            raise ConfigError("RayShardedIndex needs a Ray connection: use ragfast.runner.distributed.ray_session() "
                              "or ray.init() first")
        vec_path, saved_storage = _resolve_vectors(path)
        storage = storage or saved_storage or "fp32"
        if storage not in STORAGE_BYTES:
            raise ConfigError(f"unknown storage {storage!r}; expected one of {', '.join(STORAGE_BYTES)}")
        head = np.load(vec_path, mmap_mode="r")
        if head.ndim != 2 or head.dtype != np.float32:
            raise DataError(f"{vec_path}: expected a float32 [N, d] matrix, got {head.dtype} {head.shape}")
        n, d = int(head.shape[0]), int(head.shape[1])
        del head
        num_shards = positive_int(num_shards, "num_shards")
        if num_shards > n:
            raise ConfigError(f"num_shards={num_shards} exceeds the number of vectors ({n})")
        self.path, self.storage, self.ntotal, self.dim = vec_path, storage, n, d
        self.offsets = np.concatenate([[0], np.cumsum(split_evenly(n, num_shards))]).astype(np.int64)
        cls = ray.remote(_ShardActor).options(num_cpus=shard_cpus, num_gpus=shard_gpus, max_restarts=max_restarts,
                                             max_task_retries=max_task_retries)
        self.actors = [cls.remote(str(vec_path.resolve()), int(self.offsets[s]), int(self.offsets[s + 1]), storage,
                                  kernel_backend, threads_per_shard) for s in range(num_shards)]
        try:
            self.shard_info = ray.get([a.describe.remote() for a in self.actors])
        except ray.exceptions.RayError as exc:
            self.close()
            raise ConfigError(f"a shard actor failed to load {vec_path}: {exc}") from None
        self._flops = 2.0 * n * d

    # -- facts -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.ntotal

    @property
    def num_shards(self) -> int:
        return len(self.actors)

    def describe(self) -> dict[str, Any]:
        return {"backend": "ray-sharded", "storage": self.storage, "ntotal": self.ntotal, "dim": self.dim,
                "path": str(self.path), "shards": [dict(s) for s in self.shard_info]}

    def bytes_per_search(self) -> int:
        """Bytes one batched search reads over all shards (each shard's rows once)."""
        return int(sum(self._shard_bytes()))

    def _shard_bytes(self) -> list[int]:
        # What each shard's kernel reads per batched search, as the shard measured its storage.
        return [int(info["scan_bytes"]) for info in self.shard_info]

    def flops_per_query(self) -> float:
        return self._flops

    # -- search ------------------------------------------------------------------------------
    def search(self, queries: Any, k: int, *, exclude: Sequence[Sequence[int]] | None = None,
               min_score: float | None = None, ledger: CostLedger | None = None,
               question_ids: Sequence[str] | None = None):
        """Top-k rows by inner product over all shards (same contract as ``DenseIndex.search``).

        Returns
        -------
        (scores, ids) : (torch.Tensor, torch.Tensor)
            float32 ``[B, k]`` best first and int64 ``[B, k]`` global row ids; empty slots are
            -inf / -1. Ties in score are ordered by the lower row id.
        """
        import torch

        ray = require_ray()
        q, k, ex = check_search(queries, k, exclude, min_score, dim=self.dim, n=self.ntotal)
        b = q.shape[0]
        if b == 0:
            return torch.zeros((0, k), dtype=torch.float32), torch.zeros((0, k), dtype=torch.int64)
        t0 = time.perf_counter()
        check_exclude_range(ex, self.ntotal)
        q_ref = ray.put(q.numpy())  # one copy in the object store, read by every shard
        refs = []
        for s, actor in enumerate(self.actors):
            lo, hi = int(self.offsets[s]), int(self.offsets[s + 1])
            refs.append(actor.search.remote(q_ref, min(k, hi - lo), shard_exclude(ex, lo, hi), min_score))
        parts = ray.get(refs)
        out_s, out_i = merge_topk(parts, self.offsets[:-1], k)
        record_search(ledger, question_ids, b, time.perf_counter() - t0, self.bytes_per_search(), self._flops)
        return torch.from_numpy(out_s), torch.from_numpy(out_i)

    def close(self) -> None:
        """Stop the shard actors."""
        ray = require_ray()
        for a in getattr(self, "actors", []):
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        self.actors = []

    def __enter__(self) -> "RayShardedIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sharded_dense_retriever(corpus: Any, vectors: str | os.PathLike, num_shards: int, *, encoder: Any = "minilm",
                            storage: str | None = None, kernel_backend: str | None = None,
                            shard_cpus: float = 1.0, shard_gpus: float = 0.0, threads_per_shard: int | None = None,
                            device: str = "cpu") -> Any:
    """A :class:`~ragfast.retrieval.DenseRetriever` whose index is a :class:`RayShardedIndex`.

    Meant as ``make_retriever`` of :func:`ragfast.runner.distributed.run_on_ray` for indexes too big for one process:
    ``functools.partial(sharded_dense_retriever, corpus_path, "vectors.npy", 16, encoder=...)``.
    The shared retriever actor then holds the encoder and the corpus, and S shard actors hold
    the rows (memory-mapped). Needs a Ray connection (inside an actor there always is one).

    Parameters
    ----------
    corpus : ragfast.data.Corpus, path or sample name
        Row i of the corpus is row i of ``vectors``.
    vectors : path
        The ``.npy`` matrix (:func:`write_vectors`) or a flat ragfast index directory.
    num_shards : int
        Shard actors.
    encoder : Encoder, preset name or checkpoint path
        The query encoder (default the bundled MiniLM).
    storage, kernel_backend, shard_cpus, shard_gpus, threads_per_shard
        As for :class:`RayShardedIndex`.
    device : str
        Device of the query encoder.
    """
    from ragfast.retrieval.dense import DenseRetriever

    if isinstance(corpus, (str, os.PathLike)):
        from ragfast.data import load_corpus

        corpus = load_corpus(corpus)
    if isinstance(encoder, (str, os.PathLike)):
        from ragfast.encoders.encoder import Encoder

        encoder = Encoder(str(encoder), device=device)
    index = RayShardedIndex(vectors, num_shards, storage=storage, kernel_backend=kernel_backend,
                            shard_cpus=shard_cpus, shard_gpus=shard_gpus, threads_per_shard=threads_per_shard)
    try:
        return DenseRetriever(encoder, index, corpus)
    except Exception:
        index.close()
        raise

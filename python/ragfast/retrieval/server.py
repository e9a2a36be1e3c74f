"""A Search-R1-compatible retrieval server (FastAPI) that micro-batches concurrent requests.

Protocol (Search-R1's retrieval server, see PROTOCOLS.md): ``POST /retrieve`` with
``{"queries": [str, ...], "topk": int | null, "return_scores": bool = false}``; a null topk
means the server's default. The answer is ``{"result": [...]}`` with one list per query:
``{"document": <corpus row>, "score": float}`` items when ``return_scores`` is true, bare corpus
rows otherwise. ``GET /health`` says what serves and how much it has served.

Concurrent requests are gathered into one retriever call: the first request waits at most
``max_wait_ms`` for company, then the whole group (up to ``max_batch`` queries) is encoded and
searched at once, and each request gets its own slice back. While one batch runs, the next
one fills up, so under load the batch grows by itself. One encoder forward and one corpus scan
per batch is where the throughput comes from: a flat scan reads the whole corpus once for
however many queries ride along.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel

from ragfast.errors import ConfigError, DataError
from ragfast.retrieval.base import Retriever

__all__ = ["create_app", "load_retriever", "serve", "set_threads", "ServerLimits", "RetrieveRequest"]

_ENV_CONFIG = "RAGFAST_SERVE_CONFIG"


class RetrieveRequest(BaseModel):
    """Search-R1's request body; unknown extra fields are ignored."""

    queries: list[str]
    topk: Optional[int] = None
    return_scores: bool = False


@dataclass
class ServerLimits:
    """Per-request limits; a request over any of them gets a 4xx naming the limit."""

    max_queries: int = 1024
    max_query_chars: int = 4096
    max_topk: int = 100


@dataclass
class _Item:
    queries: list[str]
    k: int
    future: asyncio.Future


@dataclass
class _Stats:
    requests: int = 0
    queries: int = 0
    batches: int = 0
    batched_queries: int = 0
    max_batch_seen: int = 0
    errors: int = 0
    rejected: int = 0
    started: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "queries": self.queries, "batches": self.batches,
                "mean_batch_queries": (self.batched_queries / self.batches) if self.batches else 0.0,
                "max_batch_queries": self.max_batch_seen, "errors": self.errors, "rejected": self.rejected,
                "uptime_s": round(time.time() - self.started, 3)}


class _Batcher:
    """Gathers concurrent requests into one retriever call (or runs them one by one)."""

    def __init__(self, retriever: Retriever, *, enabled: bool, max_batch: int, max_wait_s: float, stats: _Stats):
        self.retriever = retriever
        self.enabled = enabled
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.stats = stats
        # One thread runs the retriever: calls never overlap, so a batch is one kernel call and
        # torch's own thread pool gets the cores.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragfast-retrieve")
        self.queue: asyncio.Queue | None = None
        self.task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is not loop or self.task is None or self.task.done():
            self.loop = loop
            self.queue = asyncio.Queue()
            self.task = loop.create_task(self._run())

    async def submit(self, queries: list[str], k: int):
        if not self.enabled:
            return await self._call(queries, k)
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Item(queries, k, fut))
        return await fut

    async def _call(self, queries: list[str], k: int):
        loop = asyncio.get_running_loop()
        self.stats.batches += 1
        self.stats.batched_queries += len(queries)
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(queries))
        return await loop.run_in_executor(self.pool, lambda: self.retriever.search(queries, k))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = await self.queue.get()
            batch, n = [first], len(first.queries)
            deadline = loop.time() + self.max_wait_s
            while n < self.max_batch:
                try:
                    item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(self.queue.get(), timeout)
                    except asyncio.TimeoutError:
                        break
                batch.append(item)
                n += len(item.queries)
            batch = [b for b in batch if not b.future.cancelled()]  # clients that gave up
            if not batch:
                continue
            queries = [q for b in batch for q in b.queries]
            # One call at the largest k; a smaller k is a prefix of the same ranking.
            k = max(b.k for b in batch)
            try:
                hits = await self._call(queries, k)
            except Exception as exc:  # a failing batch fails its requests, never the server
                for b in batch:
                    if not b.future.done():
                        b.future.set_exception(exc)
                continue
            pos = 0
            for b in batch:
                part = [h[:b.k] for h in hits[pos:pos + len(b.queries)]]
                pos += len(b.queries)
                if not b.future.done():
                    b.future.set_result(part)

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass
        self.pool.shutdown(wait=False, cancel_futures=True)


def create_app(retriever: Retriever, default_topk: int = 3, *, max_queries: int = 1024, max_query_chars: int = 4096,
               max_topk: int = 100, batching: bool = True, max_batch: int = 256, max_wait_ms: float = 2.0):
    """A FastAPI app serving Search-R1's ``POST /retrieve`` (and ``GET /health``) over ``retriever``.

    Parameters
    ----------
    retriever : Retriever
        Any ragfast retriever (dense, BM25, even a remote one).
    default_topk : int
        Used when a request's ``topk`` is null or missing (Search-R1's default is 3).
    max_queries, max_query_chars, max_topk : int
        Request limits; exceeding one answers 413 (too large) or 422 (bad topk) with a message.
    batching : bool
        Gather concurrent requests into one retriever call (``False``: one request at a time).
    max_batch : int
        Most queries per gathered call.
    max_wait_ms : float
        How long the first request of a batch waits for others.

    Returns
    -------
    fastapi.FastAPI
    """
    from fastapi import FastAPI, HTTPException
    from fastapi.exception_handlers import request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    if not isinstance(default_topk, int) or default_topk < 1:
        raise ConfigError(f"default_topk must be a positive int, got {default_topk!r}")
    limits = ServerLimits(int(max_queries), int(max_query_chars), int(max_topk))
    if min(limits.max_queries, limits.max_query_chars, limits.max_topk, max_batch) < 1 or max_wait_ms < 0:
        raise ConfigError(f"server limits must be positive: {limits}, max_batch={max_batch}, max_wait_ms={max_wait_ms}")
    if default_topk > limits.max_topk:
        raise ConfigError(f"default_topk={default_topk} exceeds max_topk={limits.max_topk}")
    stats = _Stats()
    batcher = _Batcher(retriever, enabled=batching, max_batch=int(max_batch), max_wait_s=max_wait_ms / 1e3,
                       stats=stats)

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await batcher.close()

    app = FastAPI(title="ragfast retriever", version="1", lifespan=lifespan,
                  description="Search-R1-compatible retrieval: POST /retrieve {queries, topk, return_scores}.")
    app.state.retriever = retriever
    app.state.stats = stats
    app.state.limits = limits

    def reject(status: int, msg: str):
        stats.rejected += 1
        raise HTTPException(status_code=status, detail=msg)

    @app.post("/retrieve")
    async def retrieve(req: RetrieveRequest):
        stats.requests += 1
        k = default_topk if req.topk is None else req.topk
        if k < 1 or k > limits.max_topk:
            reject(422, f"topk must be between 1 and {limits.max_topk}, got {k}")
        if len(req.queries) > limits.max_queries:
            reject(413, f"too many queries in one request: {len(req.queries)} > {limits.max_queries}")
        for i, q in enumerate(req.queries):
            if len(q) > limits.max_query_chars:
                reject(413, f"query {i} has {len(q)} characters; the limit is {limits.max_query_chars}")
        if not req.queries:
            return JSONResponse({"result": []})
        stats.queries += len(req.queries)
        try:
            hits = await batcher.submit(list(req.queries), k)
        except (ValueError, DataError) as exc:
            stats.errors += 1
            raise HTTPException(status_code=422, detail=f"retrieval rejected the request: {exc}") from None
        except Exception as exc:
            stats.errors += 1
            raise HTTPException(status_code=500, detail=f"retrieval failed: {type(exc).__name__}: {exc}") from None
        if req.return_scores:
            result = [[{"document": h.document, "score": float(h.score)} for h in row] for row in hits]
        else:
            result = [[h.document for h in row] for row in hits]
        return JSONResponse({"result": result})

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Any, exc: RequestValidationError):
        # Malformed bodies (not JSON, wrong types, missing queries): FastAPI's usual 422, counted.
        stats.rejected += 1
        return await request_validation_exception_handler(request, exc)

    @app.get("/health")
    async def health():
        try:
            desc = retriever.describe()
        except Exception as exc:  # describing must never fail the health check
            desc = {"error": str(exc)}
        return {"status": "ok", "retriever": desc, "default_topk": default_topk,
                "limits": limits.__dict__, "batching": {"enabled": batching, "max_batch": max_batch,
                                                        "max_wait_ms": max_wait_ms},
                "stats": stats.to_dict(), "pid": os.getpid()}

    return app


def load_retriever(corpus: str | os.PathLike | Any, index: str | os.PathLike | None = None,
                   encoder: str | None = None, *, storage: str | None = None, device: str = "cpu",
                   batch_size: int = 64, cache_dir: str | os.PathLike | None = None,
                   progress: bool = True) -> Retriever:
    """The retriever ``ragfast serve-retriever`` serves.

    Parameters
    ----------
    corpus : path, sample name or Corpus
        The passages (``{"id", "contents"}`` rows) whose rows the server returns.
    index : path, optional
        A directory from ``ragfast index build`` (dense, sharded or BM25), a faiss file such as Search-R1's
        ``e5_Flat.index``, or a ``.npy`` matrix. Without one, the corpus is embedded at start-up
        (cached on disk) and searched with the flat kernel.
    encoder : str, optional
        Preset name or checkpoint path, or ``"bm25"`` for BM25. Default: what the index
        directory recorded, else ``minilm``.
    storage : str, optional
        Flat storage dtype (fp32 / fp16 / bf16 / int8).
    """
    from ragfast.data import Corpus, load_corpus

    corp = corpus if isinstance(corpus, Corpus) else load_corpus(corpus)
    if index is not None:
        p = Path(index)
        if not p.exists():
            raise DataError(f"no index at {p}")
        recorded = p / "encoder.json" if p.is_dir() else None
        if recorded is not None and recorded.exists() and encoder is None:
            encoder = json.loads(recorded.read_text()).get("encoder")
        meta = p / "meta.json"
        if p.is_dir() and meta.exists() and json.loads(meta.read_text()).get("format", "").startswith("ragfast-bm25"):
            from ragfast.retrieval.bm25 import BM25, BM25Retriever

            return BM25Retriever(BM25.load(p), corp)
    encoder = encoder or "minilm"
    if encoder == "bm25":
        from ragfast.retrieval.bm25 import BM25Retriever

        if index is not None:
            raise ConfigError("--encoder bm25 builds its own index; give a BM25 index directory or no --index")
        return BM25Retriever.build(corp)
    from ragfast.retrieval.dense import DenseIndex, DenseRetriever, build_default_retriever
    from ragfast.retrieval.encoder import Encoder

    if index is not None and Path(index, "sharded.json").exists():
        from ragfast.retrieval.dense import ShardedIndex

        return DenseRetriever(Encoder(encoder, device=device, batch_size=batch_size),
                              ShardedIndex.load(index, storage=storage), corp)
    if index is None:
        return build_default_retriever(corp, encoder=encoder, cache_dir=cache_dir, storage=storage or "fp32",
                                       device=device, batch_size=batch_size, progress=progress)
    enc = Encoder(encoder, device=device, batch_size=batch_size)
    return DenseRetriever(enc, DenseIndex.load(index, storage=storage), corp)


def set_threads(threads: int | None) -> None:
    """Cap torch's intra-op threads (encoder and kernel) in this process.

    On a shared or oversubscribed CPU, OpenMP workers spin waiting for cores they do not get:
    measured on the 2-core build machine under load, one MiniLM query took 1.39 s with 2 threads
    and 72 ms with 1. Servers sharing cores (``--workers N``) want ``N * threads <= cores``.
    """
    if threads is None:
        return
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(int(threads))


def _app_from_env():
    """uvicorn factory for ``--workers N``: each worker builds its app from the same config.

    Index vectors load memory-mapped, so the workers share one copy in the page cache.
    """
    cfg = json.loads(os.environ[_ENV_CONFIG])
    set_threads(cfg.get("threads"))
    r = load_retriever(cfg["corpus"], cfg.get("index"), cfg.get("encoder"), storage=cfg.get("storage"),
                       device=cfg.get("device", "cpu"), batch_size=cfg.get("batch_size", 64),
                       cache_dir=cfg.get("cache_dir"), progress=False)
    return create_app(r, cfg.get("topk", 3), **cfg.get("app", {}))


def serve(corpus: str, index: str | None = None, encoder: str | None = None, *, topk: int = 3,
          host: str = "127.0.0.1", port: int = 8000, workers: int = 1, storage: str | None = None,
          device: str = "cpu", batch_size: int = 64, cache_dir: str | None = None,
          app_options: dict[str, Any] | None = None, log_level: str = "info", threads: int | None = None) -> None:
    """Build the retriever and run the server with uvicorn (blocks until stopped).

    With ``workers > 1`` the corpus is embedded once here first (with a progress bar), then each
    uvicorn worker process loads the cached, memory-mapped vectors.
    """
    import uvicorn

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    set_threads(threads)
    retriever = load_retriever(corpus, index, encoder, storage=storage, device=device, batch_size=batch_size,
                               cache_dir=cache_dir, progress=True)
    if workers == 1:
        uvicorn.run(create_app(retriever, topk, **(app_options or {})), host=host, port=port, log_level=log_level)
        return
    del retriever  # the cache is warm; each worker maps it
    os.environ[_ENV_CONFIG] = json.dumps({"corpus": str(corpus), "index": str(index) if index else None,
                                          "encoder": encoder, "storage": storage, "device": device,
                                          "batch_size": batch_size, "cache_dir": cache_dir, "topk": topk,
                                          "threads": threads, "app": app_options or {}})
    uvicorn.run("ragfast.retrieval.server:_app_from_env", factory=True, host=host, port=port, workers=workers,
                log_level=log_level)

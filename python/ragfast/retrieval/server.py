"""A Search-R1-compatible retrieval server (FastAPI) that micro-batches concurrent requests.

Protocol (Search-R1's retrieval server, see PROTOCOLS.md): ``POST /retrieve`` with
``{"queries": [str, ...], "topk": int | null, "return_scores": bool = false}``; a null topk
means the server's default. The answer is ``{"result": [...]}`` with one list per query:
``{"document": <corpus row>, "score": float}`` items when ``return_scores`` is true, bare corpus
rows otherwise. ``GET /health`` says what serves and how much it has served, with queue depth
and in-flight work; ``GET /metrics`` gives the same counters in Prometheus text format.

Concurrent requests are gathered into one retriever call: the first request waits at most
``max_wait_ms`` for company, then the whole group (up to ``max_batch`` queries) is encoded and
searched at once, and each request gets its own slice back. While one batch runs, the next
one fills up, so under load the batch grows by itself. One encoder forward and one corpus scan
per batch is where the throughput comes from: a flat scan reads the whole corpus once for
however many queries ride along.

Hostile input and mixed load (see :mod:`ragfast.serving`): each request is validated on its own
before it joins a batch, bodies over ``max_body_bytes`` are refused before parsing, big requests
are cut into ``chunk``-sized pieces interleaved round-robin with small ones, a failing batch is
bisected so only the offending request fails, and every response carries ``X-Request-ID``.
SIGTERM lets in-flight requests finish (up to ``graceful_s``) before the process exits.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from pydantic import BaseModel

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.accounting.remote_cost import cost_items
from ragfast.retrieval.base import Retriever
from ragfast.serving import (API_KEY_ENV, DEFAULT_GRACEFUL_S, DEFAULT_HEAD_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S,
                             DEFAULT_MAX_CONNECTIONS, FairBatcher, RequestError, check_bool, check_int, check_text_list,
                             fix_mmap_threshold, guard, json_bytes, parse_json_body, prometheus_text, rss_bytes,
                             server_gauges)

__all__ = ["create_app", "load_retriever", "serve", "set_threads", "ServerLimits", "RetrieveRequest"]

_ENV_CONFIG = "RAGFAST_SERVE_CONFIG"
log = logging.getLogger("ragfast.server")


class RetrieveRequest(BaseModel):
    """Search-R1's request body (documentation; the server checks bodies strictly itself)."""

    queries: list[str]
    topk: Optional[int] = None
    return_scores: bool = False
    return_cost: bool = False  # ragfast extension: add per-query server compute ("cost") to the answer


@dataclass
class ServerLimits:
    """Per-request limits; a request over any of them gets a 4xx naming the limit."""

    max_queries: int = 1024
    max_query_chars: int = 4096
    max_topk: int = 100
    max_body_bytes: int = 16 * 1024 * 1024


@dataclass
class _Stats:
    rejected: int = 0
    errors: int = 0


def _check_request(body: dict[str, Any], limits: ServerLimits, default_topk: int) -> tuple[list[str], int, bool, bool]:
    """(queries, k, return_scores, return_cost) of one parsed body, or a RequestError naming the field."""
    if "queries" not in body:
        raise RequestError(422, "queries: field required (a list of strings)")
    queries = check_text_list(body["queries"], "queries", max_items=limits.max_queries, items_limit="--max-queries",
                              max_chars=limits.max_query_chars, chars_limit="--max-query-chars", item_name="queries")
    topk = body.get("topk")
    # Search-R1's fallback: a missing or null topk means the server's default.
    k = default_topk if topk is None else check_int(topk, "topk", lo=1, hi=limits.max_topk)
    rs = body.get("return_scores")
    return_scores = False if rs is None else check_bool(rs, "return_scores")
    # ragfast's own extension: Search-R1's clients never send it, so their answers stay byte-identical
    rc = body.get("return_cost")
    return_cost = False if rc is None else check_bool(rc, "return_cost")
    return queries, k, return_scores, return_cost


def _search_parts(retriever: Retriever, parts: list[tuple[list[str], int]]) -> list[list[Any]]:
    """One retriever call for every part of a batch, at the largest k; each part gets its own k.

    Each query's answer is ``(hits, cost)``: its share of the encoder and search compute of the
    call (:func:`ragfast.accounting.remote_cost.cost_items`), for clients that ask for ``return_cost``.
    """
    queries = [q for qs, _ in parts for q in qs]
    k = max(k for _, k in parts)  # a smaller k is a prefix of the same ranking
    keys = [str(i) for i in range(len(queries))]
    ledger = CostLedger()
    hits = retriever.search(queries, k, ledger=ledger, question_ids=keys)
    costs = cost_items(ledger, keys)
    out, pos = [], 0
    for qs, kk in parts:
        out.append([(h[:kk], c) for h, c in zip(hits[pos:pos + len(qs)], costs[pos:pos + len(qs)])])
        pos += len(qs)
    return out


class _DocBytes:
    """Corpus rows as JSON bytes, cached by corpus id (byte-capped, least recently used out).

    A 1024-query, topk-100 answer holds 100k rows: serialising each row once and reusing its
    bytes makes building that answer a join instead of 100k dict encodes, which would hold the
    interpreter for seconds while small requests wait.
    """

    def __init__(self, max_bytes: int = 64 * 1024 * 1024):
        from ragfast.infra.cache import ByteLRU

        self.cache = ByteLRU(max_bytes, size_of=len)

    def __call__(self, hit: Any) -> bytes:
        got = self.cache.get(hit.id)
        if got is None:
            got = json_bytes(hit.document)
            self.cache.put(hit.id, got)
        return got


def _result_bytes(hits: list[list[Any]], return_scores: bool, doc: Callable[[Any], bytes] | None = None) -> bytes:
    """The response body, byte for byte what ``JSONResponse({"result": ...})`` would send.

    Built from each row's JSON bytes (``doc``, cached per corpus id) and ``float.__repr__`` of
    the score, exactly as :func:`json.dumps` writes a finite float; a non-finite score raises
    ValueError as ``json.dumps(allow_nan=False)`` does.
    """
    doc = doc or (lambda h: json_bytes(h.document))
    rows = []
    for row in hits:
        if return_scores:
            parts = []
            for h in row:
                sc = float(h.score)
                if not math.isfinite(sc):
                    raise ValueError(f"Out of range float values are not JSON compliant: {sc!r}")
                parts.append(b'{"document":' + doc(h) + b',"score":' + float.__repr__(sc).encode() + b"}")
        else:
            parts = [doc(h) for h in row]
        rows.append(b"[" + b",".join(parts) + b"]")
    return b'{"result":[' + b",".join(rows) + b"]}"


def create_app(retriever: Retriever, default_topk: int = 3, *, max_queries: int = 1024, max_query_chars: int = 4096,
               max_topk: int = 100, max_body_bytes: int = 16 * 1024 * 1024, batching: bool = True,
               max_batch: int = 256, chunk: int = 8, max_wait_ms: float = 2.0, api_key: str | None = None):
    """A FastAPI app serving Search-R1's ``POST /retrieve`` (and ``GET /health``, ``GET /metrics``).

    Parameters
    ----------
    retriever : Retriever
        Any ragfast retriever (dense, BM25, even a remote one).
    default_topk : int
        Used when a request's ``topk`` is null or missing (Search-R1's default is 3).
    max_queries, max_query_chars, max_topk, max_body_bytes : int
        Request limits; exceeding one answers 413 (too large) or 422 (bad topk) naming the limit.
        The body limit is enforced before the body is parsed (from Content-Length, or while it
        streams).
    batching : bool
        Gather concurrent requests into one retriever call (``False``: one request at a time).
    max_batch : int
        Most queries per gathered call.
    chunk : int
        While small requests are about, the most queries one request puts in a batch: big
        requests are cut into chunks and interleaved round-robin with small ones, so small
        requests stay fast (see :class:`ragfast.serving.FairBatcher`).
    max_wait_ms : float
        How long the first request of a batch waits for others (when the worker is idle).

    Returns
    -------
    fastapi.FastAPI

    Notes
    -----
    Every request is checked on its own before it joins a batch: strict types (``topk`` an
    integer, ``return_scores`` a boolean), finite numbers, text UTF-8 can encode; a failure
    answers 4xx naming the field. A batch that fails anyway is bisected, so only the request
    that caused it fails (500, with its ``X-Request-ID`` logged).
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    if isinstance(default_topk, bool) or not isinstance(default_topk, int) or default_topk < 1:
        raise ConfigError(f"default_topk must be a positive int, got {default_topk!r}")
    limits = ServerLimits(int(max_queries), int(max_query_chars), int(max_topk), int(max_body_bytes))
    if min(limits.max_queries, limits.max_query_chars, limits.max_topk, limits.max_body_bytes, max_batch,
           chunk) < 1 or max_wait_ms < 0:
        raise ConfigError(f"server limits must be positive: {limits}, max_batch={max_batch}, chunk={chunk}, "
                          f"max_wait_ms={max_wait_ms}")
    if default_topk > limits.max_topk:
        raise ConfigError(f"default_topk={default_topk} exceeds max_topk={limits.max_topk}")
    stats = _Stats()
    fix_mmap_threshold()  # big request bodies and answers must not leave the heap grown for good
    batcher = FairBatcher(lambda parts: _search_parts(retriever, parts), max_batch=int(max_batch), chunk=int(chunk),
                          max_wait_s=max_wait_ms / 1e3, enabled=batching, name="ragfast-retrieve")
    # Big answers are built off the event loop, from cached per-row bytes (see _result_bytes).
    encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ragfast-encode")
    doc_bytes = _DocBytes()

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await batcher.close()
        encode_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="ragfast retriever", version="1", lifespan=lifespan,
                  description="Search-R1-compatible retrieval: POST /retrieve {queries, topk, return_scores}.")
    app.state.retriever = retriever
    app.state.stats = stats
    app.state.limits = limits
    app.state.batcher = batcher

    def rejected() -> None:
        stats.rejected += 1

    def errored() -> None:
        stats.errors += 1

    async def retrieve(request):
        try:
            queries, k, return_scores, return_cost = _check_request(parse_json_body(await request.body()), limits,
                                                                    default_topk)
        except RequestError as exc:
            rejected()
            return JSONResponse({"detail": exc.message}, status_code=exc.status)
        if not queries:
            batcher.stats.requests += 1
            return JSONResponse({"result": []})
        try:
            t0 = time.perf_counter()
            answers = await batcher.submit(queries, k)
            server_seconds = time.perf_counter() - t0
            hits = [h for h, _ in answers]
        except (ValueError, DataError) as exc:
            errored()
            return JSONResponse({"detail": f"retrieval rejected the request: {exc}"}, status_code=422)
        except Exception as exc:
            return JSONResponse({"detail": f"retrieval failed: {type(exc).__name__}: {exc} "
                                           f"(request id {request.scope.get('state', {}).get('request_id', '-')})"},
                                status_code=500)
        if len(queries) * k <= 256:
            body = _result_bytes(hits, return_scores, doc_bytes)
        else:
            body = await asyncio.get_running_loop().run_in_executor(encode_pool, _result_bytes, hits, return_scores,
                                                                    doc_bytes)
        if return_cost:
            cost = {"items": [c for _, c in answers], "server_seconds": server_seconds}
            body = body[:-1] + b',"cost":' + json_bytes(cost) + b"}"
        return Response(body, media_type="application/json")

    # The body is read and checked by hand (strictly, see _check_request); FastAPI only documents it.
    # The annotation is set here because this module's annotations are strings and Request is local.
    retrieve.__annotations__["request"] = Request
    app.post("/retrieve", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": RetrieveRequest.model_json_schema()}}}})(retrieve)

    def state() -> dict[str, Any]:
        st = batcher.stats.to_dict()
        return {"requests": st["requests"], "queries": st["items"], "batches": st["batches"],
                "mean_batch_queries": st["mean_batch_items"], "max_batch_queries": st["max_batch_items"],
                "errors": stats.errors, "rejected": stats.rejected, "failed_requests": st["failed_requests"],
                "isolation_retries": st["isolation_retries"], "queued_requests": st["queued_requests"],
                "queued_queries": st["queued_items"], "inflight_requests": st["inflight_requests"],
                "inflight_queries": st["inflight_items"], "uptime_s": st["uptime_s"]}

    @app.get("/health")
    async def health():
        try:
            desc = retriever.describe()
        except Exception as exc:  # describing must never fail the health check
            desc = {"error": str(exc)}
        return {"status": "ok", "retriever": desc, "default_topk": default_topk,
                "limits": limits.__dict__, "batching": {"enabled": batching, "max_batch": max_batch, "chunk": chunk,
                                                        "max_wait_ms": max_wait_ms},
                "stats": state(), "rss_bytes": rss_bytes(), "pid": os.getpid()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text("ragfast_retriever", server_gauges(state(), "queries", "queries")),
                                 media_type="text/plain; version=0.0.4")

    guard(app, max_body_bytes=limits.max_body_bytes, api_key=api_key, on_reject=rejected, on_error=errored, logger=log)
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
    from ragfast.encoders.encoder import Encoder

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
    return create_app(r, cfg.get("topk", 3), api_key=os.environ.get(API_KEY_ENV) or None, **cfg.get("app", {}))


def serve(corpus: str, index: str | None = None, encoder: str | None = None, *, topk: int = 3,
          host: str = "127.0.0.1", port: int = 8000, workers: int = 1, storage: str | None = None,
          device: str = "cpu", batch_size: int = 64, cache_dir: str | None = None,
          app_options: dict[str, Any] | None = None, log_level: str = "info", threads: int | None = None,
          graceful_s: float = DEFAULT_GRACEFUL_S, api_key: str | None = None,
          head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
          max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
    """Build the retriever and run the server with uvicorn (blocks until stopped).

    With ``workers > 1`` the corpus is embedded once here first (with a progress bar), then each
    uvicorn worker process loads the cached, memory-mapped vectors. On SIGTERM or Ctrl-C the
    server stops accepting connections and lets in-flight requests finish (at most ``graceful_s``
    seconds) before it exits.
    """
    import uvicorn

    from ragfast.serving import check_bind, uvicorn_options

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    # Before anything loads: a bad port or an open bind without a token is one line at once.
    key = check_bind(host, port, api_key)
    net = uvicorn_options(host, port, head_timeout_s=head_timeout_s, keep_alive_s=keep_alive_s,
                          max_connections=max_connections)
    set_threads(threads)
    retriever = load_retriever(corpus, index, encoder, storage=storage, device=device, batch_size=batch_size,
                               cache_dir=cache_dir, progress=True)
    if workers == 1:
        uvicorn.run(create_app(retriever, topk, api_key=key, **(app_options or {})), **net, log_level=log_level,
                    timeout_graceful_shutdown=graceful_s)
        return
    del retriever  # the cache is warm; each worker maps it
    os.environ[_ENV_CONFIG] = json.dumps({"corpus": str(corpus), "index": str(index) if index else None,
                                          "encoder": encoder, "storage": storage, "device": device,
                                          "batch_size": batch_size, "cache_dir": cache_dir, "topk": topk,
                                          "threads": threads, "app": app_options or {}})
    if key:
        os.environ[API_KEY_ENV] = key  # the workers read the token from the environment, not the JSON config
    uvicorn.run("ragfast.retrieval.server:_app_from_env", factory=True, **net, workers=workers,
                log_level=log_level, timeout_graceful_shutdown=graceful_s)

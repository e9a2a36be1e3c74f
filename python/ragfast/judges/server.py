"""The stopping judge's HTTP server (``ragfast serve-judge``): :func:`make_app` around a loaded judge.

The server exposes ``POST /score``: states in (``[{"question", "evidence": [...],
"trajectory_id"?}]``), STOP scores out. Requests that arrive close together are merged into one
micro-batch, so the CausalJudge packs the states of every trajectory in it (prefix sharing)
whichever request they came from.
"""
# No `from __future__ import annotations`: FastAPI must see the request models as classes.
import contextlib
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["JudgeLimits", "MAX_STATES_PER_REQUEST", "check_states", "make_app"]

MAX_STATES_PER_REQUEST = 4096


@dataclass
class JudgeLimits:
    """Per-request limits of ``serve-judge``; a request over one gets 413 naming the limit."""

    max_states: int = MAX_STATES_PER_REQUEST
    max_passages: int = 64
    max_passage_chars: int = 20_000
    max_question_chars: int = 4096
    max_body_bytes: int = 16 * 1024 * 1024


_STATE_KEYS = ("question", "evidence", "trajectory_id")


def check_states(body: dict, lim: JudgeLimits) -> list:
    """The states of one parsed ``/score`` body, each field checked; a RequestError names the first bad one."""
    from ragfast.serving import RequestError, check_text, check_text_list
    from ragfast.types import State

    extra = sorted(set(body) - {"states"})
    if extra:
        raise RequestError(422, f"unknown field {extra[0]!r} (the body is {{\"states\": [...]}})")
    if "states" not in body:
        raise RequestError(422, "states: field required (a list of {question, evidence, trajectory_id})")
    raw = body["states"]
    if not isinstance(raw, list):
        raise RequestError(422, "states must be a list of objects")
    if len(raw) > lim.max_states:
        raise RequestError(413, f"too many states in one request: {len(raw)} > {lim.max_states} (--max-states)")
    out = []
    for i, st in enumerate(raw):
        if not isinstance(st, dict):
            raise RequestError(422, f"states[{i}] must be an object")
        bad = sorted(set(st) - set(_STATE_KEYS))
        if bad:
            raise RequestError(422, f"states[{i}]: unknown field {bad[0]!r}")
        if "question" not in st:
            raise RequestError(422, f"states[{i}].question: field required")
        q = check_text(st["question"], f"states[{i}].question", max_chars=lim.max_question_chars,
                       limit_name="--max-question-chars")
        if not q.strip():
            raise RequestError(400, f"state {i}: empty question")
        ev = st.get("evidence")
        ev = [] if ev is None else check_text_list(ev, f"states[{i}].evidence", max_items=lim.max_passages,
                                                   items_limit="--max-passages", max_chars=lim.max_passage_chars,
                                                   chars_limit="--max-passage-chars", item_name="passages")
        tid = st.get("trajectory_id")
        if tid is not None:
            tid = check_text(tid, f"states[{i}].trajectory_id", max_chars=256, limit_name="256")
        out.append(State(q, ev, tid, 0))
    return out


def make_app(judge: Any, *, max_wait_ms: float = 5.0, max_batch_states: int = 1024, chunk_states: int = 16,
             limits: Optional[JudgeLimits] = None, api_key: Optional[str] = None):
    """The FastAPI app of ``serve-judge`` around an already loaded judge.

    Endpoints: ``POST /score`` -> ``{"scores": [float | null], "judge": str, "meaningful": bool,
    "cost": {...}}`` (null where a state could not be scored; ``cost`` holds each state's share
    of the judge compute, see :mod:`ragfast.accounting.remote_cost`); ``GET /health`` -> the judge's ``describe()``, queue
    depth and in-flight work; ``GET /metrics`` -> the same in Prometheus text format.

    Every request is checked on its own before it joins a micro-batch (strict types, text UTF-8
    can encode, the limits in ``limits``); bad requests get 400/413/422 naming the field or limit.
    Big requests are cut into ``chunk_states`` pieces interleaved with small ones, and a batch that
    fails anyway is bisected so only the request that caused it fails.
    """
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    from ragfast.accounting.ledger import CostLedger
    from ragfast.errors import ConfigError, RagfastError
    from ragfast.accounting.remote_cost import cost_items
    from ragfast.serving import (FairBatcher, RequestError, fix_mmap_threshold, guard, parse_json_body, prometheus_text,
                                 rss_bytes, server_gauges)

    lim = limits or JudgeLimits()
    if min(lim.max_states, lim.max_passages, lim.max_passage_chars, lim.max_question_chars, lim.max_body_bytes,
           max_batch_states, chunk_states) < 1 or max_wait_ms < 0:
        raise ConfigError(f"serve-judge limits must be positive: {lim}, max_batch_states={max_batch_states}, "
                          f"chunk_states={chunk_states}, max_wait_ms={max_wait_ms}")
    # Running sums for /health: the per-call ledgers are dropped, so memory stays flat however
    # long the server runs.
    totals = dict.fromkeys(("calls", "input_tokens", "cached_tokens", "flops", "seconds"), 0.0)
    fix_mmap_threshold()  # big request bodies must not leave the heap grown for good

    def run(parts):
        # Each state's answer is (score, its share of the call's compute) for the response's cost.
        states = [s for st, _ in parts for s in st]
        keys = [str(i) for i in range(len(states))]
        call = CostLedger()
        scores = judge.stop_scores(states, ledger=call, question_ids=keys)
        row = call.totals().get("judge", {})
        for k in totals:
            totals[k] += row.get(k, 0)
        costs = cost_items(call, keys)
        out, off = [], 0
        for st, _ in parts:
            out.append([(float(x), c) for x, c in zip(scores[off:off + len(st)], costs[off:off + len(st)])])
            off += len(st)
        return out

    batcher = FairBatcher(run, max_batch=max_batch_states, chunk=chunk_states, max_wait_s=max_wait_ms / 1e3,
                          name="ragfast-judge")
    counts = {"rejected": 0, "errors": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await batcher.close()

    app = FastAPI(title="ragfast judge", description="STOP scores of retrieval states", lifespan=lifespan)
    app.state.batcher = batcher
    app.state.limits = lim
    desc = judge.describe()

    def stats() -> dict[str, Any]:
        return {**batcher.stats.to_dict(), **counts}

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"judge": judge.describe(), "batches": batcher.stats.batches, "limits": asdict(lim),
                "stats": stats(), "rss_bytes": rss_bytes(), "cost": dict(totals)}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(prometheus_text("ragfast_judge", server_gauges(stats(), "states")),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/score")
    async def score(request: Request):
        try:
            states = check_states(parse_json_body(await request.body()), lim)
        except RequestError as exc:
            counts["rejected"] += 1
            return JSONResponse({"detail": exc.message}, status_code=exc.status)
        if not states:
            return {"scores": [], "judge": desc["name"], "meaningful": desc["meaningful"]}
        try:
            t0 = time.perf_counter()
            answers = await batcher.submit(states)
            server_seconds = time.perf_counter() - t0
        except RagfastError as exc:
            counts["rejected"] += 1
            return JSONResponse({"detail": str(exc)}, status_code=400)
        except Exception as exc:
            rid = request.scope.get("state", {}).get("request_id", "-")
            return JSONResponse({"detail": f"scoring failed: {type(exc).__name__}: {exc} (request id {rid})"},
                                status_code=500)
        return {"scores": [None if not math.isfinite(x) else x for x, _ in answers],
                "judge": desc["name"], "meaningful": desc["meaningful"],
                "cost": {"items": [c for _, c in answers], "server_seconds": server_seconds}}

    def on_error() -> None:
        counts["errors"] += 1

    def on_reject() -> None:
        counts["rejected"] += 1

    guard(app, max_body_bytes=lim.max_body_bytes, api_key=api_key, on_reject=on_reject, on_error=on_error)
    return app

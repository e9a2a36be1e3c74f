"""Pieces both HTTP servers share: strict request checks, a fair micro-batcher, ASGI guards.

``serve-retriever`` (``POST /retrieve``, the app in :mod:`ragfast.retrieval.server`) and
``serve-judge`` (``POST /score``, :mod:`ragfast.judges.server`) are pointed at by training loops
and shared lab services, so one client's bad or huge request must never hurt another's. The
plumbing that makes that so is here, one module per role:

- :mod:`~ragfast.serving.validation`: :class:`RequestError` and the ``check_*`` helpers; every
  request is validated on its own *before* it joins a batch, and a failure names the field.
- :mod:`~ragfast.serving.batcher`: :class:`FairBatcher`, fair round-robin micro-batches with
  failure bisection, and its counters.
- :mod:`~ragfast.serving.asgi`: the body limit, request ids and access guard, added by
  :func:`guard`.
- :mod:`~ragfast.serving.connections`: :func:`check_bind` and :func:`uvicorn_options` (head
  deadlines, keep-alive and connection caps) and their defaults.
- :mod:`~ragfast.serving.memory` and :mod:`~ragfast.serving.metrics`: the process's heap and
  resident size, and ``/metrics`` in Prometheus text.

Every public name is importable from ``ragfast.serving`` itself.
"""
from __future__ import annotations

from ragfast.serving.asgi import AccessGuard, BodyLimitMiddleware, RequestIdMiddleware, guard
from ragfast.serving.batcher import BatchStats, FairBatcher
from ragfast.serving.connections import (API_KEY_ENV, DEFAULT_GRACEFUL_S, DEFAULT_HEAD_TIMEOUT_S,
                                         DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_CONNECTIONS, HeadTimeoutProtocol,
                                         check_bind, uvicorn_options)
from ragfast.serving.memory import fix_mmap_threshold, rss_bytes, trim_memory
from ragfast.serving.metrics import prometheus_text, server_gauges
from ragfast.serving.validation import (RequestError, check_bool, check_int, check_text, check_text_list, json_bytes,
                                        parse_json_body)

__all__ = ["RequestError", "parse_json_body", "check_int", "check_bool", "check_text", "check_text_list", "FairBatcher",
           "BatchStats", "BodyLimitMiddleware", "RequestIdMiddleware", "prometheus_text", "server_gauges", "json_bytes",
           "rss_bytes", "trim_memory", "fix_mmap_threshold", "AccessGuard", "guard", "check_bind", "uvicorn_options",
           "HeadTimeoutProtocol", "API_KEY_ENV", "DEFAULT_HEAD_TIMEOUT_S", "DEFAULT_KEEP_ALIVE_S",
           "DEFAULT_MAX_CONNECTIONS", "DEFAULT_GRACEFUL_S"]

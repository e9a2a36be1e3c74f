"""``RemoteRetriever``: the HTTP client of a Search-R1-compatible retrieval server.

It speaks the same ``POST /retrieve`` payload as Search-R1's own loop (``topk`` and
``return_scores=true``), so it works against ``ragfast serve-retriever`` and against Search-R1's
original server alike, and the loops use it interchangeably with a local index.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

from ragfast.checks import check_exclude, check_positive_k, check_question_ids
from ragfast.errors import ConfigError, RagfastError
from ragfast.infra.http import auth_headers, check_url, get_json, post_json
from ragfast.accounting.remote_cost import book
from ragfast.retrieval.base import Hit, Retriever

__all__ = ["RemoteRetriever", "RemoteRetrievalError", "check_reachable"]


def check_reachable(url: str, what: str, timeout: float = 5.0) -> None:
    """Open (and close) a TCP connection to ``url``'s host and port, or say plainly that it cannot.

    Commands call it before they create anything, so an unreachable server is one error line
    up front instead of a failure after the output directory exists.

    Raises
    ------
    ragfast.errors.ConfigError
        The URL is malformed or nothing accepts connections there.
    """
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ConfigError(f"{what} URL {url!r} has a bad port: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} URL must look like http://HOST:PORT, got {url!r}")
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise ConfigError(f"cannot reach the {what} at {url}: {exc.strerror or exc}") from None


class RemoteRetrievalError(RagfastError):
    """The retrieval server could not be reached or answered with an error."""


class RemoteRetriever(Retriever):
    """A :class:`~ragfast.retrieval.base.Retriever` backed by a retrieval server.

    Parameters
    ----------
    url : str
        Server address, e.g. ``http://127.0.0.1:8000`` (``/retrieve`` is appended unless given).
    timeout : float
        Seconds per HTTP request.
    max_queries_per_request : int
        Larger query lists are sent in several requests (servers cap the queries per request).
    retries : int
        Extra attempts after a connection error or a 5xx answer.

    Notes
    -----
    The protocol has no exclusion field, so ``exclude`` is met by asking for
    ``k + len(exclude)`` hits and dropping the excluded ids here.
    """

    name = "remote"

    def __init__(self, url: str, *, timeout: float = 60.0, max_queries_per_request: int = 512, retries: int = 2,
                 client: Any = None):
        import httpx

        url = check_url(url, "retriever URL").rstrip("/")
        self.base = url[: -len("/retrieve")] if url.endswith("/retrieve") else url
        self.url = self.base + "/retrieve"
        if max_queries_per_request < 1:
            raise ConfigError(f"max_queries_per_request must be >= 1, got {max_queries_per_request}")
        self.max_queries = int(max_queries_per_request)
        self.retries = int(retries)
        # A server started with --api-key (or $RAGFAST_API_KEY) needs the same token.
        self.client = client if client is not None else httpx.Client(timeout=timeout, headers=auth_headers())

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "class": type(self).__name__, "url": self.url}
        try:
            d["server"] = get_json(self.client, self.base + "/health", retries=0, timeout=5.0,
                                   error=RemoteRetrievalError).get("retriever")
        except Exception:
            d["server"] = None  # a Search-R1 server has no /health; the URL is what we know
        return d

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "RemoteRetriever":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _post(self, payload: dict[str, Any]) -> tuple[list[list[Any]], Any]:
        body = post_json(self.client, self.url, payload, retries=self.retries, error=RemoteRetrievalError)
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list):
            raise RemoteRetrievalError(f"{self.url} sent a body without 'result': {str(body)[:300]}")
        if len(result) != len(payload["queries"]):
            raise RemoteRetrievalError(f"{self.url} answered {len(result)} lists for "
                                       f"{len(payload['queries'])} queries")
        return result, body.get("cost")

    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[str]] | None = None,
               ledger=None, question_ids: Sequence[str] | None = None) -> list[list[Hit]]:
        """Up to ``k`` hits per query from the server, best first; ``exclude`` holds corpus ids."""
        queries = list(queries)
        if not queries:
            return []
        k = check_positive_k(k)
        check_exclude(exclude, len(queries), as_int=False)
        qids = check_question_ids(question_ids, len(queries))
        out: list[list[Hit]] = []
        for s in range(0, len(queries), self.max_queries):
            part = queries[s:s + self.max_queries]
            ex = [set(map(str, e)) for e in exclude[s:s + self.max_queries]] if exclude is not None else None
            extra = max((len(e) for e in ex), default=0) if ex else 0
            t0 = time.perf_counter()
            result, cost = self._post({"queries": part, "topk": k + extra, "return_scores": True, "return_cost": True})
            # Encoding and scanning happen on the server: book what it reports, else "unknown".
            book(ledger, "search", qids[s:s + self.max_queries], cost, time.perf_counter() - t0)
            for j, items in enumerate(result):
                hits = []
                for it in items:
                    if isinstance(it, dict) and "document" in it:
                        doc, score = it["document"], float(it.get("score", math.nan))
                    else:  # a server that ignores return_scores sends bare rows
                        doc, score = it, math.nan
                    hid = str(doc.get("id", ""))
                    if ex is not None and hid in ex[j]:
                        continue
                    hits.append(Hit(id=hid, score=score, document=doc))
                    if len(hits) == k:
                        break
                out.append(hits)
        return out

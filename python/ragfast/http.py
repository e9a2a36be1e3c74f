"""One JSON-over-HTTP call with retries, shared by every client of a remote component."""
from __future__ import annotations

import time
from typing import Any

from ragfast.errors import RagfastError

__all__ = ["post_json", "is_url"]


def is_url(spec: object) -> bool:
    """Whether a slot spec names a server (``http://`` or ``https://``) rather than a local thing."""
    return isinstance(spec, str) and spec.startswith(("http://", "https://"))


def post_json(client: Any, url: str, payload: Any, *, retries: int = 2,
              error: type[RagfastError] = RagfastError) -> Any:
    """POST ``payload`` as JSON and return the decoded answer.

    Connection errors and 5xx answers are retried ``retries`` times with a short exponential
    backoff (a server restarting or shedding load); any other non-200 answer is final.

    Parameters
    ----------
    client : httpx.Client
    url : str
    payload : JSON-serialisable
    retries : int
        Extra attempts after the first.
    error : RagfastError subclass
        What to raise, so each client keeps its own error type.

    Raises
    ------
    error
        ``"<url> answered <status>: <body>"`` for a non-200 answer, ``"cannot reach <url> ..."``
        when every attempt failed to connect, or a note that the body was not JSON.
    """
    import httpx

    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
        try:
            r = client.post(url, json=payload)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout
            last = exc
            continue
        if r.status_code >= 500 and attempt < retries:
            last = error(f"{url} answered {r.status_code}: {r.text[:300]}")
            continue
        if r.status_code != 200:
            raise error(f"{url} answered {r.status_code}: {r.text[:500]}")
        try:
            return r.json()
        except ValueError:
            raise error(f"{url} did not answer JSON: {r.text[:300]}") from None
    raise error(f"cannot reach {url} after {retries + 1} attempts: {last}")

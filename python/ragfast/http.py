"""The one JSON-over-HTTP client of ragfast's remote components: URL checks, and calls with retries.

Every client of a remote component (``RemoteRetriever``, ``OpenAIGenerator``, ``RemoteJudge``)
goes through :func:`request_json` (or :func:`post_json` / :func:`get_json`), so they retry the
same failures the same way and fail with the same one-line messages.
"""
from __future__ import annotations

import time
from typing import Any

from ragfast.errors import ConfigError, RagfastError

__all__ = ["is_url", "check_url", "request_json", "post_json", "get_json"]

_SCHEMES = ("http://", "https://")


def is_url(s: Any) -> bool:
    """True when ``s`` is a string starting with ``http://`` or ``https://``."""
    return isinstance(s, str) and s.startswith(_SCHEMES)


def check_url(url: str, what: str) -> str:
    """Return ``url`` when it is an http(s) URL, else raise a ConfigError naming ``what``.

    Parameters
    ----------
    url : str
    what : str
        How the message names the setting, e.g. ``"retriever URL"`` or ``"base_url"``.
    """
    if not is_url(url):
        raise ConfigError(f"{what} must start with http:// or https://, got {url!r}")
    return url


def _snippet(text: str, n: int) -> str:
    # A server's error page can span lines; the error stays one line.
    return " ".join(text[:n].split())


def request_json(client: Any, method: str, url: str, payload: Any = None, *, retries: int = 2,
                 error: type[RagfastError] = RagfastError, timeout: float | None = None) -> Any:
    """Send one JSON request and return the decoded answer.

    Connection errors and 5xx answers are retried ``retries`` times with a short exponential
    backoff (a server restarting or shedding load); any other non-200 answer is final.

    Parameters
    ----------
    client : httpx.Client
    method : {"GET", "POST"}
    url : str
    payload : JSON-serialisable, optional
        The POST body.
    retries : int
        Extra attempts after the first.
    error : RagfastError subclass
        What to raise, so each client keeps its own error type.
    timeout : float, optional
        Seconds for this request (default: the client's).

    Raises
    ------
    error
        ``"<url> answered <status>: <body>"`` for a non-200 answer, ``"cannot reach <url> ..."``
        when every attempt failed to connect, or a note that the body was not JSON.
    """
    import httpx

    kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if method == "POST":
        kw["json"] = payload
    last: Exception | None = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
        try:
            r = client.post(url, **kw) if method == "POST" else client.get(url, **kw)
        except httpx.HTTPError as exc:  # connection refused, reset, timeout
            last = exc
            continue
        if r.status_code >= 500 and attempt < retries:
            last = error(f"{url} answered {r.status_code}: {_snippet(r.text, 300)}")
            continue
        if r.status_code != 200:
            raise error(f"{url} answered {r.status_code}: {_snippet(r.text, 500)}")
        try:
            return r.json()
        except ValueError:
            raise error(f"{url} did not answer JSON: {_snippet(r.text, 300)}") from None
    raise error(f"cannot reach {url} after {retries + 1} attempts: {last}")


def post_json(client: Any, url: str, payload: Any, *, retries: int = 2,
              error: type[RagfastError] = RagfastError, timeout: float | None = None) -> Any:
    """POST ``payload`` as JSON and return the decoded answer (:func:`request_json`)."""
    return request_json(client, "POST", url, payload, retries=retries, error=error, timeout=timeout)


def get_json(client: Any, url: str, *, retries: int = 2, error: type[RagfastError] = RagfastError,
             timeout: float | None = None) -> Any:
    """GET ``url`` and return the decoded JSON answer (:func:`request_json`)."""
    return request_json(client, "GET", url, retries=retries, error=error, timeout=timeout)

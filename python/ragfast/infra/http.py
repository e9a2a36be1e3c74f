"""The one JSON-over-HTTP client of ragfast's remote components: URL checks, and calls with retries.

Every client of a remote component (``RemoteRetriever``, ``OpenAIGenerator``, ``RemoteJudge``)
goes through :func:`request_json` (or :func:`post_json` / :func:`get_json`), so they retry the
same failures the same way and fail with the same one-line messages.

Every wait is bounded: one attempt waits at most the per-call timeout, one request with its
retries at most the total timeout (``ragfast --call-timeout S --total-timeout S``, or the
``RAGFAST_CALL_TIMEOUT`` / ``RAGFAST_TOTAL_TIMEOUT`` environment variables), and while it
waits longer than :data:`WAIT_NOTICE_S` a line on stderr says what it waits for. A timeout is
one line naming the URL; what finished before stays on disk.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any, Callable

from ragfast.errors import ConfigError, RagfastError, mark_transient

__all__ = ["is_url", "check_url", "auth_headers", "http_module", "request_json", "post_json", "get_json",
           "set_timeouts", "timeouts", "wait_until_up",
           "DEFAULT_CALL_TIMEOUT_S", "DEFAULT_TOTAL_TIMEOUT_S", "WAIT_NOTICE_S", "RETRY_STATUSES"]

#: One attempt: long enough for a 7B reasoner to generate 500 tokens for a batch of 64 on a
#: CPU server, short enough that a server that accepted and never answers is given up on.
DEFAULT_CALL_TIMEOUT_S = 300.0
#: One request with its retries (attempts, backoff and connects together).
DEFAULT_TOTAL_TIMEOUT_S = 900.0
#: After this many seconds of waiting on one request, and every as many after, a line on stderr.
WAIT_NOTICE_S = 15.0

log = logging.getLogger("ragfast.infra.http")


def http_module(client: Any) -> Any:
    """The HTTP package whose client ``client`` is: ``httpx``, or ``httpx2`` for a client built on it.

    Starlette's ``TestClient`` (which the tests pass for an in-process server) subclasses
    ``httpx2.Client`` since starlette 1.10, and httpx2's clients refuse ``httpx.Timeout`` objects
    and raise their own exception classes; the retry loop must speak the client's own package.
    """
    import importlib

    for cls in type(client).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ("httpx", "httpx2"):
            return importlib.import_module(root)
    import httpx

    return httpx


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise ConfigError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return v


def timeouts() -> tuple[float, float]:
    """The (per-call, total) timeouts in seconds every client uses now."""
    return (_env_seconds("RAGFAST_CALL_TIMEOUT", DEFAULT_CALL_TIMEOUT_S),
            _env_seconds("RAGFAST_TOTAL_TIMEOUT", DEFAULT_TOTAL_TIMEOUT_S))


def set_timeouts(call: float | None = None, total: float | None = None) -> None:
    """Set the per-call and total timeouts of every client (also for worker processes and Ray actors).

    They are kept in the environment (``RAGFAST_CALL_TIMEOUT``, ``RAGFAST_TOTAL_TIMEOUT``), so
    processes this one starts inherit them.

    Raises
    ------
    ConfigError
        A value that is not a finite number > 0.
    """
    for flag, name, v in (("--call-timeout", "RAGFAST_CALL_TIMEOUT", call),
                          ("--total-timeout", "RAGFAST_TOTAL_TIMEOUT", total)):
        if v is None:
            continue
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be a number of seconds > 0, got {v!r}")
        os.environ[name] = repr(float(v))


class _Notice:
    """A line on stderr every :data:`WAIT_NOTICE_S` while one request is outstanding."""

    def __init__(self, url: str, call_s: float, total_s: float):
        self.url, self.call_s, self.total_s = url, call_s, total_s
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ragfast-http-wait", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(WAIT_NOTICE_S):
            log.warning("still waiting for %s: %.0f s so far (gives up after %.0f s per call, %.0f s in all; "
                        "--call-timeout / --total-timeout)", self.url, time.monotonic() - self.t0, self.call_s,
                        self.total_s)

    def __enter__(self) -> "_Notice":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

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


def auth_headers() -> dict[str, str]:
    """``Authorization: Bearer $RAGFAST_API_KEY`` for ragfast's own servers when the variable is set, else {}."""
    key = os.environ.get("RAGFAST_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _snippet(text: str, n: int) -> str:
    # A server's error page can span lines; the error stays one line.
    return " ".join(text[:n].split())


#: Answers a retry may turn around: the server timed the request out (408), is shedding load
#: (429) or failed (5xx). Any other non-200 answer is the server refusing this input.
RETRY_STATUSES = (408, 429)


def _error(error: type[RagfastError], message: str, *, transient: bool) -> RagfastError:
    # transient: a retry later might pass (the failed question is recorded either way)
    return mark_transient(error(message), transient)  # type: ignore[return-value]


def request_json(client: Any, method: str, url: str, payload: Any = None, *, retries: int = 2,
                 error: type[RagfastError] = RagfastError, timeout: float | None = None) -> Any:
    """Send one JSON request and return the decoded answer.

    Connection errors, 408, 429 and 5xx answers are retried ``retries`` times with a short
    exponential backoff (a server restarting or shedding load); any other non-200 answer is
    final, and so is an attempt that timed out waiting for the answer (a hung server does not
    answer a retry either). Each attempt waits at most the per-call timeout and the whole
    request at most the total timeout (:func:`timeouts`); past :data:`WAIT_NOTICE_S` a line on
    stderr says so. The error raised is marked transient (:func:`ragfast.errors.is_transient`)
    for a failure a later retry might pass, and not for an answer that refuses this request (a
    4xx other than 408/429, a body that is not JSON).

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
        Seconds for this request's attempts, when shorter than the per-call timeout (a health
        check).

    Raises
    ------
    error
        ``"<url> answered <status>: <body>"`` for a non-200 answer, ``"cannot reach <url> ..."``
        when every attempt failed to connect, ``"<url> did not answer within ..."`` on a timeout,
        or a note that the body was not JSON.
    """
    httpx = http_module(client)
    call_s, total_s = timeouts()
    if timeout is not None:
        call_s = min(call_s, float(timeout))
    deadline = time.monotonic() + total_s
    last: Exception | None = None
    with _Notice(url, call_s, total_s):
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(2.0, 0.1 * 2 ** attempt, max(0.0, deadline - time.monotonic())))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            wait = min(call_s, left)
            # (connect, read, write, pool): both httpx and httpx2 take the tuple
            kw: dict[str, Any] = {"timeout": (min(wait, 10.0), wait, wait, wait)}
            if method == "POST":
                kw["json"] = payload
            try:
                r = client.post(url, **kw) if method == "POST" else client.get(url, **kw)
            except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
                which = "--total-timeout" if wait < call_s else "--call-timeout"
                raise _error(error, f"{url} did not answer within {wait:.0f} s ({which}); it accepted the request "
                             f"but sent nothing back ({type(exc).__name__})", transient=True) from None
            except httpx.HTTPError as exc:  # connection refused, reset, connect timeout
                last = exc
                continue
            again = r.status_code >= 500 or r.status_code in RETRY_STATUSES
            if again and attempt < retries:
                last = error(f"{url} answered {r.status_code}: {_snippet(r.text, 300)}")
                continue
            if r.status_code != 200:
                raise _error(error, f"{url} answered {r.status_code}: {_snippet(r.text, 500)}", transient=again)
            try:
                return r.json()
            except ValueError:
                raise _error(error, f"{url} did not answer JSON: {_snippet(r.text, 300)}", transient=False) from None
        else:
            raise _error(error, f"cannot reach {url} after {retries + 1} attempts: {_snippet(str(last), 300)}",
                         transient=True)
    raise _error(error, f"gave up on {url} after {total_s:.0f} s (--total-timeout): {_snippet(str(last), 300)}",
                 transient=True)


def post_json(client: Any, url: str, payload: Any, *, retries: int = 2,
              error: type[RagfastError] = RagfastError, timeout: float | None = None) -> Any:
    """POST ``payload`` as JSON and return the decoded answer (:func:`request_json`)."""
    return request_json(client, "POST", url, payload, retries=retries, error=error, timeout=timeout)


def get_json(client: Any, url: str, *, retries: int = 2, error: type[RagfastError] = RagfastError,
             timeout: float | None = None) -> Any:
    """GET ``url`` and return the decoded JSON answer (:func:`request_json`)."""
    return request_json(client, "GET", url, retries=retries, error=error, timeout=timeout)


def wait_until_up(url: str, alive: Callable[[], bool], timeout_s: float, *, what: str = "server",
                  path: str = "/health", poll_s: float = 0.5, error: type[Exception] = RagfastError,
                  see: str = "") -> None:
    """Wait until a server we started answers ``GET url + path`` with 200.

    Parameters
    ----------
    alive : callable
        False once the server's process has exited: then waiting is pointless.
    error : type
        Raised (one line naming ``what``, plus ``see``) when the process exits first or
        ``timeout_s`` passes.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise error(f"{what} exited before it answered {url}{path}{see}")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise error(f"{what} did not answer {url}{path} within {timeout_s:.0f} s{see}")
        time.sleep(poll_s)

"""ASGI guards both servers wrap their app in; :func:`guard` adds them in their order.

:class:`BodyLimitMiddleware` (refuses an over-long body from its Content-Length, or while it
streams, before anything parses it; 408 for a stalled one), :class:`RequestIdMiddleware` (an
``X-Request-ID`` on every response, one log line per 5xx, and a 500 instead of a crash for
anything unhandled) and :class:`AccessGuard` (``application/json`` required on a POST, 415
otherwise, so a web page cannot drive a loopback server with a "simple" cross-origin request; an
optional bearer token).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import uuid
from typing import Any, Callable, Sequence

from ragfast.serving.connections import head_timeout
from ragfast.serving.validation import json_bytes

__all__ = ["BodyLimitMiddleware", "RequestIdMiddleware", "AccessGuard", "guard"]

log = logging.getLogger("ragfast.serving")


async def _send_json(send: Callable, status: int, payload: dict[str, Any],
                     headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json_bytes(payload)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """Pure ASGI: a body over ``max_bytes`` gets 413 before anything reads or parses it.

    The Content-Length header is checked first (nothing is read at all); a body without one
    (chunked) is counted while it streams and refused as soon as it passes the limit. The body
    is buffered up to the limit and replayed to the app, which would read it whole anyway.

    A body must also arrive whole within ``$RAGFAST_HEAD_TIMEOUT`` seconds of its head (the
    head's own deadline, :class:`~ragfast.serving.connections.HeadTimeoutProtocol`), else 408 and
    the connection closes: a client that sends a head and then stalls or trickles its body would
    otherwise hold its connection, and a request slot, forever.
    """

    def __init__(self, app: Any, max_bytes: int, on_reject: Callable[[], None] | None = None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.on_reject = on_reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        msg = f"request body too large: the limit is {self.max_bytes} bytes (--max-body-bytes)"
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    await _send_json(send, 400, {"detail": "bad Content-Length header"})
                    return
                if declared > self.max_bytes:
                    if self.on_reject:
                        self.on_reject()
                    await _send_json(send, 413, {"detail": f"{msg}; Content-Length says {declared}"})
                    return
        chunks: list[bytes] = []
        size = 0
        limit = head_timeout()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                chunks.clear()  # what a stalled client sent is not held while the answer goes out
                detail = f"body not complete {limit:g} s after its head (--head-timeout-s)"
                await _send_json(send, 408, {"detail": detail})
                return
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                if self.on_reject:
                    self.on_reject()
                await _send_json(send, 413, {"detail": msg})
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestIdMiddleware:
    """Pure ASGI: every response carries ``X-Request-ID``; every 5xx logs one line with it.

    A client's own ``X-Request-ID`` (up to 64 printable ASCII characters) is kept, else one is
    made. An exception that escapes the app becomes a 500 naming the id (one log line, no
    traceback in the server's output), so nothing a request does can take the server down.
    """

    def __init__(self, app: Any, on_error: Callable[[], None] | None = None, logger: logging.Logger | None = None):
        self.app = app
        self.on_error = on_error
        self.log = logger or log

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for k, v in scope.get("headers", ()):
            if k == b"x-request-id":
                try:
                    cand = v.decode("ascii")
                except UnicodeDecodeError:
                    cand = ""
                if 0 < len(cand) <= 64 and cand.isprintable():
                    rid = cand
                break
        rid = rid or uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        started = False
        status = 0

        async def send_with_id(message: dict) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except asyncio.CancelledError:
            # The shutdown cancels what is still running past --graceful-s: one line and a 503
            # that says so, not a bare 500 and uvicorn's traceback of the cancellation.
            if self.on_error:
                self.on_error()
            self.log.error("request %s %s %s cancelled: 503 the server is shutting down (past --graceful-s)",
                           rid, scope.get("method"), scope.get("path"))
            if not started:
                try:
                    await _send_json(send, 503, {"detail": f"the server is shutting down (request id {rid})"},
                                     headers=[(b"x-request-id", rid.encode())])
                except Exception:  # the connection may be gone already
                    pass
            return
        except Exception as exc:
            if self.on_error:
                self.on_error()
            self.log.error("request %s %s %s failed: 500 %s: %s", rid, scope.get("method"), scope.get("path"),
                           type(exc).__name__, str(exc)[:300])
            if not started:
                await _send_json(send, 500, {"detail": f"internal error (request id {rid})"},
                                 headers=[(b"x-request-id", rid.encode())])
            return
        if status >= 500:
            if self.on_error:
                self.on_error()
            self.log.error("request %s %s %s answered %d", rid, scope.get("method"), scope.get("path"), status)


class AccessGuard:
    """Pure ASGI: 415 for a POST that is not ``application/json``; 401 without the bearer token.

    A browser sends a cross-origin POST without a preflight only for "simple" content types
    (``text/plain``, forms); requiring ``application/json`` keeps a web page the user has open
    from driving a server on their loopback. With ``api_key`` set, every request (``/health``
    included) needs ``Authorization: Bearer <key>``, compared in constant time.
    """

    def __init__(self, app: Any, api_key: str | None = None):
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        if self.key is not None:
            auth = headers.get(b"authorization", b"")
            if not (auth[:7].lower() == b"bearer " and hmac.compare_digest(auth[7:].strip(), self.key)):
                await _send_json(send, 401, {"detail": "missing or wrong bearer token (Authorization: Bearer ...)"},
                                 headers=[(b"www-authenticate", b"Bearer")])
                return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json":
                shown = ctype.decode("latin-1")[:60] or "none"
                await _send_json(send, 415, {"detail": f"Content-Type must be application/json, got {shown}"})
                return
        await self.app(scope, receive, send)


def guard(app: Any, *, max_body_bytes: int, api_key: str | None = None, on_reject: Callable[[], None] | None = None,
          on_error: Callable[[], None] | None = None, logger: logging.Logger | None = None) -> None:
    """Wrap a FastAPI/Starlette ``app`` in the three guards, in their order, before any parsing.

    Added innermost first: request ids wrap everything (a guard's own answer carries one too),
    then the token and Content-Type checks, then the body limit.

    Parameters
    ----------
    max_body_bytes : int
        :class:`BodyLimitMiddleware`'s limit.
    api_key : str, optional
        The bearer token every request needs (:class:`AccessGuard`); None: none.
    on_reject, on_error : callable, optional
        Counters of refused requests (an over-long body) and of 5xx answers.
    logger : logging.Logger, optional
        Where :class:`RequestIdMiddleware` logs a 5xx (default ``ragfast.serving``).
    """
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes, on_reject=on_reject)
    app.add_middleware(AccessGuard, api_key=api_key)
    app.add_middleware(RequestIdMiddleware, on_error=on_error, logger=logger)

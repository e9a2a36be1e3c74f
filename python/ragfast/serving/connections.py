"""Connections: the bind check, the bearer token's source, and uvicorn's per-connection deadlines.

:func:`check_bind` (a bind beyond loopback needs a token, and says so loudly) and
:func:`uvicorn_options` (a deadline for each request head, keep-alive and connection caps: idle
and slow-loris connections are closed instead of held forever).
"""
from __future__ import annotations

import ipaddress
import logging
import math
import os
import random
from typing import Any

__all__ = ["API_KEY_ENV", "DEFAULT_HEAD_TIMEOUT_S", "DEFAULT_KEEP_ALIVE_S", "DEFAULT_MAX_CONNECTIONS",
           "DEFAULT_GRACEFUL_S", "MAX_HEAD_BYTES", "head_timeout", "check_bind", "HeadTimeoutProtocol",
           "uvicorn_options"]

#: Environment variable holding the servers' bearer token (``--api-key`` wins over it).
API_KEY_ENV = "RAGFAST_API_KEY"
#: A connection must deliver a whole request head (request line and headers) this soon after it
#: opens, or after its previous answer; an idle socket that sends nothing is closed then too.
DEFAULT_HEAD_TIMEOUT_S = 10.0
#: An idle keep-alive connection is closed after this (uvicorn's default).
DEFAULT_KEEP_ALIVE_S = 5.0
#: Connections (and requests in flight) above this are answered 503 (uvicorn's limit_concurrency).
DEFAULT_MAX_CONNECTIONS = 2048
#: Largest request head h11 buffers while it is incomplete (431 beyond): real heads are < 2 KB,
#: and every byte a slow client trickles in makes h11 rescan its buffer.
MAX_HEAD_BYTES = 16 * 1024
#: On SIGTERM, how long in-flight requests may take to finish (uvicorn's graceful shutdown).
DEFAULT_GRACEFUL_S = 30.0

log = logging.getLogger("ragfast.serving")


def head_timeout() -> float:
    """The request-head deadline in seconds, from the environment (:func:`uvicorn_options` sets it)."""
    return float(os.environ.get("RAGFAST_HEAD_TIMEOUT", DEFAULT_HEAD_TIMEOUT_S))


def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, port: Any, api_key: str | None) -> str | None:
    """Check a server's bind settings before anything loads; return the bearer token to require.

    The token is ``api_key``, else ``$RAGFAST_API_KEY``, else None (no token). Binding beyond
    loopback (``0.0.0.0``, a LAN address) without one is refused; with one, a warning says the
    server is reachable from other machines.

    Raises
    ------
    ConfigError
        A port outside 1-65535, or a non-loopback bind without a token.
    """
    from ragfast.checks import check_port
    from ragfast.errors import ConfigError

    check_port(port)
    key = api_key or os.environ.get(API_KEY_ENV) or None
    if not _is_loopback(host):
        if key is None:
            raise ConfigError(f"--host {host} is reachable from other machines: set --api-key (or ${API_KEY_ENV}) "
                              "so that only clients with the token are served, or bind 127.0.0.1")
        log.warning("WARNING: serving on %s:%s, reachable from other machines; every request needs the bearer "
                    "token", host, port)
    return key


try:  # uvicorn is the optional "serve" extra; the protocol class exists only with it
    from uvicorn.protocols.http.h11_impl import H11Protocol as _H11Protocol
except ImportError:  # pragma: no cover - without uvicorn there is no server to run
    _H11Protocol = object  # type: ignore[assignment,misc]


class HeadTimeoutProtocol(_H11Protocol):  # type: ignore[misc,valid-type]
    """uvicorn's h11 protocol with a deadline for each request head.

    uvicorn times out only an idle keep-alive connection after a response: a socket that opens
    and sends nothing, or trickles a header a byte at a time (slow-loris), is otherwise held
    forever. Here each connection must deliver a whole request head within
    ``$RAGFAST_HEAD_TIMEOUT`` seconds (default :data:`DEFAULT_HEAD_TIMEOUT_S`) of opening or of
    its previous response, or it is closed (each deadline is drawn between half and all of it).
    Read from the environment so that uvicorn's worker processes (which import this class by
    name) see the same value.
    """

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
        self._head_cycle = self.cycle  # a new cycle means a complete head arrived
        limit = head_timeout()
        # A deadline drawn between half and all of the limit: connections opened together (an
        # attacker's 550 at once) are then not all closed, and reopened, in the same millisecond.
        # bench/server_faults.py on the 2-core dev box (Xeon, load 17-20), 4 clients' p99 with 500
        # idle + 50 slow-loris sockets held over p99 alone: 2.98x with a fixed deadline (all 550
        # closed and reopened together every 10 s), 1.22x with this jitter.
        self._head_timer = self.loop.call_later(limit * (0.5 + 0.5 * random.random()), self._head_timeout)

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._head_timer.cancel()
            self._head_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def uvicorn_options(host: str, port: int, *, head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
                    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
                    max_connections: int = DEFAULT_MAX_CONNECTIONS) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run`` that bound every connection's idle time.

    Parameters
    ----------
    head_timeout_s : float
        A request head must arrive within this (see :class:`HeadTimeoutProtocol`).
    keep_alive_s : float
        An idle keep-alive connection is closed after this.
    max_connections : int
        Beyond this many connections or requests in flight, new requests get 503.

    Raises
    ------
    ConfigError
        A value that is not a finite number > 0.
    """
    from ragfast.errors import ConfigError

    for flag, v in (("--head-timeout-s", head_timeout_s), ("--keep-alive-s", keep_alive_s),
                    ("--max-connections", max_connections)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigError(f"{flag} must be > 0, got {v!r}")
    os.environ["RAGFAST_HEAD_TIMEOUT"] = repr(float(head_timeout_s))
    return {"host": host, "port": int(port), "http": HeadTimeoutProtocol, "timeout_keep_alive": keep_alive_s,
            "limit_concurrency": int(max_connections), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}

"""The connection flags ``serve-retriever`` and ``serve-judge`` share, declared once.

Their defaults are :mod:`ragfast.serving`'s (``serve()`` and :func:`~ragfast.serving.uvicorn_options`
read the same constants), so a server started from Python and one started from the command line
hold connections alike.
"""
from __future__ import annotations

import typer

from ragfast.serving.connections import (DEFAULT_GRACEFUL_S, DEFAULT_HEAD_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S,
                                         DEFAULT_MAX_CONNECTIONS)

__all__ = ["GRACEFUL_S", "API_KEY", "HEAD_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_CONNECTIONS"]

GRACEFUL_S = typer.Option(DEFAULT_GRACEFUL_S, "--graceful-s", help="On SIGTERM, how long in-flight requests may "
                                                                   "take to finish.")
API_KEY = typer.Option(None, "--api-key", help="Bearer token every request must carry (default $RAGFAST_API_KEY; "
                                               "required beyond loopback).")
HEAD_TIMEOUT_S = typer.Option(DEFAULT_HEAD_TIMEOUT_S, "--head-timeout-s", help="A connection that has not sent a "
                                                                               "whole request head within this is "
                                                                               "closed (idle and slow-loris "
                                                                               "sockets); a body not whole within "
                                                                               "as long after its head gets 408.")
KEEP_ALIVE_S = typer.Option(DEFAULT_KEEP_ALIVE_S, "--keep-alive-s", help="Idle keep-alive connections close after "
                                                                         "this.")
MAX_CONNECTIONS = typer.Option(DEFAULT_MAX_CONNECTIONS, "--max-connections", help="Connections or requests in "
                                                                                  "flight beyond this get 503.")

"""``RemoteJudge``: the judge slot backed by a ``ragfast serve-judge`` server.

It sends states to ``POST /score`` (``{"states": [{"question", "evidence", "trajectory_id"}]}``)
and books the server's reported compute in the caller's ledger as ``judge`` (see
:mod:`ragfast.accounting.remote_cost`); a server that reports none is booked as unknown, never as free.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, ModelError
from ragfast.infra.http import auth_headers, http_module, post_json
from ragfast.judges.base import Judge
from ragfast.accounting.remote_cost import book
from ragfast.types import State

__all__ = ["RemoteJudge"]


class RemoteJudge(Judge):
    """A :class:`~ragfast.judges.base.Judge` that asks a ``serve-judge`` server for STOP scores.

    Parameters
    ----------
    url : str
        Server address, e.g. ``http://127.0.0.1:8001`` (``/score`` is appended).
    timeout : float
        Seconds per request.
    max_states_per_request : int
        Larger batches go out in several requests.
    retries : int
        Extra attempts after a connection error or a 5xx answer.
    """

    def __init__(self, url: str, *, timeout: float = 120.0, max_states_per_request: int = 1024, retries: int = 2,
                 client: Any = None):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"judge URL must start with http:// or https://, got {url!r}")
        if max_states_per_request < 1:
            raise ConfigError(f"max_states_per_request must be >= 1, got {max_states_per_request}")
        url = url.rstrip("/")
        self.base = url[: -len("/score")] if url.endswith("/score") else url
        self.url = self.base + "/score"
        self.max_states = int(max_states_per_request)
        self.retries = int(retries)
        # A server started with --api-key (or $RAGFAST_API_KEY) needs the same token.
        self.client = client if client is not None else httpx.Client(timeout=timeout, headers=auth_headers())
        self._httpx = http_module(self.client)
        info = self._get_health()
        judge = info.get("judge") or {}
        self.name = f"{judge.get('name', 'judge')} @ {self.base}"
        self.meaningful = bool(judge.get("meaningful", True))
        self.server = judge

    def _get_health(self) -> dict[str, Any]:
        try:
            r = self.client.get(self.base + "/health")
        except self._httpx.HTTPError as exc:
            raise ModelError(f"cannot reach the judge server at {self.base}: {exc}") from None
        if r.status_code != 200:
            raise ModelError(f"{self.base}/health answered {r.status_code}: {r.text[:200]}")
        try:
            return dict(r.json())
        except ValueError:
            raise ModelError(f"{self.base}/health did not answer JSON") from None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "meaningful": self.meaningful, "class": type(self).__name__, "url": self.url,
                "server": self.server}

    def close(self) -> None:
        self.client.close()

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        body = post_json(self.client, self.url, payload, retries=self.retries, error=ModelError)
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list):
            raise ModelError(f"{self.url} sent a body without 'scores': {str(body)[:300]}")
        if len(scores) != len(payload["states"]):
            raise ModelError(f"{self.url} answered {len(scores)} scores for {len(payload['states'])} states")
        # null is the protocol's "could not score this state" (it never stops); anything else must
        # be a finite number. A bare NaN/Infinity token or a string would otherwise fail deep in
        # the threshold statistics, far from the server that sent it.
        for i, x in enumerate(scores):
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)):
                raise ModelError(f"{self.url} sent score {i} = {str(x)[:40]!r}, not a finite number or null; "
                                 "refusing the judge's answer")
        return body

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """One STOP score per state from the server (NaN where it could not score one)."""
        sts = [s if isinstance(s, State) else State(s[0], list(s[1])) for s in states]
        qids = list(question_ids) if question_ids is not None else [None] * len(sts)
        if len(qids) != len(sts):
            raise ValueError(f"{len(qids)} question ids for {len(sts)} states")
        out = np.full(len(sts), np.nan)
        for a in range(0, len(sts), self.max_states):
            part = sts[a:a + self.max_states]
            payload = {"states": [{"question": s.question, "evidence": list(s.evidence),
                                   **({"trajectory_id": s.trajectory_id} if s.trajectory_id is not None else {})}
                                  for s in part]}
            t0 = time.perf_counter()
            body = self._post(payload)
            book(ledger, "judge", qids[a:a + self.max_states], body.get("cost"), time.perf_counter() - t0)
            out[a:a + len(part)] = [np.nan if x is None else float(x) for x in body["scores"]]
        return out

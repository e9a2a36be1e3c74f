"""The fair micro-batcher both servers put their model behind (:class:`FairBatcher`).

Requests are split into chunks and gathered into micro-batches round-robin, so a one-query
request is not stuck behind a 1024-query one; a batch that fails anyway is bisected so only the
offending request fails; queue depth and in-flight work are counted for ``/health`` and
``/metrics``.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ragfast.serving.memory import trim_memory

__all__ = ["BatchStats", "FairBatcher"]


@dataclass
class BatchStats:
    """Counters a server shows on ``/health`` and ``/metrics``."""

    requests: int = 0
    items: int = 0
    batches: int = 0
    batched_items: int = 0
    max_batch_seen: int = 0
    failed_requests: int = 0
    isolation_retries: int = 0
    queued_requests: int = 0
    queued_items: int = 0
    inflight_requests: int = 0
    inflight_items: int = 0
    started: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "items": self.items, "batches": self.batches,
                "mean_batch_items": (self.batched_items / self.batches) if self.batches else 0.0,
                "max_batch_items": self.max_batch_seen, "failed_requests": self.failed_requests,
                "isolation_retries": self.isolation_retries, "queued_requests": self.queued_requests,
                "queued_items": self.queued_items, "inflight_requests": self.inflight_requests,
                "inflight_items": self.inflight_items, "uptime_s": round(time.time() - self.started, 3)}


class _Job:
    __slots__ = ("items", "param", "future", "results", "next", "left")

    def __init__(self, items: list[Any], param: Any, future: asyncio.Future):
        self.items, self.param, self.future = items, param, future
        self.results: list[Any] = [None] * len(items)
        self.next = 0  # first item not yet scheduled
        self.left = len(items)  # items not yet answered


class FairBatcher:
    """Gathers concurrent requests into micro-batches, fairly, on one worker thread.

    Parameters
    ----------
    run : callable
        ``run(parts) -> list[list[result]]`` where ``parts`` is a list of ``(items, param)``, one
        per request slice in the batch; it returns one result list per part (same lengths). It
        runs on a single worker thread, so calls never overlap (the model owns the cores).
    max_batch : int
        Most items in one call.
    chunk : int
        While small requests (at most ``chunk`` items) are about, the most items one request puts
        in one batch: its fair share, and the latency quantum, since a small request waits for at
        most the batch in flight. With no small request in the last second (or three batch
        times), big requests split the whole ``max_batch`` between them.
    max_wait_s : float
        When the worker is idle, how long the first request waits for company.
    enabled : bool
        ``False``: every request is run on its own, in arrival order (the anchor mode).

    Notes
    -----
    Scheduling is round-robin over waiting requests: a 1024-item request is cut into chunks,
    and every batch takes one chunk from each waiting request in turn (up to ``max_batch``), so
    under mixed load a small request waits for at most the batch in flight plus its own. If a
    call raises, its parts are retried by bisection, so a request that cannot be served fails
    alone with its own error.
    """

    def __init__(self, run: Callable[[list[tuple[list[Any], Any]]], list[list[Any]]], *, max_batch: int,
                 chunk: int, max_wait_s: float, enabled: bool = True, name: str = "ragfast-batch"):
        self.run = run
        self.max_batch = int(max_batch)
        self.chunk = max(1, min(int(chunk), self.max_batch))
        self.max_wait_s = float(max_wait_s)
        self.enabled = enabled
        self.idle_trim_s = 0.5
        self.min_mixed_s = 1.0
        self._last_small = -1e9  # when the last request of at most one chunk arrived (monotonic)
        self._last_batch_s = 0.0
        self.stats = BatchStats()
        # One thread runs the model: a batch is one call, and torch's own pool gets the cores.
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: deque[_Job] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public ------------------------------------------------------------------------------
    async def submit(self, items: Sequence[Any], param: Any = None) -> list[Any]:
        """Results for ``items`` (one per item), or the exception their call raised."""
        items = list(items)
        self.stats.requests += 1
        self.stats.items += len(items)
        if not items:
            return []
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        if len(items) <= self.chunk:
            self._last_small = time.monotonic()
        job = _Job(items, param, fut)
        self._pending.append(job)
        self.stats.queued_requests += 1
        self.stats.queued_items += len(items)
        self._wake.set()
        try:
            return await fut
        finally:
            if not fut.done():  # the client went away: drop what is still queued of it
                fut.cancel()

    async def close(self) -> None:
        """Stop the scheduler; queued requests get a RuntimeError."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for job in self._pending:
            if not job.future.done():
                job.future.set_exception(RuntimeError("the server is shutting down"))
        self._pending.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- scheduling --------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._task is None or self._task.done():
            self._loop = loop
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._serve())

    def _queued(self) -> int:
        return sum(len(j.items) - j.next for j in self._pending)

    def _take(self) -> list[tuple[_Job, int, int]]:
        """The next batch: slices ``(job, start, stop)``, one chunk per waiting request in turn."""
        live = deque(j for j in self._pending if not j.future.done())
        dropped = [j for j in self._pending if j.future.done()]
        for j in dropped:
            self.stats.queued_requests -= 1
            self.stats.queued_items -= len(j.items) - j.next
        self._pending = live
        if not self.enabled:
            if not live:
                return []
            j = live.popleft()
            self.stats.queued_requests -= 1
            self.stats.queued_items -= len(j.items) - j.next
            start, j.next = j.next, len(j.items)
            return [(j, start, j.next)]
        parts: list[tuple[_Job, int, int]] = []
        n = 0
        # While small requests are about (one arrived lately), every request gets one chunk per
        # batch: whatever is in flight is what the next small one waits for, so it stays short.
        # With only big requests about, they split the whole batch (fewer, bigger calls).
        if not live:  # every waiting request was cancelled by its client
            return []
        now = time.monotonic()
        recent = max(self.min_mixed_s, 3.0 * self._last_batch_s)
        share = self.chunk if now - self._last_small < recent else max(self.chunk, self.max_batch // len(live))
        again: deque[_Job] = deque()
        while live and n < self.max_batch:
            j = live.popleft()
            take = min(share, len(j.items) - j.next, self.max_batch - n)
            parts.append((j, j.next, j.next + take))
            j.next += take
            n += take
            self.stats.queued_items -= take
            if j.next < len(j.items):
                again.append(j)  # to the back of the line: round-robin
            else:
                self.stats.queued_requests -= 1
        # Requests not reached this round keep their place ahead of those just served.
        self._pending = live + again
        return parts

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        idle = True
        trimmed = True
        while True:
            if not self._pending:
                self._wake.clear()
                if not trimmed:
                    # Idle for a moment after work (answers sent, buffers freed): hand the burst's
                    # freed memory back to the OS.
                    try:
                        await asyncio.wait_for(self._wake.wait(), self.idle_trim_s)
                    except asyncio.TimeoutError:
                        await loop.run_in_executor(self.pool, trim_memory)
                        trimmed = True
                    idle = True
                    continue
                await self._wake.wait()
                idle = True
            if idle and self.enabled and self.max_wait_s > 0:
                # An idle worker lets the first request wait briefly for company.
                deadline = loop.time() + self.max_wait_s
                while self._queued() < self.max_batch and loop.time() < deadline:
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), deadline - loop.time())
                    except asyncio.TimeoutError:
                        break
            parts = self._take()
            if not parts:
                idle = True
                continue
            idle = trimmed = False
            n = sum(b - a for _, a, b in parts)
            self.stats.batches += 1
            self.stats.batched_items += n
            self.stats.max_batch_seen = max(self.stats.max_batch_seen, n)
            self.stats.inflight_requests = len({id(j) for j, _, _ in parts})
            self.stats.inflight_items = n
            calls = [(j.items[a:b], j.param) for j, a, b in parts]
            t0 = time.monotonic()
            try:
                outs = await loop.run_in_executor(self.pool, self._isolated, calls)
            except Exception as exc:  # the pool itself failed (shutdown): fail these, keep serving
                outs = [exc] * len(parts)
            finally:
                self.stats.inflight_requests = self.stats.inflight_items = 0
                self._last_batch_s = time.monotonic() - t0
            for (j, a, b), out in zip(parts, outs):
                if j.future.done():
                    continue
                if isinstance(out, BaseException):
                    self.stats.failed_requests += 1
                    j.future.set_exception(out)
                    continue
                j.results[a:b] = out
                j.left -= b - a
                if j.left == 0:
                    j.future.set_result(j.results)
            # Hold nothing of this batch while idle: its inputs may be megabytes of text.
            del parts, calls, outs, j, out

    def _isolated(self, calls: list[tuple[list[Any], Any]]) -> list[Any]:
        """``run(calls)``; on failure, bisect so each failing slice gets its own exception."""
        try:
            outs = self.run(calls)
            if len(outs) != len(calls):
                raise RuntimeError(f"batch function returned {len(outs)} results for {len(calls)} parts")
            return outs
        except Exception as exc:
            if len(calls) == 1:
                return [exc]
            self.stats.isolation_retries += 1
            mid = len(calls) // 2
            return self._isolated(calls[:mid]) + self._isolated(calls[mid:])

"""The cost ledger: one record stream for every component's compute.

Every component (reasoner, encoder, search, judge, nli, other) records what it spent: calls,
input tokens (computed fresh vs served from a KV cache), output tokens, FLOPs, wall seconds,
device seconds (CUDA events) and bytes read (``bytes_scanned``: what search scans, and the
weights a local reasoner's forward passes read, each booked as the question alone reads it).
A result served from a cache (an embedding or a judge score computed for an earlier question)
is charged the tokens and FLOPs it would have cost and counted in ``reused``, so a method's cost
does not depend on what ran before it in the process or on a resume. ``reused`` counts the reads a question made of something it
had already read earlier in the same ledger (:meth:`CostLedger.first_reads`), so it too is the
same clean, resumed or alone. Batched calls are split per question
so that totals equal the sums of the per-question records exactly.
"""
from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

COMPONENTS = ("reasoner", "encoder", "search", "judge", "nli", "other")
NUMERIC_FIELDS = ("calls", "input_tokens", "cached_tokens", "output_tokens", "flops", "seconds",
            "device_seconds", "bytes_scanned", "unknown", "reused", "flops_uncached")


@dataclass
class CostRecord:
    """What one component spent on one question (or on no question: ``question_id=None``)."""

    component: str
    question_id: str | None = None
    calls: int = 0
    input_tokens: int = 0  # computed fresh
    cached_tokens: int = 0  # served from a KV / prefix cache
    output_tokens: int = 0
    flops: float = 0.0
    seconds: float = 0.0
    device_seconds: float = 0.0
    bytes_scanned: int = 0
    # Calls whose compute was not reported (a remote server that sends no cost): their tokens
    # and FLOPs are unknown, not 0, and reports say so.
    unknown: int = 0
    # Of ``calls``, those served from a result cache: charged tokens and FLOPs as if computed
    # (so costs are deterministic), but they took no compute time.
    reused: int = 0
    # FLOPs had every cached prompt token been computed too: the cache-independent figure.
    # A server's prefix cache makes ``flops`` depend on what ran before (136.9 vs 76.4 GFLOPs
    # for identical work on vLLM); this one depends only on the call's token counts. Never below
    # ``flops``: a record that does not set it (no KV cache) gets ``flops``.
    flops_uncached: float = 0.0

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"unknown cost component {self.component!r}; expected one of {COMPONENTS}")
        if self.flops_uncached < self.flops:
            self.flops_uncached = self.flops


def _empty() -> dict[str, float]:
    return {k: 0 for k in NUMERIC_FIELDS}


class Timer:
    """Wall-clock (and, on CUDA, device) seconds of a ``with`` block."""

    def __init__(self, device: str | None = None):
        self.device = device or "cpu"
        self.seconds = 0.0
        self.device_seconds = 0.0

    def __enter__(self) -> "Timer":
        self._events = None
        if self.device.startswith("cuda"):
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, end)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._events is not None:
            import torch

            self._events[1].record()
            torch.cuda.synchronize()
            self.device_seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
        self.seconds = time.perf_counter() - self._t0


class CostLedger:
    """Collects :class:`CostRecord` s from every component; thread-safe."""

    def __init__(self) -> None:
        self.records: list[CostRecord] = []
        self.batches: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        # (component, question) -> keys that question has read: what ``reused`` is counted
        # against. Per question, so it cannot depend on the order of questions, the batching,
        # another method sharing a cache, or a resume (an unfinished question runs again whole).
        self._read: dict[tuple[str, Any], set[Any]] = {}

    # -- recording ---------------------------------------------------------------------------
    def add(self, component: str, question_id: str | None = None, **values: float) -> CostRecord:
        """Record one component call (``calls`` defaults to 1)."""
        values.setdefault("calls", 1)
        rec = CostRecord(component=component, question_id=question_id, **values)
        with self._lock:
            self.records.append(rec)
        return rec

    def first_reads(self, component: str, question_ids: Sequence[Any], keys: Sequence[Any]) -> list[int]:
        """``reused`` per read: 1 where the same question already read ``key`` as ``component`` here.

        Each (question, key) is remembered, so a later read of it by that question counts as
        reused, whether the result came from a cache or was computed again; a read by another
        question, or a cache filled by another run or method, never does.

        Parameters
        ----------
        component : str
        question_ids, keys : sequence
            One entry per read (keys hashable: a text digest, say).
        """
        if len(question_ids) != len(keys):
            raise ValueError(f"{component}: {len(keys)} keys for {len(question_ids)} reads")
        out = []
        with self._lock:
            for qid, key in zip(question_ids, keys):
                seen = self._read.setdefault((component, qid), set())
                out.append(1 if key in seen else 0)
                seen.add(key)
        return out

    def add_batch(
        self,
        component: str,
        question_ids: Sequence[str | None],
        *,
        seconds: float | Sequence[float] = 0.0,
        device_seconds: float | Sequence[float] = 0.0,
        input_tokens: Sequence[int] | None = None,
        cached_tokens: Sequence[int] | None = None,
        output_tokens: Sequence[int] | None = None,
        flops: Sequence[float] | None = None,
        bytes_scanned: Sequence[int] | None = None,
        calls: Sequence[int] | None = None,
        unknown: Sequence[int] | None = None,
        reused: Sequence[int] | None = None,
        flops_uncached: Sequence[float] | None = None,
    ) -> None:
        """Record one batched call covering several questions.

        Token, FLOP and byte counts are given per question. The batch's seconds are split in
        proportion to the FLOPs (or, without FLOPs, to the tokens; else evenly) of the calls
        actually computed (``reused`` ones get none unless every call was reused), so that the
        per-question records add up to the measured time exactly.

        Parameters
        ----------
        component : str
            One of :data:`COMPONENTS`.
        question_ids : sequence of str
            One entry per item of the batch (repeats allowed: their costs add up).
        flops_uncached : sequence of float, optional
            FLOPs with every cached token computed (default: ``flops``); see :class:`CostRecord`.
        seconds, device_seconds : float or sequence of float
            The batch's time, split as above, or each entry's own (a generator that ran the
            entries' rows through several calls and split each call's time itself).
        """
        n = len(question_ids)
        if n == 0:
            return

        def col(v: Sequence[float] | None, name: str) -> list[float]:
            if v is None:
                return [0] * n
            if len(v) != n:
                raise ValueError(f"{component}: {name} has {len(v)} entries for {n} questions")
            return list(v)

        inp, cac, out = col(input_tokens, "input_tokens"), col(cached_tokens, "cached_tokens"), col(output_tokens, "output_tokens")
        fl, by, un = col(flops, "flops"), col(bytes_scanned, "bytes_scanned"), col(unknown, "unknown")
        ru = col(reused, "reused")
        fu = col(flops_uncached, "flops_uncached")
        ca = col(calls, "calls") if calls is not None else [1] * n
        # Reused calls took no compute time: the seconds go to the computed share of each entry.
        live = [max(0.0, c - r) / c if c > 0 else 1.0 for c, r in zip(ca, ru)]
        if not any(live):
            live = [1.0] * n
        weights = fl if sum(fl) > 0 else [a + b + c for a, b, c in zip(inp, cac, out)]
        weights = [w * v for w, v in zip(weights, live)]
        tot = float(sum(weights))
        share = [w / tot for w in weights] if tot > 0 else [v / sum(live) for v in live]
        sec = list(seconds) if isinstance(seconds, Sequence) else [seconds * x for x in share]
        dsec = list(device_seconds) if isinstance(device_seconds, Sequence) else [device_seconds * x for x in share]
        if len(sec) != n or len(dsec) != n:
            raise ValueError(f"{component}: {len(sec)} seconds and {len(dsec)} device seconds for {n} questions")
        recs = [
            CostRecord(component, qid, calls=int(ca[i]), input_tokens=int(inp[i]), cached_tokens=int(cac[i]),
                       output_tokens=int(out[i]), flops=float(fl[i]), seconds=float(sec[i]),
                       device_seconds=float(dsec[i]), bytes_scanned=int(by[i]), unknown=int(un[i]), reused=int(ru[i]),
                       flops_uncached=float(fu[i]))
            for i, qid in enumerate(question_ids)
        ]
        with self._lock:
            self.records.extend(recs)
            self.batches[component] += 1

    @contextlib.contextmanager
    def timer(self, device: str | None = None) -> Iterator[Timer]:
        """Time a block: ``with ledger.timer() as t: ...`` then pass ``t.seconds`` on."""
        t = Timer(device)
        with t:
            yield t

    def extend(self, records: Iterable[CostRecord]) -> None:
        """Append records (e.g. a finished question's, handed over from a batch ledger)."""
        recs = list(records)
        with self._lock:
            self.records.extend(recs)

    def drop(self, question_ids: Iterable[str]) -> None:
        """Remove the records of ``question_ids`` (questions that run again from the start)."""
        gone = set(question_ids)
        if gone:
            with self._lock:
                self.records = [r for r in self.records if r.question_id not in gone]

    def merge(self, other: "CostLedger") -> None:
        """Append every record of ``other`` (e.g. from a worker process)."""
        with self._lock:
            self.records.extend(other.records)
            for k, v in other.batches.items():
                self.batches[k] += v

    # -- reading -----------------------------------------------------------------------------
    def totals(self) -> dict[str, dict[str, float]]:
        """Per-component sums plus a ``"total"`` row."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            row = out.setdefault(r.component, _empty())
            for k in NUMERIC_FIELDS:
                row[k] += getattr(r, k)
        total = _empty()
        for c, row in out.items():
            row["batches"] = self.batches.get(c, 0)
            row["tokens"] = row["input_tokens"] + row["cached_tokens"] + row["output_tokens"]
            for k in NUMERIC_FIELDS:
                total[k] += row[k]
        total["tokens"] = total["input_tokens"] + total["cached_tokens"] + total["output_tokens"]
        total["batches"] = sum(self.batches.values())
        ordered = {c: out[c] for c in COMPONENTS if c in out}
        ordered["total"] = total
        return ordered

    def per_question(self) -> dict[str, dict[str, dict[str, float]]]:
        """question id -> component -> sums (records without a question are left out)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for r in self.records:
            if r.question_id is None:
                continue
            row = out.setdefault(r.question_id, {}).setdefault(r.component, _empty())
            for k in NUMERIC_FIELDS:
                row[k] += getattr(r, k)
        return out

    def for_question(self, question_id: str) -> dict[str, dict[str, float]]:
        """One question's costs by component (what a trajectory's ``cost`` field holds)."""
        out: dict[str, dict[str, float]] = {}
        for r in self.records:
            if r.question_id == question_id:
                row = out.setdefault(r.component, _empty())
                for k in NUMERIC_FIELDS:
                    row[k] += getattr(r, k)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"totals": self.totals(), "per_question": self.per_question()}

    def save(self, path: str | Path) -> None:
        """Write every record as one JSON line."""
        with open(path, "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(json.dumps(asdict(r)) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostLedger":
        led = cls()
        names = {f.name for f in fields(CostRecord)}
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    d = json.loads(line)
                    led.records.append(CostRecord(**{k: v for k, v in d.items() if k in names}))
        return led

    def table(self, title: str = "cost by component"):
        """A rich Table of :meth:`totals`."""
        from rich.table import Table

        t = Table(title=title)
        for h in ("component", "calls", "batches", "fresh tok", "cached tok", "out tok", "GFLOPs", "seconds", "MB scanned"):
            t.add_column(h, justify="right" if h != "component" else "left")
        for c, r in self.totals().items():
            t.add_row(c, f"{int(r['calls'])}", f"{int(r['batches'])}", f"{int(r['input_tokens'])}",
                      f"{int(r['cached_tokens'])}", f"{int(r['output_tokens'])}", f"{r['flops'] / 1e9:.2f}",
                      f"{r['seconds']:.3f}", f"{r['bytes_scanned'] / 1e6:.1f}")
        return t


def sum_cost_dicts(dicts: Iterable[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Add up per-question cost dicts (component -> field -> value)."""
    out: dict[str, dict[str, float]] = {}
    for d in dicts:
        for comp, row in d.items():
            acc = out.setdefault(comp, _empty())
            for k, v in row.items():
                acc[k] = acc.get(k, 0) + v
    return out


# forward_flops lives in ragfast.accounting.flops (analytic transformer FLOPs); re-exported here because
# the ledger is where callers look for it.
def forward_flops(config: Any, input_lengths: Sequence[int], past_lengths: Sequence[int] | None = None) -> float:
    """Analytic matmul + attention FLOPs of one forward pass; see :func:`ragfast.accounting.flops.forward_flops`."""
    from ragfast.accounting.flops import forward_flops as _ff

    return _ff(config, input_lengths, past_lengths)

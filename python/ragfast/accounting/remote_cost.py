"""The ``cost`` object that ragfast's servers add to their answers, and how clients book it.

A retrieval or judge server computes on behalf of its clients, so their ledgers would show
only round-trip time. ``serve-retriever`` and ``serve-judge`` therefore add an optional
``cost`` object to each response (clients that do not know it, such as Search-R1's, ignore
extra keys)::

    "cost": {"items": [{"encoder": {"input_tokens": 12, "flops": 2.1e8, ...},
                        "search": {"flops": 7.7e7, "bytes_scanned": 3072000, ...}}, ...],
             "server_seconds": 0.012}

``items`` holds one entry per query (or state), in request order, with the same fields the
component would have recorded in-process. The client books each component as reported, then
books the rest of the round trip (queueing, network, serialisation) as ``seconds`` of its own
component with no calls, so the ledger's seconds add up to what the client waited. A server
that sends no ``cost`` is booked as ``unknown``: calls counted, compute not known (never 0).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ragfast.accounting.ledger import COMPONENTS, CostLedger

__all__ = ["FIELDS", "cost_items", "book"]

#: Per-item fields a server reports (seconds are the server's share of its batched calls).
FIELDS = ("calls", "input_tokens", "cached_tokens", "output_tokens", "flops", "seconds", "device_seconds",
          "bytes_scanned", "reused", "flops_uncached")


def cost_items(ledger: CostLedger, keys: Sequence[str]) -> list[dict[str, dict[str, float]]]:
    """Server side: per-item costs from a ledger whose records are keyed by ``keys``.

    The server runs its components with ``question_ids=keys`` (one key per query or state of
    the request) into a private ledger; this turns that ledger into the ``items`` list.
    """
    per = ledger.per_question()
    out = []
    for k in keys:
        comps = per.get(k, {})
        out.append({c: {f: row[f] for f in FIELDS if row.get(f)} for c, row in comps.items()})
    return out


def book(ledger: CostLedger | None, component: str, question_ids: Sequence[str | None],
         cost: Mapping[str, Any] | None, client_seconds: float) -> None:
    """Client side: put a response's ``cost`` (or its absence) into ``ledger``.

    Parameters
    ----------
    ledger : CostLedger or None
        Nothing is booked without one.
    component : str
        The client's own component (``"search"`` for a retriever, ``"judge"`` for a judge):
        round-trip time not covered by the server's reported seconds goes there.
    question_ids : sequence
        One per item of the request, in order.
    cost : mapping or None
        The response's ``cost`` object; ``None`` books every item as ``unknown``.
    client_seconds : float
        The round trip the client measured.
    """
    if ledger is None:
        return
    qids = list(question_ids)
    items = (cost or {}).get("items") if isinstance(cost, Mapping) else None
    if not isinstance(items, list) or len(items) != len(qids):
        ledger.add_batch(component, qids, seconds=client_seconds, unknown=[1] * len(qids))
        return
    server_seconds = 0.0
    for comp in COMPONENTS:
        rows = [it.get(comp) if isinstance(it, Mapping) else None for it in items]
        if not any(rows):
            continue
        col = {f: [float((r or {}).get(f, 0) or 0) for r in rows] for f in FIELDS}
        secs = sum(col["seconds"])
        server_seconds += secs
        ledger.add_batch(comp, qids, seconds=secs, device_seconds=sum(col["device_seconds"]),
                         calls=[int(x) for x in col["calls"]],
                         input_tokens=[int(x) for x in col["input_tokens"]],
                         cached_tokens=[int(x) for x in col["cached_tokens"]],
                         output_tokens=[int(x) for x in col["output_tokens"]], flops=col["flops"],
                         bytes_scanned=[int(x) for x in col["bytes_scanned"]],
                         reused=[int(x) for x in col["reused"]], flops_uncached=col["flops_uncached"])
    # The rest of the wait (queue, network, JSON) is the client's own component's time.
    ledger.add_batch(component, qids, seconds=max(0.0, client_seconds - server_seconds), calls=[0] * len(qids))

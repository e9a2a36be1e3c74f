"""How a batched index search is charged to the questions in the batch."""
from __future__ import annotations

from typing import Any, Sequence

from ragfast.checks import check_question_ids

__all__ = ["split_evenly", "record_search"]


def split_evenly(total: int, n: int) -> list[int]:
    """Integers summing to ``total`` exactly, as even as possible over ``n`` items.

    Parameters
    ----------
    total : int
    n : int
        ``n >= 1``; the first ``total % n`` items get one more.
    """
    base, rem = divmod(int(total), n)
    return [base + (1 if i < rem else 0) for i in range(n)]


def record_search(ledger: Any, question_ids: Sequence[Any] | None, b: int, seconds: float, bytes_per_query: int,
                  flops_per_query: float = 0.0) -> None:
    """Add one ``search`` record per query of a batched scan to ``ledger`` (no-op without one).

    Each query is charged the bytes a search for it alone reads (the whole index for a flat
    scan), not a share of what its batch read: a share would depend on how many queries were
    batched together, so a resumed run (which batches the leftover questions anew) would cost
    more or less than a clean one for the same work. The seconds are the batch's, split.

    Parameters
    ----------
    ledger : CostLedger or None
    question_ids : sequence, optional
        One per query (``None`` each when absent).
    b : int
        Queries in the batch.
    seconds : float
        Wall time of the whole batch.
    bytes_per_query : int
        Bytes one query's search reads.
    flops_per_query : float
        FLOPs charged to each query.
    """
    if ledger is None or b == 0:
        return
    qids = check_question_ids(question_ids, b)
    ledger.add_batch("search", qids, seconds=seconds, bytes_scanned=[int(bytes_per_query)] * b,
                     flops=[float(flops_per_query)] * b)

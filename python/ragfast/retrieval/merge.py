"""The exact merge of per-shard top-k results into the global top-k."""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["merge_topk", "shard_exclude"]


def merge_topk(parts: Sequence[tuple[np.ndarray, np.ndarray]], offsets: Sequence[int], k: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Merge shard results into the top-k over all rows, exactly as one unsharded search.

    The global top-k is contained in the union of the per-shard top-k, so sorting the union by
    (score descending, row id ascending) gives the unsharded answer, ties included.

    Parameters
    ----------
    parts : sequence of (scores, ids)
        Per shard, float ``[B, k_s]`` scores and int ``[B, k_s]`` shard-local row ids; an empty
        slot has id -1 (score -inf).
    offsets : sequence of int
        Global row id of each shard's first row.
    k : int
        Hits kept per query.

    Returns
    -------
    (scores, ids) : (np.ndarray, np.ndarray)
        Contiguous float32 ``[B, k]`` best first and int64 ``[B, k]`` global row ids; empty slots
        (-1) sort last.
    """
    scores = np.concatenate([np.asarray(p[0]) for p in parts], axis=1)
    ids = np.concatenate([np.where(np.asarray(p[1]) >= 0, np.asarray(p[1]) + int(offsets[s]), -1)
                          for s, p in enumerate(parts)], axis=1)
    key_id = np.where(ids < 0, np.iinfo(np.int64).max, ids)
    order = np.lexsort((key_id, -scores), axis=1)[:, :k]
    out_s = np.take_along_axis(scores, order, axis=1)
    out_i = np.take_along_axis(ids, order, axis=1)
    return np.ascontiguousarray(out_s, dtype=np.float32), np.ascontiguousarray(out_i, dtype=np.int64)


def shard_exclude(exclude: Sequence[Sequence[int]] | None, lo: int, hi: int) -> list[list[int]] | None:
    """The part of global per-query exclude lists that falls in rows ``lo..hi-1``, as shard-local ids.

    Parameters
    ----------
    exclude : list of B lists of int, optional
        Global row ids each query must skip.
    lo, hi : int
        The shard's global row range.
    """
    if exclude is None:
        return None
    return [[x - lo for x in e if lo <= x < hi] for e in exclude]

"""Keys and values shared between one call's sessions whose tokens extend one another.

S2G's answer-only probes continue one native session from each of its states, so state ``t``'s
tokens are a prefix of state ``t + 1``'s; a rewound live session, or a checker re-reading a
step, is the same shape. Prefilling every row on its own computes ``sum_t L_t`` tokens and pads
each row to the longest. Here the longest row of each such chain is computed once (one batch-1
pass of the decoder) and the shorter rows take the first tokens of its keys and values, so their
prefill is the few tokens after the shared part. The values are the same computation (the same
positions over the same tokens); only the matmul shapes differ, as with the instruction prefix
the generator already shares.

:func:`plan_nested` decides (pure: token ids in, steps out); :func:`share_nested` carries the
steps out on the generator's sessions and says which rows pay for what was computed.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["common_prefix", "plan_nested", "share_nested"]


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else int(n)


def _shares(a: np.ndarray, b: np.ndarray, k: int) -> bool:
    """Whether ``a`` and ``b`` agree on their first ``k`` tokens (a scalar test first: most
    pairs of a batch are other questions and differ right after the instruction)."""
    if k <= 0:
        return True
    if a.size < k or b.size < k or a[k - 1] != b[k - 1]:
        return False
    return common_prefix(a[:k], b[:k]) == k


def plan_nested(ids: Sequence[Sequence[int]], cached: Sequence[int], min_prefix: int
                ) -> list[tuple[str, int, int, int]]:
    """Steps that give each row the longest cached prefix another row of the call can supply.

    Parameters
    ----------
    ids : sequence of sequence of int
        Each row's tokens.
    cached : sequence of int
        Each row's leading tokens whose keys/values it already holds.
    min_prefix : int
        Fewest tokens worth a step (a row gains at least this many cached tokens).

    Returns
    -------
    list of (kind, row, source, tokens)
        In order. ``("compute", b, -1, n)``: compute row ``b``'s keys/values up to ``n`` tokens
        (all but its last, whose logits start its turn), after what it holds; done only when a
        shorter row shares at least ``min_prefix`` more tokens with it than either holds.
        ``("seed", b, d, n)``: row ``b`` takes row ``d``'s first ``n`` keys/values; ``d`` holds
        them by then. Rows are visited longest first, so a chain's longest row is computed and
        the rest are seeded from it.
    """
    arr = [np.asarray(x, dtype=np.int64) for x in ids]
    cover = [int(c) for c in cached]
    order = sorted(range(len(arr)), key=lambda b: -arr[b].size)
    steps: list[tuple[str, int, int, int]] = []
    for j, b in enumerate(order):
        need = arr[b].size - 1
        if need - cover[b] < min_prefix:
            continue
        want = cover[b] + min_prefix
        best, src = 0, -1
        for d in range(len(arr)):
            if d != b and cover[d] >= want and _shares(arr[d][:cover[d]], arr[b], want):
                m = min(common_prefix(arr[d][:cover[d]], arr[b]), need)
                if m > best:
                    best, src = m, d
        if src >= 0:
            steps.append(("seed", b, src, best))
            cover[b] = best
        # The rest is computed here when a shorter row would take more of it than anyone holds.
        if need - cover[b] >= min_prefix and any(_shares(arr[b], arr[o], max(cover[o], cover[b]) + min_prefix)
                                                 for o in order[j + 1:]):
            steps.append(("compute", b, -1, need))
            cover[b] = need
    return steps


def share_nested(model: Any, config: Any, sessions: Sequence[Any], min_prefix: int, device: str,
                 stats: dict[str, int]) -> dict[int, list[tuple[int, int]]]:
    """Carry out :func:`plan_nested` on sessions (``.ids``, ``.kv``, ``.n_cached``).

    Returns
    -------
    dict
        Row -> ``[(tokens, past), ...]``: keys/values computed here for that row (``tokens``
        new ones after ``past`` cached), which its ledger entry books.
    """
    from ragfast.models.kv_buffer import extend_kv

    paid: dict[int, list[tuple[int, int]]] = {}
    steps = plan_nested([s.ids for s in sessions], [s.n_cached if s.kv is not None else 0 for s in sessions],
                        min_prefix)
    for kind, b, src, n in steps:
        s = sessions[b]
        past = s.n_cached if s.kv is not None else 0
        if kind == "compute":
            s.kv = extend_kv(model, config, list(s.ids[past:n]), s.kv if past else None, device)
            paid.setdefault(b, []).append((n - past, past))
            stats["prefix_tokens_computed"] += n - past
        else:
            s.kv = [(k[:, :n], v[:, :n]) for k, v in sessions[src].kv]
            stats["prefix_tokens_reused"] += n - past
        s.n_cached = n
    return paid

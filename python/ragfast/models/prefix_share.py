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
:class:`PrefixSeeding` is the generator's side: the kept instruction prefix, ended sessions'
keys/values (``keep_ended``) and the nested sharing, applied to a call's sessions.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from ragfast.models.kv_buffer import extend_kv

__all__ = ["PrefixSeeding", "common_prefix", "plan_nested", "share_nested"]


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


class PrefixSeeding:
    """Mixin of :class:`~ragfast.models.generator.HFGenerator`: sessions seeded with keys/values
    computed once for several of them (the instruction prefix, nested states, ended sessions).

    It reads the generator's ``model``, ``config``, ``device``, ``min_prefix`` and writes
    ``_template`` (the kept prefix), ``_ended`` (inside :meth:`keep_ended`), ``_shelves`` (ended
    sessions kept for a later block), ``stats`` and the sessions' ``kv`` / ``n_cached``.
    """

    _template: Any
    _ended: Any
    _shelves: dict[str, Any]
    stats: dict[str, int]
    min_prefix: int

    @contextlib.contextmanager
    def keep_ended(self, *, shelve: str | None = None, reuse: str | None = None) -> Iterator[Any]:
        """Within the block, keep each ended session's keys/values for a later session on the same prompt.

        A new session then starts from the tokens it shares with the last ended session that opened
        with its prompt (S2G's answer-only probes of a run's states: each probe re-reads a prefix
        of its trajectory, whose keys/values the run computed). Those tokens are neither computed
        again nor booked, as in a live session that holds its cache. The kept caches count against
        the memory budget and are the first to go when a turn needs the room; all go when the
        block ends, unless it shelves them.

        Parameters
        ----------
        shelve : str, optional
            Keep the block's ended sessions after it, under this name, for a later block that
            reuses them; nothing else seeds from them meanwhile (another method's live session on
            the same question computes and books its prompt). They still count against the budget
            and go first.
        reuse : str, optional
            Start the block with the sessions shelved under this name (taken off the shelf).
        """
        outer = self._ended is not None
        if outer and (shelve or reuse):
            raise RuntimeError("keep_ended: shelve and reuse belong to the outermost block")
        if not outer:
            self._ended = self._shelves.pop(reuse, {}) if reuse else {}
        try:
            yield self
        finally:
            if not outer:
                if shelve and self._ended:
                    self._shelves[shelve] = self._ended
                self._ended = None

    def forget_prefix(self) -> None:
        """Drop the kept shared prefix (benchmarks: every repetition computes it afresh)."""
        self._template = None

    def _share_prefix(self, sessions: list[Any]) -> dict[int, list[tuple[int, int]]]:
        """Seed sessions with the keys/values of prefixes they share.

        Sessions matching the kept prefix take its first tokens. The others, if two or more
        share ``min_prefix`` tokens, get that common prefix computed once (one batch-1 forward
        pass); a lone one gets its own prompt but the last token computed the same way, kept for
        the next sessions (one-at-a-time calls). Then rows whose tokens extend one another
        (S2G's probes of one session's states) share the longest one's keys/values
        (:func:`ragfast.models.prefix_share.share_nested`). Each session keeps at least one
        token to compute, whose logits start its turn.

        Returns
        -------
        dict
            Row -> ``[(tokens, past), ...]``: what was computed here for the chunk, booked by that
            row's ledger entry.
        """
        paid: dict[int, list[tuple[int, int]]] = {}
        cold = [b for b, s in enumerate(sessions) if s.kv is None and len(s.ids) > self.min_prefix]
        rest = [b for b in cold if not self._seed(sessions[b])]
        if rest:
            first = sessions[rest[0]].ids
            n = len(first) - 1
            for b in rest[1:]:
                n = min(n, common_prefix(first, sessions[b].ids), len(sessions[b].ids) - 1)
            if len(rest) == 1 or n < self.min_prefix:
                # Nothing shared inside this chunk: the first one's prompt becomes the kept prefix.
                n = len(first) - 1
            prefix = list(first[:n])
            self._template = (prefix, extend_kv(self.model, self.config, prefix, None, self.device))
            self.stats["prefix_tokens_computed"] += n
            for b in rest:
                self._seed(sessions[b], count=b != rest[0])
            paid[rest[0]] = [(n, 0)]
        for b, more in share_nested(self.model, self.config, sessions, self.min_prefix, self.device,
                                    self.stats).items():
            paid.setdefault(b, []).extend(more)
        return paid

    def _seed_ended(self, sess: Any) -> bool:
        """Give a session the keys/values it shares with the ended session of its prompt (:meth:`keep_ended`)."""
        ended = (self._ended or {}).get(sess.prompt)
        if ended is None or sess.ids[:len(sess.prompt)] != list(sess.prompt):
            return False
        ids, kv = ended
        m = min(common_prefix(ids, sess.ids), len(sess.ids) - 1)
        if m < self.min_prefix:
            return False
        sess.kv = [(k[:, :m], v[:, :m]) for k, v in kv]
        sess.n_cached = m
        self.stats["prefix_tokens_reused"] += m
        return True

    def _seed(self, sess: Any, count: bool = True) -> bool:
        """Give a session the kept prefix's keys/values for the tokens they share; False if too few."""
        if self._template is None:
            return False
        ids, kv = self._template
        m = min(common_prefix(ids, sess.ids), len(sess.ids) - 1)
        if m < self.min_prefix:
            return False
        sess.kv = [(k[:, :m], v[:, :m]) for k, v in kv]
        sess.n_cached = m
        if count:
            self.stats["prefix_tokens_reused"] += m
        return True


"""Planning a local generator's chunks against its memory budget.

:class:`ChunkBudget` is the part of :class:`~ragfast.models.generator.HFGenerator` that decides how
many sessions a chunk of a turn runs: the bytes the open sessions' kept keys/values hold (and the
kept prefix's, and inside ``keep_ended`` the ended sessions'), each chunk's peak by
:class:`~ragfast.models.memory_budget.GenerationBytes`, and what gives way when a turn does not
fit (ended sessions' caches first, then other sessions' kept caches, largest first).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

from ragfast.errors import MemoryBudgetError
from ragfast.models.memory_budget import auto_budget, format_size, held_bytes

log = logging.getLogger("ragfast.models.generator")  # the generator's messages, under its logger

__all__ = ["ChunkBudget"]

class ChunkBudget:
    """Mixin of :class:`~ragfast.models.generator.HFGenerator`: its memory budget's planning.

    It reads the generator's ``_sessions`` (``ids``, ``n_cached``, ``kv``), ``_template``,
    ``_ended``, ``_shelves``, ``_budget`` / ``_budget_note``, ``bytes``, ``device``, ``max_batch``,
    ``kv_reuse``, ``share_prefix``, ``min_prefix``, ``kv_step``, ``prefill_tokens``, ``last_chunks``, ``_seed``
    and ``_running_bytes`` (the running batch at its planned largest), and writes ``stats``,
    ``budget_note`` and ``_smallest_said``.
    """

    _budget: int | None
    _budget_note: str
    _sessions: dict[str, Any]
    _template: Any
    _ended: Any
    _shelves: dict[str, Any]
    _smallest_said: int | None
    stats: dict[str, int]
    last_chunks: list[int]
    budget_note: str

    def budget_bytes(self) -> int | None:
        """The memory budget in bytes (None: none); ``auto`` is measured on the first call."""
        if not self._budget_note:
            self._budget, self._budget_note = auto_budget(self.device)
            log.debug("reasoner memory budget %s (%s)", format_size(self._budget), self._budget_note)
        return self._budget

    def _held(self, running: bool = True) -> tuple[int, dict[str, int]]:
        # The kept prefix and the ended sessions' caches are no session's own: dropping a session
        # frees none of their storage (_fit drops the ended ones first, all at once). The running
        # batch counts at its planned largest (its rows may write their whole turns).
        kept = [*(self._ended or {}).values(), *(v for shelf in self._shelves.values() for v in shelf.values())]
        shared = [p for _, kv in kept for p in kv]
        if self._template is not None:
            shared += self._template[1]
        held, own = held_bytes({sid: s.kv for sid, s in self._sessions.items()}, shared)
        return held + (self._running_bytes() if running else 0), own

    def _peaks(self, todo: list[str], max_new: int, held: int, own: Mapping[str, int]) -> list[int]:
        """The most bytes each chunk ``todo[:b]`` may reach, b = 1, 2, ... (a session without a cache
        may be seeded with a prefix computed in its chunk: its tokens count as cached and as new)."""
        spans = []
        for sid in todo:
            s = self._sessions[sid]
            past = s.n_cached
            if s.kv is None and self.kv_reuse and self.share_prefix and len(s.ids) > self.min_prefix:
                past = len(s.ids) - 1
            spans.append((past, len(s.ids) - s.n_cached, own.get(sid, 0)))
        return self.bytes.chunk_peaks(spans, max_new, self.kv_step, held, self.prefill_tokens)

    def _fit(self, todo: list[str], max_new: int, beside: bool = False) -> int:
        """How many of ``todo``'s first sessions the next chunk runs: at most ``max_batch``, and only as
        many as fit the memory budget. ``beside``: beside running rows, where 0 means waiting for
        room (nothing is dropped to make it).

        Raises
        ------
        MemoryBudgetError
            When one session's turn alone does not fit, after dropping every other kept cache.
        """
        n = min(self.max_batch, len(todo))
        budget = self.budget_bytes()
        if budget is None:
            return n
        held, own = self._held()
        peaks = self._peaks(todo[:n], max_new, held, own)
        k = max((b for b, need in enumerate(peaks, 1) if need <= budget), default=0)
        if beside and not k:
            return 0
        if k < n and (self._ended or self._shelves) and not beside:
            # ended sessions' caches (kept or shelved) only save work; a turn's rows come first
            if self._ended:
                self._ended.clear()
            self._shelves.clear()
            held, own = self._held()
            peaks = self._peaks(todo[:n], max_new, held, own)
            k = max((b for b, need in enumerate(peaks, 1) if need <= budget), default=0)
        if k == 0:
            held, own = self._make_room(todo, max_new, budget, held, own)
            peaks = self._peaks(todo[:n], max_new, held, own)
            k = max((b for b, need in enumerate(peaks, 1) if need <= budget), default=1)
        self.stats["planned_peak_bytes"] = max(self.stats["planned_peak_bytes"], peaks[k - 1])
        return k

    def _make_room(self, todo: list[str], max_new: int, budget: int, held: int,
                   own: dict[str, int]) -> tuple[int, dict[str, int]]:
        """Drop the largest kept caches of other sessions until ``todo[0]``'s turn fits (they are computed
        again at their next turn): sessions of later chunks last, as they need theirs soonest."""
        first, later = todo[0], set(todo)
        victims = sorted((i for i in own if i != first and own[i] > 0), key=lambda i: (i in later, -own[i]))
        dropped = freed = 0
        need = self._peaks(todo[:1], max_new, held, own)[0]
        for sid in victims:
            if need <= budget:
                break
            sess = self._sessions[sid]
            sess.kv, sess.n_cached = None, 0
            if self.kv_reuse and self.share_prefix:
                self._seed(sess)  # the kept prefix stays (shared, it costs nothing more)
            held, freed, dropped = held - own[sid], freed + own[sid], dropped + 1
            own[sid] = 0
            need = self._peaks(todo[:1], max_new, held, own)[0]
        if need > budget:
            sess = self._sessions[first]
            raise MemoryBudgetError(
                f"reasoner memory budget {format_size(budget)} ({self._budget_note}) is too small for one session's "
                f"turn: session {first!r} ({len(sess.ids)} tokens, up to {max_new} new) may need "
                f"{format_size(need)}; raise --memory-budget, or lower --prompt-budget or --max-new-tokens")
        if dropped:
            self.stats["caches_dropped_for_memory"] += dropped
            log.warning("reasoner memory budget %s: the open sessions' kept keys/values leave no room for a turn; "
                        "dropped those of %d session(s) (%s), computed again at their next turn", format_size(budget),
                        dropped, format_size(freed))
        return held, own

    def _say_shrunk(self, n: int) -> None:
        """One log line when the budget split a call into smaller chunks than ``max_batch`` (at INFO the
        first time and whenever the chunks get smaller than announced before; DEBUG otherwise)."""
        small = min(self.last_chunks)
        self.stats["shrunk_calls"] += 1
        self.stats["smallest_chunk"] = min(self.stats["smallest_chunk"] or small, small)
        sizes = ", ".join(map(str, self.last_chunks[:8])) + (", ..." if len(self.last_chunks) > 8 else "")
        self.budget_note = f"memory budget: chunks of {sizes}"
        msg = (f"reasoner memory budget {format_size(self._budget)}: {n} sessions ran in chunks of {sizes} instead of "
               f"{min(n, self.max_batch)} at once (kept keys/values now {format_size(self._held()[0])})")
        level = logging.INFO if self._smallest_said is None or small < self._smallest_said else logging.DEBUG
        self._smallest_said = small if level == logging.INFO else self._smallest_said
        log.log(level, msg)

    def _note_kv(self, n: int) -> None:
        self.stats["kv_peak_bytes"] = max(self.stats["kv_peak_bytes"], int(n))

"""The rows an :class:`~ragfast.models.generator.HFGenerator` decodes together, across its calls.

A Search-R1 turn ends at ``</search>``, ``</answer>``, EOS or 500 tokens, so the rows of one
batched call finish at very different steps: on the default bench one row in twenty wrote 500
tokens while the other nineteen waited for it, and the run took as many decode steps as its
slowest question's turns added up. The generator therefore keeps one running batch: a call
admits its sessions into it as room frees (continuous batching), and a call made with
``partial=True`` returns once some rows have finished, leaving the others decoding: the next
call goes on with them beside whatever it admits (the Search-R1 loop's next turns).

:class:`Row` is one session's turn in progress (its tokens and what it has cost so far);
:class:`RunningBatch` the left-padded batch cache, its mask and the rows, in order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Row", "RunningBatch", "StopRule", "admit_count", "padded_inputs", "return_now", "share_time",
           "turn_figures"]


@dataclass(frozen=True)
class StopRule:
    """When a row's turn ends: a stop string, EOS, or ``max_new`` tokens, or once ``settled``.

    ``last_chars`` holds the stop strings' last characters (None: any token may end one): a stop
    string can only complete on a token whose text holds its last character, so the window
    decode is skipped on most steps. ``settled`` (one prompt's, from ``complete``) says of the
    text so far that its reader's outcome no longer depends on what would follow.
    """

    stop: tuple[str, ...]
    max_new: int
    window: int
    last_chars: frozenset[str] | None
    settled: Callable[[str], bool] | None = None

    @classmethod
    def of(cls, stop: Any, max_new: int) -> "StopRule":
        stop = tuple(stop)
        last = frozenset(x[-1] for x in stop if x)
        # Non-ASCII last characters may span several byte-level tokens: they always take the decode.
        return cls(stop, int(max_new), max((len(x) for x in stop), default=0) + 2,
                   None if any(not c.isascii() for c in last) else last)


@dataclass(eq=False)
class Row:
    """One session's turn in the running batch.

    Attributes
    ----------
    sid : str
    rule : StopRule
    base : int
        The session's length when the turn began (its tokens before the generated ones).
    n_past, n_new : int
        Tokens cached and computed by the turn's first pass (the ledger's cached and input tokens).
    paid : list of (int, int)
        Shared-prefix passes this row pays for: (tokens, past) each.
    gen : list of int
        Tokens generated so far (the last one not yet fed to the model).
    pos : int
        Position of the next token fed.
    seconds, device_seconds : float
        This turn's share of the calls it ran in so far.
    passes : list of (int, int)
        (tokens, past) of the passes it took in the current call (its share of the call's time).
    drafted : list of (int, int, int)
        (tokens fed, past, positions kept: its picked token and the drafts it kept) of its passes
        with draft tokens (:mod:`~ragfast.models.drafts`).
    """

    sid: str
    rule: StopRule
    base: int
    n_past: int
    n_new: int
    paid: list[tuple[int, int]] = field(default_factory=list)
    gen: list[int] = field(default_factory=list)
    pos: int = 0
    seconds: float = 0.0
    device_seconds: float = 0.0
    passes: list[tuple[int, int]] = field(default_factory=list)
    drafted: list[tuple[int, int, int]] = field(default_factory=list)
    kept: Any = None  # its keys/values once cut out of the batch (per layer, [kv_heads, n, head_dim])

    def left(self) -> int:
        """Tokens it may still write."""
        return self.rule.max_new - len(self.gen)


@dataclass(eq=False)
class RunningBatch:
    """A left-padded batch cache, its mask and its rows, between decode steps.

    Exactly one of ``last`` (logits ``[rows, vocab]`` to pick from) and ``nxt`` (picked tokens
    ``[rows]`` not yet fed) is set while rows remain. ``mergeable``: the cache's layers are
    buffered (:func:`ragfast.models.kv_buffer.merge_left_padded` can add rows to it).
    """

    cache: Any
    mask: Any
    rows: list[Row]
    mergeable: bool
    last: Any = None
    nxt: Any = None

    def index(self, sids: Any) -> list[int]:
        """Batch rows of the given session ids, in batch order."""
        want = set(sids)
        return [r for r, row in enumerate(self.rows) if row.sid in want]

    def cut(self, gone: list[int], keep_kv: bool) -> list[Row]:
        """Take batch rows ``gone`` out (each with its keys/values as ``row.kept`` when ``keep_kv``)."""
        import torch

        from ragfast.models.kv_buffer import cut_rows

        kv, order = cut_rows(self.cache, self.mask, gone, [keep_kv] * len(gone))
        out = [self.rows[r] for r in gone]
        for row, k in zip(out, kv):
            row.kept = k
        self.rows = [self.rows[r] for r in order]
        idx = torch.tensor(order, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask[idx]
        self.nxt = self.nxt[idx] if self.nxt is not None and order else None
        self.last = self.last[idx] if self.last is not None and order else None
        return out

    def planned_bytes(self, kv_per_token: int) -> int:
        """Its keys/values once every row has written its whole turn (for the memory plan)."""
        if not self.rows:
            return 0
        return kv_per_token * len(self.rows) * (int(self.mask.shape[1]) + max(r.left() for r in self.rows))


def share_time(config: Any, rows: list[Row], seconds: float, device_seconds: float) -> None:
    """Split a call's time over the rows it ran, in proportion to the FLOPs each computed in it
    (``row.passes``, emptied here)."""
    from ragfast.accounting.flops import forward_flops_per_sequence

    w = [sum(forward_flops_per_sequence(config, [n for n, _ in r.passes], [p for _, p in r.passes], logits="last"))
         if r.passes else 0.0 for r in rows]
    tot = sum(w)
    for r, x in zip(rows, w):
        share = x / tot if tot > 0 else 1.0 / len(rows)
        r.seconds += seconds * share
        r.device_seconds += device_seconds * share
        r.passes = []


def turn_figures(config: Any, row: Row, weight_bytes: int) -> tuple[int, int, int, float, float, int]:
    """A finished turn's ledger figures: input, cached and output tokens, FLOPs, FLOPs with
    nothing cached, and weight bytes read.

    The same whatever calls and batches the turn ran in: its first pass (``n_new`` tokens after
    ``n_past`` cached), one pass per further token except those a drafted pass kept (that pass
    computes every token it fed, with the logits of each), and the shared-prefix passes it pays
    for. Weight bytes as search books its bytes: what the row alone reads, the weights once per
    forward pass it takes, so the figure shows the weight precision (int8 reads a quarter of
    fp32's bytes).
    """
    from ragfast.accounting.flops import completion_flops, forward_flops_per_sequence

    n_past, n_new, n_out = row.n_past, row.n_new, len(row.gen)
    first = n_past + n_new  # position of the first generated token, fed by the first decode pass
    covered = {p + j for _, p, kept in row.drafted for j in range(kept)}
    pasts = [n_past] + [first + j for j in range(n_out - 1) if first + j not in covered]
    chunks = [n_new] + [1] * (len(pasts) - 1)
    fresh, cached, paid = n_new, n_past, 0.0
    for n_b, past_b in row.paid:
        # This row pays for keys/values computed once for its admission (decoder only, no lm head).
        paid += forward_flops_per_sequence(config, [n_b], [past_b], head="none")[0]
        fresh, cached = fresh + n_b, cached - n_b
    flops = paid + sum(forward_flops_per_sequence(config, chunks, pasts, logits="last"))
    flops += sum(forward_flops_per_sequence(config, [t], [p], logits="all")[0] for t, p, _ in row.drafted)
    # the same call with nothing cached: what the URL backend books as the cache-independent figure
    uncached = completion_flops(config, n_past + n_new, 0, n_out)
    return fresh, cached, n_out, flops, uncached, weight_bytes * (len(chunks) + len(row.drafted) + len(row.paid))


def padded_inputs(n_past: list[int], fresh: list[list[int]], pad_id: int) -> tuple[Any, Any, Any]:
    """Input ids ``[B, F]``, attention mask ``[B, P + F]`` and positions ``[B, F]`` of a left-padded
    prefill: row b is ``[pad | cache_b][pad | new_b]`` (P, F: the most cached and new tokens).
    Built on the host, to be moved once rather than one small copy per row."""
    import torch

    B, P, F = len(fresh), max(n_past), max(len(f) for f in fresh)
    input_ids = torch.full((B, F), pad_id, dtype=torch.long)
    mask = torch.zeros((B, P + F), dtype=torch.long)
    pos = torch.zeros((B, F), dtype=torch.long)
    for b, (np_, f) in enumerate(zip(n_past, fresh)):
        input_ids[b, F - len(f):] = torch.tensor(f, dtype=torch.long)
        mask[b, P - np_:P] = 1
        mask[b, P + F - len(f):] = 1
        pos[b, F - len(f):] = torch.arange(np_, np_ + len(f))
    return input_ids, mask, pos


def admit_count(run: RunningBatch | None, waiting: int, max_batch: int) -> int:
    """How many waiting sessions to admit now: all that fit an empty batch; beside running rows,
    none until a quarter of ``max_batch`` is free (or all that wait fit), since each admission
    copies the running batch's cache once."""
    if not waiting:
        return 0
    free = max_batch - (len(run.rows) if run is not None else 0)
    if run is None or not run.rows:
        return min(free, waiting)
    if free <= 0 or not run.mergeable or free < min(waiting, max(1, max_batch // 4)):
        return 0
    return min(free, waiting)


def return_now(finished: int, running: int, steps_since: int) -> bool:
    """Whether a partial call returns: when no row runs, an eighth of the rows have finished, or
    one finished row has waited 16 steps; its next turn (retrieval, observation, prefill) then
    joins the batch without holding it up for long."""
    return running == 0 or finished >= max(1, (finished + running) // 8) or steps_since >= 16

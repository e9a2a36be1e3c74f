"""Draft tokens looked up in a row's own context and checked in one pass (prompt-lookup decoding).

A Search-R1 turn copies much of what it has read: titles and phrases of its ``<information>``
blocks, the question into ``<search>``, the shape of its own earlier turns ("Doc 1 (...) does
not answer it ..."); and a turn that runs to 500 tokens is a loop repeating one phrase. The
tokens that followed the latest earlier occurrence of a row's last few tokens are therefore
often the next ones: replayed over the default bench's 20 Search-R1 test questions (5,758
generated tokens of the trained 0.5B reasoner), five such tokens gave 2.9 tokens per pass.

When few rows decode (a call's tail: one row took 717 of the 1,159 decode steps of that run,
at 33 ms each on an AMD EPYC Zen 4), each row feeds its picked token and up to
:data:`DRAFT_TOKENS` looked-up tokens in one pass, which costs little more than a one-token
step while it is bound by reading the weights, and less than the steps it replaces up to a few
rows (:data:`DRAFT_ROWS`). The pass's greedy picks
accept a row's drafts up to the first that differs. The batch cache drops the columns no row
kept; a row's rejected drafts stay as masked columns (the mask may hold padding between a
row's tokens, as between a cache and new tokens) until the row is cut out. The kept tokens are
what step-by-step greedy decoding picks (the same positions over the same tokens; only the
matmul shapes differ, as between batch sizes).

:func:`propose` looks a draft up (pure: tokens in, tokens out); :func:`settle` takes a pass's
picks and appends the tokens each row accepted.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["DRAFT_ROWS", "DRAFT_TOKENS", "NGRAM", "draft_width", "propose", "settle"]

#: Draft tokens a row feeds beside its picked token. Five: replayed on the bench's test questions,
#: 3 / 5 / 7 drafts gave 2.41 / 2.88 / 3.13 tokens a pass, and one-row passes of 4 / 6 / 8 tokens
#: took 37.1 / 37.3 / 41.8 ms (Qwen2.5-Coder-0.5B w8a8, 1,500 cached tokens, two threads, AMD EPYC
#: Zen 4): 12.9 ms a token at five against 13.4 at seven and 15.4 at three.
DRAFT_TOKENS = 5
#: Most rows a drafted pass serves. A pass of several tokens a row costs little more than a step
#: only while it is bound by reading the weights: one row 37 ms for six tokens against 32 for one,
#: two rows 52 against 37. Past that it is bound by the packed int8 product: once the prefill
#: attention packed the heads of a few queries into its lanes (stop 62), six tokens a row took 70.5
#: ms at four rows against 35.1 for one (~2.9 tokens a pass: 1.4x the tokens per ms), 117 at eight
#: against 43 (1.06x), 215 at sixteen against 65 (0.7x) (Qwen2.5-Coder-0.5B w8a8, 1,200 cached
#: tokens, two threads, AMD EPYC Zen 4).
DRAFT_ROWS = 4
#: Longest suffix (tokens) looked up; shorter ones are tried when it has no earlier occurrence.
NGRAM = 3


def draft_width(rows: int, k: int) -> int:
    """Drafts per row in a pass of ``rows`` rows: ``k`` up to :data:`DRAFT_ROWS` rows, else none."""
    return max(0, k) if rows <= DRAFT_ROWS else 0


def propose(ctx: Sequence[int] | np.ndarray, k: int, ngram: int = NGRAM) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of ``ctx``'s last tokens.

    The longest suffix of ``ngram`` tokens down to one that occurs earlier in ``ctx`` decides.
    When what followed it runs into the end of ``ctx`` (a loop: the occurrence is a period
    back), the draft repeats it. No occurrence (or ``k`` < 1): an empty draft.
    """
    a = np.asarray(ctx)
    L = a.size
    if k < 1:
        return []
    for n in range(min(ngram, L - 1), 0, -1):
        hit = a[:L - n] == a[L - n]
        for j in range(1, n):
            hit &= a[j:L - n + j] == a[L - n + j]
        where = np.flatnonzero(hit)
        if where.size:
            # what followed, up to the end; a loop (the match overlaps the suffix) goes round again
            seg = a[int(where[-1]) + n:]
            return np.tile(seg, -(-k // seg.size))[:k].tolist()
    return []


def settle(gens: Sequence[list[int]], drafts: Sequence[Sequence[int]], picks: Any,
           ends: Callable[[int, list[int]], bool]) -> list[int]:
    """Take one drafted pass's greedy picks: how many drafts each row keeps, appended to its tokens.

    Parameters
    ----------
    gens : sequence of list of int
        Each row's generated tokens; its last one was fed first in the pass, its draft after it.
    drafts : sequence of sequence of int
        Each row's draft (may be empty).
    picks : sequence of sequence of int
        ``picks[r][j]``: row ``r``'s greedy token after its ``j``-th fed token.
    ends : callable
        ``ends(r, tokens)``: whether row ``r``'s tokens end its turn at their last one (stop
        string, EOS, length).

    Returns
    -------
    list of int
        Per row, the drafts it accepted (equal to its picks) up to the first that ends its turn,
        which is left out: the next pick takes it from the logits after the kept drafts, and the
        turn ends there as it would step by step. ``gens[r]`` gets its kept drafts.
    """
    keeps = []
    for r, (gen, d, p) in enumerate(zip(gens, drafts, picks)):
        a = 0
        while a < len(d) and d[a] == p[a]:
            gen.append(d[a])
            if ends(r, gen):
                gen.pop()
                break
            a += 1
        keeps.append(a)
    return keeps

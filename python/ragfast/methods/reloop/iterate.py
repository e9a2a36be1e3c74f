"""The guided, budget-aware iterator: per-question tracks, read in batched sliding-window steps."""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger, CostRecord
from ragfast.errors import blame
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.methods.reloop.workspace import Workspace
from ragfast.judges.base import Judge
from ragfast.methods.reloop.plan import Plan
from ragfast.text import EXTENDED_STOPWORDS, NAME_SPAN_PATTERN, content_words, whitespace_tokens, words
from ragfast.types import State

__all__ = ["Track", "CachedEncoding", "iterate"]


@dataclass
class Track:
    """One question's iterator state: what it has read, its budget use, its step log."""

    ws: Workspace
    plan: Plan
    selected: list[int] = field(default_factory=list)   # positions in ws.cand, read order
    context: list[int] = field(default_factory=list)    # extra seq rows pulled in by expansion
    tokens: int = 0
    steps: int = 0
    stop_reason: str = ""
    step_log: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False

    def evidence(self) -> list[str]:
        ws = self.ws
        out = [ws.views[p] for p in self.selected]
        for r in self.context:
            out.append(_context_view(ws, r))
        return out


def _context_view(ws: Workspace, row: int) -> str:
    seq = ws.seq
    if ws.kind == "text":
        return f"{seq.sources[int(seq.doc[row])]['title']}: {seq.contents[row].strip()}"
    if seq.level_name(row) == "cell":
        m = seq.meta[row]
        return f"{m['row_header']} | {m['col_header']}: {seq.contents[row].strip()}"
    return seq.contents[row].strip()


def _expansion_rows(ws: Workspace, row: int) -> list[int]:
    """Structural context of a read segment, via the vectorised neighbour ops.

    A sentence brings the lead sentence of its paragraph (which names what "it"/"he" refers
    to); a cell brings its row's label cell (column 0), since the view already carries the
    headers as text but the pack should point at the cells themselves.
    """
    seq = ws.seq
    r = np.asarray([row], dtype=np.int64)
    if seq.level_name(row) == "sentence":
        sib, _ = seq.siblings(r)
        return [int(s) for s in sib if seq.meta[s].get("sent_index") == 0]
    if seq.level_name(row) == "cell":
        same, _ = seq.same_row(r)
        return [int(s) for s in same if seq.col[s] == 0 and seq.contents[s].strip()]
    return []


@dataclass
class CachedEncoding:
    """One workspace's candidate embeddings and the encoder cost of computing them.

    A question served from the cache is charged ``cost`` again, so its recorded encoder calls,
    tokens and FLOPs do not depend on which questions ran before it. Not counted as ``reused``:
    that counts only what the same question read before (:meth:`ragfast.accounting.ledger.CostLedger.first_reads`),
    and a question's workspace is encoded for it once.
    """

    emb: Any
    cost: CostRecord


# what a cache hit is charged: everything but time (a hit takes no compute)
_CHARGED = ("calls", "input_tokens", "cached_tokens", "output_tokens", "flops", "bytes_scanned", "unknown")


def _summed(records: Sequence[CostRecord]) -> CostRecord:
    out = CostRecord("encoder")
    for r in records:
        for k in _CHARGED:
            setattr(out, k, getattr(out, k) + getattr(r, k))
    return out


def _encode_candidates(tracks: Sequence[Track], encoder: Any, ledger: CostLedger | None,
                       cache: dict[str, CachedEncoding] | None) -> None:
    # Questions over the same document (TAT-QA has ~6 per report) share one encoding: within
    # the batch by key, and across batches through ``cache``. Each sharer is charged what the
    # encoding cost; not as reused, which would depend on which sharer ran first.
    texts: list[str] = []
    slots: list[str] = []
    fresh: list[Track] = []
    hits: list[tuple[Track, CachedEncoding]] = []
    shared: list[tuple[Track, str]] = []
    keys: set[str] = set()
    for t in tracks:
        if t.ws.emb is not None:
            continue  # encoded (and charged) by an earlier iterate call on this track
        key = t.ws.meta.get("cache_key")
        if cache is not None and key is not None and key in cache:
            hits.append((t, cache[key]))
        elif key is not None and key in keys:
            shared.append((t, key))
        else:
            if key is not None:
                keys.add(key)
            # the encoder records under one slot id per track, so each track's cost reads back
            slots += [str(len(fresh))] * len(t.ws.views)
            fresh.append(t)
            texts += t.ws.views
    first: dict[str, CachedEncoding] = {}
    if texts:
        scratch = CostLedger()
        with blame("encoder", [t.ws.qid for t in fresh]):
            emb = encoder.encode_passages(texts, ledger=scratch, question_ids=slots)
        pos = 0
        for k, t in enumerate(fresh):
            n = len(t.ws.views)
            t.ws.emb = emb[pos:pos + n]
            pos += n
            key = t.ws.meta.get("cache_key")
            if key is not None:
                first[key] = CachedEncoding(t.ws.emb, _summed([r for r in scratch.records if r.question_id == str(k)]))
                if cache is not None:
                    cache[key] = first[key]
        owner = {str(k): t.ws.qid for k, t in enumerate(fresh)}
        for r in scratch.records:
            r.question_id = owner.get(r.question_id, r.question_id)
        if ledger is not None:
            ledger.merge(scratch)
    # (a document with no candidates encodes nothing: its sharers stay empty, as their first did)
    for t, entry in hits + [(t, first[key]) for t, key in shared if key in first]:
        t.ws.emb = entry.emb
        if ledger is not None and entry.cost.calls:
            ledger.add("encoder", t.ws.qid, **{k: getattr(entry.cost, k) for k in _CHARGED})


def iterate(tracks: Sequence[Track], encoder: Any, judge: Judge, cfg: ReloopConfig, *,
            ledger: CostLedger | None = None, max_steps: int | None = None, extra_tokens: int = 0,
            emb_cache: dict[str, CachedEncoding] | None = None, topk_backend: str | None = None) -> None:
    """Run the guided sliding-window loop on every unfinished track, batched per step.

    Parameters
    ----------
    tracks : sequence of Track
        Per-question state; updated in place (selected segments, steps, stop reason).
    max_steps : int, optional
        Step cap for this call (the refinement passes a reduced one); never above
        ``cfg.max_steps`` in total.
    extra_tokens : int
        Token allowance on top of what a track holds, capped by ``cfg.max_tokens``.
    emb_cache : dict, optional
        Workspace ``meta["cache_key"]`` -> :class:`CachedEncoding`, kept across calls; a hit is
        charged to its question as if computed.
    """
    from ragfast.ops.topk_ip import topk_ip

    _encode_candidates(tracks, encoder, ledger, emb_cache)
    cap = cfg.max_steps if max_steps is None else min(cfg.max_steps, max_steps)
    start_steps = {id(t): t.steps for t in tracks}
    start_tokens = {id(t): t.tokens for t in tracks}
    active = [t for t in tracks if not t.done]
    for t in active:
        if len(t.ws.cand) == 0:
            t.done, t.stop_reason = True, "no candidates"
    active = [t for t in active if not t.done]
    while active:
        # step budget (checked before a step starts: a step is never begun past the cap)
        for t in active:
            if t.steps - start_steps[id(t)] >= cap or t.steps >= cfg.max_steps:
                t.done, t.stop_reason = True, "step budget"
        active = [t for t in active if not t.done]
        if not active:
            break
        covered = [set(e for e in t.plan.entities if _covered(e, t.evidence())) for t in active]
        queries = [t.plan.query(c, _bridges(t) if t.plan.hops >= 2 else ()) for t, c in zip(active, covered)]
        with blame("encoder", [t.ws.qid for t in active]):
            qv = encoder.encode_queries(queries, ledger=ledger, question_ids=[t.ws.qid for t in active])
        for j, t in enumerate(active):
            ws = t.ws
            n = len(ws.cand)
            avail = n - len(t.selected)
            if avail <= 0:
                t.done, t.stop_reason = True, "exhausted"
                continue
            w = min(cfg.window, avail)
            t0 = time.perf_counter()
            scores, ids = topk_ip(qv[j:j + 1], ws.emb, w, exclude=[t.selected] if t.selected else None,
                                  backend=topk_backend)
            if ledger is not None:
                # an exhaustive inner-product scan: one multiply-add per candidate and dimension
                ledger.add("search", ws.qid, seconds=time.perf_counter() - t0,
                           bytes_scanned=int(n * ws.emb.shape[1] * 4), flops=2.0 * n * ws.emb.shape[1])
            ids = [int(i) for i in ids[0].tolist() if i >= 0]
            sc = scores[0].tolist()[:len(ids)]
            # window re-ranking: dense score + guidance (mentions an uncovered plan entity) +
            # locality (same source as something already read)
            read_docs = {int(ws.seq.doc[ws.cand[p]]) for p in t.selected}
            todo = [e.lower() for e in t.plan.entities if e not in covered[j]]

            def bonus(p: int, s: float) -> float:
                v = ws.views[p].lower()
                b = 0.15 * sum(e in v for e in todo)
                if ws.kind == "text" and int(ws.seq.doc[ws.cand[p]]) in read_docs:
                    b += 0.05
                return s + b

            ranked = sorted(zip(ids, sc), key=lambda x: -bonus(*x))
            budget = cfg.max_tokens if extra_tokens <= 0 else min(cfg.max_tokens, start_tokens[id(t)] + extra_tokens)
            picked, added_ctx = [], []
            have_ctx = set(t.context) | {int(ws.cand[p]) for p in t.selected}
            for p, s in ranked:
                if len(picked) >= cfg.k:
                    break
                cost = whitespace_tokens(ws.views[p])
                if t.tokens + cost > budget:
                    continue
                t.selected.append(p)
                t.tokens += cost
                picked.append(p)
                have_ctx.add(int(ws.cand[p]))
                if cfg.expand:
                    for r in _expansion_rows(ws, int(ws.cand[p])):
                        if r in have_ctx:
                            continue
                        c = whitespace_tokens(_context_view(ws, r))
                        if t.tokens + c > budget:
                            continue
                        t.context.append(r)
                        t.tokens += c
                        have_ctx.add(r)
                        added_ctx.append(r)
            t.steps += 1
            t.step_log.append({"step": t.steps, "query": queries[j], "window": [ws.seq.ids[ws.cand[p]] for p in ids],
                               "read": [ws.seq.ids[ws.cand[p]] for p in picked],
                               "context": [ws.seq.ids[r] for r in added_ctx], "tokens": t.tokens})
            if not picked:
                t.done, t.stop_reason = True, "token budget"
        active = [t for t in active if not t.done]
        if not active:
            break
        states = [State(t.ws.question, t.evidence(), t.ws.qid, t.steps) for t in active]
        with blame("judge", [t.ws.qid for t in active]):
            s = judge.stop_scores(states, ledger=ledger, question_ids=[t.ws.qid for t in active])
        for t, v in zip(active, np.asarray(s, dtype=np.float64)):
            t.step_log[-1]["stop_score"] = None if math.isnan(v) else float(v)
            if not math.isnan(v) and v >= cfg.judge_threshold:
                t.done, t.stop_reason = True, "sufficient"
        active = [t for t in active if not t.done]


def _bridges(t: "Track", n: int = 2) -> list[str]:
    """Names in the read evidence that the question does not mention: the likely bridge of a
    multi-hop question (the band behind the album, the director behind the film)."""
    qwords = set(words(t.ws.question))
    counts: dict[str, int] = {}
    for ev in t.evidence():
        body = ev.split(": ", 1)[1] if ": " in ev else ev
        for m in NAME_SPAN_PATTERN.finditer(body):
            span = m.group(0).strip(" .,")
            w = set(words(span))
            if len(span) > 2 and w and not w <= qwords and not w <= EXTENDED_STOPWORDS and not re.search(r"\d", span):
                counts[span] = counts.get(span, 0) + 1
    return sorted(counts, key=lambda x: -counts[x])[:n]


def _covered(entity: str, evidence: Sequence[str]) -> bool:
    ew = content_words(entity, EXTENDED_STOPWORDS, min_len=2) or words(entity)
    seen = set(words(" ".join(evidence)))
    return bool(ew) and sum(w in seen for w in ew) >= 0.6 * len(ew)

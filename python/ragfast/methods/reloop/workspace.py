"""Workspaces: one question's evidence HSEQ and the candidate segments the iterator may read."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ragfast.errors import DataError
from ragfast.methods.reloop.hseq import HSeq, from_tatqa, from_text
from ragfast.types import Question

__all__ = ["Workspace", "text_workspace", "tatqa_workspace", "workspace_key"]


@dataclass
class Workspace:
    """One question's evidence sequence and candidates.

    ``cand`` are the rows of ``seq`` the iterator may read; ``views[i]`` is the text encoded for
    ``cand[i]`` (a cell reads "row header | column header: value"); ``emb`` their vectors.
    """

    qid: str
    question: str
    golden_answers: list[str]
    seq: HSeq
    cand: np.ndarray
    views: list[str]
    kind: str  # "text" | "tatqa"
    emb: Any = None
    meta: dict[str, Any] = field(default_factory=dict)


def text_workspace(q: Question) -> Workspace:
    """HotpotQA-style question: its context paragraphs become one HSEQ of text documents."""
    ctx = q.metadata.get("context")
    if not isinstance(ctx, dict) or not ctx.get("title"):
        raise DataError(f"question {q.id!r}: no metadata['context'] (titles + sentences) to read evidence from")
    parts, seen = [], set()
    for j, (title, sents) in enumerate(zip(ctx["title"], ctx["sentences"])):
        doc_id = title if title not in seen else f"{title}#{j}"
        seen.add(doc_id)
        parts.append(from_text(doc_id, title, "".join(sents), sentences=sents))
    seq = HSeq.concat(parts)
    cand = seq.where("sentence")
    cand = cand[[bool(seq.contents[i].strip()) for i in cand]] if len(cand) else cand
    views = [f"{seq.sources[int(seq.doc[i])]['title']}: {seq.contents[i].strip()}" for i in cand]
    return Workspace(q.id, q.question, list(q.golden_answers), seq, cand, views, "text")


def tatqa_workspace(q: Question, doc: dict[str, Any]) -> Workspace:
    """TAT-QA question: its document's table and paragraphs become one HSEQ."""
    seq = from_tatqa(doc)
    cells = seq.where("cell")
    keep = [i for i in cells if seq.contents[i].strip() and not seq.meta[i]["header"] and seq.col[i] > 0]
    sents = [i for i in seq.where("sentence") if seq.contents[i].strip()]
    cand = np.asarray(keep + sents, dtype=np.int64)
    views = []
    for i in cand:
        if seq.level_name(i) == "cell":
            m = seq.meta[i]
            views.append(f"{m['row_header']} | {m['col_header']}: {seq.contents[i].strip()}")
        else:
            views.append(seq.contents[i].strip())
    return Workspace(q.id, q.question, list(q.golden_answers), seq, cand, views, "tatqa",
                     meta={"scale": q.metadata.get("scale"), "answer_type": q.metadata.get("answer_type"),
                           "answer_from": q.metadata.get("answer_from")})

def workspace_key(doc: dict[str, Any]) -> str:
    """A cache key for a TAT-QA document's candidate embeddings (questions of one doc share them)."""
    return hashlib.sha1(json.dumps([doc.get("table"), doc.get("paragraphs")], sort_keys=True).encode()).hexdigest()

"""HSEQ's builders (text, TAT-QA, knowledge-graph triples) and their exact reversal, :func:`to_source`.

Each builder accumulates rows in a :class:`_Builder` and hands them to :class:`HSeq` at once;
text is split into paragraphs and sentences here (:func:`split_sentences`), so that joining the
segments gives the source back byte for byte (:mod:`ragfast.methods.reloop.hseq.core`).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

import numpy as np

from ragfast.errors import DataError
from ragfast.methods.reloop.hseq.core import LEVEL_CODE, HSeq, KGraph, check_str

__all__ = ["split_sentences", "from_text", "from_tatqa", "from_triples", "to_source"]


# ---------------------------------------------------------------------------------------------
# sentence splitting
# ---------------------------------------------------------------------------------------------
# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) before whitespace and
# an upper-case letter, digit or opening quote. Common abbreviations are not ends.
_SENT_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+(?=[\"'\u201c\u2018(\[]?[A-Z0-9])")
_ABBREV = re.compile(r"(?:\b(?:Mr|Mrs|Ms|Dr|Prof|Sr|Jr|St|vs|etc|Inc|Ltd|Co|Corp|No|U\.S|e\.g|i\.e|approx|Jan|Feb|Mar|Apr|"
                     r"Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)|\b[A-Z])\.$")


def split_sentences(text: str) -> list[tuple[int, int]]:
    """Split ``text`` into sentence spans that partition it exactly.

    Each span keeps the whitespace after its sentence, so ``"".join(text[s:e] for s, e in
    spans) == text``. An empty text gives no spans.
    """
    if not text:
        return []
    spans = []
    start = 0
    for m in _SENT_END.finditer(text):
        end_punct = m.start() + 1
        if _ABBREV.search(text[max(start, end_punct - 12):end_punct]):
            continue
        spans.append((start, m.end()))
        start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans


def _paragraph_spans(text: str) -> list[tuple[int, int]]:
    """Paragraphs = runs of text up to and including their newline run; they partition the text."""
    if not text:
        return []
    spans = []
    start = 0
    for m in re.finditer(r"\n+", text):
        # a leading newline run joins the first paragraph, a trailing one the last
        if m.start() > start and m.end() < len(text):
            spans.append((start, m.end()))
            start = m.end()
    if start < len(text):
        spans.append((start, len(text)))
    return spans



# ---------------------------------------------------------------------------------------------
# adapters
# ---------------------------------------------------------------------------------------------
class _Builder:
    """Row-wise accumulation of segments for one adapter call."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.contents: list[str] = []
        self.meta: list[dict[str, Any]] = []
        self.cols: dict[str, list[int]] = {c: [] for c in HSeq.INT_COLS}

    def add(self, seg_id: str, level: str, parent: int, content: str, meta: dict[str, Any] | None = None,
            **cols: int) -> int:
        self.ids.append(seg_id)
        self.contents.append(content)
        self.meta.append(meta or {})
        self.cols["level"].append(LEVEL_CODE[level])
        self.cols["parent"].append(parent)
        for c in HSeq.INT_COLS[2:]:
            self.cols[c].append(cols.get(c, -1))
        return len(self.ids) - 1

    def build(self, sources: list[dict[str, Any]]) -> HSeq:
        return HSeq(self.ids, self.contents, self.meta, sources,
                    **{c: np.asarray(v, dtype=np.int64) for c, v in self.cols.items()})


def _add_text(b: _Builder, prefix: str, parent: int, text: str, base_level: str,
              sentences: Sequence[str] | None, where: str) -> None:
    """Paragraph and sentence segments of ``text`` under ``parent`` (offsets relative to ``text``)."""
    if sentences is not None:
        # Caller-given sentence boundaries (HotpotQA's own, which its supporting facts index):
        # they must tile the text exactly; newlines inside them still start paragraphs.
        sents = [check_str(s, f"{where}: sentence {i}") for i, s in enumerate(sentences)]
        if "".join(sents) != text:
            raise DataError(f"{where}: the given sentences do not concatenate to the text")
        spans, pos = [], 0
        for s in sents:
            spans.append((pos, pos + len(s)))
            pos += len(s)
        para_spans = [(0, len(text))] if text else []
        sent_by_para = [spans] if text else []
    else:
        para_spans = _paragraph_spans(text)
        sent_by_para = [[(ps + s, ps + e) for s, e in split_sentences(text[ps:pe])] for ps, pe in para_spans]
    for pi, ((ps, pe), sspans) in enumerate(zip(para_spans, sent_by_para)):
        p = b.add(f"{prefix}/p{pi}", base_level, parent, text[ps:pe], None, doc=0, start=ps, end=pe)
        for si, (ss, se) in enumerate(sspans):
            b.add(f"{prefix}/p{pi}/s{si}", "sentence", p, text[ss:se], {"sent_index": si}, doc=0, start=ss, end=se)


def from_text(doc_id: str, title: str, text: str, *, sentences: Sequence[str] | None = None) -> HSeq:
    """Turn a text document into ``document -> paragraph -> sentence`` segments.

    Parameters
    ----------
    doc_id : str
        Document id; prefixes every segment id (``"{doc_id}/p0/s1"``).
    title : str
        Document title (the document segment's content).
    text : str
        The text. Paragraphs break after newline runs; sentences after ``.!?`` followed by
        whitespace and a capital/digit (common abbreviations excepted).
    sentences : sequence of str, optional
        Use these sentence boundaries instead of the splitter (they must concatenate to
        ``text`` exactly), e.g. HotpotQA's, which its supporting facts index; they then form
        one paragraph.

    Returns
    -------
    HSeq
        Segments whose ``start``/``end`` offsets index ``text``; :func:`to_source` rebuilds
        ``{"id": doc_id, "title": title, "text": text}`` exactly.

    Raises
    ------
    DataError
        Non-string fields, an empty id, invalid unicode (lone surrogates), sentences that do not
        tile the text.
    """
    where = f"text document {doc_id!r}"
    check_str(doc_id, f"{where}: id", allow_empty=False)
    check_str(title, f"{where}: title")
    check_str(text, f"{where}: text")
    b = _Builder()
    root = b.add(doc_id, "document", -1, title, {"title": title}, doc=0, start=0, end=len(text))
    _add_text(b, doc_id, root, text, "paragraph", sentences, where)
    return b.build([{"kind": "text", "id": doc_id, "title": title, "length": len(text)}])


def _header_rows(table: list[list[str]]) -> int:
    """How many leading rows are headers: row 0, then rows whose first cell is empty (TAT-QA style)."""
    n = 1
    while n < len(table) - 1 and not table[n][0].strip():
        n += 1
    return n


def from_tatqa(doc: dict[str, Any], doc_id: str | None = None) -> HSeq:
    """Turn one TAT-QA document (table + linked paragraphs) into segments.

    Layout: ``document -> table -> row -> cell`` and ``document -> paragraph -> sentence``.
    Cells keep ``row``/``col``, ``meta["col_header"]`` (the non-empty header-row cells of that
    column, joined) and ``meta["row_header"]`` (the row's first cell). Empty cells are kept.

    Parameters
    ----------
    doc : dict
        ``{"table": {"uid", "table": [[str, ...], ...]}, "paragraphs": [{"uid", "order",
        "text"}, ...], ...}`` (the ``questions`` are not part of the evidence and are ignored).
    doc_id : str, optional
        Defaults to the table uid.

    Returns
    -------
    HSeq
        :func:`to_source` gives ``{"id", "table", "paragraphs"}`` whose ``table`` and
        ``paragraphs`` equal the input's (every key, every cell, in order).

    Raises
    ------
    DataError
        Missing table/paragraphs, a ragged table (rows of different lengths), a non-string
        cell, a paragraph without text, invalid unicode.
    """
    if not isinstance(doc, dict):
        raise DataError(f"TAT-QA document: expected a dict, got {type(doc).__name__}")
    tab = doc.get("table")
    if not isinstance(tab, dict) or "table" not in tab:
        raise DataError("TAT-QA document: missing 'table': {'uid': ..., 'table': [[...]]}")
    grid = tab["table"]
    paras = doc.get("paragraphs")
    if paras is None or not isinstance(paras, list):
        raise DataError("TAT-QA document: missing 'paragraphs' list")
    doc_id = doc_id or str(tab.get("uid") or "tatqa")
    where = f"TAT-QA document {doc_id!r}"
    if not isinstance(grid, list) or not grid or not all(isinstance(r, list) for r in grid):
        raise DataError(f"{where}: the table must be a non-empty list of rows (lists of cell strings)")
    width = len(grid[0])
    for ri, r in enumerate(grid):
        if len(r) != width:
            raise DataError(f"{where}: ragged table: row {ri} has {len(r)} cells but row 0 has {width}")
        for ci, c in enumerate(r):
            check_str(c, f"{where}: cell ({ri}, {ci})")
    nh = _header_rows(grid)
    col_header = [" ".join(grid[r][c].strip() for r in range(nh) if grid[r][c].strip()) for c in range(width)]
    b = _Builder()
    root = b.add(doc_id, "document", -1, "", {"kind": "tatqa"}, doc=0)
    t = b.add(f"{doc_id}/table", "table", root, " | ".join(h for h in col_header if h),
              {"uid": tab.get("uid"), "header_rows": nh}, doc=0)
    for ri, r in enumerate(grid):
        rs = b.add(f"{doc_id}/table/r{ri}", "row", t, " | ".join(r), {"header": ri < nh}, doc=0, row=ri)
        for ci, c in enumerate(r):
            b.add(f"{doc_id}/table/r{ri}/c{ci}", "cell", rs, c,
                  {"col_header": col_header[ci], "row_header": r[0].strip(), "header": ri < nh}, doc=0, row=ri, col=ci)
    para_keys = []
    for pi, p in enumerate(paras):
        if not isinstance(p, dict) or "text" not in p:
            raise DataError(f"{where}: paragraph {pi} has no 'text'")
        text = check_str(p["text"], f"{where}: paragraph {pi} text")
        para_keys.append(list(p))
        pm = {k: v for k, v in p.items() if k != "text"}
        ps = b.add(f"{doc_id}/p{pi}", "paragraph", root, text, {"para_index": pi, **pm}, doc=0, start=0, end=len(text))
        for si, (ss, se) in enumerate(split_sentences(text)):
            b.add(f"{doc_id}/p{pi}/s{si}", "sentence", ps, text[ss:se], {"sent_index": si, "para_index": pi},
                  doc=0, start=ss, end=se)
    src = {"kind": "tatqa", "id": doc_id, "table_keys": [k for k in tab if k != "table"],
           "table_meta": {k: v for k, v in tab.items() if k != "table"}, "para_keys": para_keys, "width": width}
    return b.build([src])


def from_triples(triples: Iterable[Sequence[str]], *, relations: Sequence[str] | None = None,
                 doc_id: str = "kg") -> HSeq:
    """Turn ``(head, relation, tail)`` triples into ``entity -> triple`` segments plus a :class:`KGraph`.

    Entities appear in first-mention order (head before tail); each triple hangs under its
    head entity and keeps its input index (``tidx``). The graph is on ``HSeq.kg``.

    Parameters
    ----------
    triples : iterable of (str, str, str)
        E.g. MetaQA's ``head|relation|tail`` lines split on ``|``.
    relations : sequence of str, optional
        The allowed relation names (e.g. :data:`METAQA_RELATIONS`); a triple with another
        relation is an error. Without it any non-empty relation name is accepted.
    doc_id : str
        Prefix of the segment ids.

    Raises
    ------
    DataError
        A triple that is not three strings, an empty field, an unknown relation, invalid
        unicode (each error names the triple index).
    """
    allowed = set(relations) if relations is not None else None
    ent: dict[str, int] = {}
    rel: dict[str, int] = {}
    heads, rels, tails = [], [], []
    for i, t in enumerate(triples):
        if isinstance(t, str) or len(t) != 3:
            raise DataError(f"triple {i}: expected (head, relation, tail), got {t!r:.80}")
        h, r, tl = t
        for name, v in (("head", h), ("relation", r), ("tail", tl)):
            check_str(v, f"triple {i} {name}", allow_empty=False)
        if allowed is not None and r not in allowed:
            raise DataError(f"triple {i}: unknown relation {r!r}; allowed: {', '.join(sorted(allowed))}")
        heads.append(ent.setdefault(h, len(ent)))
        rels.append(rel.setdefault(r, len(rel)))
        tails.append(ent.setdefault(tl, len(ent)))
    names = list(ent)
    rel_names = list(rel)
    H, R, T = (np.asarray(x, dtype=np.int64) for x in (heads, rels, tails))
    ne, nt = len(names), len(H)
    # Rows 0..ne-1 are entities, ne.. are triples: built column-wise, no per-segment Python objects.
    ids = [f"{doc_id}/e{i}" for i in range(ne)] + [f"{doc_id}/t{i}" for i in range(nt)]
    contents = names + [f"{names[h]} {rel_names[r].replace('_', ' ')} {names[tl]}" for h, r, tl in zip(heads, rels, tails)]
    neg_e = np.full(ne, -1, np.int64)
    cols = {
        "level": np.concatenate([np.full(ne, LEVEL_CODE["entity"]), np.full(nt, LEVEL_CODE["triple"])]),
        "parent": np.concatenate([neg_e, H]),
        "doc": np.zeros(ne + nt, np.int64),
        "head": np.concatenate([neg_e, H]),
        "rel": np.concatenate([neg_e, R]),
        "tail": np.concatenate([np.arange(ne, dtype=np.int64), T]),
        "tidx": np.concatenate([neg_e, np.arange(nt, dtype=np.int64)]),
    }
    seq = HSeq(ids, contents, [{} for _ in range(ne + nt)],
               [{"kind": "triples", "id": doc_id, "n_entities": ne}], **cols)
    seq.kg = KGraph(names, rel_names, H, R, T)
    return seq


# ---------------------------------------------------------------------------------------------
# reversal
# ---------------------------------------------------------------------------------------------
def _rebuild_text(seq: HSeq, rows: np.ndarray, src: dict[str, Any]) -> dict[str, Any]:
    paras = rows[seq.level[rows] == LEVEL_CODE["paragraph"]]
    text = "".join(seq.contents[i] for i in paras[np.argsort(seq.start[paras], kind="stable")])
    if len(text) != src["length"]:
        raise DataError(f"source {src['id']!r}: segments cover {len(text)} of {src['length']} characters "
                        "(a paragraph segment is missing)")
    return {"id": src["id"], "title": src["title"], "text": text}


def _rebuild_tatqa(seq: HSeq, rows: np.ndarray, src: dict[str, Any]) -> dict[str, Any]:
    cells = rows[seq.level[rows] == LEVEL_CODE["cell"]]
    nrows = int(seq.row[cells].max()) + 1 if len(cells) else 0
    grid: list[list[str | None]] = [[None] * src["width"] for _ in range(nrows)]
    for i in cells:
        grid[int(seq.row[i])][int(seq.col[i])] = seq.contents[i]
    if any(c is None for r in grid for c in r):
        raise DataError(f"source {src['id']!r}: a table cell segment is missing")
    table = {**src["table_meta"], "table": grid}
    # restore the input's key order ("uid" first in TAT-QA) so even json.dumps matches
    table = {k: table[k] for k in (src["table_keys"] + ["table"]) if k in table} | table
    paras = rows[seq.level[rows] == LEVEL_CODE["paragraph"]]
    out_p = []
    for i in sorted(paras.tolist(), key=lambda i: seq.meta[i]["para_index"]):
        m = seq.meta[i]
        full = {k: v for k, v in m.items() if k != "para_index"}
        full["text"] = seq.contents[i]
        out_p.append({k: full[k] for k in src["para_keys"][m["para_index"]]})
    return {"id": src["id"], "table": table, "paragraphs": out_p}


def _rebuild_triples(seq: HSeq, rows: np.ndarray, src: dict[str, Any]) -> list[tuple[str, str, str]]:
    tr = rows[seq.level[rows] == LEVEL_CODE["triple"]]
    tr = tr[np.argsort(seq.tidx[tr], kind="stable")]
    if seq.kg is None:
        raise DataError(f"source {src['id']!r}: the sequence has lost its knowledge graph")
    ents, rels = seq.kg.entities, seq.kg.relations
    return [(ents[h], rels[r], ents[t]) for h, r, t in zip(seq.head[tr].tolist(), seq.rel[tr].tolist(),
                                                            seq.tail[tr].tolist())]


def to_source(segments: HSeq, doc: int | str | None = None) -> Any:
    """Rebuild the original source of a sequence exactly.

    Parameters
    ----------
    segments : HSeq or list of Segment
        A sequence from :func:`from_text`, :func:`from_tatqa` or :func:`from_triples` (or a
        :meth:`HSeq.concat` of several), or its :meth:`HSeq.segments` list.
    doc : int or str, optional
        Which source of a concatenated sequence (position or document id); required when there
        are several.

    Returns
    -------
    dict or list
        ``{"id", "title", "text"}`` for a text; ``{"id", "table", "paragraphs"}`` for a TAT-QA
        document; the list of ``(head, relation, tail)`` tuples, in input order, for triples.
    """
    if isinstance(segments, (list, tuple)):
        segments = HSeq.from_segments(segments)
    if not isinstance(segments, HSeq):
        raise DataError(f"to_source expects an HSeq or a list of Segments, got {type(segments).__name__}")
    if not segments.sources:
        raise DataError("to_source: the sequence has no sources")
    if doc is None:
        if len(segments.sources) > 1:
            raise DataError(f"to_source: the sequence holds {len(segments.sources)} sources; pass doc= (index or id)")
        d = 0
    elif isinstance(doc, str):
        matches = [i for i, s in enumerate(segments.sources) if s["id"] == doc]
        if not matches:
            raise DataError(f"to_source: no source with id {doc!r}")
        d = matches[0]
    else:
        d = int(doc)
        if not 0 <= d < len(segments.sources):
            raise DataError(f"to_source: doc {d} out of range (0..{len(segments.sources) - 1})")
    src = segments.sources[d]
    rows = np.nonzero(segments.doc == d)[0]
    kind = src["kind"]
    if kind == "text":
        return _rebuild_text(segments, rows, src)
    if kind == "tatqa":
        return _rebuild_tatqa(segments, rows, src)
    if kind == "triples":
        return _rebuild_triples(segments, rows, src)
    raise DataError(f"to_source: unknown source kind {kind!r}")

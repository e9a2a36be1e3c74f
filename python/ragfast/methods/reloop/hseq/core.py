"""HSEQ's records: the segments, :class:`HSeq` and :class:`KGraph` (the builders and their
reversal are :mod:`ragfast.methods.reloop.hseq.build`).

HSEQ: one reversible hierarchical sequence of segments over text, tables and knowledge graphs.

Every source becomes a flat sequence of segments ``(id, level, parent, content, meta)``:

- text: ``document -> paragraph -> sentence``. Paragraphs and sentences partition the text
  exactly (each one keeps its trailing whitespace), so ``content`` is always the exact source
  slice ``text[start:end]`` and joining the paragraphs gives the text back byte for byte.
- TAT-QA tables: ``document -> table -> row -> cell`` plus ``document -> paragraph -> sentence``
  for the linked paragraphs. Cells keep their coordinates ``(row, col)``, their column header
  and their row header; empty cells are segments too, so the table comes back unchanged.
- knowledge graphs: ``entity -> triple``. Each triple hangs under its head entity and keeps its
  input position, so the triple list comes back in input order.

:class:`HSeq` stores the sequence column-wise (numpy arrays for level codes, parents, row/col,
char offsets and KG ids; a Python list for the contents) so that structural neighbours
(parent, children, siblings, same row, same column) are index operations over whole arrays of
segments at once. :class:`KGraph` holds per-relation CSR adjacency (forward and inverse) over
entity ids, so a relation hop over a frontier of entities is a few numpy gathers.

Offsets are Python string indices (code points), not UTF-8 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ragfast.errors import DataError

__all__ = [
    "LEVELS",
    "METAQA_RELATIONS",
    "Segment",
    "HSeq",
    "KGraph",
    "LEVEL_CODE",
    "check_str",
    "gather_csr",
]

#: Segment levels; :attr:`HSeq.level` stores the index into this tuple.
LEVELS = ("document", "paragraph", "sentence", "table", "row", "cell", "entity", "triple")
LEVEL_CODE = {name: i for i, name in enumerate(LEVELS)}

#: The nine relations of the MetaQA movie knowledge base (every head is a movie).
METAQA_RELATIONS = ("directed_by", "written_by", "starred_actors", "release_year", "in_language",
                    "has_tags", "has_genre", "has_imdb_votes", "has_imdb_rating")


@dataclass
class Segment:
    """One HSEQ segment.

    Attributes
    ----------
    id : str
        Unique within its sequence, e.g. ``"doc1/p0/s2"``, ``"tbl/r3/c1"``, ``"kg/t17"``.
    level : str
        One of :data:`LEVELS`.
    parent : str or None
        Id of the parent segment (None for a root).
    content : str
        Text of the segment (for text levels the exact source slice).
    meta : dict
        Offsets (``start``, ``end``), coordinates (``row``, ``col``), headers, uids, the
        source document id, the triple index, whatever the adapter keeps.
    """

    id: str
    level: str
    parent: str | None
    content: str
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# CSR helpers
# ---------------------------------------------------------------------------------------------
def gather_csr(indptr: np.ndarray, indices: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the CSR rows ``rows`` without a Python loop.

    Parameters
    ----------
    indptr, indices : ndarray
        A CSR structure (``indices[indptr[r]:indptr[r+1]]`` is row ``r``).
    rows : ndarray of int
        Rows to gather; negative entries gather nothing.

    Returns
    -------
    values : ndarray
        The gathered entries, row after row.
    owner : ndarray
        For each value, the position in ``rows`` it came from.
    """
    rows = np.asarray(rows, dtype=np.int64)
    ok = rows >= 0
    starts = np.where(ok, indptr[np.where(ok, rows, 0)], 0)
    ends = np.where(ok, indptr[np.where(ok, rows, 0) + 1], 0)
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return indices[:0].copy(), np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    # position within each row: a global arange minus the start offset of its run
    run_start = np.cumsum(lengths) - lengths
    pos = np.arange(total, dtype=np.int64) - np.repeat(run_start, lengths) + np.repeat(starts, lengths)
    return indices[pos], owner


def _group(keys: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR over ``keys`` (values in ``[0, n_keys)``; negatives dropped): rows = key, entries = positions."""
    keys = np.asarray(keys, dtype=np.int64)
    pos = np.nonzero(keys >= 0)[0]
    k = keys[pos]
    order = np.argsort(k, kind="stable")
    counts = np.bincount(k, minlength=n_keys)
    indptr = np.zeros(n_keys + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, pos[order].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------
def check_str(s: Any, where: str, *, allow_empty: bool = True) -> str:
    if not isinstance(s, str):
        raise DataError(f"{where}: expected a string, got {type(s).__name__} ({s!r:.60})")
    if not allow_empty and not s.strip():
        raise DataError(f"{where}: empty string")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Lone surrogates come from bad decoding upstream; offsets over them would not survive
        # a write to disk, so refuse them here with the position.
        raise DataError(f"{where}: invalid unicode (lone surrogate {s[exc.start]!r} at index {exc.start}); "
                        "decode the source as UTF-8 first") from None
    return s


# ---------------------------------------------------------------------------------------------
# the columnar container
# ---------------------------------------------------------------------------------------------
class HSeq:
    """A columnar hierarchical sequence of segments.

    Columns (one entry per segment, all numpy arrays of the same length ``n`` except
    ``contents`` / ``ids`` / ``meta``, which are Python lists):

    ``level`` (int8 code into :data:`LEVELS`), ``parent`` (int64 row of the parent, -1 for a
    root), ``doc`` (int32 index of the source in :attr:`sources`), ``row`` / ``col`` (int32 cell
    coordinates; a row segment has ``row`` set and ``col=-1``), ``start`` / ``end`` (int64 char
    offsets into the source text; for a TAT-QA paragraph or its sentences the offsets are into
    that paragraph's text), ``head`` / ``rel`` / ``tail`` (int64 KG ids, with ``tail`` also
    the entity id of an entity segment), ``tidx`` (int64 triple input index).

    ``sources`` keeps one small dict per source with what the segments alone do not hold
    (the kind, the document id and title, the table uid, key orders), which :func:`to_source`
    needs to rebuild the input exactly.
    """

    INT_COLS = ("level", "parent", "doc", "row", "col", "start", "end", "head", "rel", "tail", "tidx")
    _DTYPES = {"level": np.int8, "doc": np.int32, "row": np.int32, "col": np.int32}

    def __init__(self, ids: list[str], contents: list[str], meta: list[dict[str, Any]],
                 sources: list[dict[str, Any]], **cols: np.ndarray):
        n = len(ids)
        if len(contents) != n or len(meta) != n:
            raise ValueError("ids, contents and meta must have one entry per segment")
        self.ids = ids
        self.contents = contents
        self.meta = meta
        self.sources = sources
        for c in self.INT_COLS:
            a = cols.get(c)
            a = np.full(n, -1, dtype=self._DTYPES.get(c, np.int64)) if a is None else \
                np.asarray(a, dtype=self._DTYPES.get(c, np.int64))
            if a.shape != (n,):
                raise ValueError(f"column {c} has shape {a.shape}, expected ({n},)")
            setattr(self, c, a)
        self._id_index: dict[str, int] | None = None
        self._children: tuple[np.ndarray, np.ndarray] | None = None
        self._columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.kg: KGraph | None = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def concat(cls, parts: Sequence["HSeq"]) -> "HSeq":
        """Join several sequences (e.g. the ten contexts of a HotpotQA question) into one.

        Parent rows and source indices are shifted; segment ids must stay unique.
        """
        if not parts:
            return cls([], [], [], [])
        ids: list[str] = []
        contents: list[str] = []
        meta: list[dict[str, Any]] = []
        sources: list[dict[str, Any]] = []
        cols: dict[str, list[np.ndarray]] = {c: [] for c in cls.INT_COLS}
        off = 0
        for p in parts:
            ids += p.ids
            contents += p.contents
            meta += p.meta
            for c in cls.INT_COLS:
                a = getattr(p, c).astype(np.int64)
                if c == "parent":
                    a = np.where(a >= 0, a + off, -1)
                elif c == "doc":
                    a = np.where(a >= 0, a + len(sources), -1)
                cols[c].append(a)
            sources += p.sources
            off += len(p)
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            dup = next(i for i in ids if i in seen or seen.add(i))
            raise DataError(f"HSeq.concat: duplicate segment id {dup!r} (give each source a distinct doc id)")
        return cls(ids, contents, meta, sources, **{c: np.concatenate(v) for c, v in cols.items()})

    # -- basic access ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        counts = np.bincount(self.level.astype(np.int64), minlength=len(LEVELS)) if len(self) else np.zeros(len(LEVELS))
        parts = ", ".join(f"{LEVELS[i]}={int(c)}" for i, c in enumerate(counts) if c)
        return f"HSeq({len(self)} segments: {parts}; {len(self.sources)} sources)"

    def index(self, seg_id: str) -> int:
        """Row of the segment with id ``seg_id``."""
        if self._id_index is None:
            self._id_index = {s: i for i, s in enumerate(self.ids)}
        try:
            return self._id_index[seg_id]
        except KeyError:
            raise DataError(f"no segment with id {seg_id!r} in this sequence") from None

    def level_name(self, i: int) -> str:
        return LEVELS[int(self.level[i])]

    _DERIVED = ("doc_id", "row", "col", "start", "end", "tidx", "source", "head", "relation", "tail")

    def _first_rows(self) -> dict[int, int]:
        if not hasattr(self, "_firsts"):
            d = self.doc.astype(np.int64)
            ok = np.nonzero(d >= 0)[0]
            uniq, first = np.unique(d[ok], return_index=True)
            self._firsts = {int(u): int(ok[f]) for u, f in zip(uniq, first)}
        return self._firsts

    def segment(self, i: int) -> Segment:
        """Row ``i`` as a self-contained :class:`Segment`.

        ``meta`` gains ``doc_id`` and the coordinates, offsets and triple index it has; a
        triple also gets its ``head``/``relation``/``tail`` names, and the first segment of each
        source carries that source's record (``meta["source"]``), so that a plain list of
        segments is enough for :func:`to_source`.
        """
        i = int(i)
        m = dict(self.meta[i])
        d = int(self.doc[i])
        m["doc_id"] = self.sources[d]["id"] if d >= 0 else None
        for c in ("row", "col", "start", "end", "tidx"):
            v = int(getattr(self, c)[i])
            if v >= 0:
                m[c] = v
        if d >= 0 and self._first_rows().get(d) == i:
            m["source"] = dict(self.sources[d])
        if self.level[i] == LEVEL_CODE["triple"] and self.kg is not None:
            m["head"] = self.kg.entities[int(self.head[i])]
            m["relation"] = self.kg.relations[int(self.rel[i])]
            m["tail"] = self.kg.entities[int(self.tail[i])]
        p = int(self.parent[i])
        return Segment(self.ids[i], LEVELS[int(self.level[i])], self.ids[p] if p >= 0 else None, self.contents[i], m)

    def segments(self) -> list[Segment]:
        return [self.segment(i) for i in range(len(self))]

    @classmethod
    def from_segments(cls, segments: Sequence[Segment]) -> "HSeq":
        """Rebuild the columnar sequence from :class:`Segment` objects (as :meth:`segments` gives them).

        Raises
        ------
        DataError
            An unknown level, a parent id that is not in the list, a segment whose source
            record is missing.
        """
        segs = list(segments)
        index: dict[str, int] = {}
        for i, sg in enumerate(segs):
            if not isinstance(sg, Segment):
                raise DataError(f"segment {i}: expected a Segment, got {type(sg).__name__}")
            if sg.id in index:
                raise DataError(f"duplicate segment id {sg.id!r}")
            index[sg.id] = i
        sources: list[dict[str, Any]] = []
        src_of: dict[str, int] = {}
        for sg in segs:
            if "source" in sg.meta:
                src_of[sg.meta["source"]["id"]] = len(sources)
                sources.append(dict(sg.meta["source"]))
        n = len(segs)
        cols = {c: np.full(n, -1, dtype=np.int64) for c in cls.INT_COLS}
        ids, contents, meta = [], [], []
        ent_names: list[str] = []
        ent_id: dict[str, int] = {}
        rel_id: dict[str, int] = {}
        for i, sg in enumerate(segs):
            if sg.level not in LEVEL_CODE:
                raise DataError(f"segment {sg.id!r}: unknown level {sg.level!r}; expected one of {LEVELS}")
            cols["level"][i] = LEVEL_CODE[sg.level]
            if sg.parent is not None:
                if sg.parent not in index:
                    raise DataError(f"segment {sg.id!r}: parent {sg.parent!r} is not in the list")
                cols["parent"][i] = index[sg.parent]
            doc = sg.meta.get("doc_id")
            if doc is not None:
                if doc not in src_of:
                    raise DataError(f"segment {sg.id!r}: no segment carries the record of source {doc!r}")
                cols["doc"][i] = src_of[doc]
            for c in ("row", "col", "start", "end", "tidx"):
                if c in sg.meta:
                    cols[c][i] = int(sg.meta[c])
            if sg.level == "entity":
                cols["tail"][i] = ent_id.setdefault(sg.content, len(ent_id))
                if cols["tail"][i] == len(ent_names):
                    ent_names.append(sg.content)
            ids.append(sg.id)
            contents.append(sg.content)
            meta.append({k: v for k, v in sg.meta.items() if k not in cls._DERIVED})
        tri = [i for i, sg in enumerate(segs) if sg.level == "triple"]
        for i in tri:
            m = segs[i].meta
            for k in ("head", "tail"):
                if m.get(k) not in ent_id:
                    raise DataError(f"segment {segs[i].id!r}: triple {k} {m.get(k)!r} has no entity segment")
            cols["head"][i] = ent_id[m["head"]]
            cols["rel"][i] = rel_id.setdefault(m["relation"], len(rel_id))
            cols["tail"][i] = ent_id[m["tail"]]
        seq = cls(ids, contents, meta, sources, **cols)
        if tri:
            t = np.asarray(tri, dtype=np.int64)
            seq.kg = KGraph(ent_names, list(rel_id), seq.head[t], seq.rel[t], seq.tail[t])
            # the KG's triple rows must line up with the ids the columns hold
            seq.head[t], seq.rel[t], seq.tail[t] = seq.kg.head, seq.kg.rel, seq.kg.tail
        return seq

    def __iter__(self) -> Iterator[Segment]:
        for i in range(len(self)):
            yield self.segment(i)

    def where(self, *levels: str) -> np.ndarray:
        """Rows whose level is one of ``levels``."""
        for lv in levels:
            if lv not in LEVEL_CODE:
                raise ValueError(f"unknown level {lv!r}; expected one of {LEVELS}")
        return np.nonzero(np.isin(self.level, [LEVEL_CODE[lv] for lv in levels]))[0]

    # -- structural neighbours (vectorised) --------------------------------------------------
    def parents(self, rows: np.ndarray) -> np.ndarray:
        """Parent row of each row (-1 for roots and for -1 inputs)."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.where(rows >= 0, self.parent[np.where(rows >= 0, rows, 0)], -1)

    def _child_csr(self) -> tuple[np.ndarray, np.ndarray]:
        if self._children is None:
            self._children = _group(self.parent, len(self))
        return self._children

    def children(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Children of each row: ``(child_rows, owner)`` with ``owner`` the position in ``rows``."""
        indptr, idx = self._child_csr()
        return gather_csr(indptr, idx, rows)

    def siblings(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Other children of each row's parent: ``(sibling_rows, owner)`` (self excluded)."""
        rows = np.asarray(rows, dtype=np.int64)
        sib, owner = self.children(self.parents(rows))
        keep = sib != rows[owner]
        return sib[keep], owner[keep]

    def same_row(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Other cells of each cell's table row (non-cells get nothing)."""
        rows = np.asarray(rows, dtype=np.int64)
        is_cell = self.level[rows] == LEVEL_CODE["cell"]
        sib, owner = self.siblings(np.where(is_cell, rows, -1))
        return sib, owner

    def _col_csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._columns is None:
            cells = self.where("cell")
            # key = (table row, col), table = grandparent of a cell
            table = self.parents(self.parents(cells))
            key = np.full(len(self), -1, dtype=np.int64)
            ncol = int(self.col[cells].max()) + 1 if len(cells) else 1
            key[cells] = table * ncol + self.col[cells]
            uniq, inv = np.unique(key[cells], return_inverse=True) if len(cells) else (np.zeros(0, np.int64), np.zeros(0, np.int64))
            gid = np.full(len(self), -1, dtype=np.int64)
            gid[cells] = inv
            indptr, idx = _group(gid, len(uniq))
            self._columns = (gid, indptr, idx)
        return self._columns

    def same_column(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Other cells of each cell's table column (non-cells get nothing)."""
        rows = np.asarray(rows, dtype=np.int64)
        gid, indptr, idx = self._col_csr()
        vals, owner = gather_csr(indptr, idx, gid[rows])
        keep = vals != rows[owner]
        return vals[keep], owner[keep]

    def expand(self, rows: np.ndarray, kinds: Iterable[str] = ("parent", "children", "siblings", "row", "column")
               ) -> np.ndarray:
        """The union of the chosen structural neighbours of ``rows`` (sorted, unique, ``rows`` excluded).

        ``kinds`` is any of ``parent``, ``children``, ``siblings``, ``row``, ``column``.
        """
        rows = np.asarray(rows, dtype=np.int64)
        out = []
        for k in kinds:
            if k == "parent":
                p = self.parents(rows)
                out.append(p[p >= 0])
            elif k == "children":
                out.append(self.children(rows)[0])
            elif k == "siblings":
                out.append(self.siblings(rows)[0])
            elif k == "row":
                out.append(self.same_row(rows)[0])
            elif k == "column":
                out.append(self.same_column(rows)[0])
            else:
                raise ValueError(f"unknown neighbour kind {k!r}; expected parent, children, siblings, row, column")
        if not out:
            return np.zeros(0, dtype=np.int64)
        u = np.unique(np.concatenate(out))
        return u[~np.isin(u, rows)]


# ---------------------------------------------------------------------------------------------
# knowledge graph
# ---------------------------------------------------------------------------------------------
class KGraph:
    """Entity ids, relation ids and per-relation CSR adjacency in both directions.

    Parameters
    ----------
    entities : list of str
        Entity names; the id of an entity is its position.
    relations : list of str
        Relation names; the id of a relation is its position.
    head, rel, tail : ndarray of int64
        One entry per triple.
    """

    def __init__(self, entities: list[str], relations: list[str], head: np.ndarray, rel: np.ndarray,
                 tail: np.ndarray):
        self.entities = entities
        self.relations = relations
        self.entity_id = {e: i for i, e in enumerate(entities)}
        self.relation_id = {r: i for i, r in enumerate(relations)}
        self.head = np.asarray(head, dtype=np.int64)
        self.rel = np.asarray(rel, dtype=np.int64)
        self.tail = np.asarray(tail, dtype=np.int64)
        n = len(entities)
        # one CSR per (relation, direction) over all entities; entries = triple rows, so a hop
        # can also report which triples it walked through (provenance)
        self._fwd: list[tuple[np.ndarray, np.ndarray]] = []
        self._inv: list[tuple[np.ndarray, np.ndarray]] = []
        for r in range(len(relations)):
            sel = np.where(self.rel == r, self.head, -1)
            self._fwd.append(_group(sel, n))
            sel = np.where(self.rel == r, self.tail, -1)
            self._inv.append(_group(sel, n))

    def __len__(self) -> int:
        return len(self.head)

    def ids(self, names: Sequence[str]) -> np.ndarray:
        """Entity ids of ``names`` (-1 for unknown names)."""
        return np.asarray([self.entity_id.get(n, -1) for n in names], dtype=np.int64)

    def relation(self, name: str) -> int:
        try:
            return self.relation_id[name]
        except KeyError:
            raise DataError(f"unknown relation {name!r}; this graph has {', '.join(self.relations)}") from None

    def hop_triples(self, entity_ids: np.ndarray, relation: str, *, inverse: bool = False
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Triples leaving each entity along ``relation``.

        Returns ``(triple_rows, owner)``: forward hops follow head -> tail, inverse hops tail -> head.
        """
        r = self.relation(relation)
        indptr, idx = (self._inv if inverse else self._fwd)[r]
        return gather_csr(indptr, idx, np.asarray(entity_ids, dtype=np.int64))

    def hop(self, entity_ids: np.ndarray, relation: str, *, inverse: bool = False) -> np.ndarray:
        """Entities reached from ``entity_ids`` in one ``relation`` hop (sorted, unique)."""
        t, _ = self.hop_triples(entity_ids, relation, inverse=inverse)
        return np.unique((self.head if inverse else self.tail)[t])

    def hop_counts(self, weights: np.ndarray, relation: str, *, inverse: bool = False) -> np.ndarray:
        """Propagate path counts one hop: ``out[e]`` = sum of ``weights[h]`` over edges h -> e.

        ``weights`` is a dense vector over all entities (e.g. a one-hot topic entity); after
        several hops ``out[e]`` counts the relation paths from the start to ``e``.
        """
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != (len(self.entities),):
            raise ValueError(f"weights must have shape ({len(self.entities)},), got {weights.shape}")
        src = np.nonzero(weights)[0]
        t, owner = self.hop_triples(src, relation, inverse=inverse)
        dst = (self.head if inverse else self.tail)[t]
        return np.bincount(dst, weights=weights[src][owner], minlength=len(self.entities))

    def out_relations(self, entity_id: int) -> list[str]:
        """Relations for which the entity is a head."""
        return [r for i, r in enumerate(self.relations)
                if self._fwd[i][0][entity_id + 1] > self._fwd[i][0][entity_id]]

    def in_relations(self, entity_id: int) -> list[str]:
        """Relations for which the entity is a tail."""
        return [r for i, r in enumerate(self.relations)
                if self._inv[i][0][entity_id + 1] > self._inv[i][0][entity_id]]



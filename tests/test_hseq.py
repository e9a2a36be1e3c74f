"""HSEQ: reversibility on every bundled document, vectorised neighbours, clear errors."""
import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragfast.methods.reloop import hseq
from ragfast.data import load_triples, sample
from ragfast.errors import DataError
from ragfast.methods.reloop.hseq import HSeq, from_tatqa, from_text, from_triples, gather_csr, to_source


def _hotpot_contexts():
    for name in ("hotpotqa-train", "hotpotqa-dev"):
        with open(sample(name), encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                yield from zip(rec["context"]["title"], rec["context"]["sentences"])


def _check_spans(seq: HSeq, text_of):
    # every text segment's content is exactly its source slice
    for i in seq.where("paragraph", "sentence"):
        s, e = int(seq.start[i]), int(seq.end[i])
        assert text_of(i)[s:e] == seq.contents[i]


def test_text_roundtrip_every_hotpotqa_context():
    n = 0
    for k, (title, sents) in enumerate(_hotpot_contexts()):
        text = "".join(sents)
        own = from_text(f"d{k}", title, text)
        assert to_source(own) == {"id": f"d{k}", "title": title, "text": text}
        given_ = from_text(f"d{k}", title, text, sentences=sents)
        assert to_source(given_)["text"] == text
        sent_rows = given_.where("sentence")
        assert [given_.contents[i] for i in sent_rows] == list(sents)
        if k % 50 == 0:
            _check_spans(own, lambda i: text)
            assert to_source(own.segments()) == to_source(own)
        n += 1
    assert n > 5900  # 2 x 300 questions, (up to) 10 contexts each


def test_tatqa_roundtrip_every_document():
    docs = json.loads(sample("tatqa-dev").read_text(encoding="utf-8"))
    assert len(docs) == 278
    for doc in docs:
        seq = from_tatqa(doc)
        back = to_source(seq)
        assert back["table"] == doc["table"]
        assert back["paragraphs"] == doc["paragraphs"]
        # key order too, so a JSON dump is byte-identical
        assert json.dumps(back["table"]) == json.dumps(doc["table"])
        assert json.dumps(back["paragraphs"]) == json.dumps(doc["paragraphs"])
        cells = seq.where("cell")
        grid = doc["table"]["table"]
        assert len(cells) == sum(len(r) for r in grid)
        for i in cells[:: max(1, len(cells) // 7)]:
            assert grid[seq.row[i]][seq.col[i]] == seq.contents[i]
        paras = seq.where("paragraph")
        for i in seq.where("sentence"):
            p = int(seq.parent[i])
            assert seq.contents[p][seq.start[i]:seq.end[i]] == seq.contents[i]
        assert len(paras) == len(doc["paragraphs"])
        # a plain list of Segment objects is enough to rebuild the source too
        assert to_source(seq.segments()) == back


def test_metaqa_kb_roundtrip_whole_kb():
    triples = load_triples(sample("metaqa-kb"))
    seq = from_triples(triples, relations=hseq.METAQA_RELATIONS)
    assert to_source(seq) == triples
    assert len(seq.where("triple")) == len(triples)
    part = triples[:5000]
    assert to_source(from_triples(part).segments()) == part
    # every triple hangs under its head entity
    tr = seq.where("triple")[:1000]
    assert all(seq.contents[seq.parent[i]] == triples[seq.tidx[i]][0] for i in tr)


def test_text_edge_cases_roundtrip():
    for text in ["", "\n", "one", "A. B. C.", "\n\nStart.  Two spaces!\n\n\nThird para?\n", "Fröbe ✓ 😀 Ça va? Oui.",
                 "e\u0301 combining. Next"]:
        seq = from_text("x", "tïtle", text)
        assert to_source(seq) == {"id": "x", "title": "tïtle", "text": text}
        _check_spans(seq, lambda i: text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .!?\nAZ9\"é😀")), max_size=80))
def test_text_roundtrip_random(text):
    seq = from_text("r", "t", text)
    assert to_source(seq)["text"] == text
    _check_spans(seq, lambda i: text)


def test_tatqa_empty_cells_and_unicode_roundtrip():
    doc = {"table": {"uid": "u1", "table": [["", "2019", ""], ["Revenue €", "", "1,2"], ["", "", ""]]},
           "paragraphs": [{"uid": "p", "order": 1, "text": "Résumé of € sales. Second line."}], "questions": []}
    seq = from_tatqa(doc)
    back = to_source(seq)
    assert back["table"] == doc["table"] and back["paragraphs"] == doc["paragraphs"]
    assert len(seq.where("cell")) == 9


def test_bad_sources_raise_clear_errors():
    with pytest.raises(DataError, match="ragged table: row 1 has 2 cells but row 0 has 3"):
        from_tatqa({"table": {"uid": "u", "table": [["a", "b", "c"], ["d", "e"]]}, "paragraphs": []})
    with pytest.raises(DataError, match=r"cell \(0, 1\): expected a string, got int"):
        from_tatqa({"table": {"uid": "u", "table": [["a", 5]]}, "paragraphs": []})
    with pytest.raises(DataError, match="missing 'table'"):
        from_tatqa({"paragraphs": []})
    with pytest.raises(DataError, match="paragraph 0 has no 'text'"):
        from_tatqa({"table": {"uid": "u", "table": [["a"]]}, "paragraphs": [{"uid": "x"}]})
    with pytest.raises(DataError, match="unknown relation 'acted_in'"):
        from_triples([("A", "directed_by", "B"), ("A", "acted_in", "C")], relations=hseq.METAQA_RELATIONS)
    with pytest.raises(DataError, match="triple 1: expected"):
        from_triples([("A", "r", "B"), ("A", "r")])
    with pytest.raises(DataError, match="triple 0 tail: empty string"):
        from_triples([("A", "r", " ")])
    with pytest.raises(DataError, match="invalid unicode.*lone surrogate"):
        from_text("d", "t", "ok \ud800 bad")
    with pytest.raises(DataError, match="invalid unicode"):
        from_triples([("A\udc80", "r", "B")])
    with pytest.raises(DataError, match="do not concatenate"):
        from_text("d", "t", "One. Two.", sentences=["One.", "Two."])
    with pytest.raises(DataError, match="expected a string, got NoneType"):
        from_text("d", None, "x")  # type: ignore[arg-type]
    seq = from_triples([("A", "r", "B")])
    with pytest.raises(DataError, match="unknown relation 'q'; this graph has r"):
        seq.kg.hop(np.array([0]), "q")


def test_concat_and_select_source():
    a = from_text("a", "A", "First. Second.")
    b = from_text("b", "B", "Other text.")
    both = HSeq.concat([a, b])
    assert to_source(both, "b") == {"id": "b", "title": "B", "text": "Other text."}
    assert to_source(both, 0)["text"] == "First. Second."
    with pytest.raises(DataError, match="holds 2 sources"):
        to_source(both)
    with pytest.raises(DataError, match="duplicate segment id"):
        HSeq.concat([a, a])
    # parents were shifted: b's sentence points at b's paragraph
    i = both.index("b/p0/s0")
    assert both.ids[both.parent[i]] == "b/p0"


# ---------------------------------------------------------------------------------------------
# neighbours on constructed tables and graphs, against plain Python walks
# ---------------------------------------------------------------------------------------------
def test_table_neighbours_constructed():
    grid = [["", "2019", "2018"], ["Sales", "10", "9"], ["Costs", "4", "3"], ["", "", "x"]]
    seq = from_tatqa({"table": {"uid": "t", "table": grid}, "paragraphs": [{"uid": "p", "order": 1, "text": "One. Two."}]})
    c = seq.index("t/table/r1/c1")
    row, _ = seq.same_row(np.array([c]))
    col, _ = seq.same_column(np.array([c]))
    assert sorted(seq.ids[i] for i in row) == ["t/table/r1/c0", "t/table/r1/c2"]
    assert sorted(seq.ids[i] for i in col) == ["t/table/r0/c1", "t/table/r2/c1", "t/table/r3/c1"]
    assert seq.ids[seq.parents(np.array([c]))[0]] == "t/table/r1"
    kids, owner = seq.children(np.array([seq.index("t/table/r2"), seq.index("t/p0")]))
    assert [seq.ids[i] for i in kids] == ["t/table/r2/c0", "t/table/r2/c1", "t/table/r2/c2", "t/p0/s0", "t/p0/s1"]
    assert owner.tolist() == [0, 0, 0, 1, 1]
    # a sentence has no row/column neighbours
    s = seq.index("t/p0/s1")
    assert len(seq.same_row(np.array([s]))[0]) == 0 and len(seq.same_column(np.array([s]))[0]) == 0
    assert [seq.ids[i] for i in seq.siblings(np.array([s]))[0]] == ["t/p0/s0"]
    assert seq.meta[c]["col_header"] == "2019" and seq.meta[c]["row_header"] == "Sales"
    ex = seq.expand(np.array([c]), ("row", "column", "parent"))
    assert c not in ex and seq.index("t/table/r1") in ex and len(ex) == 6


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.integers(1, 5), st.integers(0, 2 ** 31 - 1))
def test_neighbours_match_python_walk(table_rows, width, seed):
    rng = np.random.default_rng(seed)
    parts = []
    for t, nrows in enumerate(table_rows):
        grid = [[str(rng.integers(0, 3)) if rng.random() < 0.7 else "" for _ in range(width)] for _ in range(nrows)]
        parts.append(from_tatqa({"table": {"uid": f"t{t}", "table": grid},
                                 "paragraphs": [{"uid": "p", "order": 1, "text": "One. Two. Three."}]}))
    seq = HSeq.concat(parts)
    kids = defaultdict(list)
    for i, p in enumerate(seq.parent.tolist()):
        if p >= 0:
            kids[p].append(i)
    q = rng.integers(0, len(seq), size=11)
    got_sib, owner = seq.siblings(q)
    got_row, rowner = seq.same_row(q)
    got_col, cowner = seq.same_column(q)
    for j, i in enumerate(q.tolist()):
        p = int(seq.parent[i])
        want = [k for k in kids[p] if k != i] if p >= 0 else []
        assert sorted(got_sib[owner == j].tolist()) == sorted(want)
        if seq.level_name(i) == "cell":
            want_row = want
            want_col = [k for k in range(len(seq)) if seq.level_name(k) == "cell" and k != i and seq.col[k] == seq.col[i]
                        and seq.parent[seq.parent[k]] == seq.parent[seq.parent[i]]]
        else:
            want_row, want_col = [], []
        assert sorted(got_row[rowner == j].tolist()) == sorted(want_row)
        assert sorted(got_col[cowner == j].tolist()) == sorted(want_col)


def test_kg_hop_constructed():
    triples = [("M1", "directed_by", "D1"), ("M2", "directed_by", "D1"), ("M1", "starred_actors", "A1"),
               ("M3", "starred_actors", "A1"), ("M3", "starred_actors", "A2"), ("M2", "release_year", "1999"),
               ("M3", "release_year", "1999")]
    kg = from_triples(triples).kg
    ids = kg.ids
    name = lambda a: sorted(kg.entities[i] for i in a)  # noqa: E731
    assert name(kg.hop(ids(["M1"]), "directed_by")) == ["D1"]
    assert name(kg.hop(ids(["D1"]), "directed_by", inverse=True)) == ["M1", "M2"]
    assert name(kg.hop(kg.hop(ids(["M1"]), "starred_actors"), "starred_actors", inverse=True)) == ["M1", "M3"]
    assert name(kg.hop(ids(["M1", "M3"]), "release_year")) == ["1999"]
    assert len(kg.hop(ids(["D1"]), "directed_by")) == 0
    w = np.zeros(len(kg.entities))
    w[ids(["D1"])] = 1
    m = kg.hop_counts(w, "directed_by", inverse=True)
    y = kg.hop_counts(m, "release_year")
    assert y[kg.entity_id["1999"]] == 1.0  # only M2 of D1's movies has a year
    w[:] = 0
    w[ids(["A1"])] = 1
    assert kg.hop_counts(kg.hop_counts(w, "starred_actors", inverse=True), "release_year")[kg.entity_id["1999"]] == 1
    assert kg.out_relations(kg.entity_id["M3"]) == ["starred_actors", "release_year"]
    assert kg.in_relations(kg.entity_id["D1"]) == ["directed_by"]
    # unknown entity names map to -1 and hop to nothing
    assert len(kg.hop(ids(["nope"]), "directed_by")) == 0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(0, 2 ** 31 - 1))
def test_kg_hop_matches_dict_walk(n_triples, n_rel, seed):
    rng = np.random.default_rng(seed)
    triples = [(f"e{rng.integers(0, 12)}", f"r{rng.integers(0, n_rel)}", f"e{rng.integers(0, 12)}") for _ in range(n_triples)]
    kg = from_triples(triples).kg
    fwd, inv = defaultdict(set), defaultdict(set)
    for h, r, t in triples:
        fwd[(h, r)].add(t)
        inv[(t, r)].add(h)
    starts = [f"e{i}" for i in rng.integers(0, 12, size=3)]
    for r in kg.relations:
        for table, inverse in ((fwd, False), (inv, True)):
            want = set().union(*(table[(s, r)] for s in starts))
            got = {kg.entities[i] for i in kg.hop(kg.ids(starts), r, inverse=inverse)}
            assert got == want


def test_gather_csr_matches_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, size=30)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    indices = rng.integers(0, 100, size=int(indptr[-1]))
    rows = np.array([3, -1, 0, 29, 3, 7])
    vals, owner = gather_csr(indptr, indices, rows)
    want = [(indices[indptr[r]:indptr[r + 1]].tolist() if r >= 0 else []) for r in rows]
    assert vals.tolist() == [v for w in want for v in w]
    assert owner.tolist() == [j for j, w in enumerate(want) for _ in w]


def test_from_segments_errors_and_self_contained_segments():
    seq = from_text("d", "T", "One. Two.")
    segs = seq.segments()
    assert segs[0].meta["source"]["kind"] == "text" and "source" not in segs[1].meta
    assert segs[2].meta["start"] == 0 and segs[2].meta["doc_id"] == "d"
    with pytest.raises(DataError, match="parent 'd/p0' is not in the list"):
        to_source([segs[0], segs[2]])
    stripped = [hseq.Segment(x.id, x.level, x.parent, x.content, {k: v for k, v in x.meta.items() if k != "source"})
                for x in segs]
    with pytest.raises(DataError, match="no segment carries the record of source 'd'"):
        to_source(stripped)
    bad = hseq.Segment("x", "chapter", None, "", {})
    with pytest.raises(DataError, match="unknown level 'chapter'"):
        HSeq.from_segments([bad])
    kg = from_triples([("A", "r", "B")]).segments()
    assert kg[-1].meta["head"] == "A" and kg[-1].meta["relation"] == "r"

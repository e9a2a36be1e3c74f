"""BM25 (bm25s): rare-word retrieval, exclude, save/load, the Retriever wrapper and bad input."""
import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError
from ragfast.retrieval.bm25 import BM25, BM25Retriever


@pytest.fixture(scope="module")
def corpus():
    from ragfast.data import Corpus

    rng = np.random.default_rng()
    common = ["river", "city", "history", "music", "school", "bridge", "team", "season", "village", "church"]
    rows = []
    for i in range(300):
        words = rng.choice(common, size=12)
        rows.append({"id": f"d{i}", "contents": f'"Doc {i}"\n' + " ".join(words) + "."})
    # Two passages carry rare words; one of them twice, so it scores higher.
    rows[137]["contents"] = '"Zeppelin"\nThe quixotic zeppelin drifted over Reykjavik, a quixotic sight.'
    rows[211]["contents"] = '"Harbour"\nA zeppelin was moored near the harbour bridge.'
    return Corpus.from_rows(rows)


def test_bm25_finds_rare_words(corpus):
    idx = BM25.build(corpus)
    s, i = idx.search(["quixotic zeppelin", "zeppelin", "the of and"], 5)
    assert i[0, 0] == 137 and i[0, 1] == 211 and s[0, 0] > s[0, 1] > 0
    assert set(i[1, :2]) == {137, 211} and (i[1, 2:] == -1).all() and np.isinf(s[1, 2:]).all()
    assert (i[2] == -1).all()  # only stop words: nothing matches, nothing returned
    assert idx.search([], 3)[0].shape == (0, 3)


def test_bm25_exclude_and_ledger(corpus):
    idx = BM25.build(corpus)
    led = CostLedger()
    s, i = idx.search(["quixotic zeppelin", "river bridge"], 4, exclude=[[137], []], ledger=led,
                      question_ids=["a", "b"])
    assert i[0, 0] == 211 and 137 not in i[0]
    assert (i[1] >= 0).all() and (np.diff(s[1]) <= 0).all()
    per_q = led.per_question()
    assert per_q["a"]["search"]["calls"] == 1 and per_q["b"]["search"]["bytes_scanned"] > per_q["a"]["search"][
        "bytes_scanned"]  # common words have long posting lists


def test_bm25_save_load(corpus, tmp_path):
    idx = BM25.build(corpus, k1=1.2, b=0.75)
    idx.save(tmp_path / "bm25")
    back = BM25.load(tmp_path / "bm25")
    assert back.describe() == idx.describe()
    q = ["quixotic zeppelin", "history of the church", "season team music"]
    s1, i1 = idx.search(q, 7)
    s2, i2 = back.search(q, 7)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2)
    with pytest.raises(DataError, match="not a ragfast BM25 index"):
        BM25.load(tmp_path)


def test_bm25_retriever(corpus):
    r = BM25Retriever.build(corpus)
    hits = r.search(["quixotic zeppelin over Reykjavik"], 2)
    assert hits[0][0].id == "d137" and hits[0][0].document == corpus.row(137) and hits[0][0].title == "Zeppelin"
    hits = r.search(["zeppelin"], 2, exclude=[["d137", "unknown-id"]])
    assert [h.id for h in hits[0]] == ["d211"]
    assert r.search([], 2) == []
    assert r.describe()["passages"] == 300


def test_bm25_bad_input(corpus):
    idx = BM25.build(corpus)
    with pytest.raises(DataError, match="one string"):
        idx.search("zeppelin", 3)
    with pytest.raises(ValueError, match="positive"):
        idx.search(["zeppelin"], 0)
    with pytest.raises(ValueError, match="exclude has"):
        idx.search(["zeppelin"], 3, exclude=[[1], [2]])
    with pytest.raises(DataError, match="empty"):
        BM25.build([])
    assert idx.search(["zeppelin"], 10_000)[1].shape == (1, 10_000)  # k above N is clipped inside

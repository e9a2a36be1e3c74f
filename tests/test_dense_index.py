"""DenseIndex (flat kernel and faiss), ShardedIndex, DenseRetriever and the cached default builder."""
import numpy as np
import pytest
import torch

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.retrieval.dense import DenseIndex, DenseRetriever, ShardedIndex, build_default_retriever
from topk_compare import assert_topk_agree

# scores here are O(1) (unit corpus, Gaussian queries): fp32 implementations agree to ~1e-6, and
# ids are compared only where the scores separate them (tests/topk_compare.py)
TOL = 1e-5


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture
def data():
    rng = np.random.default_rng(20261201)  # seeded: a failure reproduces (shard edges: test_merge.py)
    return _unit(rng, 989, 37), rng.standard_normal((19, 37)).astype(np.float32)


def _brute(x, q, k, exclude=None, min_score=None):
    s = q @ x.T
    if exclude is not None:
        for r, ex in enumerate(exclude):
            s[r, ex] = -np.inf
    if min_score is not None:
        s[s < min_score] = -np.inf
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]
    sc = np.take_along_axis(s, ids, axis=1)
    return sc, np.where(np.isfinite(sc), ids, -1)


def test_flat_and_faiss_flat_agree(data):
    x, q = data
    flat, fa = DenseIndex.build(x), DenseIndex.build(x, "faiss", factory="Flat")
    s1, i1 = flat.search(q, 10)
    s2, i2 = fa.search(torch.from_numpy(q), 10)
    want_s, want_i = _brute(x, q, 10)
    assert s1.dtype == torch.float32 and i1.dtype == torch.int64 and i1.shape == (19, 10)
    assert_topk_agree(s1, i1, want_s, want_i, atol=TOL)
    assert_topk_agree(s2, i2, want_s, want_i, atol=TOL)


def test_exclude_and_min_score(data):
    x, q = data
    ex = [list(np.random.default_rng(r).choice(len(x), 30, replace=False)) for r in range(len(q))]
    _, top = _brute(x, q, 5)
    ex = [e + top[r, :3].tolist() for r, e in enumerate(ex)]  # make sure real winners are excluded
    thr = float(np.sort(q @ x.T, axis=1)[:, -8].mean())  # some rows keep fewer than k hits
    want_s, want_i = _brute(x, q, 10, ex, thr)
    assert (want_i == -1).any() and (want_i >= 0).any()
    for idx in (DenseIndex.build(x), DenseIndex.build(x, "faiss", factory="Flat")):
        s, i = idx.search(q, 10, exclude=ex, min_score=thr)
        assert_topk_agree(s, i, want_s, want_i, atol=TOL, min_score=thr)
        assert torch.isinf(s[i < 0]).all() and (s[i >= 0] >= thr).all()
        for r in range(len(q)):
            assert not set(i[r].tolist()) & set(ex[r])


def test_save_load_roundtrip_and_search_r1_faiss_file(data, tmp_path):
    import faiss

    x, q = data
    want_s, want = DenseIndex.build(x).search(q, 7)
    flat = DenseIndex.build(x, storage="fp32")
    flat.save(tmp_path / "flat")
    back = DenseIndex.load(tmp_path / "flat")
    assert isinstance(back.vectors, np.memmap)  # memory-mapped, not read into private memory
    assert torch.equal(back.search(q, 7)[1], want)
    DenseIndex.build(x, "faiss", factory="Flat").save(tmp_path / "fa")
    assert_topk_agree(*DenseIndex.load(tmp_path / "fa").search(q, 7), want_s, want, atol=TOL)
    # Search-R1 ships its index as a bare faiss file (e5_Flat.index): it must load as is.
    raw = faiss.IndexFlatIP(x.shape[1])
    raw.add(x)
    faiss.write_index(raw, str(tmp_path / "e5_Flat.index"))
    ix = DenseIndex.load(tmp_path / "e5_Flat.index")
    assert ix.backend == "faiss" and len(ix) == len(x)
    assert_topk_agree(*ix.search(q, 7), want_s, want, atol=TOL)
    np.save(tmp_path / "vecs.npy", x)
    assert torch.equal(DenseIndex.load(tmp_path / "vecs.npy").search(q, 7)[1], want)
    l2 = faiss.IndexFlatL2(x.shape[1])
    faiss.write_index(l2, str(tmp_path / "l2.index"))
    with pytest.raises(ConfigError, match="inner product"):
        DenseIndex.load(tmp_path / "l2.index")
    (tmp_path / "junk.index").write_bytes(b"not an index")
    with pytest.raises(DataError, match="not a readable faiss index"):
        DenseIndex.load(tmp_path / "junk.index")


def test_quantized_storage_and_bytes_scanned(data):
    x, q = data
    led = CostLedger()
    fp32 = DenseIndex.build(x)
    fp32.search(q, 10, ledger=led, question_ids=[f"q{i}" for i in range(len(q))])
    tot = led.totals()["search"]
    # each query is charged the whole index it was compared against, however it was batched
    assert tot["bytes_scanned"] == x.size * 4 * len(q) and tot["calls"] == len(q)
    assert led.per_question()["q1"]["search"]["bytes_scanned"] == x.size * 4
    assert led.per_question()["q0"]["search"]["flops"] == 2.0 * x.size
    _, want = _brute(x, q, 10)
    for st in ("fp16", "bf16", "int8"):
        idx = DenseIndex.build(x, storage=st)
        got = idx.search(q, 10)[1].numpy()
        recall = np.mean([len(set(got[r]) & set(want[r])) / 10 for r in range(len(q))])
        assert recall >= 0.95, (st, recall)
        assert idx.bytes_per_search() < fp32.bytes_per_search()


def test_faiss_factories_build_and_train(data, tmp_path):
    x, q = data
    want_s, want = _brute(x, q, 10)
    ivf = DenseIndex.build(x, "faiss", factory="IVF8,Flat", search_params={"nprobe": 8})
    assert_topk_agree(*ivf.search(q, 10), want_s, want, atol=TOL)  # all lists probed: exact
    ivf.save(tmp_path / "ivf")  # IVF lists load memory-mapped; search params travel with the index
    back = DenseIndex.load(tmp_path / "ivf")
    assert back.describe()["search_params"] == {"nprobe": 8} and torch.equal(back.search(q, 10)[1], ivf.search(q, 10)[1])
    hnsw = DenseIndex.build(x, "faiss", factory="HNSW16", search_params={"efSearch": 128})
    got = hnsw.search(q, 10)[1].numpy()
    assert np.mean([len(set(got[r]) & set(want[r])) / 10 for r in range(len(q))]) >= 0.9
    with pytest.raises(ConfigError, match="factory"):
        DenseIndex.build(x, "faiss", factory="NoSuchIndex42")
    with pytest.raises(ConfigError, match="search parameter"):
        DenseIndex.build(x, "faiss", factory="Flat", search_params={"nprobe": 3})


def test_bad_input_errors(data):
    x, q = data
    idx = DenseIndex.build(x)
    with pytest.raises(DataError, match="dimension"):
        idx.search(q[:, :5], 3)
    bad = q.copy()
    bad[0, 0] = np.nan
    with pytest.raises(DataError, match="NaN"):
        idx.search(bad, 3)
    with pytest.raises(ValueError, match="exceeds"):
        idx.search(q, len(x) + 1)
    with pytest.raises(ValueError, match=">= 1"):
        idx.search(q, 0)
    with pytest.raises(ValueError, match="exclude has"):
        idx.search(q, 3, exclude=[[1]])
    with pytest.raises(DataError, match="empty"):
        DenseIndex.build(np.zeros((0, 4), np.float32))
    with pytest.raises(DataError, match="floating"):
        DenseIndex.build(np.ones((4, 4), np.int32))
    with pytest.raises(ConfigError, match="storage"):
        DenseIndex.build(x, storage="fp8")
    with pytest.raises(ConfigError, match="backend"):
        DenseIndex.build(x, "annoy")


@pytest.mark.parametrize("shards", [1, 3, 8])
def test_sharded_equals_unsharded(data, shards):
    x, q = data
    ex = [[int(j) for j in np.random.default_rng(r).choice(len(x), 40, replace=False)] for r in range(len(q))]
    whole = DenseIndex.build(x)
    sh = ShardedIndex.split(x, shards)
    assert len(sh) == len(x) and len(sh.shards) == shards
    for kw in ({}, {"exclude": ex}, {"min_score": 0.2}):
        s1, i1 = whole.search(q, 12, **kw)
        s2, i2 = sh.search(q, 12, **kw)
        # the shards' results are merged by score: the same up to near-ties (a shard's rows may
        # fall in a different kernel block than in the whole, summing in another order)
        assert_topk_agree(s1, i1, s2, i2, atol=TOL, min_score=kw.get("min_score"))
    led = CostLedger()
    sh.search(q, 5, ledger=led)
    assert led.totals()["search"]["bytes_scanned"] == x.size * 4 * len(q)


def test_sharded_from_memory_map_keeps_views(data, tmp_path):
    x, q = data
    DenseIndex.build(x).save(tmp_path / "ix")
    mm = DenseIndex.load(tmp_path / "ix")
    sh = ShardedIndex.split(mm, 4)
    assert all(isinstance(s.vectors, np.memmap) for s in sh.shards)  # slices, no copies
    assert_topk_agree(*sh.search(q, 5), *mm.search(q, 5), atol=TOL)


@pytest.fixture(scope="module")
def small_corpus():
    from ragfast.data import Corpus

    facts = [
        ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris, completed in 1889."),
        ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, in the Himalayas."),
        ("Photosynthesis", "Photosynthesis converts light energy into chemical energy in plants."),
        ("Python (language)", "Python is a high-level programming language created by Guido van Rossum."),
        ("Great Barrier Reef", "The Great Barrier Reef is the world's largest coral reef system, off Australia."),
        ("Amazon River", "The Amazon River in South America is the largest river by discharge volume."),
    ]
    filler = [(f"Filler {i}", f"Unrelated filler passage number {i} about subject {i % 7} and nothing else.")
              for i in range(60)]
    rows = [{"id": str(i), "contents": f'"{t}"\n{b}'} for i, (t, b) in enumerate(facts + filler)]
    return Corpus.from_rows(rows)


def test_dense_retriever_and_cached_builder(small_corpus, tmp_path, monkeypatch):
    from ragfast.encoders.encoder import Encoder

    led = CostLedger()
    r = build_default_retriever(small_corpus, cache_dir=tmp_path, progress=False, chunk_size=16)
    assert isinstance(r.index.vectors, np.memmap)  # 5 chunks consolidated once, then mapped
    hits = r.search(["Which tower was finished in 1889 in Paris?", "highest mountain on earth"], 3,
                    ledger=led, question_ids=["a", "b"])
    assert [h[0].id for h in hits] == ["0", "1"]
    assert hits[0][0].document == small_corpus.row(0) and hits[0][0].title == "Eiffel Tower"
    assert hits[0][0].score >= hits[0][1].score >= hits[0][2].score
    per_q = led.per_question()
    assert per_q["a"]["encoder"]["input_tokens"] > 0 and per_q["b"]["search"]["bytes_scanned"] > 0
    again = r.search(["Which tower was finished in 1889 in Paris?"], 3, exclude=[["0", "not-an-id"]])
    assert "0" not in [h.id for h in again[0]] and len(again[0]) == 3
    assert r.search([], 3) == []
    assert r.describe()["encoder"]["preset"] == "minilm" and r.describe()["passages"] == len(small_corpus)

    # A second build reuses the cached embeddings: no passage is encoded again.
    def boom(*a, **k):
        raise AssertionError("re-encoded a cached corpus")

    monkeypatch.setattr(Encoder, "encode_passages", boom)
    r2 = build_default_retriever(small_corpus, encoder=r.encoder, cache_dir=tmp_path, progress=False,
                                 storage="int8")
    assert r2.search(["coral reef off Australia"], 1)[0][0].id == "4"
    with pytest.raises(DataError, match="vectors but the corpus"):
        DenseRetriever(r.encoder, DenseIndex.build(np.ones((3, 384), np.float32)), small_corpus)


def test_sharded_save_load_in_processes(data, tmp_path):
    x, q = data
    whole = DenseIndex.build(x)
    ShardedIndex.split(x, 2).save(tmp_path / "sh")
    inproc = ShardedIndex.load(tmp_path / "sh")
    assert all(isinstance(s.vectors, np.memmap) for s in inproc.shards)
    ex = [[int(j) for j in np.random.default_rng(r).choice(len(x), 25, replace=False)] for r in range(len(q))]
    want = whole.search(q, 9, exclude=ex)
    with ShardedIndex.load(tmp_path / "sh", processes=True, threads_per_shard=1) as procs:
        pids = {s.describe()["process"] for s in procs.shards}
        assert len(pids) == 2  # one process per shard
        got = procs.search(q, 9, exclude=ex)
        assert_topk_agree(*got, *want, atol=TOL)
        with pytest.raises(ValueError, match="exceeds"):
            procs.search(q, len(x) + 1)
        assert_topk_agree(*procs.search(q, 4), *whole.search(q, 4), atol=TOL)  # still serving after an error
    with pytest.raises(DataError, match="sharded.json"):
        ShardedIndex.load(tmp_path)

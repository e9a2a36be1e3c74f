"""The Ray-sharded flat index (ragfast.retrieval.ray_index) equals the unsharded one, ties and
excludes included, and names bad input.

One local Ray cluster (2 CPUs, the conftest `cluster` fixture) serves the whole module. The stand-in encoder lives in this
module, which Ray ships to its actors by value.
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from topk_compare import assert_topk_agree

ray = pytest.importorskip("ray")

from ragfast.errors import ConfigError, DataError  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# -- sharded index -------------------------------------------------------------------------------

def _tie_aware_equal(s1, i1, s2, i2, tol=1e-5):
    assert_topk_agree(s1, i1, s2, i2, atol=tol)


class HashEncoder:
    """A deterministic stand-in query encoder: each text maps to a fixed random vector."""

    def __init__(self, dim: int):
        self.dim = dim

    def describe(self):
        return {"name": "hash", "dim": self.dim}

    def encode_queries(self, texts, *, ledger=None, question_ids=None):
        import zlib

        import torch

        return torch.from_numpy(np.stack([np.random.default_rng(zlib.crc32(t.encode())).standard_normal(self.dim)
                                          for t in texts]).astype(np.float32))


def test_ray_sharded_equals_unsharded(cluster, tmp_path):
    from ragfast.data import Corpus
    from ragfast.retrieval.ray_index import sharded_dense_retriever, write_vectors
    from ragfast.retrieval.dense import DenseIndex, DenseRetriever

    rng = np.random.default_rng(7)
    n, d = 389, 24
    emb = rng.standard_normal((n, d)).astype(np.float32)
    emb[200] = emb[5]  # exact ties across the shard boundary: the lower id must win
    emb[388] = emb[5]
    emb[300] = emb[194]
    path = write_vectors(emb, tmp_path / "vectors")
    q = rng.standard_normal((6, d)).astype(np.float32)
    q[0] = emb[5] * 3.0  # row 5 and its copies are the top hits of query 0
    storage = "fp32"
    ref = DenseIndex.build(emb, storage=storage)
    corpus = Corpus.from_rows({"id": f"p{i}", "contents": f'"T{i}"\ntext {i}'} for i in range(n))
    sharded = sharded_dense_retriever(corpus, path, 2, encoder=HashEncoder(d), shard_cpus=0.5)
    with sharded.index as idx:
        # The sharded index is a drop-in DenseIndex: the retriever over it returns the same hits.
        enc = HashEncoder(d)
        texts = ["who wrote it", "a river", "the 1990s"]
        got = sharded.search(texts, 4, exclude=[["p1"], [], ["p200", "p5"]])
        want = DenseRetriever(enc, ref, corpus).search(texts, 4, exclude=[["p1"], [], ["p200", "p5"]])
        # the same hits up to near-ties (tests/topk_compare.py): compare as row indices
        ids_of = (lambda rows: [[int(h.id[1:]) for h in r] for r in rows])  # passage "p<i>" is row i
        _tie_aware_equal([[h.score for h in r] for r in got], ids_of(got),
                         [[h.score for h in r] for r in want], ids_of(want))
        assert len(idx) == n and idx.dim == d and idx.num_shards == 2
        infos = idx.describe()["shards"]
        assert [i["lo"] for i in infos] == [0, 195] and [i["hi"] for i in infos] == [195, 389]
        # Both shards map the same file; their byte ranges tile it.
        assert infos[1]["offset_bytes"] - infos[0]["offset_bytes"] == 195 * d * 4
        assert all(i["mmap"] for i in infos)
        assert all(i["zero_copy"] == (storage == "fp32") for i in infos)
        for k in (1, 7, 50):
            s1, i1 = idx.search(q, k)
            s2, i2 = ref.search(q, k)
            _tie_aware_equal(s1, i1, s2, i2)
        s1, i1 = idx.search(q, 3)
        assert i1[0].tolist() == [5, 200, 388]  # bitwise ties ordered by row id, across shards
        ex = [[5, 200], [], [1, 2, 3], [], [388], list(range(0, 389, 2))]
        s1, i1 = idx.search(q, 5, exclude=ex, min_score=0.0)
        s2, i2 = ref.search(q, 5, exclude=ex, min_score=0.0)
        _tie_aware_equal(s1, i1, s2, i2)
        assert not set(i1[5].tolist()) & set(ex[5])
        from ragfast.accounting.ledger import CostLedger

        led = CostLedger()
        idx.search(q[:2], 3, ledger=led, question_ids=["a", "b"])
        assert led.totals()["search"]["bytes_scanned"] == 2 * idx.bytes_per_search()  # per query
        with pytest.raises(DataError, match="dimension"):
            idx.search(q[:, :5], 3)
        with pytest.raises(ValueError, match="exceeds"):
            idx.search(q, n + 1)


def test_ray_sharded_bad_input(cluster, tmp_path):
    from ragfast.retrieval.ray_index import RayShardedIndex, write_vectors

    with pytest.raises(DataError, match="no vectors"):
        RayShardedIndex(tmp_path / "missing.npy", 2)
    path = write_vectors(np.ones((4, 3), np.float32), tmp_path / "v.npy")
    with pytest.raises(ConfigError, match="num_shards"):
        RayShardedIndex(path, 5, shard_cpus=0.1)
    (tmp_path / "x.json").write_text(json.dumps({}))
    with pytest.raises(DataError, match="not a .npy"):
        RayShardedIndex(tmp_path / "x.json", 2)

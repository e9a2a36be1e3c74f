"""Shard boundaries: exclusion of every shard's first and last row, and tie order across shards.

The data are small integers, so every inner product is exact in fp32 whatever the kernel's
summation order: ties are real ties, and the oracle is a numpy brute force with the contract's
tie order (score descending, then row id ascending).
"""
import numpy as np
import pytest

from ragfast.retrieval.dense import DenseIndex, ShardedIndex
from ragfast.retrieval.merge import merge_topk, shard_exclude


def _oracle(x, q, k, exclude=None):
    s = (q.astype(np.float64) @ x.T.astype(np.float64))
    if exclude is not None:
        for r, ex in enumerate(exclude):
            s[r, list(ex)] = -np.inf
    ids = np.argsort(-s, axis=1, kind="stable")[:, :k]  # stable: equal scores keep ascending ids
    sc = np.take_along_axis(s, ids, axis=1)
    return sc.astype(np.float32), np.where(np.isfinite(sc), ids, -1)


def _bounds(sh):
    return [(int(sh.offsets[s]), int(sh.offsets[s + 1])) for s in range(len(sh.shards))]


def test_shard_exclude_hand_cases():
    ex = [[0, 3, 4, 6, 7, 9], [], [5, 2]]
    # rows 3..6: both ends are kept, 2 and 7 are outside; order within a list is kept
    assert shard_exclude(ex, 3, 7) == [[0, 1, 3], [], [2]]
    assert shard_exclude(ex, 0, 3) == [[0], [], [2]]
    assert shard_exclude(ex, 7, 10) == [[0, 2], [], []]
    assert shard_exclude(None, 0, 5) is None


def test_merge_topk_hand_ties_and_empty_slots():
    # shard 0 = rows 0..2, shard 1 = rows 3..5; row 4 (local 1) ties row 1, row 3 ties row 0
    p0 = (np.array([[2.0, 1.0, -np.inf]], np.float32), np.array([[0, 1, -1]]))
    p1 = (np.array([[2.0, 1.0, 0.5]], np.float32), np.array([[0, 1, 2]]))
    s, i = merge_topk([p1, p0][::-1], [0, 3], 5)  # shard order as given: 0 then 1
    assert i.tolist() == [[0, 3, 1, 4, 5]] and s.tolist() == [[2.0, 2.0, 1.0, 1.0, 0.5]]
    # the later shard listed first changes nothing: the order is by (score, global id)
    s2, i2 = merge_topk([p1, p0], [3, 0], 6)
    assert i2.tolist() == [[0, 3, 1, 4, 5, -1]] and np.isneginf(s2[0, -1])
    assert s2.dtype == np.float32 and i2.dtype == np.int64 and i2.flags.c_contiguous


@pytest.fixture(scope="module")
def tied():
    """91 rows in {-2..2}^7, 4 shards whose first rows are all one vector and last rows another."""
    rng = np.random.default_rng(30)
    x = rng.integers(-2, 3, size=(91, 7)).astype(np.float32)
    q = rng.integers(-2, 3, size=(6, 7)).astype(np.float32)
    sh = ShardedIndex.split(x, 4)
    a, b = 3 * rng.integers(-2, 3, size=(2, 7))  # big norms: the copies tie at the top
    for lo, hi in _bounds(sh):
        x[lo], x[hi - 1] = a, b
    return x, q


def test_ties_across_shards_come_in_row_order(tied):
    x, q = tied
    want_s, want_i = _oracle(x, q, 16)
    sh = ShardedIndex.split(x, 4)
    s, i = sh.search(q, 16)
    # the planted copies make many exact ties across shards at the top of every query
    assert any(len(set(row[:8].tolist())) < 8 for row in want_s)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(i.numpy(), want_i)
    _, i1 = DenseIndex.build(x).search(q, 16)  # the unsharded index keeps the same order
    np.testing.assert_array_equal(i1.numpy(), want_i)


@pytest.mark.parametrize("shards", [2, 4, 7])
def test_every_shard_first_and_last_row_excluded(shards):
    rng = np.random.default_rng(shards)
    x = rng.integers(-2, 3, size=(53, 9)).astype(np.float32)
    sh = ShardedIndex.split(x, shards)
    edges = sorted({r for lo, hi in _bounds(sh) for r in (lo, hi - 1)})
    q = 3 * x[edges] + rng.integers(-1, 2, size=(len(edges), 9))  # each query's winner is an edge row
    q = q.astype(np.float32)
    _, top = _oracle(x, q, 1)
    assert set(top[:, 0].tolist()) & set(edges)  # the exclusions below bite
    ex = [list(edges)] * len(edges)
    want_s, want_i = _oracle(x, q, 10, ex)
    s, i = sh.search(q, 10, exclude=ex)
    assert not set(i.numpy().ravel().tolist()) & set(edges)
    np.testing.assert_array_equal(s.numpy(), want_s)
    np.testing.assert_array_equal(i.numpy(), want_i)
    # one edge at a time: only that row disappears
    for e in (edges[0], edges[-1], edges[len(edges) // 2]):
        ws, wi = _oracle(x, q, 10, [[e]] * len(q))
        gs, gi = sh.search(q, 10, exclude=[[e]] * len(q))
        np.testing.assert_array_equal(gi.numpy(), wi)
        np.testing.assert_array_equal(gs.numpy(), ws)


def test_merge_topk_output_types():
    # shards may hand back float64 scores and int32 ids: the merge promises float32 / int64
    s, i = merge_topk([(np.array([[0.5, 0.25]]), np.array([[1, 0]], np.int32))], [5], 2)
    assert s.dtype == np.float32 and i.dtype == np.int64 and i.tolist() == [[6, 5]]

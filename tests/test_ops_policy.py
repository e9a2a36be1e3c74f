"""ops/policy.py's numpy references across their memory blocks, and the wrappers' checks.

The references process rows (sweep) and resamples (bootstrap) in blocks bounded by a memory
budget; the other tests' inputs fit in one block. Here the budget forces several blocks with
a short last one, against oracles computed another way: a running maximum searched per row for
the first crossing, and the documented draw stream read one resample at a time for the means.
The budgets are lowered for the test: the real ones need inputs of hundreds of MB.
"""
from __future__ import annotations

import numpy as np
import pytest

import ragfast
from ragfast.ops import policy as ops

BACKENDS = ["ref"] + (["cpp"] if ragfast.backends()["available"]["cpp"] else [])


def _first_by_running_max(scores, lengths, thresholds):
    """First state t < L with score >= h: the first index where the running maximum reaches h.
    NaN becomes -inf (never crosses a finite threshold)."""
    B = scores.shape[0]
    out = np.full((B, thresholds.size), -1, dtype=np.int64)
    for b in range(B):
        row = np.nan_to_num(scores[b, :lengths[b]].astype(np.float64), nan=-np.inf)
        if row.size == 0:
            continue
        run = np.maximum.accumulate(row)
        t = np.searchsorted(run, thresholds, side="left")
        out[b] = np.where(t < row.size, t, -1)
    return out


def test_sweep_ref_across_row_blocks(monkeypatch):
    T, M, B = 16, 41, 7
    # a budget of 3 rows per block (the real one, 2^24 booleans, needs 2^24 / (T * M) rows):
    # blocks of 3, 3 and 1 rows
    monkeypatch.setattr(ops, "_REF_SWEEP_BLOCK", 3 * T * M + T * M - 1)
    rng = np.random.default_rng(20261201)
    s = rng.normal(size=(B, T))
    s[rng.random(s.shape) < 0.2] = np.nan
    L = np.array([16, 0, 9, 16, 5, 1, 12])
    finite = s[np.isfinite(s)]
    h = np.concatenate([rng.normal(size=M - 12) * 1.5, rng.choice(finite, 12)])  # ties with scores
    got = ops.sweep(s, h, L, backend="ref")
    want = _first_by_running_max(s, L, h)
    assert got.dtype == np.int64 and got.shape == (B, M)
    np.testing.assert_array_equal(got, want)
    assert (got[1] == -1).all()  # an empty trajectory never stops
    assert (got >= 0).any() and (got == -1).any() and (got[[0, 3, 6]] > 0).any()
    # a budget below one row still makes progress, one row per block
    monkeypatch.setattr(ops, "_REF_SWEEP_BLOCK", 1)
    np.testing.assert_array_equal(ops.sweep(s, h, L, backend="ref"), want)


def test_bootstrap_ref_across_resample_blocks(monkeypatch):
    n, R, seed = 101, 8, 77
    # a budget of 3 resamples per block (the real one holds 2^23 indices): blocks of 3, 3 and 2
    monkeypatch.setattr(ops, "_REF_BOOT_BLOCK", 4 * n - 1)
    rng = np.random.default_rng(5)
    d = np.stack([rng.integers(-1, 2, n).astype(np.float64), rng.normal(size=n)])
    got = ops.bootstrap_means(d, R, seed, backend="ref")
    draws = np.random.default_rng(seed)  # the documented stream: integers(0, n, (R, n)), row by row
    for r in range(R):
        idx = draws.integers(0, n, (1, n))[0]
        np.testing.assert_allclose(got[:, r], d[:, idx].mean(axis=1), rtol=0, atol=1e-12)
    # a budget below one resample still makes progress, one per block
    monkeypatch.setattr(ops, "_REF_BOOT_BLOCK", 1)
    np.testing.assert_allclose(ops.bootstrap_means(d, R, seed, backend="ref"), got, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bootstrap_means_shapes_defaults_and_out(backend):
    d = np.array([1.0, 0.0, -1.0, 1.0, 1.0])
    # defaults: 10000 resamples, seed 0
    m = ops.bootstrap_means(d, backend=backend)
    assert m.shape == (10000,)
    np.testing.assert_array_equal(m, ops.bootstrap_means(d, 10000, 0, backend=backend))
    # every resample mean is a multiple of 1/5 inside [min, max]
    assert np.allclose(m * 5, np.round(m * 5)) and m.min() >= -1 and m.max() <= 1
    # a 1-D out of the resamples' length is filled in place
    out = np.full(7, np.nan)
    res = ops.bootstrap_means(d, 7, 3, out=out, backend=backend)
    assert np.shares_memory(res, out) and np.isfinite(out).all()
    np.testing.assert_array_equal(out, ops.bootstrap_means(d, 7, 3, backend=backend))
    with pytest.raises(ValueError, match=r"^bootstrap: out must have shape \(7,\)$"):
        ops.bootstrap_means(d, 7, 3, out=np.zeros(6), backend=backend)
    with pytest.raises(ValueError, match=r"^bootstrap: out must have shape \(7,\)$"):
        ops.bootstrap_means(d, 7, 3, out=[0.0] * 7, backend=backend)
    if backend == "ref":  # a strided out is refused (the compiled binding words it its own way)
        with pytest.raises(ValueError, match=r"^bootstrap: out must be a writeable C-contiguous float64 array "
                                             r"of shape \(1, 7\)$"):
            ops.bootstrap_means(d, 7, 3, out=np.zeros(14)[::2], backend=backend)


def test_wrapper_messages_are_whole():
    with pytest.raises(ValueError, match=r"^diffs must be 1-D \[n\] or 2-D \[K, n\], got shape \(1, 1, 2\)$"):
        ops.bootstrap_means(np.zeros((1, 1, 2)))
    with pytest.raises(ValueError, match=r"^diffs must hold at least one question$"):
        ops.bootstrap_means(np.zeros((2, 0)))
    with pytest.raises(ValueError, match=r"^diffs contain NaN or inf; drop or fill those questions first$"):
        ops.bootstrap_means([0.0, np.inf])
    with pytest.raises(ValueError, match=r"^n_resamples must be >= 1, got 0$"):
        ops.bootstrap_means([0.0], 0)
    with pytest.raises(ValueError, match=r"^seed must be a non-negative integer, got -1$"):
        ops.bootstrap_means([0.0], 5, -1)
    assert ops.bootstrap_means([2.5], 1, 0).tolist() == [2.5]  # one resample, seed 0: both bounds allowed
    with pytest.raises(ValueError, match=r"^scores must be a 2-D \[trajectories, states\] array, got shape \(3,\)$"):
        ops.sweep(np.zeros(3), [0.0])
    with pytest.raises(TypeError, match=r"^scores must be numeric, got dtype <U1$"):
        ops.sweep(np.array([["a"]]), [0.0])
    with pytest.raises(ValueError, match=r"^thresholds must be a scalar or 1-D, got shape \(1, 1\)$"):
        ops.sweep(np.zeros((1, 1)), [[0.0]])
    with pytest.raises(ValueError, match=r"^thresholds contain NaN; use \+inf for 'never stop'$"):
        ops.sweep(np.zeros((1, 1)), [np.nan])
    with pytest.raises(ValueError, match=r"^lengths must be 1-D with one entry per trajectory \(2\), got shape \(1,\)$"):
        ops.sweep(np.zeros((2, 3)), [0.0], [1])
    with pytest.raises(ValueError, match=r"^lengths must be whole numbers of states$"):
        ops.sweep(np.zeros((2, 3)), [0.0], [1.5, 2.0])
    with pytest.raises(ValueError, match=r"^lengths must be whole numbers of states$"):
        ops.sweep(np.zeros((2, 3)), [0.0], [np.nan, 2.0])
    with pytest.raises(ValueError, match=r"^lengths\[0\]=-1 is outside \[0, 3\] \(T = number of state columns\)$"):
        ops.sweep(np.zeros((2, 3)), [0.0], [-1, 2])
    # the first bad entry is named, not an empty trajectory (0 states) before it,
    with pytest.raises(ValueError, match=r"^lengths\[1\]=5 is outside \[0, 3\]"):
        ops.sweep(np.zeros((2, 3)), [0.0], [0, 5])
    # nor a full one (T states) before it
    with pytest.raises(ValueError, match=r"^lengths\[1\]=5 is outside \[0, 3\]"):
        ops.sweep(np.zeros((2, 3)), [0.0], [3, 5])
    with pytest.raises(ValueError, match=r"^sweep: out must be a writeable C-contiguous int64 array of shape \(2, 1\)$"):
        ops.sweep(np.zeros((2, 3)), [0.0], out=np.zeros((2, 2), dtype=np.int64)[:, :1], backend="ref")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_converts_other_types_and_whole_float_lengths(backend):
    # bool and int scores are compared as float64; whole float lengths are accepted
    s_bool = np.array([[False, True, True], [False, False, False]])
    assert ops.sweep(s_bool, [0.5, 1.0], backend=backend).tolist() == [[1, 1], [-1, -1]]
    s_int = np.array([[1, 3, 2], [5, 0, 0]], dtype=np.int32)
    assert ops.sweep(s_int, [2.0, 4.0], np.array([3.0, 1.0]), backend=backend).tolist() == [[1, -1], [0, 0]]
    # a scalar threshold is one column
    assert ops.sweep(s_int, 3, backend=backend).tolist() == [[1], [0]]
    if backend == "ref":  # a read-only out is refused
        ro = np.zeros((2, 1), dtype=np.int64)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writeable C-contiguous int64"):
            ops.sweep(s_int, 3, out=ro, backend=backend)

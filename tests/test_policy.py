"""First crossing, threshold sweeps (C++ against the numpy reference), threshold selection and
counterfactual policy evaluation."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ragfast
from ragfast.ops.policy import bootstrap_means
from ragfast.methods.s2g.policy import (evaluate_policy, first_crossing, outcome_at, select_threshold, stop_precision_recall,
                            sweep, threshold_curve)

HAS_CPP = ragfast.backends()["available"]["cpp"]
BACKENDS = ["ref"] + (["cpp"] if HAS_CPP else [])
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="ragfast._C not built")


def _brute_first(scores, lengths, h):
    """Obvious double loop: the oracle of the oracle."""
    B, T = scores.shape
    out = np.full(B, -1, dtype=np.int64)
    for b in range(B):
        for t in range(int(lengths[b])):
            if scores[b, t] >= h:  # NaN compares False
                out[b] = t
                break
    return out


# -- first_crossing edge cases -----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_at_threshold_cross(backend):
    s = np.array([[0.2, 0.5, 0.9], [0.5, 0.1, 0.1], [0.49999, 0.4, 0.3]])
    assert first_crossing(s, 0.5, backend=backend).tolist() == [1, 0, -1]
    # float32 score equal to the float32-rounded threshold crosses
    s32 = np.array([[0.1, 0.7]], dtype=np.float32)
    assert first_crossing(s32, float(np.float32(0.7)), backend=backend).tolist() == [1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_never_crosses(backend):
    s = np.array([[np.nan, np.nan, 3.0], [np.nan, np.nan, np.nan], [np.nan, 5.0, np.nan]])
    assert first_crossing(s, 1.0, backend=backend).tolist() == [2, -1, 1]
    # even the lowest threshold does not make a NaN state cross
    assert first_crossing(s, -np.inf, backend=backend).tolist() == [2, -1, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_padded_trajectories(backend):
    s = np.array([[9.0, 9.0, 9.0], [0.0, 0.0, 9.0], [9.0, 9.0, 9.0]])
    assert first_crossing(s, 1.0, lengths=[0, 2, 3], backend=backend).tolist() == [-1, -1, 0]
    # zero states at all
    assert first_crossing(np.zeros((4, 0)), 0.0, backend=backend).tolist() == [-1] * 4
    assert first_crossing(np.zeros((0, 3)), 0.0, backend=backend).shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inf_threshold_never_stops_finite_scores(backend):
    s = np.array([[1e300, -1.0], [np.inf, 0.0]])
    assert first_crossing(s, np.inf, backend=backend).tolist() == [-1, 0]


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=9),
                  elements=st.one_of(st.sampled_from([np.nan, -1.0, 0.0, 0.5, 1.0]),
                                     st.floats(-3, 3, allow_nan=False))),
       st.lists(st.sampled_from([-np.inf, -1.0, 0.0, 0.5, 1.0, np.inf]), min_size=1, max_size=6),
       st.data())
def test_sweep_property_against_brute_force(scores, thresholds, data):
    B, T = scores.shape
    L = np.array(data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B)), dtype=np.int64)
    expect = np.stack([_brute_first(scores, L, h) for h in thresholds], axis=1) if B else np.zeros((0, len(thresholds)))
    for backend in BACKENDS:
        np.testing.assert_array_equal(sweep(scores, thresholds, L, backend=backend), expect)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="2-D"):
        first_crossing(np.zeros(3), 0.0)
    with pytest.raises(ValueError, match="NaN"):
        sweep(np.zeros((2, 2)), [0.0, np.nan])
    with pytest.raises(ValueError, match=r"lengths\[1\]=5 is outside \[0, 3\]"):
        first_crossing(np.zeros((2, 3)), 0.0, lengths=[1, 5])
    with pytest.raises(ValueError, match="one entry per trajectory"):
        first_crossing(np.zeros((2, 3)), 0.0, lengths=[1])
    with pytest.raises(ValueError, match="scalar"):
        first_crossing(np.zeros((2, 3)), [0.0, 1.0])
    with pytest.raises(TypeError, match="numeric"):
        sweep(np.array([["a"]]), [0.0])


# -- C++ against the reference ------------------------------------------------------------------
@needs_cpp
@pytest.mark.parametrize("B,T,M", [(1, 1, 1), (19, 5, 7), (123, 17, 200), (989, 4, 33)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sweep_cpp_matches_ref(B, T, M, dtype):
    rng = np.random.default_rng()  # fresh inputs every run
    s = rng.normal(size=(B, T)).astype(dtype)
    s[rng.random(s.shape) < 0.15] = np.nan
    # ties: some thresholds equal to scores
    finite = s[np.isfinite(s)]
    h = np.concatenate([rng.normal(size=M - M // 2), rng.choice(finite, M // 2)]) if finite.size else rng.normal(size=M)
    h = h.astype(np.float64)
    L = rng.integers(0, T + 1, B)
    ref = sweep(s, h, L, backend="ref")
    got = sweep(s, h, L, backend="cpp")
    assert got.dtype == np.int64 and got.shape == (B, M)
    np.testing.assert_array_equal(got, ref)
    for m in range(0, M, max(1, M // 5)):
        np.testing.assert_array_equal(ref[:, m], _brute_first(s.astype(np.float64), L, h[m]))


@needs_cpp
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sweep_cpp_non_contiguous(dtype):
    rng = np.random.default_rng()
    base = rng.normal(size=(7, 45)).astype(dtype)
    s = base.T[::2]  # transposed and strided: shape (23, 7)
    assert not s.flags.c_contiguous
    h = rng.normal(size=41)[::2]
    L = rng.integers(0, 8, 3 * s.shape[0])[::3]  # strided lengths too
    np.testing.assert_array_equal(sweep(s, h, L, backend="cpp"), sweep(np.ascontiguousarray(s), h, L, backend="ref"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sweep_writes_every_output(backend):
    """Poison a caller-provided output: every element must be overwritten, and rightly."""
    rng = np.random.default_rng()
    s = rng.normal(size=(31, 6))
    s[rng.random(s.shape) < 0.2] = np.nan
    h = np.linspace(-2, 2, 13)
    L = rng.integers(0, 7, 31)
    out = np.full((31, 13), -7777, dtype=np.int64)
    res = sweep(s, h, L, out=out, backend=backend)
    assert np.shares_memory(res, out) and (out != -7777).all()
    for m in range(13):
        np.testing.assert_array_equal(out[:, m], _brute_first(s, L, h[m]))
    with pytest.raises(ValueError, match="out"):
        sweep(s, h, L, out=np.zeros((31, 12), dtype=np.int64), backend=backend)
    with pytest.raises(ValueError, match="out"):
        sweep(s, h, L, out=np.zeros((31, 13), dtype=np.int32), backend=backend)


@needs_cpp
def test_cpp_binding_rejects_bad_shapes():
    import ragfast._C as C

    with pytest.raises(ValueError, match="lengths has 2 entries for 3 rows"):
        C.sweep_first_crossing(np.zeros((3, 2)), np.zeros(2, dtype=np.int64), np.zeros(1))
    with pytest.raises(ValueError, match=r"outside \[0, 2\]"):
        C.sweep_first_crossing(np.zeros((1, 2)), np.array([3], dtype=np.int64), np.zeros(1))
    with pytest.raises(ValueError, match="n_resamples"):
        C.bootstrap_means(np.zeros(3), 0, 1)


# -- select_threshold: constructed cases with known answers ------------------------------------
def test_select_threshold_known_answer():
    # descending: 0.9(1) 0.8(1) 0.7(0) 0.6(1) 0.5(0)
    sc = np.array([0.6, 0.9, 0.5, 0.8, 0.7])
    y = np.array([1, 1, 0, 1, 0])
    assert select_threshold(sc, y, 0.90) == 0.8  # precision 1.0, recall 2/3; 0.6 has precision 0.75
    assert select_threshold(sc, y, 0.75) == 0.6  # exactly 3/4: the tie at the bound is feasible
    assert select_threshold(sc, y, 0.70) == 0.6
    # everything feasible: recall 1 is reached at 0.6 and at 0.5; the tie goes to the higher
    assert select_threshold(sc, y, 0.0) == 0.6


def test_select_threshold_recall_tie_picks_higher_threshold():
    # 0.9 and 0.8 both reach recall 1 (0.8 adds a negative: precision 1/2, still feasible at
    # 0.5); 0.1 adds another (1/3, infeasible). The tie goes to the more conservative 0.9.
    sc = np.array([0.9, 0.8, 0.1])
    y = np.array([1, 0, 0])
    assert select_threshold(sc, y, 0.5) == 0.9
    assert select_threshold(sc, y, 0.5, groups=[0, 1, 2]) == 0.9


def test_select_threshold_infeasible_and_nan():
    sc = np.array([0.9, 0.8, np.nan, 0.3])
    y = np.array([0, 0, 1, 1])
    # the only positives are a NaN (never stops) and the lowest score: best precision is 1/3
    assert select_threshold(sc, y, 0.9) == np.inf
    assert select_threshold(sc, y, 0.3) == 0.3
    assert select_threshold([np.nan, np.nan], [1, 1]) == np.inf
    assert select_threshold([], []) == np.inf
    with pytest.raises(ValueError, match="min_precision"):
        select_threshold(sc, y, 1.5)
    with pytest.raises(ValueError, match="0/1"):
        select_threshold(sc, [0, 2, 1, 1])


def test_select_threshold_grouped_first_crossing():
    # q0: [0.2 (0), 0.9 (1)]; q1: [0.8 (0), 0.95 (1)]; q2: [0.7 (1)]
    sc = np.array([0.2, 0.9, 0.8, 0.95, 0.7])
    y = np.array([0, 1, 0, 1, 1])
    g = np.array(["q0", "q0", "q1", "q1", "q2"])
    # Per state, 0.7 has precision 3/4 and recall 1. Under first crossing, q1 stops at its
    # unsafe first state for any threshold <= 0.8; only >= 0.9 keeps every stop right.
    assert select_threshold(sc, y, 0.75) == 0.7
    assert select_threshold(sc, y, 0.75, groups=g) == 0.9
    p, r, n = stop_precision_recall(sc, y, [0.7, 0.9], groups=g)
    np.testing.assert_allclose(p, [2 / 3, 1.0])
    np.testing.assert_allclose(r, [2 / 3, 2 / 3])
    assert n.tolist() == [3, 2]


@pytest.mark.parametrize("seed", range(5))
def test_select_threshold_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 60
    sc = np.round(rng.normal(size=n), 1)  # many ties
    sc[rng.random(n) < 0.1] = np.nan
    y = (rng.random(n) < 1 / (1 + np.exp(-2 * np.nan_to_num(sc)))).astype(int)
    g = rng.integers(0, 15, n)
    for groups in (None, g):
        cands = np.unique(sc[np.isfinite(sc)])
        brute = [_brute_prec_rec(sc, y, c, groups) for c in cands]
        p, r, ns = stop_precision_recall(sc, y, cands, groups=groups)
        np.testing.assert_array_equal(ns, [b[2] for b in brute])
        np.testing.assert_allclose(p, [b[0] for b in brute], equal_nan=True)
        np.testing.assert_allclose(r, [b[1] for b in brute], equal_nan=True)
        for mp in (0.5, 0.7, 0.9):
            best = (np.inf, -1)
            for c, (pc, rc, nc) in zip(cands, brute):
                if nc > 0 and pc >= mp:
                    key = (np.nan_to_num(rc), c)
                    if best[1] < 0 or key > (best[1], best[0]):
                        best = (c, key[0])
            assert select_threshold(sc, y, mp, groups=groups) == best[0]


def _brute_prec_rec(sc, y, c, groups):
    """Plain loops: every state its own decision, or (groups) each question stops at its first
    state in order with score >= c; precision = right stops / stops, recall = right stops /
    questions (states) with anything right."""
    if groups is None:
        decisions = [[i] for i in range(len(sc))]
    else:
        decisions = [[i for i in range(len(sc)) if groups[i] == q] for q in dict.fromkeys(groups.tolist())]
    stops = right = positives = 0
    for states in decisions:
        positives += any(y[i] == 1 for i in states)
        hit = next((i for i in states if sc[i] >= c), None)  # NaN >= c is False
        if hit is not None:
            stops += 1
            right += int(y[hit] == 1)
    return (right / stops if stops else np.nan), (right / positives if positives else np.nan), stops


# -- counterfactual evaluation -----------------------------------------------------------------
def test_outcome_and_evaluate_policy():
    idx = np.array([1, -1, 0])
    state_em = np.array([[0, 1, 1], [1, 1, 0], [0, 0, 1]], dtype=float)
    native_em = np.array([1.0, 0.0, 1.0])
    native_searches = np.array([2, 2, 2])
    np.testing.assert_array_equal(outcome_at(idx, state_em, native_em), [1, 0, 0])
    out = evaluate_policy(idx, state_em, native_em, native_searches)
    assert out.em.tolist() == [1, 0, 0]
    assert out.searches.tolist() == [1, 2, 0]
    assert out.early.tolist() == [True, False, True]
    assert out.unsafe.tolist() == [False, False, True]
    assert out.harmful.tolist() == [False, False, True]
    # 2-D index (one column per threshold) gives one column per threshold
    both = evaluate_policy(np.stack([idx, [-1, -1, -1]], 1), state_em, native_em, native_searches)
    assert both.em.shape == (3, 2) and both.em[:, 1].tolist() == native_em.tolist()
    with pytest.raises(ValueError, match=r"index must lie in \[-1, 2\]"):
        outcome_at(np.array([3, 0, 0]), state_em, native_em)


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_curve_against_loop(backend):
    rng = np.random.default_rng(11)
    B, T = 150, 5
    S = rng.integers(1, T, B)  # native searches
    L = S + 1
    scores = rng.normal(size=(B, T))
    scores[:, 0] = np.nan  # state 0 not scored
    state_em = (rng.random((B, T)) < 0.5).astype(float)
    native_em = state_em[np.arange(B), S]
    h = np.quantile(scores[np.isfinite(scores)], [0.2, 0.5, 0.9]).tolist() + [np.inf]
    cur = threshold_curve(scores, state_em, native_em, S, h, L, n_resamples=2000, seed=3, backend=backend)
    for m, th in enumerate(h):
        idx = _brute_first(scores, L, th)
        em = np.where(idx >= 0, state_em[np.arange(B), np.maximum(idx, 0)], native_em)
        sr = np.where(idx >= 0, idx, S)
        assert cur.em[m] == pytest.approx(em.mean())
        assert cur.searches[m] == pytest.approx(sr.mean())
        assert cur.early_stops[m] == int(((idx >= 0) & (idx < S)).sum())
        d = em - native_em
        assert cur.d_em_low[m] <= d.mean() + 1e-12 <= cur.d_em_high[m] + 2e-12
        # the means of one row equal those bootstrap_means gives it alone with the same seed
        one = bootstrap_means(d, 2000, 3, backend=backend)
        assert cur.d_em_low[m] == pytest.approx(np.quantile(one, 0.025), abs=1e-12)
        # independent check of the interval against the exact bootstrap distribution: 2000
        # resamples put the 2.5% / 97.5% ends within 4 sd (0.014) of those probabilities
        lo, hi = _exact_boot_quantiles(d, [0.011, 0.039]), _exact_boot_quantiles(d, [0.961, 0.989])
        assert lo[0] - 1e-12 <= cur.d_em_low[m] <= lo[1] + 1e-12
        assert hi[0] - 1e-12 <= cur.d_em_high[m] <= hi[1] + 1e-12
    # +inf: nothing stops, nothing changes, a degenerate CI at 0 that is non-inferior
    assert cur.stops[-1] == 0 and cur.d_em[-1] == 0 and cur.d_em_low[-1] == 0 and cur.d_em_high[-1] == 0
    assert bool(cur.non_inferior[-1])
    assert len(cur.rows()) == 4


def _exact_boot_quantiles(d, probs):
    """Quantiles of the exact bootstrap distribution of the mean of values in {-1, 0, 1}: with
    (N+, N-, N0) multinomial over n draws, the mean is (N+ - N-) / n (scipy's binomials)."""
    from scipy.stats import binom

    n = d.size
    pp, pm = np.mean(d == 1), np.mean(d == -1)
    assert np.isin(d, (-1, 0, 1)).all()
    pmf = np.zeros(2 * n + 1)  # index N+ - N- + n
    for a in range(n + 1):
        w = binom.pmf(a, n, pp)
        if w == 0:
            continue
        b = np.arange(n - a + 1)
        pmf[a - b + n] += w * (binom.pmf(b, n - a, pm / (1 - pp)) if pp < 1 else (b == 0))
    cdf = np.cumsum(pmf)
    return (np.searchsorted(cdf, np.asarray(probs) - 1e-12) - n) / n


# -- every ISA level of the bootstrap tile kernel ------------------------------------------------

LEVELS = list(__import__("ragfast._C", fromlist=["isa_info"]).isa_info()["supported"]) if HAS_CPP else []


def _boot_at(level, d, R, seed):
    from ragfast import _C

    before = _C.isa_info()["chosen"]
    _C.set_isa(level)
    try:
        return bootstrap_means(d, R, seed, backend="cpp")
    finally:
        _C.set_isa(before)


@needs_cpp
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("K,n,R", [(1, 1, 1), (3, 17, 9), (13, 101, 33), (25, 64, 8)])
def test_bootstrap_every_isa_level_agrees(level, K, n, R):
    # the compiled generator is the same at every level; only the tile kernel differs (FMA or
    # not), so the means agree to rounding with the portable level and with a direct check
    rng = np.random.default_rng(K * 1000 + n)
    d = rng.normal(size=(K, n))
    got = _boot_at(level, d, R, 11)
    # oracle: the resample counts, read back through one-hot rows (row j = question j alone:
    # its resample mean is count_j / n), then numpy's matmul over the real rows
    counts = _boot_at(level, np.eye(n), R, 11) * n
    np.testing.assert_allclose(counts, np.round(counts), rtol=0, atol=1e-9)
    assert (np.round(counts).sum(0) == n).all()  # n draws with replacement per resample
    np.testing.assert_allclose(got, d @ np.round(counts) / n, rtol=0, atol=1e-12)
    if level != "generic":
        np.testing.assert_allclose(got, _boot_at("generic", d, R, 11), rtol=0, atol=1e-12)
    # one-question case: every resample mean is that question's value
    one = _boot_at(level, d[:, :1], R, 5)
    np.testing.assert_allclose(one, np.repeat(d[:, :1], R, axis=1), rtol=0, atol=1e-15)

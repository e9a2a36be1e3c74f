"""Paired bootstrap against scipy, the C++ resampler against the numpy one, ranking and
calibration metrics against scikit-learn."""
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats
from sklearn.calibration import calibration_curve
from sklearn.metrics import average_precision_score, brier_score_loss

import ragfast
from ragfast.ops.policy import bootstrap_means
from ragfast.scoring.stats import (BootstrapResult, average_precision, brier, calibration_table, non_inferiority,
                           paired_bootstrap, precision_recall, sigmoid, unsafe_stop_fraction)

HAS_CPP = ragfast.backends()["available"]["cpp"]
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="ragfast._C not built")


def _scipy(a, b, n_resamples, seed, method, confidence=0.95):
    return scipy.stats.bootstrap((a, b), lambda x, y, axis=-1: np.mean(x - y, axis=axis), paired=True,
                                 vectorized=True, n_resamples=n_resamples, rng=np.random.default_rng(seed),
                                 method=method, confidence_level=confidence)


# -- paired bootstrap --------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["percentile", "bca"])
@pytest.mark.parametrize("n", [2, 19, 123, 800])
def test_ref_bootstrap_equals_scipy(method, n):
    """The ref backend draws scipy's indices, so the intervals agree to rounding."""
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**31))
    a = rng.normal(size=n)
    b = a + rng.exponential(size=n) - 0.8  # skewed differences: BCa differs from percentile
    r = paired_bootstrap(a, b, n_resamples=3000, seed=seed, method=method, confidence=0.9, backend="ref")
    s = _scipy(a, b, 3000, seed, method, confidence=0.9)
    assert r.delta == pytest.approx(np.mean(a - b), abs=1e-14)
    assert r.low == pytest.approx(s.confidence_interval.low, abs=1e-12)
    assert r.high == pytest.approx(s.confidence_interval.high, abs=1e-12)
    assert r.se == pytest.approx(s.standard_error, rel=1e-10)


def test_em_like_binary_outcomes_match_scipy():
    rng = np.random.default_rng(7)
    a = (rng.random(800) < 0.45).astype(float)
    b = np.where(rng.random(800) < 0.9, a, 1 - a)
    for method in ("percentile", "bca"):
        r = paired_bootstrap(a, b, n_resamples=5000, seed=1, method=method, backend="ref")
        s = _scipy(a, b, 5000, 1, method)
        assert (r.low, r.high) == pytest.approx((s.confidence_interval.low, s.confidence_interval.high), abs=1e-12)


@needs_cpp
@pytest.mark.parametrize("method", ["percentile", "bca"])
def test_cpp_bootstrap_interval_close_to_scipy(method):
    """Different random stream: the intervals agree within resampling error."""
    rng = np.random.default_rng()
    n = 400
    a = rng.normal(size=n)
    b = a - rng.gamma(2.0, size=n) / 4
    r = paired_bootstrap(a, b, n_resamples=40000, seed=2, method=method, backend="cpp")
    s = _scipy(a, b, 40000, 2, method)
    se = s.standard_error
    # a 2.5% quantile of 40k resamples has a Monte-Carlo sd of about 0.02 se
    assert abs(r.low - s.confidence_interval.low) < 0.1 * se
    assert abs(r.high - s.confidence_interval.high) < 0.1 * se
    assert r.se == pytest.approx(se, rel=0.03)


@needs_cpp
def test_cpp_resample_distribution_matches_ref():
    rng = np.random.default_rng()
    d = np.concatenate([rng.normal(size=(3, 151)), (rng.random((1, 151)) < 0.3).astype(float)])
    R = 20000
    ref = bootstrap_means(d, R, 5, backend="ref")
    cpp = bootstrap_means(d, R, 5, backend="cpp")
    assert cpp.shape == ref.shape == (4, R)
    n = d.shape[1]
    for k in range(4):
        # mean of resample means: E = mean(d), sd = sd(d)/sqrt(n)/sqrt(R); variance sd(d)^2/n
        sd = d[k].std() / np.sqrt(n)
        assert abs(cpp[k].mean() - d[k].mean()) < 5 * sd / np.sqrt(R)
        assert cpp[k].std() == pytest.approx(sd, rel=0.04)
        ks = scipy.stats.ks_2samp(cpp[k], ref[k])
        assert ks.pvalue > 1e-4
    # rows share indices per resample: a row that is twice another gives exactly twice the means
    two = bootstrap_means(np.stack([d[0], 2 * d[0]]), 500, 9, backend="cpp")
    np.testing.assert_allclose(two[1], 2 * two[0], rtol=1e-12)
    one = bootstrap_means(d[0], 500, 9, backend="cpp")
    np.testing.assert_array_equal(one, two[0])


@needs_cpp
def test_cpp_bootstrap_deterministic_for_seed_and_thread_count():
    # big enough (n * 12 * R > 2**22) that the kernel runs its OpenMP team
    d = np.random.default_rng(3).normal(size=(2, 197))
    a = bootstrap_means(d, 3001, 42, backend="cpp")
    b = bootstrap_means(d, 3001, 42, backend="cpp")
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, bootstrap_means(d, 3001, 43, backend="cpp"))
    # the same call in a fresh process with one OpenMP thread
    code = ("import numpy as np, sys; from ragfast.ops.policy import bootstrap_means;"
            "d = np.random.default_rng(3).normal(size=(2, 197));"
            "sys.stdout.write(bootstrap_means(d, 3001, 42, backend='cpp').tobytes().hex())")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(np.frombuffer(bytes.fromhex(out.stdout), dtype=np.float64).reshape(2, 3001), a)


@pytest.mark.parametrize("backend", ["ref"] + (["cpp"] if HAS_CPP else []))
def test_bootstrap_inputs_and_poisoned_output(backend):
    d = np.random.default_rng().normal(size=(40, 3)).T  # non-contiguous rows
    out = np.full((3, 777), np.nan)
    res = bootstrap_means(d, 777, 0, out=out, backend=backend)
    assert np.shares_memory(res, out) and np.isfinite(out).all()
    np.testing.assert_allclose(out.mean(1), d.mean(1), atol=4 * d.std() / np.sqrt(40 * 777) + 0.05)
    np.testing.assert_array_equal(out, bootstrap_means(np.ascontiguousarray(d), 777, 0, backend=backend))
    with pytest.raises(ValueError, match="NaN"):
        bootstrap_means(np.array([1.0, np.nan]), 10, 0, backend=backend)
    with pytest.raises(ValueError, match="at least one"):
        bootstrap_means(np.zeros(0), 10, 0, backend=backend)
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_means(np.zeros(3), 0, 0, backend=backend)


def test_paired_bootstrap_rows_and_degenerate():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 50))
    b = np.zeros((3, 50))
    b[2] = a[2]  # no difference at all
    many = paired_bootstrap(a, b, n_resamples=2000, seed=4, method="bca")
    for k in range(2):
        one = paired_bootstrap(a[k], b[k], n_resamples=2000, seed=4, method="bca")
        assert (one.delta, one.low, one.high) == pytest.approx((many.delta[k], many.low[k], many.high[k]), abs=1e-12)
    assert many.delta[2] == many.low[2] == many.high[2] == 0.0
    assert isinstance(many.to_dict()["low"], list)
    with pytest.raises(ValueError, match="same shape"):
        paired_bootstrap(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="method"):
        paired_bootstrap(np.zeros(3), np.zeros(3), method="basic")
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap(np.zeros(3), np.zeros(3), confidence=95)
    with pytest.raises(ValueError, match=r"^outcomes contain NaN or inf; drop or fill those questions first$"):
        paired_bootstrap(np.array([0.0, np.nan]), np.zeros(2))


def test_non_inferiority():
    r = BootstrapResult(delta=-0.00625, low=-0.0125, high=0.0, se=0.003, method="percentile", confidence=0.95,
                        n_resamples=10000, n=800)
    v = non_inferiority(r, margin=0.02)
    assert v.non_inferior and bool(v) and v.verdict == "non-inferior"
    assert not non_inferiority((-0.03, 0.01), 0.02)
    assert not non_inferiority((-0.02, 0.01), 0.02)  # on the margin is not above it
    vs = non_inferiority(BootstrapResult(np.zeros(2), np.array([-0.01, -0.05]), np.zeros(2), np.zeros(2),
                                         "bca", 0.95, 10, 5), 0.02)
    assert [x.non_inferior for x in vs] == [True, False]
    with pytest.raises(ValueError, match="margin"):
        non_inferiority((-0.01, 0.0), -1)


# -- ranking and calibration -------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_average_precision_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    y = (rng.random(n) < rng.uniform(0.1, 0.9)).astype(int)
    y[0] = 1
    s = rng.normal(size=n) + y * rng.uniform(0, 2)
    if seed % 2:
        s = np.round(s, 1)  # ties
    assert average_precision(y, s) == pytest.approx(average_precision_score(y, s), abs=1e-12)


def test_average_precision_nan_ranks_last_and_no_positive():
    y = np.array([1, 0, 1, 0])
    s = np.array([0.9, 0.8, np.nan, 0.1])
    assert average_precision(y, s) == pytest.approx(average_precision_score(y, [0.9, 0.8, -1e9, 0.1]))
    assert np.isnan(average_precision([0, 0], [0.1, 0.2]))


@pytest.mark.parametrize("seed", range(4))
def test_brier_and_calibration_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    p = rng.random(500)
    p[:8] = [0.0, 1.0, 0.5, 0.2, 0.4, 0.6, 1 / 7, 2 / 7]  # bin edges for 10 and for 7 bins
    y = (rng.random(500) < p).astype(int)
    assert brier(y, p) == pytest.approx(brier_score_loss(y, p), abs=1e-14)
    n_bins = 7 if seed % 2 else 10
    tab = calibration_table(y, p, n_bins=n_bins)
    frac, mean = calibration_curve(y, p, n_bins=n_bins, strategy="uniform")
    rows = [r for r in tab["bins"] if r["count"] > 0]
    np.testing.assert_allclose([r["frac_positive"] for r in rows], frac, atol=1e-12)
    np.testing.assert_allclose([r["mean_prob"] for r in rows], mean, atol=1e-12)
    assert sum(r["count"] for r in tab["bins"]) == 500 == tab["n"]
    assert 0 <= tab["ece"] <= 1


def test_calibration_bad_inputs_and_sigmoid():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier([1, 0], [0.5, 2.0])
    with pytest.raises(ValueError, match="NaN"):
        brier([1, 0], [0.5, np.nan])
    with pytest.raises(ValueError, match="0/1"):
        brier([2, 0], [0.5, 0.5])
    tab = calibration_table([1, 0, 1], [0.9, np.nan, 0.95], n_bins=2)
    assert tab["n_nan"] == 1 and tab["bins"][1]["count"] == 2
    x = np.array([-800.0, -1.0, 0.0, 3.0, 800.0, np.nan])
    p = sigmoid(x)
    np.testing.assert_allclose(p[:5], [0.0, 1 / (1 + np.e), 0.5, 1 / (1 + np.exp(-3)), 1.0])
    assert np.isnan(p[5])


def test_precision_recall_and_unsafe_fraction():
    p, r = precision_recall([1, 1, 0, 1], [1, 0, 1, 1])
    assert (p, r) == (2 / 3, 2 / 3)
    p, r = precision_recall([0, 0], [0, 0])
    assert np.isnan(p) and np.isnan(r)
    safe = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 0]])
    res = unsafe_stop_fraction(index=[0, 1, 2, -1], safe=safe, native_stop=[2, 2, 2, 2])
    # q0 stops early at an unsafe state, q1 early and safe, q2 at its native stop, q3 never
    assert res == {"stops": 3, "early_stops": 2, "unsafe_early_stops": 1, "unsafe_fraction": 0.5,
                   "early_precision": 0.5}
    with pytest.raises(ValueError, match="past the last state"):
        unsafe_stop_fraction([3, 0, 0, 0], safe, [2, 2, 2, 2])


def test_records_serialise_exactly_and_non_inferiority_edges():
    # to_dict is what summary.json holds: every key, and plain floats / lists
    r = BootstrapResult(np.float64(-0.00625), -0.0125, 0, 0.003, "percentile", 0.95, 10000, 800, "ref")
    d = r.to_dict()
    assert d == {"delta": -0.00625, "low": -0.0125, "high": 0.0, "se": 0.003, "method": "percentile",
                 "confidence": 0.95, "n_resamples": 10000, "n": 800, "backend": "ref"}
    assert all(type(d[k]) is float for k in ("delta", "low", "high", "se"))
    rows = BootstrapResult(np.array([0.1, 0.2]), np.array([0.0, 0.1]), np.array([0.2, 0.3]), np.array([0.05, 0.05]),
                           "bca", 0.9, 10, 5)
    assert rows.to_dict()["low"] == [0.0, 0.1] and rows.to_dict()["backend"] == ""
    v = non_inferiority((np.float32(-0.01), 1), 0.02)
    assert v.to_dict() == {"non_inferior": True, "low": pytest.approx(-0.01), "high": 1.0, "margin": 0.02,
                           "verdict": "non-inferior"}
    assert all(type(x) is float for x in (v.low, v.high, v.margin))
    assert non_inferiority((0.001, 0.01), 0).non_inferior  # margin 0 is allowed: strictly better
    assert not non_inferiority((0.0, 0.01), 0).non_inferior
    vs = non_inferiority(BootstrapResult(np.zeros(2), np.array([-0.02, -0.019]), np.ones(2), np.zeros(2),
                                         "bca", 0.95, 10, 5), 0.02)
    assert [x.non_inferior for x in vs] == [False, True]  # on the margin is not above it, per row too
    assert [(x.low, x.high, x.margin) for x in vs] == [(-0.02, 1.0, 0.02), (-0.019, 1.0, 0.02)]
    assert all(type(x.low) is float and type(x.high) is float and type(x.margin) is float for x in vs)
    with pytest.raises(ValueError, match=r"^delta_ci must be a BootstrapResult or a \(low, high\) pair$"):
        non_inferiority(3, 0.02)
    with pytest.raises(ValueError, match=r"^the confidence interval contains NaN$"):
        non_inferiority((0.0, float("nan")), 0.02)
    with pytest.raises(ValueError, match=r"^the confidence interval contains NaN$"):
        non_inferiority((float("nan"), 0.0), 0.02)


def test_calibration_brier_and_stop_counts_edges():
    # hand-computed edge cases; error lines matched whole (one clear line naming the problem)
    assert brier([1], [0.8]) == pytest.approx(0.04)  # a single state is a valid input
    with pytest.raises(ValueError, match=r"^brier: no states$"):
        brier([], [])
    with pytest.raises(ValueError, match=r"^labels and probs must be 1-D of the same length"):
        brier([0, 1], [0.5])
    with pytest.raises(ValueError, match=r"^probs must lie in \[0, 1\] and not be NaN \(map log-odds scores with "
                                         r"sigmoid\(\)\)$"):
        brier([0], [1.5])
    assert sigmoid(np.array([0.5], np.float32)).dtype == np.float64
    tab = calibration_table([0, 1], [0.05, 0.1])  # default: 10 bins, the empty upper ones included
    assert len(tab["bins"]) == 10 and [b["count"] for b in tab["bins"]] == [2] + [0] * 9
    assert [(b["lo"], b["hi"]) for b in tab["bins"][:2]] == [(0.0, 0.1), (0.1, 0.2)]
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # empty bins give NaN means without a warning
        mid = calibration_table([0, 1], [0.05, 0.35])
    assert [b["count"] for b in mid["bins"]] == [1, 0, 0, 1] + [0] * 6
    assert mid["bins"][3]["mean_prob"] == 0.35 and mid["bins"][3]["frac_positive"] == 1.0
    assert np.isnan(mid["bins"][9]["mean_prob"]) and mid["ece"] == pytest.approx((0.05 + 0.65) / 2)
    none = calibration_table([0, 1], [np.nan, np.nan])  # nothing scored: no ECE, not an error
    assert none["n"] == 0 and none["n_nan"] == 2 and np.isnan(none["ece"])
    one = calibration_table([0, 1], [0.2, 0.9], n_bins=1)
    assert [b["count"] for b in one["bins"]] == [2] and one["ece"] == pytest.approx(abs(0.5 - 0.55))
    with pytest.raises(ValueError, match=r"^n_bins must be >= 1, got 0$"):
        calibration_table([0], [0.5], n_bins=0)
    with pytest.raises(ValueError, match=r"^probs must lie in \[0, 1\]$"):
        calibration_table([0], [1.5])
    with pytest.raises(ValueError, match=r"^labels and probs must be 1-D of the same length"):
        calibration_table([0, 1], [0.5])
    # stops given as counts: any non-zero is a stop
    assert precision_recall([2, 0, 1], [1, 1, 0]) == (0.5, 0.5)
    with pytest.raises(ValueError, match=r"^stops and labels must have the same shape, got \(2,\) and \(3,\)$"):
        precision_recall([1, 0], [1, 0, 1])


def test_unsafe_stop_fraction_counts_by_hand():
    safe = np.array([[0, 1, 1], [1, 0, 1], [1, 0, 1], [1, 1, 0], [0, 1, 1]])
    # q0 early at an unsafe state 0; q1 early, unsafe at 1 (safe at 0); q2 early, safe at 2 < 3;
    # q3 never stops; q4 stops at its native state (not early)
    res = unsafe_stop_fraction(np.array([0.0, 1.0, 2.0, -1.0, 1.0]), safe, [2, 2, 3, 2, 1])
    assert res == {"stops": 4, "early_stops": 3, "unsafe_early_stops": 2, "unsafe_fraction": 2 / 3,
                   "early_precision": 1 / 3}
    none = unsafe_stop_fraction([-1, 2], safe[:2], [2, 2])  # no early stop: fractions undefined
    assert none["early_stops"] == 0 and np.isnan(none["unsafe_fraction"]) and np.isnan(none["early_precision"])
    bad = r"^expected index \[B\], safe \[B, T\], native_stop \[B\]; got "
    with pytest.raises(ValueError, match=bad + r"\(1, 2\), \(2, 3\), \(2,\)$"):
        unsafe_stop_fraction([[0, 1]], safe[:2], [2, 2])
    with pytest.raises(ValueError, match=bad + r"\(2,\), \(2,\), \(2,\)$"):
        unsafe_stop_fraction([0, 1], [1, 0], [2, 2])
    with pytest.raises(ValueError, match=bad + r"\(2,\), \(3, 3\), \(2,\)$"):
        unsafe_stop_fraction([0, 1], safe[:3], [2, 2])
    with pytest.raises(ValueError, match=bad + r"\(2,\), \(2, 3\), \(3,\)$"):
        unsafe_stop_fraction([0, 1], safe[:2], [2, 2, 2])
    with pytest.raises(ValueError, match=r"^index points past the last state column of safe$"):
        unsafe_stop_fraction([3, 0], safe[:2], [2, 2])


@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_percentile_interval_is_numpys_quantile_of_the_resample_means(confidence):
    # 4000 resamples: the order-statistic selection (partition, not a full sort) is exercised
    d = np.random.default_rng(5).normal(size=(3, 41))
    means = bootstrap_means(d, 4000, 7, backend="ref")
    r = paired_bootstrap(d, None, 4000, 7, "percentile", confidence, backend="ref")
    a = (1 - confidence) / 2
    np.testing.assert_allclose(r.low, np.quantile(means, a, axis=1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(r.high, np.quantile(means, 1 - a, axis=1), rtol=0, atol=1e-12)


def test_average_precision_edges_by_hand():
    assert average_precision([0, 1], [0.2, 0.9]) == 1.0  # a single positive is enough
    # NaN scores rank last and tie with each other: blocks 0.9 (neg), 0.5 (pos), {nan, nan}
    assert average_precision([0, 1, 1, 0], [0.9, 0.5, np.nan, np.nan]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match=r"^labels and scores must be 1-D of the same length, got \(1, 2\) and "
                                         r"\(1, 2\)$"):
        average_precision([[0, 1]], [[0.1, 0.2]])
    with pytest.raises(ValueError, match=r"^labels must be 0/1 \(or booleans\)$"):
        average_precision([0, 2], [0.1, 0.2])


def test_paired_bootstrap_defaults_and_edges():
    d = np.random.default_rng(8).normal(size=30)
    r = paired_bootstrap(d, backend="ref")  # defaults: 10000 resamples, seed 0, percentile, 95%
    means = bootstrap_means(d, 10000, 0, backend="ref")
    assert (r.n_resamples, r.method, r.confidence, r.n, r.backend) == (10000, "percentile", 0.95, 30, "ref")
    assert r.low == pytest.approx(np.quantile(means, 0.025), abs=1e-12)
    for conf in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="confidence"):
            paired_bootstrap(d, confidence=conf)
    one = paired_bootstrap([0.3], method="bca", n_resamples=50, backend="ref")  # one question: a point
    assert one.delta == one.low == one.high == pytest.approx(0.3)
    with pytest.raises(ValueError, match=r"^expected 1-D \[n\] or 2-D \[K, n\] outcomes with n >= 1, got shape \(2, 0\)$"):
        paired_bootstrap(np.zeros((2, 0)))
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 3\)$"):
        paired_bootstrap(np.zeros((1, 2, 3)))
    # BCa on several rows: each row's interval is the one it gets alone (the jackknife is per row)
    rows = np.random.default_rng(9).normal(size=(3, 25)) + np.array([[0.0], [1.0], [-2.0]])
    many = paired_bootstrap(rows, method="bca", n_resamples=400, seed=2, backend="ref")
    for k in range(3):
        alone = paired_bootstrap(rows[k], method="bca", n_resamples=400, seed=2, backend="ref")
        assert (many.low[k], many.high[k]) == pytest.approx((alone.low, alone.high), abs=1e-12)


def test_paired_bootstrap_degenerate_rows_and_types():
    rng = np.random.default_rng(10)
    d = rng.normal(size=20)
    r = paired_bootstrap(d, n_resamples=200, backend="ref")
    assert all(type(v) is float for v in (r.delta, r.low, r.high, r.se))  # one row: plain floats
    assert paired_bootstrap(d, n_resamples=1, backend="ref").se == 0.0  # one resample: no spread
    # BCa where one row's differences are all equal: that row collapses to its point, the other
    # row is untouched (its interval is the one it gets alone)
    rows = np.stack([np.full(20, 0.2), d])
    for method in ("bca", "percentile"):
        both = paired_bootstrap(rows, method=method, n_resamples=300, seed=4, backend="ref")
        alone = paired_bootstrap(d, method=method, n_resamples=300, seed=4, backend="ref")
        assert both.low[0] == pytest.approx(0.2) and both.high[0] == pytest.approx(0.2)
        assert (both.low[1], both.high[1]) == pytest.approx((alone.low, alone.high), abs=1e-12)


def test_unsafe_stop_fraction_single_state_study():
    # a study with one state (T = 1): a question that never stopped must not read a column past
    # the only one (the masked gather uses column 0 for it). By hand: q0 never stops; q1 stops
    # at state 0, before its native stop 1, where answering is wrong -> 1 early stop, unsafe.
    res = unsafe_stop_fraction([-1, 0], [[1], [0]], [1, 1])
    assert res == {"stops": 1, "early_stops": 1, "unsafe_early_stops": 1, "unsafe_fraction": 1.0,
                   "early_precision": 0.0}


def test_bca_levels_fall_back_to_percentile_where_the_bias_correction_is_infinite():
    # Right-skewed differences and 4 resamples (seed 23) whose means all lie below the estimate
    # 0.7 but differ: z0 = ndtri(1) = +inf and the acceleration is > 0, so both BCa levels are
    # inf/-inf = NaN. The interval then takes the percentile levels of the same resample means.
    d = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 6.0])
    means = bootstrap_means(d[None], 4, 23, backend="ref")[0]
    assert (means < d.mean()).all() and np.ptp(means) > 0  # the case this test is about
    r = paired_bootstrap(d, n_resamples=4, seed=23, method="bca", backend="ref")
    assert r.low == pytest.approx(np.quantile(means, 0.025), abs=1e-12)
    assert r.high == pytest.approx(np.quantile(means, 0.975), abs=1e-12)
    assert np.isfinite(r.low) and r.low < r.high


def test_bootstrap_se_of_two_resamples_by_hand():
    # two resamples: se is their sample standard deviation, |m0 - m1| / sqrt(2) (ddof = 1)
    d = np.array([0.0, 1.0, 3.0, 0.5, 2.0])
    m0, m1 = bootstrap_means(d[None], 2, 1, backend="ref")[0]
    assert m0 != m1
    r = paired_bootstrap(d, n_resamples=2, seed=1, backend="ref")
    assert r.se == pytest.approx(abs(m0 - m1) / np.sqrt(2.0), rel=1e-12)

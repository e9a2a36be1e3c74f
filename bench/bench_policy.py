"""Policy benchmark: sweep + counterfactual evaluation + paired-bootstrap CI per threshold.

Workload (issue 5): 800 trajectories x T=5 states, 200 thresholds, 10,000 bootstrap resamples
of each threshold's paired EM differences (policy minus native). Providers, all on the same
data in this process:

* ``numpy-loop`` (anchor): Python loops over thresholds and over resamples, numpy inside.
* ``scipy-bootstrap-loop``: a loop over thresholds calling ``scipy.stats.bootstrap`` (itself
  vectorised over resamples) on each threshold's differences.
* ``ragfast-ref``: :func:`ragfast.methods.s2g.policy.threshold_curve` on the numpy backends (vectorised
  sweep, counts-times-matrix bootstrap with scipy's draws).
* ``ragfast-cpp``: the same on the C++/OpenMP backends; also without row de-duplication, and
  with Δsearches CIs as well (twice the rows).

Run ``python bench/bench_policy.py`` (``--quick`` for a small smoke run). Rows go to
bench/results/bench_policy.csv in the harness schema; speed is reported as ratios against the
anchor measured in the same run (medians).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import print_table, row, time_fn, write_csv  # noqa: E402

from ragfast.methods.s2g.policy import threshold_curve  # noqa: E402


def make_data(B: int, T: int, seed: int = 0):
    """Recorded-trajectory look-alike: native searches 1..T-1, state 0 unscored, scores that
    rise with the evidence and correlate with the probe's EM."""
    rng = np.random.default_rng(seed)
    S = rng.integers(1, T, B)
    L = S + 1
    latent = np.cumsum(rng.normal(0.3, 1.0, (B, T)), axis=1)
    state_em = (rng.random((B, T)) < 1 / (1 + np.exp(-(latent - 1.0)))).astype(np.float64)
    scores = latent + rng.normal(0, 0.7, (B, T))
    scores[:, 0] = np.nan
    native_em = state_em[np.arange(B), S]
    finite = scores[np.isfinite(scores) & (np.arange(T)[None, :] < L[:, None])]
    return scores, state_em, native_em, S, L, finite


def numpy_loop(scores, state_em, native_em, S, L, thresholds, n_resamples, seed):
    """The anchor: what one writes without vectorising across thresholds and resamples."""
    B, T = scores.shape
    rng = np.random.default_rng(seed)
    valid = np.arange(T)[None, :] < L[:, None]
    out = []
    for h in thresholds:
        hit = valid & (scores >= h)
        crossed = hit.any(1)
        idx = np.where(crossed, hit.argmax(1), -1)
        em = np.where(crossed, state_em[np.arange(B), np.maximum(idx, 0)], native_em)
        d = em - native_em
        means = np.empty(n_resamples)
        for r in range(n_resamples):
            means[r] = d[rng.integers(0, B, B)].mean()
        lo, hi = np.percentile(means, [2.5, 97.5])
        out.append((d.mean(), lo, hi))
    return np.asarray(out)


def scipy_loop(scores, state_em, native_em, S, L, thresholds, n_resamples, seed):
    """A library anchor: vectorised first crossing, then scipy.stats.bootstrap per threshold."""
    import scipy.stats

    B, T = scores.shape
    valid = np.arange(T)[None, :] < L[:, None]
    out = []
    for h in thresholds:
        hit = valid & (scores >= h)
        crossed = hit.any(1)
        idx = np.where(crossed, hit.argmax(1), -1)
        d = np.where(crossed, state_em[np.arange(B), np.maximum(idx, 0)], native_em) - native_em
        r = scipy.stats.bootstrap((d,), np.mean, n_resamples=n_resamples, method="percentile",
                                  rng=np.random.default_rng(seed), vectorized=True)
        out.append((d.mean(), r.confidence_interval.low, r.confidence_interval.high))
    return np.asarray(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_policy.csv"))
    args = ap.parse_args(argv)
    if args.quick:
        B, T, M, R, reps, anchor_reps = 200, 5, 40, 2000, 3, 1
    else:
        B, T, M, R, reps, anchor_reps = 800, 5, 200, 10000, 7, 3
    scores, state_em, native_em, S, L, finite = make_data(B, T)
    thresholds = np.quantile(finite, np.linspace(0.0, 1.0, M))
    params = f"B={B},T={T},M={M},R={R}"

    def ours(backend, **kw):
        return lambda: threshold_curve(scores, state_em, native_em, S, thresholds, L, n_resamples=R, seed=0,
                                       searches_ci=kw.get("searches_ci", False), dedupe=kw.get("dedupe", True),
                                       backend=backend)

    # Sanity: every provider gives the same point estimates, and CIs of the same width.
    anchor_res = numpy_loop(scores, state_em, native_em, S, L, thresholds[:5], 2000, 0)
    cur = ours("cpp")()
    assert np.allclose(cur.d_em[:5], anchor_res[:, 0])
    assert np.all(cur.d_em_low <= cur.d_em + 1e-12) and np.all(cur.d_em <= cur.d_em_high + 1e-12)
    ref_cur = ours("ref")()
    width_gap = np.max(np.abs((cur.d_em_high - cur.d_em_low) - (ref_cur.d_em_high - ref_cur.d_em_low)))
    print(f"distinct difference rows: {cur.meta['distinct_rows']} of {cur.meta['rows']}; "
          f"max |CI width cpp - ref| = {width_gap:.4f} (resampling noise)")

    t_anchor = time_fn(lambda: numpy_loop(scores, state_em, native_em, S, L, thresholds, R, 0),
                       reps=anchor_reps, warmup=0)
    timings = {
        "numpy-loop": t_anchor,
        "scipy-bootstrap-loop": time_fn(lambda: scipy_loop(scores, state_em, native_em, S, L, thresholds, R, 0),
                                        reps=anchor_reps, warmup=0),
        "ragfast-ref": time_fn(ours("ref"), reps=reps),
        "ragfast-cpp": time_fn(ours("cpp"), reps=reps),
        "ragfast-cpp-nodedupe": time_fn(ours("cpp", dedupe=False), reps=reps),
        "ragfast-cpp+searches-ci": time_fn(ours("cpp", searches_ci=True), reps=reps),
    }
    a50 = float(np.median(t_anchor))
    rows = []
    for prov, t in timings.items():
        rows.append(row("policy_curve", prov, params, "seconds", "s", t))
        if prov != "numpy-loop":
            rows.append(row("policy_curve", prov, params, "speedup_vs_numpy-loop", "x", a50 / t))
    # The two kernels alone, compiled against the numpy reference (same inputs as the curve).
    from ragfast.ops.policy import bootstrap_means
    from ragfast.methods.s2g.policy import evaluate_policy, sweep

    idx = sweep(scores, thresholds, L)
    D = np.unique((evaluate_policy(idx, state_em, native_em, S).em - native_em[:, None]).T, axis=0)
    for op, fn in (("sweep", lambda be: sweep(scores, thresholds, L, backend=be)),
                   ("bootstrap_means", lambda be: bootstrap_means(D, R, 0, backend=be))):
        t_ref = time_fn(lambda: fn("ref"), reps=reps)
        t_cpp = time_fn(lambda: fn("cpp"), reps=reps)
        p = params + (f",rows={D.shape[0]}" if op == "bootstrap_means" else "")
        rows += [row(op, "ref", p, "seconds", "s", t_ref), row(op, "cpp", p, "seconds", "s", t_cpp),
                 row(op, "cpp", p, "speedup_vs_ref", "x", float(np.median(t_ref)) / t_cpp)]
    write_csv(rows, args.csv)
    print_table(rows, title="sweep + evaluate + bootstrap CI per threshold")
    cpp50 = float(np.median(timings["ragfast-cpp"]))
    ok_t, ok_x = cpp50 < 2.0, a50 / cpp50 >= 50
    print(f"ragfast-cpp {cpp50:.3f} s (target < 2 s: {'met' if ok_t else 'MISSED'}); "
          f"{a50 / cpp50:.0f}x the numpy loop (target >= 50x: {'met' if ok_x else 'MISSED'}); "
          f"ref {a50 / float(np.median(timings['ragfast-ref'])):.0f}x; "
          f"{float(np.median(timings['scipy-bootstrap-loop'])) / cpp50:.0f}x the scipy.stats.bootstrap loop; "
          f"csv: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

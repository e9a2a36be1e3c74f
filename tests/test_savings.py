"""The checker-pays verdict: paired intervals, never a negative saving, unknown named."""
import numpy as np
import pytest

from ragfast.accounting.savings import balance, cost_value


def _traj(qid, judge=0.0, reasoner=0.0, search=0.0, tok=(0, 0)):
    return {"id": qid, "cost": {"judge": {"flops": judge, "seconds": judge / 1e9, "input_tokens": tok[0]},
                                "reasoner": {"flops": reasoner, "seconds": reasoner / 1e9,
                                             "input_tokens": tok[1], "output_tokens": 3},
                                "search": {"flops": search, "seconds": 0.0}}}


def test_clear_saving_pays_and_means_match_hand_computation():
    rng = np.random.default_rng(1)
    nat, met = [], []
    for i in range(60):
        r = float(rng.uniform(5e9, 6e9))
        nat.append(_traj(f"q{i}", reasoner=r, search=1e6))
        met.append(_traj(f"q{i}", judge=1e8, reasoner=r * 0.5, search=5e5))
    b = balance(nat, met, n_resamples=2000)
    f = b.metrics["flops"]
    want = np.mean([cost_value(a, "reasoner", "flops") + cost_value(a, "search", "flops")
                    - cost_value(m, "reasoner", "flops") - cost_value(m, "search", "flops") for a, m in zip(nat, met)])
    assert f.saved.mean == pytest.approx(want)
    assert f.spent.mean == pytest.approx(1e8)
    assert f.saved.low > 0 and "pays for itself" in f.verdict
    assert b.questions == 60


def test_noise_around_zero_is_no_measurable_saving_never_negative():
    rng = np.random.default_rng(2)
    nat = [_traj(f"q{i}", reasoner=1e9 + float(rng.normal(0, 1e8))) for i in range(50)]
    met = [_traj(f"q{i}", judge=1e7, reasoner=1e9 + float(rng.normal(0, 1e8))) for i in range(50)]
    b = balance(nat, met, n_resamples=2000)
    for m in ("flops", "tokens"):
        mb = b.metrics[m]
        assert mb.saved.low <= 0 <= mb.saved.high or m == "tokens"
    assert "no measurable saving" in b.metrics["flops"].saving_text
    # wall-clock is a difference beside the verdict, not a saving
    assert b.metrics["seconds"].role == "beside" and not b.metrics["seconds"].verdict
    text = "\n".join(b.lines())
    assert "saved -" not in text


def test_extra_spend_is_worded_as_extra_not_negative_saving():
    nat = [_traj(f"q{i}", reasoner=1e9) for i in range(30)]
    met = [_traj(f"q{i}", judge=1e7, reasoner=2e9 + i) for i in range(30)]
    mb = balance(nat, met, n_resamples=1000).metrics["flops"]
    assert mb.saved.high < 0
    assert "extra" in mb.saving_text and "-" not in mb.saving_text.split("spent")[1].split("extra")[0]
    assert "does not pay" in mb.verdict


def test_unknown_component_has_no_verdict_and_free_is_named():
    nat = [_traj(f"q{i}", reasoner=1e9, search=1) for i in range(10)]
    met = [_traj(f"q{i}", judge=1e7, reasoner=5e8, search=1) for i in range(10)]
    b = balance(nat, met, components={"search": "unknown", "reasoner": "free"}, n_resamples=500)
    assert all(m.spent is None and "unknown" in m.verdict for m in b.metrics.values())
    assert "free (not real compute): reasoner" in b.lines()[-1]
    b2 = balance(nat, met, components={"reasoner": "free"}, n_resamples=500)
    # a free reasoner saves nothing real: only measured components count
    assert b2.metrics["flops"].saved.mean == 0.0
    with pytest.raises(ValueError, match="status"):
        balance(nat, met, components={"search": "maybe"})


def test_tokens_are_cache_independent_and_computed_tokens_are_beside():
    t = {"id": "a", "cost": {"reasoner": {"input_tokens": 5, "cached_tokens": 100, "output_tokens": 2,
                                          "flops": 10.0, "flops_uncached": 50.0}}}
    assert cost_value(t, "reasoner", "tokens") == 107
    assert cost_value(t, "reasoner", "tokens_computed") == 7
    assert cost_value(t, "reasoner", "flops") == 50.0 and cost_value(t, "reasoner", "flops_computed") == 10.0
    # a record written before flops_uncached existed: its FLOPs are what there is
    assert cost_value({"cost": {"reasoner": {"flops": 3.0}}}, "reasoner", "flops") == 3.0
    assert cost_value(t, "judge", "flops") == 0.0


def _rec(fresh, cached, out, flops, uncached, seconds, calls=1):
    return {"input_tokens": fresh, "cached_tokens": cached, "output_tokens": out, "flops": flops,
            "flops_uncached": uncached, "seconds": seconds, "calls": calls}


def test_identical_trajectories_differ_by_exactly_zero_and_wall_clock_is_never_a_saving():
    """Issue 24 #8: S2G equal to native (0 judge calls) was reported as "saved 190 ms/q; judge
    pays for itself" from wall-clock drift, and a warmer prefix cache made identical work cheaper."""
    rng = np.random.default_rng(3)
    nat, met = [], []
    for i in range(40):
        n_prompt, n_out = int(rng.integers(200, 900)), int(rng.integers(5, 60))
        full = 1e6 * (n_prompt + n_out)
        # the same calls; the method ran second, on a warmer server cache, and 190 ms faster
        warm = int(rng.integers(0, n_prompt))
        nat.append({"id": f"q{i}", "cost": {"reasoner": _rec(n_prompt, 0, n_out, full, full, 1.0 + rng.random())}})
        met.append({"id": f"q{i}", "cost": {
            "reasoner": _rec(n_prompt - warm, warm, n_out, full - 1e6 * warm, full, 0.81 + rng.random() * 0.2),
            "judge": _rec(0, 0, 0, 0.0, 0.0, 0.0, calls=0)}})
    b = balance(nat, met, n_resamples=1000)
    for m in ("flops", "tokens"):
        mb = b.metrics[m]
        assert mb.role == "verdict"
        assert mb.saved.mean == mb.saved.low == mb.saved.high == 0.0
        assert mb.net.mean == 0.0 and "nothing to pay for" in mb.verdict
    # what the server computed did differ, and is shown beside the verdict, as a difference
    comp = b.metrics["flops_computed"]
    assert comp.role == "beside" and comp.saved.low > 0 and not comp.verdict
    secs = b.metrics["seconds"]
    assert secs.role == "beside" and secs.saved.low > 0 and not secs.verdict
    text = "\n".join(b.lines())
    assert "pays for itself" not in text and "saved" not in text
    assert "cache-independent" in text and "wall-clock" in text


def test_lines_and_record_by_hand():
    # every question: native reasoner 5 GFLOPs and search 1 GFLOP, method reasoner 3 GFLOPs and
    # search 0.5 GFLOP, judge 1 GFLOP: saved 2.5, spent 1, net 1.5 GFLOPs per question, every
    # interval a point (constant differences)
    def rec(qid, judge, reasoner, search, scores=None):
        r = {"id": qid, "cost": {"judge": {"flops": judge, "seconds": judge / 1e12, "input_tokens": 7},
                                 "reasoner": {"flops": reasoner, "seconds": reasoner / 1e12,
                                              "input_tokens": 100 if judge == 0 else 60, "output_tokens": 4},
                                 "search": {"flops": search}}}
        if scores is not None:
            r["extra"] = {"judge_scores": scores}
        return r

    nat = [rec(f"q{i}", 0, 5e9, 1e9) for i in range(4)]
    met = [rec("q0", 1e9, 3e9, 5e8, [0.1, 0.2, 0.9]), rec("q1", 1e9, 3e9, 5e8, [0.9]), rec("q2", 1e9, 3e9, 5e8),
           rec("extra", 1e9, 0, 0)]  # not in the native run: left out
    b = balance(nat, met, components={"encoder": "free"}, n_resamples=50)
    assert b.questions == 3 and b.checked_states == 2  # states after the first: 2 + 0 + 0
    assert b.metrics["flops"].saved_by_component == {"reasoner": 2e9, "search": 5e8}
    # the verdict's figures (cache-independent FLOPs and tokens), then the ones shown beside it,
    # as differences and never as a saving (no cache here: computed equals cache-independent)
    assert b.lines() == [
        "flops: FLOPs, cache-independent (every prompt token counted as computed) (GFLOPs per question): "
        "judge spent 1 [1, 1]; the method saved 2.5 [2.5, 2.5]; judge pays for itself (net 1.5 [1.5, 1.5])",
        "tokens: tokens, cache-independent (input + cached + output) (tokens per question): "
        "judge spent 7 [7, 7]; the method saved 40 [40, 40]; judge pays for itself (net 33 [33, 33])",
        "beside the verdict, flops_computed: FLOPs the backends computed (with their KV / prefix caches) "
        "(GFLOPs per question): native minus method on the other components 2.5 [2.5, 2.5] "
        "(interval, not a saving by itself); judge 1 [1, 1]",
        "beside the verdict, tokens_computed: tokens computed (fresh input + output) (tokens per question): "
        "native minus method on the other components 40 [40, 40] (interval, not a saving by itself); judge 7 [7, 7]",
        "beside the verdict, seconds: wall-clock (ms per question): native minus method on the other "
        "components 2 [2, 2] (interval, not a saving by itself); judge 1 [1, 1]",
        "measured: judge, reasoner, search; unknown: none; free (not real compute): encoder"]
    d = b.to_dict()
    assert d["metrics"]["flops"]["spent"] == {"mean": 1e9, "low": 1e9, "high": 1e9}
    assert d["components"] == {"judge": "measured", "reasoner": "measured", "search": "measured",
                               "encoder": "free"} and d["confidence"] == 0.95
    # an unknown component: no interval, every metric says which, and the summary line names it
    u = balance(nat, met, components={"search": "unknown"}, n_resamples=50)
    assert u.lines() == [
        "flops: FLOPs, cache-independent (every prompt token counted as computed): unknown: search reported no cost",
        "tokens: tokens, cache-independent (input + cached + output): unknown: search reported no cost",
        "flops_computed: FLOPs the backends computed (with their KV / prefix caches): unknown: search reported no cost",
        "tokens_computed: tokens computed (fresh input + output): unknown: search reported no cost",
        "seconds: wall-clock: unknown: search reported no cost",
        "measured: encoder, judge, reasoner; unknown: search; free (not real compute): none"]
    assert u.metrics["tokens"].unknown == ["search"]
    assert u.metrics["tokens"].saved_by_component == {"reasoner": 40.0, "encoder": 0.0}  # encoder did not run
    e = balance([], met, n_resamples=50)
    assert [m.verdict for m in e.metrics.values()] == ["no paired questions"] * 5 and e.questions == 0
    with pytest.raises(ValueError, match="status must be one of"):
        balance(nat, met, components={"judge": "maybe"})


def test_intervals_use_the_given_bootstrap_settings():
    from ragfast.scoring.stats import paired_bootstrap

    rng = np.random.default_rng(4)
    nat = [_traj(f"q{i}", reasoner=float(rng.uniform(1e9, 2e9))) for i in range(9)]
    met = [_traj(f"q{i}", judge=float(rng.uniform(1e8, 3e8)), reasoner=float(rng.uniform(5e8, 1e9))) for i in range(9)]
    spent = np.array([cost_value(m, "judge", "flops") for m in met])
    for kw in ({"n_resamples": 200, "seed": 5, "confidence": 0.8}, {}):
        got = balance(nat, met, **kw).metrics["flops"].spent
        r = paired_bootstrap(spent, None, n_resamples=kw.get("n_resamples", 10000), seed=kw.get("seed", 0),
                             confidence=kw.get("confidence", 0.95))
        assert (got.mean, got.low, got.high) == (float(r.delta), float(r.low), float(r.high))


def test_interval_describe_units():
    from ragfast.accounting.savings import Interval

    assert Interval(1.0, 0.5, 1.5).describe("ms") == "1 [0.5, 1.5] ms"
    assert Interval(1.0, 0.5, 1.5).describe() == "1 [0.5, 1.5]"


def test_zero_intervals_free_spender_and_record_fields():
    # one question, nothing saved, nothing spent: identical costs are exactly zero by construction
    # (issue 24 #8), neither a saving nor an extra spend; a single pair is averaged over one question
    nat, met = [_traj("q0", reasoner=2e9)], [_traj("q0", judge=0.0, reasoner=2e9)]
    f = balance(nat, met, n_resamples=20).metrics["flops"]
    assert f.saving_text == "no saving: exactly 0 on every question (the same cost)"
    assert f.verdict == ("nothing to pay for: judge spent nothing and the other components cost the same "
                         "(net exactly 0)")
    one = balance(nat, [_traj("q0", judge=1e9, reasoner=1e9)], n_resamples=20)
    assert one.metrics["flops"].saved_by_component == {"reasoner": 1e9, "encoder": 0.0, "search": 0.0}
    d = one.to_dict()["metrics"]["flops"]
    assert d["metric"] == "flops" and d["unknown"] == [] and d["net"] == {"mean": 0.0, "low": 0.0, "high": 0.0}
    # a free spender costs nothing, whatever its records say
    free = balance(nat, [_traj("q0", judge=1e9, reasoner=1e9)], components={"judge": "free"}, n_resamples=20)
    assert free.metrics["flops"].spent.mean == 0.0 and free.metrics["flops"].spent.high == 0.0
    # two unknown components are both named
    two = balance(nat, met, components={"search": "unknown", "encoder": "unknown"}, n_resamples=20)
    assert two.metrics["seconds"].verdict == "unknown: encoder, search reported no cost"
    assert two.metrics["seconds"].metric == "seconds"
    assert two.lines()[-1] == "measured: judge, reasoner; unknown: encoder, search; free (not real compute): none"
    both_free = balance(nat, met, components={"search": "free", "encoder": "free"}, n_resamples=20)
    assert both_free.lines()[-1] == "measured: judge, reasoner; unknown: none; free (not real compute): encoder, search"

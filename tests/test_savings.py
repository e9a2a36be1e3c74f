"""The checker-pays verdict: paired intervals, never a negative saving, unknown named."""
import numpy as np
import pytest

from ragfast.savings import balance, cost_value


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
    for m in ("flops", "seconds"):
        mb = b.metrics[m]
        assert mb.saved.low <= 0 <= mb.saved.high
        assert "no measurable saving" in mb.saving_text
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


def test_tokens_count_computed_tokens_only():
    t = {"id": "a", "cost": {"reasoner": {"input_tokens": 5, "cached_tokens": 100, "output_tokens": 2}}}
    assert cost_value(t, "reasoner", "tokens") == 7
    assert cost_value(t, "judge", "flops") == 0.0

"""methods/s2g/policy.py by hand: the counterfactual outcome of a stopping policy, the grouped
threshold choice at a single stop, and the threshold curve's record (mutation survivors of the
sampled run in docs/mutation.md)."""
from __future__ import annotations

import numpy as np
import pytest

from ragfast.methods.s2g.policy import (evaluate_policy, outcome_at, select_threshold, stop_precision_recall,
                                        threshold_curve)

# three questions, T = 3 states. q0 stops at state 1 (probe wrong, native right: harmful),
# q1 never stops, q2 stops at state 0 (probe right, native wrong)
STATE_EM = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
NATIVE_EM = np.array([1.0, 0.0, 0.0])
NATIVE_SEARCHES = np.array([3.0, 2.0, 1.0])
INDEX = np.array([1, -1, 0])


def test_evaluate_policy_by_hand_with_given_state_searches():
    # searches spent when stopping at each state, not the column index
    ss = np.array([[0.0, 2.0, 5.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    out = evaluate_policy(INDEX, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, ss)
    assert out.index.tolist() == [1, -1, 0]
    assert out.em.tolist() == [0.0, 0.0, 1.0] and out.searches.tolist() == [2.0, 2.0, 0.5]
    assert out.stopped.tolist() == [True, False, True] and out.early.tolist() == [True, False, True]
    assert out.unsafe.tolist() == [True, False, False]
    # harmful: early, native right, stopped wrong (q2's native 0 and q1's never-stop are not)
    assert out.harmful.tolist() == [True, False, False]
    # default: state t follows t searches
    d = evaluate_policy(INDEX, STATE_EM, NATIVE_EM, NATIVE_SEARCHES)
    assert d.searches.tolist() == [1.0, 2.0, 0.0]
    with pytest.raises(ValueError, match=r"^state_searches must be \[B, T\] = \(3, 3\), got \(3, 2\)$"):
        evaluate_policy(INDEX, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, ss[:, :2])


def test_harmful_needs_a_native_answer_that_was_right():
    # q0 stops early with a wrong probe; its native answer was wrong too: unsafe, not harmful
    out = evaluate_policy([0], [[0.0, 1.0]], [0.0], [2.0])
    assert out.unsafe.tolist() == [True] and out.harmful.tolist() == [False]


def test_outcome_at_one_state_never_crossed():
    # T = 1: a trajectory that never crossed keeps its native outcome
    assert outcome_at([-1, 0], [[5.0], [7.0]], [1.0, 2.0]).tolist() == [1.0, 7.0]
    assert outcome_at([[-1, 0]], [[5.0]], [1.0]).tolist() == [[1.0, 5.0]]


def test_grouped_threshold_at_a_single_stop():
    # per question: q0's one state (right) crosses 0.9 alone, precision 1/1; at 0.5 q1 (wrong)
    # crosses too, 1/2. The highest recall at precision >= 0.9 is 0.9's
    assert select_threshold([0.9, 0.5], [1, 0], 0.9, groups=["q0", "q1"]) == 0.9
    with pytest.raises(ValueError, match=r"^labels must be 0/1 \(1 = stopping at this state is right\)$"):
        select_threshold([0.9, 0.5], [1, 2])


def test_threshold_curve_records_its_settings_and_state_searches():
    scores = np.array([[0.2, 0.8, 0.9], [0.1, 0.1, 0.1], [0.8, 0.0, 0.0]])
    ss = np.array([[0.0, 2.0, 5.0], [1.0, 1.0, 1.0], [0.5, 0.5, 0.5]])
    cur = threshold_curve(scores, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, [0.75, 0.85, 2.0], state_searches=ss,
                          n_resamples=50, seed=4, confidence=0.9)
    # at 0.75: q0 stops at state 1 (2 searches), q1 never, q2 at state 0 (0.5 searches);
    # at 0.85: q0 at state 2 (5 searches, more than its native 3), the others never; at 2.0 none
    assert cur.searches.tolist() == pytest.approx([(2.0 + 2.0 + 0.5) / 3, (5.0 + 2.0 + 1.0) / 3, 2.0])
    assert cur.d_searches.tolist() == pytest.approx([(-1.0 + 0.0 - 0.5) / 3, 2.0 / 3, 0.0])
    assert cur.em.tolist() == pytest.approx([1 / 3, 1 / 3, 1 / 3]) and cur.harmful_early_stops.tolist() == [1, 0, 0]
    m = cur.meta
    assert (m["n_resamples"], m["seed"], m["method"], m["confidence"]) == (50, 4, "percentile", 0.9)
    # rows: ΔEM and Δsearches per threshold; 0.85's ΔEM, 2.0's ΔEM and 2.0's Δsearches are all
    # zero: 4 distinct of 6 (over 3 questions)
    assert m["rows"] == 6 and m["distinct_rows"] == 4


def test_grouped_precision_recall_without_states():
    # no state at all, grouped by question: nothing stops, precision and recall undefined
    prec, rec, stops = stop_precision_recall([], [], [0.5, 1.0], groups=[])
    assert np.isnan(prec).all() and np.isnan(rec).all() and stops.tolist() == [0, 0]


def test_threshold_curve_defaults_backend_and_no_searches_interval():
    scores = np.array([[0.2, 0.8, 0.9], [0.1, 0.1, 0.1], [0.8, 0.0, 0.0]])
    kw = dict(n_resamples=200)
    base = threshold_curve(scores, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, [0.75], **kw)
    seed0 = threshold_curve(scores, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, [0.75], seed=0, **kw)
    seed1 = threshold_curve(scores, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, [0.75], seed=1, **kw)
    assert base.meta["seed"] == 0 and base.meta["backend"] in ("ref", "cpp")
    assert (base.d_em_low.tolist(), base.d_em_high.tolist()) == (seed0.d_em_low.tolist(), seed0.d_em_high.tolist())
    assert (base.d_searches_low.tolist(), base.d_searches_high.tolist()) != \
        (seed1.d_searches_low.tolist(), seed1.d_searches_high.tolist())  # the seed matters here
    # without the searches interval: its bounds are NaN, the ΔEM interval is still there
    cur = threshold_curve(scores, STATE_EM, NATIVE_EM, NATIVE_SEARCHES, [0.75], searches_ci=False, **kw)
    assert cur.d_searches_low.shape == cur.d_searches_high.shape == (1,)
    assert np.isnan(cur.d_searches_low).all() and np.isnan(cur.d_searches_high).all()
    assert np.isfinite(base.d_searches_low).all() and np.isfinite(base.d_searches_high).all()
    # default searches = the state index: (1 - 3) + 0 + (0 - 1) over 3 questions
    assert np.isfinite(cur.d_em_low).all() and cur.d_searches.tolist() == pytest.approx([-1.0])


def test_policy_messages_and_boolean_scores():
    with pytest.raises(ValueError, match=r"^state_em must be \[B, T\], got shape \(3,\)$"):
        evaluate_policy([0, 0, 0], [1.0, 0.0, 1.0], NATIVE_EM, NATIVE_SEARCHES)
    with pytest.raises(ValueError, match=r"^groups must give one question id per state \(2\), got shape \(3,\)$"):
        select_threshold([0.9, 0.5], [1, 0], groups=["a", "b", "c"])
    # a yes/no judge: True stops; every True state is right -> threshold 1.0
    assert select_threshold(np.array([True, False, True]), [1, 0, 1], 0.9) == 1.0

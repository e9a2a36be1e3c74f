"""A question's recorded cost does not depend on what ran before it (issue 14).

Every judge with a result cache is scored cold (a fresh judge) and warm (after scoring other
and the same states): the per-question cost records must be identical in calls, tokens and
FLOPs, and the warm run must say which calls it served from the cache (``reused``). The same
holds when the questions are batched differently (a resumed run), and for a whole RELOOP run.
"""
import json

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.types import State

FIELDS = ("calls", "input_tokens", "cached_tokens", "output_tokens", "flops")
WORDS = ("river mountain album film born played city capital director singer novel war treaty king queen "
         "province company founded league season").split()


def _obs(title, words):
    return f'<information>Doc 1(Title: "{title}") {" ".join(words)}</information>'


def _states(seed, n_q=4, shared=None):
    """Trajectories (every prefix of a question's evidence), question ids, and the documents used.

    ``shared`` documents are read by every question, so one judge call holds a text that
    several questions need.
    """
    rng = np.random.default_rng(seed)
    states, qids = [], []
    for i in range(n_q):
        q = f"Which {rng.choice(WORDS)} was {rng.choice(WORDS)} number {seed}-{i}?"
        ev = list(shared or [])
        for t in range(3):
            states.append(State(q, list(ev), f"q{seed}-{i}", t))
            qids.append(f"q{seed}-{i}")
            ev.append(_obs(rng.choice(WORDS).title(), rng.choice(WORDS, size=int(rng.integers(4, 30)))))
        states.append(State(q, list(ev), f"q{seed}-{i}", 3))
        qids.append(f"q{seed}-{i}")
    return states, qids


def _rows(ledger, component="judge"):
    """question id -> the counts that must not depend on cache state."""
    return {q: tuple(c[component][k] for k in FIELDS) for q, c in ledger.per_question().items() if component in c}


def _flat(rows):
    """(question id, field) -> value: pytest.approx compares flat mappings only."""
    return {(q, f): x for q, v in rows.items() for f, x in zip(FIELDS, v)}


def _reused(ledger, component="judge"):
    return ledger.totals()[component]["reused"]


def _cold_vs_warm(make_judge, **kw):
    """Scores of target states by a fresh judge, and by one that scored other states and these first."""
    target, tq = _states(1, shared=[_obs("Shared", ["common", "words"] * 5)])
    other, oq = _states(2, shared=[_obs("Shared", ["common", "words"] * 5)])
    cold, warm = make_judge(), make_judge()
    led_cold = CostLedger()
    s_cold = cold.stop_scores(target, ledger=led_cold, question_ids=tq, **kw)
    warm.stop_scores(other, ledger=CostLedger(), question_ids=oq, **kw)
    warm.stop_scores(target[:5], ledger=CostLedger(), question_ids=tq[:5], **kw)
    led_warm = CostLedger()
    s_warm = warm.stop_scores(target, ledger=led_warm, question_ids=tq, **kw)
    np.testing.assert_allclose(s_warm, s_cold, atol=1e-5)
    assert _flat(_rows(led_warm)) == pytest.approx(_flat(_rows(led_cold)), rel=1e-12)
    assert set(_rows(led_cold)) == set(tq)
    # reused counts what a question read before on the same ledger, never what the cache held
    assert _reused(led_warm) == _reused(led_cold)
    assert led_cold.totals()["judge"]["flops"] > 0
    # A resumed run scores the questions in other batches: each question's cost is its own.
    led_split = CostLedger()
    fresh = make_judge()
    half = tq.index(tq[-1])  # the last question alone, then the rest
    fresh.stop_scores(target[half:], ledger=led_split, question_ids=tq[half:], **kw)
    fresh.stop_scores(target[:half], ledger=led_split, question_ids=tq[:half], **kw)
    assert _flat(_rows(led_split)) == pytest.approx(_flat(_rows(led_cold)), rel=1e-12)
    return led_cold, led_warm


@pytest.fixture(scope="module")
def docset_judge(minilm_encoder):
    from ragfast.judges.docset import DocSetJudge

    return lambda: DocSetJudge(encoder=minilm_encoder)


def test_docset_judge_cost_does_not_depend_on_its_caches(docset_judge):
    cold, warm = _cold_vs_warm(docset_judge)
    c, w = cold.totals()["judge"], warm.totals()["judge"]
    # The shared document is embedded once, but each question reads it for the first time: no
    # question read anything twice on these ledgers, so nothing is reused, cold or warm.
    assert c["reused"] == w["reused"] == 0 and c["batches"] == w["batches"]


def test_encoder_judge_cost_does_not_depend_on_its_caches(minilm_encoder):
    from ragfast.judges.head import EncoderJudge

    _cold_vs_warm(lambda: EncoderJudge(encoder=minilm_encoder))


def test_cross_judge_cost_does_not_depend_on_its_cache(tmp_path):
    from safetensors.numpy import save_file

    from ragfast.judges.base import STATE_FEATURES
    from ragfast.judges.cross import CROSS_FORMAT, CrossEncoderJudge

    # Untrained heads and no LoRA factors: the compute path is the real one, which is all the
    # ledger sees.
    rng = np.random.default_rng(0)
    save_file({"doc_head.weight": rng.normal(size=384).astype(np.float32), "doc_head.bias": np.zeros(1, np.float32),
               "state_head.weight": rng.normal(size=len(STATE_FEATURES)), "state_head.bias": np.zeros(1)},
              str(tmp_path / "cross_judge.safetensors"))
    (tmp_path / "cross_judge.json").write_text(json.dumps(
        {"format": CROSS_FORMAT, "state_features": list(STATE_FEATURES), "lora": {"alpha": 1, "r": 1},
         "base": "minilm", "max_length": 64}))
    _cold_vs_warm(lambda: CrossEncoderJudge(tmp_path, batch_size=8))


def test_causal_judge_question_cost_does_not_depend_on_the_system_prefix_cache():
    from ragfast.judges.causal import CausalJudge
    from ragfast.models.tiny import tiny_path

    judge = CausalJudge(tiny_path("qwen2"), attention="ref")
    states, qids = _states(3, n_q=3)
    led_cold, led_warm = CostLedger(), CostLedger()
    judge.set_system_prompt(None)  # drops the system KV: the next call computes it
    judge.stop_scores(states, ledger=led_cold, question_ids=qids)
    judge.stop_scores(states, ledger=led_warm, question_ids=qids)
    assert _rows(led_warm) == _rows(led_cold) and set(_rows(led_cold)) == set(qids)
    # The one-off prefill is the judge's setup, booked with no question and no call.
    S = len(judge._sys_ids)
    cold, warm = led_cold.totals()["judge"], led_warm.totals()["judge"]
    assert cold["input_tokens"] == warm["input_tokens"] + S and cold["calls"] == warm["calls"]
    setup = [r for r in led_cold.records if r.question_id is None]
    assert len(setup) == 1 and setup[0].calls == 0 and setup[0].input_tokens == S and setup[0].flops > 0


def test_remote_judge_books_the_servers_reused_calls(minilm_encoder):
    from fastapi.testclient import TestClient

    from ragfast.judges.server import make_app
    from ragfast.judges.docset import DocSetJudge
    from ragfast.judges.remote import RemoteJudge

    states, qids = _states(4, n_q=2)
    with TestClient(make_app(DocSetJudge(encoder=minilm_encoder))) as cl:
        remote = RemoteJudge("http://testserver", client=cl)
        led_cold, led_warm = CostLedger(), CostLedger()
        remote.stop_scores(states, ledger=led_cold, question_ids=qids)
        remote.stop_scores(states, ledger=led_warm, question_ids=qids)
    assert _flat(_rows(led_warm)) == pytest.approx(_flat(_rows(led_cold)), rel=1e-12)
    # the warm server read every text from its caches: that shows in no cost field, reused included
    assert _reused(led_cold) == _reused(led_warm)


def test_reloop_judge_cost_does_not_depend_on_what_the_judge_scored_before(docset_judge):
    import ragfast.methods.reloop as rl
    from ragfast.data import load_qa
    from ragfast.encoders.hashing import HashingEncoder

    wss = [rl.text_workspace(q) for q in load_qa("hotpotqa-dev", limit=4)]
    cfg = rl.ReloopConfig(k=2, window=6, max_steps=3, max_tokens=400, batch_size=2, judge_threshold=50.0)

    def run(judge, workspaces):
        led = CostLedger()
        rl.run_text(workspaces, encoder=HashingEncoder(), judge=judge, generator=rl.ExtractiveHead(), cfg=cfg,
                    ledger=led)
        return led

    judge = docset_judge()
    alone = run(judge, wss)
    # S2G-like states over the same questions and documents first, then the same run on the warm judge.
    shared = docset_judge()
    shared.stop_scores([State(w.question, [_obs("x", w.question.split())]) for w in wss])
    run(shared, wss)
    after = run(shared, wss)
    resumed = run(docset_judge(), wss[1:])  # question 0 done before the kill: other batches
    assert _rows(alone) and _flat(_rows(after)) == pytest.approx(_flat(_rows(alone)), rel=1e-12)
    assert _flat(_rows(resumed)) == pytest.approx(_flat({q: v for q, v in _rows(alone).items() if q != wss[0].qid}), rel=1e-12)
    assert _reused(after) == _reused(alone)


def test_first_reads_count_per_question_and_component():
    led = CostLedger()
    assert led.first_reads("judge", ["q1", "q2", "q1"], ["a", "a", "b"]) == [0, 0, 0]
    # q1 read "a" before, q2 never read "b"; the encoder component keeps its own reads
    assert led.first_reads("judge", ["q1", "q2", "q1"], ["a", "b", "a"]) == [1, 0, 1]
    assert led.first_reads("encoder", ["q1"], ["a"]) == [0]
    assert CostLedger().first_reads("judge", ["q1"], ["a"]) == [0]  # another ledger: nothing read yet
    with pytest.raises(ValueError, match="2 keys for 1 reads"):
        led.first_reads("judge", ["q1"], ["a", "b"])


def test_reused_calls_get_no_seconds():
    led = CostLedger()
    led.add_batch("judge", ["q1", "q2", "q3"], seconds=3.0, input_tokens=[5, 5, 10], flops=[1.0, 1.0, 2.0],
                  reused=[0, 1, 0])
    assert [r.seconds for r in led.records] == pytest.approx([1.0, 0.0, 2.0])
    led2 = CostLedger()  # every call reused: the measured seconds still add up
    led2.add_batch("judge", ["q1", "q2"], seconds=1.0, flops=[1.0, 3.0], reused=[1, 1])
    assert sum(r.seconds for r in led2.records) == pytest.approx(1.0)
    assert led2.totals()["judge"]["reused"] == 2

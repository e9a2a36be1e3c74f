"""Judges: packed == naive scoring on tiny Qwen2/Qwen3, prompt and score definitions, verdict parsing,
the bundled EncoderJudge, its trainer, and the /score server."""
import math
import threading
import time

import numpy as np
import pytest
import torch

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError, ModelError
from ragfast.judges.causal import CausalJudge
from ragfast.judges.head import EncoderJudge
from ragfast.judges.prompt import ANSWER_PREFIX, NO_CONTEXT, group_states, parse_verdict, user_text
from ragfast.types import State

WORDS = ("river mountain album film born played city capital director singer novel war treaty king queen "
         "province company founded league season").split()


def _doc(rng, i):
    n = int(rng.integers(3, 3 + 4 * i + 5))
    return ("<information>Doc 1(Title: \"" + rng.choice(WORDS).title() + "\") "
            + " ".join(rng.choice(WORDS, size=n)) + "</information>")


def _mixed_states(seed=0, n_traj=5):
    """Several trajectories of uneven length, shuffled; some with ids, some found by prefix."""
    rng = np.random.default_rng(seed)
    states = []
    for t in range(n_traj):
        q = f"Which {rng.choice(WORDS)} was {rng.choice(WORDS)} number {t}?"
        T = int(rng.integers(1, 5))
        ev = []
        for s in range(T + 1):
            states.append(State(q, list(ev), trajectory_id=f"traj{t}" if t % 2 else None, index=s))
            ev.append("\n\n" + _doc(rng, s) + "\n\n")
    # Two trajectories of one question that diverge after their first block, without ids.
    q = "Who founded the league?"
    a, b, c = _doc(rng, 1), _doc(rng, 2), _doc(rng, 3)
    states += [State(q, [a]), State(q, [a, b]), State(q, [a, c]), State(q, []), State(q, [a, b])]
    order = rng.permutation(len(states))
    return [states[i] for i in order]


@pytest.fixture(scope="module")
def qwen2_judge():
    from ragfast.models.tiny import tiny_path

    return CausalJudge(tiny_path("qwen2"), attention="ref")


@pytest.fixture(scope="module")
def qwen3_judge():
    from ragfast.models.tiny import tiny_path

    return CausalJudge(tiny_path("qwen3"), attention="ref")


@pytest.mark.parametrize("which", ["qwen2", "qwen3"])
def test_packed_equals_naive(which, qwen2_judge, qwen3_judge):
    judge = qwen2_judge if which == "qwen2" else qwen3_judge
    states = _mixed_states(seed=1 if which == "qwen2" else 2)
    naive = judge.stop_scores(states, packed=False)
    packed = judge.stop_scores(states)
    assert naive.dtype == np.float64 and packed.shape == (len(states),)
    assert np.isfinite(packed).all()
    np.testing.assert_allclose(packed, naive, atol=1e-4, rtol=0)
    # The scores differ between states (so agreement is not trivial).
    assert np.ptp(naive) > 1e-3
    # Small micro-batches (one trajectory per forward) give the same scores.
    judge.max_batch_tokens, keep = 64, judge.max_batch_tokens
    try:
        np.testing.assert_allclose(judge.stop_scores(states), naive, atol=1e-4, rtol=0)
    finally:
        judge.max_batch_tokens = keep


def test_packed_flex_and_triton_equal_naive(qwen2_judge):
    judge = qwen2_judge
    # A short system prompt keeps the Triton interpreter quick.
    judge.set_system_prompt("Judge sufficiency; reply in JSON.")
    judge.attention = "flex"
    a, b, c = "<information>x king born</information>", "<information>city river</information>", "<information>film</information>"
    states = [State("Who?", [a, b, c]), State("Who?", [a]), State("Who?", []), State("When?", [b], "t"),
              State("When?", [b, a], "t")]
    naive = judge.stop_scores(states, packed=False)
    np.testing.assert_allclose(judge.stop_scores(states), naive, atol=1e-4, rtol=0)
    judge.attention = "triton"
    try:
        np.testing.assert_allclose(judge.stop_scores(states), naive, atol=1e-4, rtol=0)
    finally:
        judge.attention = "ref"
        judge.set_system_prompt(None)
    assert len(judge._sys_ids) > 200


def test_prompt_ids_are_the_templated_text(qwen2_judge):
    st = State("Who directed it?", ["\n\n<information>Doc 1(Title: \"A\") x y</information>\n\n", "<information>B</information>"])
    assert user_text(st) == ("QUESTION:\nWho directed it?\n\nCONTEXT:\n<information>Doc 1(Title: \"A\") x y"
                             "</information>\n\n<information>B</information>")
    assert user_text(State("q", [])) == f"QUESTION:\nq\n\nCONTEXT:\n{NO_CONTEXT}"
    text = qwen2_judge.prompt_text(st)
    msgs = [{"role": "system", "content": qwen2_judge.system_prompt}, {"role": "user", "content": user_text(st)}]
    want = qwen2_judge.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) + ANSWER_PREFIX
    assert text == want
    assert qwen2_judge.tokenizer.decode(qwen2_judge.prompt_ids(st)) == text
    # The piece boundaries (system | question | each block with its leading separator | tail) are
    # stable: tokenising the pieces separately gives the whole text's own tokenisation.
    for s in _mixed_states(seed=7):
        whole = qwen2_judge.tokenizer(qwen2_judge.prompt_text(s), add_special_tokens=False)["input_ids"]
        assert whole == qwen2_judge.prompt_ids(s)


def test_score_is_logp_true_minus_logp_false(qwen2_judge):
    j = qwen2_judge
    tok = j.tokenizer
    want_t = sorted({tok(w, add_special_tokens=False)["input_ids"][0] for w in (" true", "true")})
    want_f = sorted({tok(w, add_special_tokens=False)["input_ids"][0] for w in (" false", "false")})
    assert sorted(j._true_ids) == want_t and sorted(j._false_ids) == want_f
    st = State("Where was the king born?", ["<information>Doc 1(Title: \"King\") born in a city</information>"])
    ids = torch.tensor([j.prompt_ids(st)])
    with torch.inference_mode():
        logp = torch.log_softmax(j.model(input_ids=ids).logits[0, -1].double(), -1)
    want = math.log(logp[want_t].exp().sum()) - math.log(logp[want_f].exp().sum())
    got = j.stop_scores([st])[0]
    assert got == pytest.approx(want, abs=1e-4)


def test_ledger_fresh_vs_cached(qwen2_judge):
    judge = qwen2_judge
    judge.set_system_prompt(None)  # drops the system KV: the next packed call pays the prefill
    states = _mixed_states(seed=4)
    S = len(judge._sys_ids)
    led_n, led_p, led_p2 = CostLedger(), CostLedger(), CostLedger()
    judge.stop_scores(states, packed=False, ledger=led_n, question_ids=[s.question for s in states])
    judge.stop_scores(states, ledger=led_p, question_ids=[s.question for s in states])
    judge.stop_scores(states, ledger=led_p2)
    n, p, p2 = (x.totals()["judge"] for x in (led_n, led_p, led_p2))
    n_traj = len(group_states(states))
    assert n["input_tokens"] == sum(len(judge.prompt_ids(s)) for s in states) and n["cached_tokens"] == 0
    assert p["calls"] == n_traj and p2["cached_tokens"] == S * n_traj
    assert p["input_tokens"] == p2["input_tokens"] + S  # the system prefill is paid once
    assert p["input_tokens"] < n["input_tokens"] and p["flops"] < n["flops"] and p["flops"] > 0
    assert p["seconds"] > 0
    assert set(led_p.per_question()) == {s.question for s in states}


def test_group_states():
    a, b, c = "<information>a</information>", "<information>b</information>", "<information>c</information>"
    sts = [State("q", [a, b]), State("q", []), State("q", [a, c]), State("q", [a]), State("r", [a]),
           State("q", [a], trajectory_id="x"), State("q", [a, b], trajectory_id="x")]
    groups = group_states(sts)
    assert sorted(map(sorted, groups)) == [[0, 1, 3], [2], [4], [5, 6]]
    for g in groups:  # each chain ordered by evidence length
        assert [len(sts[i].evidence) for i in g] == sorted(len(sts[i].evidence) for i in g)


def test_bad_states_are_named(qwen2_judge):
    with pytest.raises(DataError, match="single state"):
        qwen2_judge.stop_scores(State("q", []))
    with pytest.raises(DataError, match="state 1"):
        qwen2_judge.stop_scores([State("q", []), 42])
    with pytest.raises(DataError, match="evidence must be a list of strings"):
        qwen2_judge.stop_scores([State("q", "just a string")])
    with pytest.raises(DataError, match="2 question ids for 1 states"):
        qwen2_judge.stop_scores([("q", [])], question_ids=["a", "b"])
    assert qwen2_judge.stop_scores([]).shape == (0,)
    with pytest.raises(ModelError, match="not found"):
        CausalJudge("/nonexistent/judge")


def test_describe_says_random_weights(qwen2_judge):
    d = qwen2_judge.describe()
    assert d["meaningful"] is False and "random" in d["why"] and d["name"].endswith("qwen2-0-v1")


def test_parse_verdict_strict_lenient_failed():
    ok = '{"sufficient": false, "gap_items": [{"category": "bridge entity", "target": "X", "slot": "birthplace", "description": "where X was born"}]}'
    v = parse_verdict(ok)
    assert v.parse == "strict" and v.sufficient is False and v.gap_items[0]["slot"] == "birthplace"
    assert parse_verdict('{"sufficient": true, "gap_items": []}').sufficient is True
    # Lenient: trailing prose, trailing comma, Python literal, cut-off generation, odd category.
    v = parse_verdict('{"sufficient": True, "gap_items": [],} and then some text')
    assert v.parse == "lenient" and v.sufficient is True
    v = parse_verdict('{"sufficient": false, "gap_items": [{"category": "Weird", "target": "Y", "slot": "date", "description": "when')
    assert v.parse == "lenient" and v.gap_items[0]["category"] == "other" and v.gap_items[0]["description"] == "when"
    v = parse_verdict("{'sufficient': 'true'}")
    assert v.parse == "lenient" and v.sufficient is True
    # Failures mean CONTINUE.
    for bad in ('{"sufficient": maybe', "no json here", '{"sufficient": true, "gap_items": [{"category": "other", '
                '"target": "a", "slot": "b", "description": "c"}]}', '{"sufficient": false, "gap_items": []}'):
        v = parse_verdict(bad)
        assert v.parse == "failed" and v.sufficient is False and v.error
    # Strict rejects what lenient accepts.
    assert parse_verdict('{"gap_items": [], "sufficient": true}').parse == "lenient"


def test_verdicts_generate_and_count(qwen2_judge):
    states = _mixed_states(seed=5)[:4]
    before = sum(qwen2_judge.parse_stats.values())
    led = CostLedger()
    out = qwen2_judge.verdicts(states, max_new_tokens=12, ledger=led)
    assert len(out) == 4
    assert sum(qwen2_judge.parse_stats.values()) == before + 4
    for v in out:
        assert v.raw.startswith(ANSWER_PREFIX)
        if v.parse == "failed":
            assert v.sufficient is False
    t = led.totals()["judge"]
    assert 0 < t["output_tokens"] <= 48 and t["flops"] > 0


# -- EncoderJudge ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoder_judge():
    return EncoderJudge()


def test_bundled_encoder_judge_card_and_scores(encoder_judge):
    d = encoder_judge.describe()
    assert d["meaningful"] is True and d["encoder"] == "minilm"
    m = d["metrics"]
    assert 0 < m["validation"]["ap"] <= 1 and 0 <= m["validation"]["brier"] <= 1 and "dev" in m
    from ragfast.data import load_qa, sample

    qs = [q for q in load_qa(sample("hotpotqa-dev"))[:12]]
    support, empty = [], []
    for q in qs:
        ctx = q.metadata["context"]
        gold = [f'<information>Doc 1(Title: "{t}") {"".join(s)}</information>'
                for t, s in zip(ctx["title"], ctx["sentences"]) if t in q.supporting_titles]
        support.append(State(q.question, gold, q.id))
        empty.append(State(q.question, [], q.id))
    led = CostLedger()
    s_sup = encoder_judge.stop_scores(support, ledger=led, question_ids=[q.id for q in qs])
    s_emp = encoder_judge.stop_scores(empty)
    assert s_sup.dtype == np.float64 and np.isfinite(s_sup).all()
    # The gold supporting paragraphs must look more sufficient than nothing at all.
    assert (s_sup > s_emp).mean() >= 0.9
    assert led.totals()["judge"]["input_tokens"] > 0 and led.totals()["judge"]["flops"] > 0
    # Repeated documents come from the embedding cache: same scores, charged as computed. On a new
    # ledger no question read them before (reused 0); read again on the same ledger, all are reused.
    led2 = CostLedger()
    np.testing.assert_allclose(encoder_judge.stop_scores(support, ledger=led2), s_sup)
    t, t2 = led.totals()["judge"], led2.totals()["judge"]
    assert [t2[k] for k in ("calls", "input_tokens", "flops")] == [t[k] for k in ("calls", "input_tokens", "flops")]
    assert t2["reused"] == t["reused"] == 0
    encoder_judge.stop_scores(support, ledger=led, question_ids=[q.id for q in qs])
    assert led.totals()["judge"]["reused"] == t["calls"] > 0


def test_train_encoder_judge_small(tmp_path):
    from ragfast.data import sample
    from ragfast.judges.train.head import train_encoder_judge

    src = sample("hotpotqa-train")
    small = tmp_path / "small.jsonl"
    small.write_text("".join(open(src).readlines()[:16]))
    card = train_encoder_judge(small, tmp_path / "head", val_fraction=0.25, turns=2, log=lambda m: None)
    assert (tmp_path / "head" / "encoder_judge.safetensors").stat().st_size < 20_000
    assert card["metrics"]["validation"]["n_questions"] == 4
    j = EncoderJudge(tmp_path / "head")
    s = j.stop_scores([("Who?", []), ("Who?", ["<information>Doc 1(Title: x) y</information>"])])
    assert s.shape == (2,) and np.isfinite(s).all()
    # what training must change: a fitted head has non-zero weights, so the evidence moves the score
    from safetensors.numpy import load_file

    w = load_file(str(tmp_path / "head" / "encoder_judge.safetensors"))
    assert np.abs(w["weight"]).max() > 0 and s[0] != s[1]
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(ModelError, match="not found"):
        EncoderJudge(bad)


# -- server ------------------------------------------------------------------------------------------
class _HoldOnce:
    """Wraps a judge; records the states of every call, and once armed holds the next call until
    ``release`` (so the test can queue other requests behind it without timing)."""

    def __init__(self, judge):
        self.judge, self.batches = judge, []
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()

    def describe(self):
        return self.judge.describe()

    def stop_scores(self, states, **kw):
        self.batches.append({(s.question, tuple(s.evidence)) for s in states})
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.release.wait(60), "the test never released the held call"
        return self.judge.stop_scores(states, **kw)


def test_score_server(qwen2_judge):
    from fastapi.testclient import TestClient

    from ragfast.judges.server import make_app

    states = _mixed_states(seed=6, n_traj=3)
    want = qwen2_judge.stop_scores(states, packed=False)
    body = {"states": [{"question": s.question, "evidence": s.evidence,
                        **({"trajectory_id": s.trajectory_id} if s.trajectory_id else {})} for s in states]}
    judge = _HoldOnce(qwen2_judge)
    with TestClient(make_app(judge, max_wait_ms=20)) as client:
        r = client.post("/score", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meaningful"] is False
        np.testing.assert_allclose(out["scores"], want, atol=1e-4)
        # Concurrent requests are merged into shared batches and each gets its own scores back.
        res = {}

        def post(i):
            res[i] = client.post("/score", json={"states": body["states"][i::3]}).json()["scores"]

        threads = [threading.Thread(target=post, args=(i,)) for i in range(3)]
        judge.armed = True
        threads[0].start()  # held inside the judge until the other two are queued behind it
        assert judge.entered.wait(60)
        threads[1].start()
        threads[2].start()
        deadline = time.monotonic() + 60
        while client.get("/health").json()["stats"]["queued_requests"] < 2:
            assert time.monotonic() < deadline, "the other requests never queued"
            time.sleep(0.01)
        held = len(judge.batches)
        judge.release.set()
        for t in threads:
            t.join()
        for i in range(3):
            np.testing.assert_allclose(res[i], want[i::3], atol=1e-4)
        # the two queued requests shared the next batch
        keys = [{(st["question"], tuple(st.get("evidence", []))) for st in body["states"][i::3]} for i in (1, 2)]
        only = [keys[0] - keys[1], keys[1] - keys[0]]  # states that name their request
        assert only[0] and only[1] and judge.batches[held] & only[0] and judge.batches[held] & only[1]
        assert client.post("/score", json={"states": []}).json()["scores"] == []
        assert client.post("/score", json={"states": [{"question": 3}]}).status_code == 422
        assert client.post("/score", json={"states": [{"question": "q", "evidence": "x", "bogus": 1}]}).status_code == 422
        r = client.post("/score", json={"states": [{"question": "  "}]})
        assert r.status_code == 400 and "empty question" in r.json()["detail"]
        h = client.get("/health").json()
        assert h["judge"]["meaningful"] is False and h["batches"] >= 2 and h["cost"]["calls"] > 0


def test_cli_lists_judge_commands():
    from typer.testing import CliRunner

    from ragfast.cli import app

    r = CliRunner().invoke(app, ["serve-judge", "--help"])
    assert r.exit_code == 0 and "127.0.0.1" in r.output
    r = CliRunner().invoke(app, ["train-judge", "--help"])
    assert r.exit_code == 0 and "--data" in r.output

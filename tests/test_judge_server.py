"""serve-judge under hostile input: per-request checks and limits, failure isolation, fairness
counters; and the byte-capped LRU caches (ragfast.infra.cache) the judges use."""
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from ragfast.infra.cache import ByteLRU, set_default_max_bytes, text_key
from ragfast.judges.server import JudgeLimits, make_app
from ragfast.types import State


class FakeJudge:
    """Scores a state by its evidence count; fails on the question 'boom'; sleeps a little per call."""

    def __init__(self, delay=0.0):
        self.delay, self.calls = delay, []

    def describe(self):
        return {"name": "fake", "meaningful": False}

    def stop_scores(self, states, ledger=None, question_ids=None):
        self.calls.append(len(states))
        if any(s.question == "boom" for s in states):
            raise RuntimeError("judge exploded")
        time.sleep(self.delay)
        return np.array([len(s.evidence) + len(s.question) / 1000 for s in states], dtype=np.float64)


class GatedJudge(FakeJudge):
    """FakeJudge whose first call waits for ``release`` (the test queues the others behind it)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def stop_scores(self, states, ledger=None, question_ids=None):
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the first call"
        return super().stop_scores(states, ledger, question_ids)


def test_score_requests_are_checked_alone_and_limits_are_named():
    lim = JudgeLimits(max_states=3, max_passages=2, max_passage_chars=20, max_question_chars=30, max_body_bytes=2000)
    with TestClient(make_app(FakeJudge(), limits=lim), raise_server_exceptions=False) as cl:
        cases = [
            (b'{"states": [{"question": "a\\udc00"}]}', 422, "states[0].question"),
            (b'{"states": [{"question": "q", "evidence": ["ok", "x\\ud800"]}]}', 422, "states[0].evidence[1]"),
            (b'{"states": [{"question": "q", "evidence": ["a", "b", "c"]}]}', 413, "--max-passages"),
            (b'{"states": [{"question": "q", "evidence": ["' + b"y" * 21 + b'"]}]}', 413, "--max-passage-chars"),
            (b'{"states": [{"question": "' + b"q" * 31 + b'"}]}', 413, "--max-question-chars"),
            (b'{"states": [{"question": "q"}, {"question": "q"}, {"question": "q"}, {"question": "q"}]}', 413,
             "--max-states"),
            (b'{"states": [{"question": "q", "trajectory_id": 7}]}', 422, "trajectory_id"),
            (b'{"states": [{"question": "q", "evidence": "x"}]}', 422, "evidence"),
            (b'{"states": [{"question": "q", "bogus": NaN}]}', 422, "finite"),
            (b'{"states": [{"question": "q", "bogus": 1}]}', 422, "bogus"),
            (b'{"states": "q"}', 422, "states"),
            (b'{"states": [{"question": "  "}]}', 400, "empty question"),
            (b'{"states": []}' + b" " * 2000, 413, "--max-body-bytes"),
        ]
        for body, status, word in cases:
            r = cl.post("/score", content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (body[:70], r.status_code, r.text)
            assert word in r.json()["detail"], (body[:70], r.text)
        r = cl.post("/score", json={"states": [{"question": "q", "evidence": ["a", "b"]}, {"question": "qq"}]})
        assert r.status_code == 200 and r.json()["scores"] == pytest.approx([2.001, 0.002])
        h = cl.get("/health").json()
        assert h["stats"]["rejected"] == len(cases) and h["limits"]["max_passages"] == 2
        assert "ragfast_judge_rejected_total 13" in cl.get("/metrics").text


def test_a_failing_state_fails_only_its_request():
    judge = GatedJudge()
    app = make_app(judge, max_wait_ms=30)
    bodies = [{"states": [{"question": "boom" if i in (1, 6) else f"q{i}", "evidence": ["e"] * (i % 3)}]}
              for i in range(10)]
    with TestClient(app, raise_server_exceptions=False) as cl:
        out = [None] * len(bodies)

        def post(i):
            out[i] = cl.post("/score", json=bodies[i])

        ths = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        ths[0].start()  # the first request is held inside the judge ...
        assert judge.entered.wait(30)
        for t in ths[1:]:
            t.start()
        deadline = time.monotonic() + 30  # ... until the other nine are queued behind it
        while cl.get("/health").json()["stats"]["queued_requests"] < 9:
            assert time.monotonic() < deadline, "the other requests never queued"
            time.sleep(0.01)
        judge.release.set()
        for t in ths:
            t.join()
        for i, r in enumerate(out):
            if i in (1, 6):
                assert r.status_code == 500 and "judge exploded" in r.text and r.headers["x-request-id"] in r.text
            else:
                assert r.status_code == 200 and r.json()["scores"] == pytest.approx([i % 3 + len(f"q{i}") / 1000])
        st = cl.get("/health").json()["stats"]
        assert st["failed_requests"] == 2 and st["errors"] == 2
    assert max(judge.calls) > 1  # requests did share batches


def test_big_score_request_is_chunked():
    judge = FakeJudge()
    with TestClient(make_app(judge, max_batch_states=16, chunk_states=4)) as cl:
        states = [{"question": f"q{i}", "evidence": ["e"] * (i % 4)} for i in range(50)]
        r = cl.post("/score", json={"states": states})
        assert r.status_code == 200 and r.json()["scores"] == pytest.approx([i % 4 + len(f"q{i}") / 1000
                                                                              for i in range(50)])
    assert max(judge.calls) <= 16 and sum(judge.calls) == 50


# -- ByteLRU ------------------------------------------------------------------------------------------
def test_byte_lru_caps_bytes_and_evicts_least_recently_used():
    c = ByteLRU(max_bytes=10_000)
    vec = np.zeros(400, dtype=np.float32)  # 1600 bytes + header
    for i in range(5):
        c.put(f"k{i}", vec.copy())
    assert len(c) == 5 and c.bytes <= 10_000
    assert c.get("k0") is not None  # k0 is now the most recent: k1 goes first
    for i in range(5, 8):
        c.put(f"k{i}", vec.copy())
    assert c.bytes <= 10_000 and "k1" not in c and "k0" in c and c.evictions >= 1
    assert c.put("huge", np.zeros(10_000, dtype=np.float32)) is False and "huge" not in c
    c["k0"] = np.zeros(10, dtype=np.float32)  # replacing an entry re-counts its size
    assert c.bytes <= 10_000 and c["k0"].shape == (10,)
    with pytest.raises(KeyError):
        c["nope"]
    assert text_key("a" * 10**6) != text_key("a" * (10**6 - 1)) and len(text_key("x\ud800")) == 16
    set_default_max_bytes(1234)
    try:
        assert ByteLRU().max_bytes == 1234
    finally:
        set_default_max_bytes(None)
    with pytest.raises(ValueError):
        set_default_max_bytes(-1)


def test_encoder_judge_cache_stays_under_its_byte_cap():
    from ragfast.judges.head import EncoderJudge

    set_default_max_bytes(64 * 1024)  # ~30 passage vectors
    try:
        small = EncoderJudge()
    finally:
        set_default_max_bytes(None)
    big = EncoderJudge(encoder=small.encoder)
    rng = np.random.default_rng(0)
    words = "river mountain album film born played city capital director singer novel war".split()
    states = [State(f"who {i}?", [f"<information>Doc 1(Title: T{i}) " + " ".join(rng.choice(words, 30)) + f" {i}"
                                  f"</information>"]) for i in range(120)]
    got = small.stop_scores(states)
    np.testing.assert_allclose(got, big.stop_scores(states), atol=1e-5)  # eviction never changes a score
    d = small.features._d.describe()
    assert d["bytes"] <= 64 * 1024 and d["evictions"] > 0
    assert big.features._d.describe()["evictions"] == 0
    np.testing.assert_allclose(small.stop_scores(states[:5]), got[:5], atol=1e-5)


def test_every_server_limit_is_in_help():
    from typer.testing import CliRunner

    from ragfast.cli import app

    r = CliRunner().invoke(app, ["serve-judge", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for flag in ("--max-states", "--max-passages", "--max-passage-chars", "--max-question-chars", "--max-body-bytes",
                 "--cache-mb", "--chunk-states", "--graceful-s"):
        assert flag in r.output, flag
    r = CliRunner().invoke(app, ["serve-retriever", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for flag in ("--max-queries", "--max-query-chars", "--max-topk", "--max-body-bytes", "--chunk", "--graceful-s"):
        assert flag in r.output, flag

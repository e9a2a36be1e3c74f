"""Remote components book what their servers report, and "unknown" when a server reports nothing."""
from __future__ import annotations

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger
from ragfast.accounting.remote_cost import book, cost_items
from ragfast.types import State

fastapi = pytest.importorskip("fastapi")


def _states(n=6):
    from ragfast.data import load_qa, sample

    out = []
    for q in load_qa(sample("hotpotqa-dev"))[:n]:
        ctx = q.metadata["context"]
        ev = [f'<information>Doc 1(Title: "{t}") {"".join(s)}</information>' for t, s in
              list(zip(ctx["title"], ctx["sentences"]))[:2]]
        out.append(State(q.question, ev, q.id))
    return out


def test_reported_cost_books_exactly_what_the_component_recorded_in_process():
    from ragfast.judges.head import EncoderJudge

    states = _states()
    keys = [str(i) for i in range(len(states))]
    server = CostLedger()
    EncoderJudge().stop_scores(states, ledger=server, question_ids=keys)
    items = cost_items(server, keys)
    client = CostLedger()
    qids = [s.trajectory_id for s in states]
    book(client, "judge", qids, {"items": items, "server_seconds": 0.0}, client_seconds=10.0)
    s, c = server.totals()["judge"], client.totals()["judge"]
    assert c["flops"] == pytest.approx(s["flops"], rel=1e-9) and c["flops"] > 0
    assert c["input_tokens"] == s["input_tokens"] and c["calls"] == s["calls"]
    assert c["seconds"] == pytest.approx(10.0)  # server share + the rest of the round trip
    assert c["unknown"] == 0
    # per question, not only in total
    for q, k in zip(qids, keys):
        assert client.per_question()[q]["judge"]["flops"] == pytest.approx(server.per_question()[k]["judge"]["flops"])


def _app(with_cost: bool):
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/health")
    def health():
        return {"judge": {"name": "fake", "meaningful": False}}

    @app.post("/score")
    def score(body: dict):
        n = len(body["states"])
        out = {"scores": [float(i) for i in range(n)]}
        if with_cost:
            out["cost"] = {"items": [{"judge": {"calls": 1, "input_tokens": 5, "flops": 1e6, "seconds": 0.001}}] * n}
        return out

    @app.post("/retrieve")
    def retrieve(body: dict):
        hit = {"document": {"id": "d0", "contents": '"T"\nx'}, "score": 1.0}
        return {"result": [[hit] * body["topk"] for _ in body["queries"]]}

    return app


def test_remote_judge_books_reported_cost_or_unknown():
    from fastapi.testclient import TestClient

    from ragfast.judges.remote import RemoteJudge

    states = [State("q?", [], "a"), State("q?", ["<information>x</information>"], "a"), State("r?", [], "b")]
    for with_cost in (True, False):
        j = RemoteJudge("http://testserver", client=TestClient(_app(with_cost)), max_states_per_request=2)
        assert j.meaningful is False and j.name.startswith("fake @")
        led = CostLedger()
        s = j.stop_scores(states, ledger=led, question_ids=["a", "a", "b"])
        np.testing.assert_array_equal(s, [0.0, 1.0, 0.0])  # two requests: 2 states, then 1
        t = led.totals()["judge"]
        if with_cost:
            assert t["flops"] == 3e6 and t["calls"] == 3 and t["unknown"] == 0
        else:
            assert t["flops"] == 0 and t["unknown"] == 3 and t["calls"] == 3


def test_remote_retriever_without_cost_is_unknown_not_free():
    from fastapi.testclient import TestClient

    from ragfast.retrieval.remote import RemoteRetriever

    rr = RemoteRetriever("http://testserver", client=TestClient(_app(False)))
    led = CostLedger()
    hits = rr.search(["a", "b"], 2, ledger=led, question_ids=["q1", "q2"])
    assert [len(h) for h in hits] == [2, 2]
    t = led.totals()["search"]
    assert t["unknown"] == 2 and t["flops"] == 0 and t["seconds"] > 0


def test_model_errors():
    from ragfast.errors import ConfigError, ModelError
    from ragfast.judges.remote import RemoteJudge

    with pytest.raises(ConfigError, match="http"):
        RemoteJudge("localhost:1")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelError, match="cannot reach the judge server"):
        RemoteJudge(f"http://127.0.0.1:{port}", timeout=2)


def test_served_components_cost_what_they_cost_in_process(minilm_encoder):
    """serve-retriever and serve-judge report per-item compute; the clients' ledgers then hold
    what the same components record in-process (FLOPs within 1%)."""
    from fastapi.testclient import TestClient

    from ragfast.judges.server import make_app
    from ragfast.data import corpus_from_contexts, load_qa, sample
    from ragfast.judges.head import EncoderJudge
    from ragfast.judges.remote import RemoteJudge
    from ragfast.retrieval import build_default_retriever
    from ragfast.retrieval.remote import RemoteRetriever
    from ragfast.retrieval.server import create_app

    qs = load_qa(sample("hotpotqa-dev"))[:8]
    retriever = build_default_retriever(corpus_from_contexts(qs), encoder=minilm_encoder)
    queries, qids = [q.question for q in qs], [q.id for q in qs]
    local = CostLedger()
    retriever.search(queries, 3, ledger=local, question_ids=qids)
    remote = CostLedger()
    with TestClient(create_app(retriever, max_wait_ms=0)) as client:
        # a Search-R1 client that does not ask for cost gets Search-R1's answer, no extra key
        assert set(client.post("/retrieve", json={"queries": queries[:2], "topk": 3}).json()) == {"result"}
        RemoteRetriever("http://testserver", client=client).search(queries, 3, ledger=remote, question_ids=qids)
    for comp in ("encoder", "search"):
        lt, rt = local.totals()[comp], remote.totals()[comp]
        assert rt["flops"] == pytest.approx(lt["flops"], rel=0.01) and rt["flops"] > 0, comp
        assert rt["unknown"] == 0
    assert remote.totals()["encoder"]["input_tokens"] == local.totals()["encoder"]["input_tokens"]

    states = _states()
    judge_local = CostLedger()
    EncoderJudge().stop_scores(states, ledger=judge_local, question_ids=[s.trajectory_id for s in states])
    judge_remote = CostLedger()
    with TestClient(make_app(EncoderJudge(), max_wait_ms=0)) as client:
        j = RemoteJudge("http://testserver", client=client)
        j.stop_scores(states, ledger=judge_remote, question_ids=[s.trajectory_id for s in states])
    lt, rt = judge_local.totals()["judge"], judge_remote.totals()["judge"]
    assert rt["flops"] == pytest.approx(lt["flops"], rel=0.01) and rt["flops"] > 0 and rt["unknown"] == 0

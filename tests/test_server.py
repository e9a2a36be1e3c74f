"""The Search-R1-compatible retrieval server, its micro-batching, limits, the client and the CLI."""
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from ragfast.cost import CostLedger
from ragfast.errors import ConfigError
from ragfast.retrieval.base import Retriever
from ragfast.retrieval.bm25 import BM25Retriever
from ragfast.retrieval.remote import RemoteRetrievalError, RemoteRetriever
from ragfast.retrieval.server import create_app, load_retriever

TOPICS = ["zeppelin", "volcano", "saxophone", "glacier", "cathedral", "marathon", "orchid", "telescope",
          "lighthouse", "submarine", "tornado", "violin", "pyramid", "penguin", "satellite", "vineyard"]


@pytest.fixture(scope="module")
def corpus():
    from ragfast.data import Corpus

    rows = []
    for i in range(240):
        t = TOPICS[i % len(TOPICS)]
        rows.append({"id": str(i), "contents": f'"{t.title()} {i}"\nA passage about the {t}, number {i}, '
                                               f"with detail {i * 7 % 13} and {'extra ' * (i % 4)}words."})
    return Corpus.from_rows(rows)


@pytest.fixture(scope="module")
def bm25(corpus):
    return BM25Retriever.build(corpus)


class Slow(Retriever):
    """Wraps a retriever: sleeps per call (so requests pile up) and fails on the query 'boom'."""

    name = "slow"

    def __init__(self, inner, delay=0.05):
        self.inner, self.delay, self.calls = inner, delay, []

    def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
        self.calls.append(len(queries))
        if "boom" in queries:
            raise RuntimeError("kaboom")
        time.sleep(self.delay)
        return self.inner.search(queries, k, exclude=exclude)


def test_retrieve_protocol(bm25, corpus):
    app = create_app(bm25, default_topk=3)
    with TestClient(app) as cl:
        payload = {"queries": ["zeppelin number 16", "glacier detail"], "topk": 3, "return_scores": True}
        r = cl.post("/retrieve", json=payload)
        assert r.status_code == 200
        res = r.json()["result"]
        assert len(res) == 2 and all(len(x) == 3 for x in res)
        want = bm25.search(payload["queries"], 3)
        for got_row, want_row in zip(res, want):
            assert [g["document"] for g in got_row] == [corpus.row(int(h.id)) for h in want_row]
            assert [g["score"] for g in got_row] == pytest.approx([h.score for h in want_row])
            assert set(got_row[0]) == {"document", "score"} and set(got_row[0]["document"]) == {"id", "contents"}
        # Without return_scores: bare corpus rows. Null or missing topk: the server default.
        bare = cl.post("/retrieve", json={"queries": ["zeppelin number 16"], "topk": None}).json()["result"]
        assert bare == [[g["document"] for g in res[0]]]
        assert len(cl.post("/retrieve", json={"queries": ["volcano"]}).json()["result"][0]) == 3
        assert len(cl.post("/retrieve", json={"queries": ["volcano"], "topk": 5, "extra": 1}).json()["result"][0]) == 5
        assert cl.post("/retrieve", json={"queries": []}).json() == {"result": []}
        h = cl.get("/health").json()
        assert h["status"] == "ok" and h["retriever"]["name"] == "bm25" and h["stats"]["queries"] == 5


def test_bad_requests_get_4xx_and_server_survives(bm25):
    slow = Slow(bm25, delay=0.0)
    app = create_app(slow, default_topk=2, max_queries=3, max_query_chars=50, max_topk=10)
    bad = [
        ({"queries": ["a"] * 4}, 413, "too many queries"),
        ({"queries": ["x" * 51]}, 413, "characters"),
        ({"queries": ["a"], "topk": 0}, 422, "topk"),
        ({"queries": ["a"], "topk": 11}, 422, "topk"),
        ({"queries": "a"}, 422, "list"),
        ({"topk": 3}, 422, "queries"),
        ({"queries": [1, 2]}, 422, "string"),
        ({"queries": ["a"], "topk": "many"}, 422, "topk"),
    ]
    with TestClient(app, raise_server_exceptions=False) as cl:
        for body, status, word in bad:
            r = cl.post("/retrieve", json=body)
            assert r.status_code == status, body
            assert word in r.text, (body, r.text)
        r = cl.post("/retrieve", content=b"{not json", headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500
        r = cl.post("/retrieve", json={"queries": ["boom"]})
        assert r.status_code == 500 and "kaboom" in r.text
        ok = cl.post("/retrieve", json={"queries": ["penguin"], "return_scores": True})
        assert ok.status_code == 200 and "Penguin" in ok.json()["result"][0][0]["document"]["contents"]
        assert cl.get("/health").json()["stats"]["rejected"] == len(bad) + 1  # + the non-JSON body
    with pytest.raises(ConfigError):
        create_app(bm25, default_topk=0)
    with pytest.raises(ConfigError):
        create_app(bm25, default_topk=5, max_topk=4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server():
    import uvicorn

    servers = []

    def start(app):
        port = _free_port()
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        deadline = time.monotonic() + 30
        while not srv.started:
            if time.monotonic() > deadline or not th.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        servers.append((srv, th))
        return f"http://127.0.0.1:{port}"

    yield start
    for srv, th in servers:
        srv.should_exit = True
        th.join(10)


def test_concurrent_requests_are_batched_and_answered_correctly(bm25, live_server):
    slow = Slow(bm25, delay=0.1)  # while one call sleeps, the other requests queue up
    url = live_server(create_app(slow, default_topk=4, max_wait_ms=5.0))
    queries = [f"{TOPICS[i % len(TOPICS)]} number {i}" for i in range(32)]
    ks = [1 + i % 5 for i in range(32)]

    async def run():
        async with httpx.AsyncClient(timeout=30) as cl:
            reqs = [cl.post(url + "/retrieve", json={"queries": [q], "topk": k, "return_scores": True})
                    for q, k in zip(queries, ks)]
            return await asyncio.gather(*reqs)

    answers = asyncio.run(run())
    assert all(a.status_code == 200 for a in answers)
    for q, k, a in zip(queries, ks, answers):
        got = [x["document"]["id"] for x in a.json()["result"][0]]
        assert got == [h.id for h in bm25.search([q], k)[0]], q
    stats = httpx.get(url + "/health").json()["stats"]
    assert stats["requests"] == 32 and stats["errors"] == 0
    assert stats["batches"] < 32 and max(slow.calls) > 1  # requests shared retriever calls


def test_remote_retriever_matches_local(bm25, live_server):
    url = live_server(create_app(bm25, default_topk=3, max_queries=2))
    queries = ["volcano number 1", "violin detail 5", "orchid", "pyramid number 12", "satellite"]
    local = bm25.search(queries, 4)
    led = CostLedger()
    with RemoteRetriever(url, max_queries_per_request=2) as rr:  # 5 queries -> 3 requests under the limit
        remote = rr.search(queries, 4, ledger=led, question_ids=list("abcde"))
        assert [[h.id for h in row] for row in remote] == [[h.id for h in row] for row in local]
        assert [[h.document for h in row] for row in remote] == [[h.document for h in row] for row in local]
        assert remote[0][0].score == pytest.approx(local[0][0].score)
        ex = rr.search(queries[:1], 4, exclude=[[local[0][0].id]])
        assert local[0][0].id not in [h.id for h in ex[0]] and len(ex[0]) == 4
        assert led.per_question()["c"]["search"]["calls"] == 1
        assert rr.describe()["server"]["name"] == "bm25"
    with pytest.raises(RemoteRetrievalError, match="413"):
        RemoteRetriever(url, max_queries_per_request=10).search(queries, 3)
    with pytest.raises(RemoteRetrievalError, match="cannot reach"):
        RemoteRetriever(f"http://127.0.0.1:{_free_port()}", retries=0).search(["x"], 1)
    with pytest.raises(ConfigError):
        RemoteRetriever("localhost:8000")


@pytest.mark.slow
def test_cli_index_build_then_serve_dense(corpus, tmp_path, live_server):
    from ragfast.data import Corpus

    small = Corpus.from_rows([corpus.row(i) for i in range(48)])  # the CLI test embeds for real: keep it small
    src = tmp_path / "corpus.jsonl"
    small.save(src)
    out = tmp_path / "index"
    p = subprocess.run([sys.executable, "-m", "ragfast.cli", "index", "build", "--corpus", str(src), "--encoder",
                        "minilm", "--out", str(out), "--chunk-size", "20"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout)
    assert report["passages"] == len(small) and report["index"]["backend"] == "flat" and report["encode_s"] > 0
    assert (out / "vectors.npy").exists() and not (out / "chunks").exists()
    r = load_retriever(str(src), str(out))  # encoder recorded by the build
    assert type(r).__name__ == "DenseRetriever" and r.describe()["encoder"]["preset"] == "minilm"
    from ragfast.retrieval.dense import DenseIndex, ShardedIndex

    ShardedIndex.split(DenseIndex.load(out), 2).save(tmp_path / "sharded")
    rs = load_retriever(str(src), str(tmp_path / "sharded"), encoder=r.encoder.name)
    assert rs.describe()["index"]["backend"] == "sharded"
    q = ["a passage about the orchid number 7"]
    assert [h.id for h in rs.search(q, 5)[0]] == [h.id for h in r.search(q, 5)[0]]
    url = live_server(create_app(r))
    res = httpx.post(url + "/retrieve", json={"queries": ["a passage about the saxophone"], "topk": 3,
                                              "return_scores": True}).json()["result"][0]
    assert len(res) == 3 and all("Saxophone" in x["document"]["contents"] for x in res)
    bad = subprocess.run([sys.executable, "-m", "ragfast.cli", "index", "build", "--corpus", str(tmp_path / "nope"),
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "no such file" in (bad.stderr + bad.stdout)


@pytest.mark.slow
def test_bounded_load_test_script(tmp_path):
    """bench/bench_server.py in CI: a short bounded run on loopback, BM25, no errors, CSV rows."""
    import csv
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "bench_server.py"
    out = tmp_path / "bs.csv"
    p = subprocess.run([sys.executable, str(script), "--retriever", "bm25", "--corpus", "wiki-sample", "--duration",
                        "2", "--reps", "2", "--clients", "8", "--csv", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    by = {(r["provider"], r["metric"]): r for r in rows}
    assert float(by[("batched", "errors")]["p50"]) == 0 and float(by[("one-at-a-time", "errors")]["p50"]) == 0
    assert float(by[("batched", "throughput")]["p50"]) > 0 and float(by[("one-at-a-time", "mean_batch")]["p50"]) == 1
    assert ("batched/one-at-a-time", "throughput_ratio") in by

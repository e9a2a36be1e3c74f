"""``bench/bench_server.py --faults``: both servers under hostile input and mixed load, on loopback.

Phases, each bounded in time (``--phase-s``) and in requests (``--max-requests``):

1. retriever, baseline: N valid clients (one query, topk 3, Search-R1's payload) in closed loops;
2. retriever + faults: the same clients while a stream of malformed requests of every kind
   arrives (lone surrogates, NaN/Infinity, booleans and strings for topk, over-long queries,
   too many queries, non-JSON, non-UTF-8, wrong types, a 200 MB body);
3. retriever + huge: the same clients while one 1024-query, topk-100 request after another runs;
4. body limit: a declared 200 MB body, timed to its 413, with the server's RSS around it;
5. judge + faults: N valid ``/score`` clients plus malformed judge requests;
6. judge burst: distinct large passages (``--judge-burst-mb`` in all), RSS before, at peak, after.

``python -m bench.server_faults`` runs the connection phase on its own (issue 27): normal clients
in closed loops, alone and while 500 idle sockets and 50 slow-loris connections (a header line
every 0.5 s) are held open (each reopened when the server closes it), in alternating windows.
Reported: the normal clients' p99 under attack over their p99 alone (median of the window pairs;
goal <= 2), and how long after opening the server closed each idle socket (goal: within the
head timeout, ``--head-timeout-s``).

Reported: errors seen by valid clients (goal 0), how each malformed kind was answered, p50/p99
of the small requests with and without the huge one (goal: p99 ratio <= 3), the time to refuse
the 200 MB body (goal < 100 ms, < 10 MB growth), and the judge's RSS after the burst (goal:
within 100 MB of the baseline).
"""
from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any, Callable

import numpy as np

from ragfast.serving import uvicorn_options

LOOPBACK = "127.0.0.1"


# -- server processes -----------------------------------------------------------------------------
def serve_retriever(spec: str, kind: str, port: int, threads: int | None, ready) -> None:
    """Retriever server process (uvicorn on loopback) with the default limits."""
    import uvicorn

    from ragfast.retrieval.server import create_app, set_threads

    set_threads(threads)
    from bench.bench_server import bench_corpus

    corpus = bench_corpus(spec)
    if kind == "bm25":
        from ragfast.retrieval.bm25 import BM25Retriever

        retriever = BM25Retriever.build(corpus)
    else:
        from ragfast.retrieval.dense import build_default_retriever

        retriever = build_default_retriever(corpus, progress=False)
    retriever.search(["warm-up query"], 3)
    app = create_app(retriever, default_topk=3)
    ready.send("ready")
    ready.close()
    # The production connection settings (a deadline for each request head, keep-alive, a cap).
    uvicorn.run(app, **uvicorn_options(LOOPBACK, port), log_level="warning", access_log=False)


def serve_judge(port: int, threads: int | None, passage_chars: int, ready) -> None:
    """Judge server process: the bundled EncoderJudge; passages may be as long as ``passage_chars``."""
    import uvicorn

    from ragfast.judges import load as load_judge
    from ragfast.judges.server import JudgeLimits, make_app
    from ragfast.retrieval.server import set_threads

    set_threads(threads)
    judge = load_judge("encoder")
    judge.stop_scores([("warm-up?", ["<information>Doc 1(Title: x) y</information>"])])
    app = make_app(judge, limits=JudgeLimits(max_passage_chars=passage_chars))
    ready.send("ready")
    ready.close()
    uvicorn.run(app, **uvicorn_options(LOOPBACK, port), log_level="warning", access_log=False)


# -- clients --------------------------------------------------------------------------------------
async def closed_loop(cl, url: str, bodies: list[dict], check: Callable[[Any], bool], clients: int,
                      seconds: float, max_requests: int) -> dict:
    """``clients`` closed loops posting ``bodies`` (cycled) for ``seconds`` or ``max_requests``."""
    lat: list[float] = []
    errors: list[str] = []
    stop = time.perf_counter() + seconds
    sent = 0

    async def client(c: int) -> None:
        nonlocal sent
        i = c
        while time.perf_counter() < stop and sent < max_requests:
            sent += 1
            body = bodies[i % len(bodies)]
            i += clients
            t0 = time.perf_counter()
            try:
                r = await cl.post(url, json=body)
                ok = r.status_code == 200 and check(r.json())
                why = f"{r.status_code} {r.text[:120]}" if not ok else ""
            except Exception as exc:
                ok, why = False, f"{type(exc).__name__}: {exc}"
            if ok:
                lat.append(time.perf_counter() - t0)
            else:
                errors.append(why)

    await asyncio.gather(*(client(c) for c in range(clients)))
    return {"lat": np.asarray(lat), "errors": errors}


def _raw_post(url: str, path: str, body: bytes, declared: int | None = None,
              timeout: float = 30.0) -> tuple[int, float]:
    """POST over a raw socket (so a declared size can exceed what is sent); (status, seconds to answer)."""
    host, port = url.removeprefix("http://").split(":")
    n = len(body) if declared is None else declared
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        t0 = time.perf_counter()
        s.sendall(head)
        try:
            s.sendall(body)
        except OSError:
            pass  # the server may answer and close before a declared-huge body is sent
        reply = b""
        while b"\r\n" not in reply:
            got = s.recv(4096)
            if not got:
                break
            reply += got
        dt = time.perf_counter() - t0
    try:
        return int(reply.split(b" ", 2)[1]), dt
    except (IndexError, ValueError):
        return 0, dt


def retriever_faults() -> list[tuple[str, bytes, int | None]]:
    """(kind, body, declared length) of every malformed /retrieve request the stream sends."""
    long_q = "x" * 5000
    return [
        ("lone surrogate", b'{"queries": ["a\\ud800b"], "topk": 3}', None),
        ("topk NaN", b'{"queries": ["a"], "topk": NaN}', None),
        ("topk Infinity", b'{"queries": ["a"], "topk": Infinity}', None),
        ("topk true", b'{"queries": ["a"], "topk": true}', None),
        ("topk string", b'{"queries": ["a"], "topk": "3"}', None),
        ("topk 3.0", b'{"queries": ["a"], "topk": 3.0}', None),
        ("topk too big", b'{"queries": ["a"], "topk": 100000}', None),
        ("return_scores string", b'{"queries": ["a"], "return_scores": "yes"}', None),
        ("query too long", json.dumps({"queries": [long_q]}).encode(), None),
        ("too many queries", json.dumps({"queries": ["q"] * 1025}).encode(), None),
        ("not JSON", b'{"queries": [', None),
        ("not UTF-8", b'\xff\xfe{"queries": ["a"]}', None),
        ("queries not a list", b'{"queries": "a"}', None),
        ("query not a string", b'{"queries": [1, 2]}', None),
        ("no queries", b'{"topk": 3}', None),
        ("body a list", b'["a"]', None),
        ("200 MB body", b'{"queries": ["', 200_000_000),
    ]


def judge_faults() -> list[tuple[str, bytes, int | None]]:
    """(kind, body, declared length) of every malformed /score request the stream sends."""
    def st(**kw):
        return json.dumps({"states": [kw]}).encode()

    return [
        ("lone surrogate question", b'{"states": [{"question": "a\\udc00"}]}', None),
        ("lone surrogate passage", b'{"states": [{"question": "q", "evidence": ["x\\ud800"]}]}', None),
        ("NaN", b'{"states": [{"question": "q", "trajectory_id": NaN}]}', None),
        ("too many passages", st(question="q", evidence=["p"] * 65), None),
        ("too many states", json.dumps({"states": [{"question": "q"}] * 4097}).encode(), None),
        ("question too long", st(question="q" * 5000), None),
        ("evidence a string", st(question="q", evidence="x"), None),
        ("unknown field", st(question="q", bogus=1), None),
        ("empty question", st(question="  "), None),
        ("not JSON", b'{"states": [', None),
        ("200 MB body", b'{"states": [', 200_000_000),
    ]


async def fault_stream(url: str, path: str, faults: list, seconds: float, max_requests: int) -> dict[str, list[int]]:
    """Send the malformed requests round-robin (raw sockets, on threads) for ``seconds``."""
    seen: dict[str, list[int]] = {k: [] for k, _, _ in faults}
    stop = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < stop and i < max_requests:
        kind, body, declared = faults[i % len(faults)]
        status, _ = await asyncio.to_thread(_raw_post, url, path, body, declared)
        seen[kind].append(status)
        i += 1
        await asyncio.sleep(0.01)
    return seen


async def huge_stream(cl, url: str, queries: list[str], seconds: float) -> dict:
    """One 1024-query, topk-100 request after another for ``seconds``."""
    stop = time.perf_counter() + seconds
    done, errors, lat = 0, [], []
    body = {"queries": (queries * (1024 // len(queries) + 1))[:1024], "topk": 100, "return_scores": True}
    while time.perf_counter() < stop:
        t0 = time.perf_counter()
        try:
            r = await cl.post(url, json=body)
            # Not parsed here (~70 MB): parsing would stall this process's small clients, not the server.
            ok = r.status_code == 200 and r.content.startswith(b'{"result":[[')
            why = "" if ok else f"{r.status_code} {r.text[:120]}"
        except Exception as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if ok:
            done += 1
            lat.append(time.perf_counter() - t0)
        else:
            errors.append(why)
    return {"done": done, "errors": errors, "lat": lat}


async def rss_poll(cl, url: str, stop: asyncio.Event, every: float = 0.05) -> list[int]:
    """The server's RSS (from /health) until ``stop`` is set."""
    out: list[int] = []
    while not stop.is_set():
        try:
            out.append(int((await cl.get(url + "/health")).json()["rss_bytes"]))
        except Exception:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass
    return out


async def _settled_rss(cl, url: str, seconds: float = 3.0) -> int:
    """RSS once the server is idle (queue empty, then a short rest so it can hand memory back)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        st = (await cl.get(url + "/health")).json()["stats"]
        if not st.get("queued_requests") and not st.get("inflight_requests"):
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    return int((await cl.get(url + "/health")).json()["rss_bytes"])


# -- the run --------------------------------------------------------------------------------------
async def run_faults(r_url: str, j_url: str, questions: list[str], docs: list[str], *, clients: int,
                     phase_s: float, max_requests: int, burst_mb: float, passage_chars: int, seed: int = 0) -> dict:
    import httpx

    rng = np.random.default_rng(seed)
    small = [{"queries": [q], "topk": 3, "return_scores": True} for q in questions]

    def ok_small(js):
        return len(js["result"]) == 1 and len(js["result"][0]) == 3

    res: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as cl:
        url = r_url + "/retrieve"
        # 1. baseline
        res["baseline"] = await closed_loop(cl, url, small, ok_small, clients, phase_s, max_requests)
        # 2. with malformed requests arriving
        load = asyncio.ensure_future(closed_loop(cl, url, small, ok_small, clients, phase_s, max_requests))
        res["fault_kinds"] = await fault_stream(r_url, "/retrieve", retriever_faults(), phase_s, max_requests)
        res["faults"] = await load
        # 3. with a huge request running
        rss0 = int((await cl.get(r_url + "/health")).json()["rss_bytes"])
        stop = asyncio.Event()
        poll = asyncio.ensure_future(rss_poll(cl, r_url, stop))
        huge = asyncio.ensure_future(huge_stream(cl, url, questions, phase_s))
        await asyncio.sleep(min(0.5, phase_s / 4))  # let the first huge request get going
        res["huge"] = await closed_loop(cl, url, small, ok_small, clients, phase_s, max_requests)
        res["huge_requests"] = await huge
        stop.set()
        peak = await poll
        res["retriever_rss"] = {"before": rss0, "peak": max(peak or [rss0]), "after": await _settled_rss(cl, r_url)}
        # 4. a 200 MB body, refused from its header
        before = int((await cl.get(r_url + "/health")).json()["rss_bytes"])
        times, statuses = [], []
        for _ in range(5):
            status, dt = await asyncio.to_thread(_raw_post, r_url, "/retrieve", b"x" * 65536, 200_000_000)
            times.append(dt)
            statuses.append(status)
        after = int((await cl.get(r_url + "/health")).json()["rss_bytes"])
        res["body_limit"] = {"statuses": statuses, "seconds": times, "rss_growth": after - before}

        # 5. judge: valid clients plus malformed requests
        jurl = j_url + "/score"
        jbodies = []
        for i, q in enumerate(questions):
            ev = [f"<information>Doc 1(Title: {d[:20]}) {d}</information>" for d in
                  (docs[(i * 3 + t) % len(docs)] for t in range(3))]
            jbodies.append({"states": [{"question": q, "evidence": ev[:1 + i % 3]}]})

        def ok_judge(js):
            return len(js["scores"]) == 1

        jload = asyncio.ensure_future(closed_loop(cl, jurl, jbodies, ok_judge, clients, phase_s, max_requests))
        res["judge_fault_kinds"] = await fault_stream(j_url, "/score", judge_faults(), phase_s, max_requests)
        res["judge_faults"] = await jload

        # 6. judge: a burst of distinct large passages
        base = await _settled_rss(cl, j_url)
        words = np.array("river mountain album film born played city capital director singer novel war treaty "
                         "king queen province company founded league season".split())
        per_passage = passage_chars
        n_pass = max(1, int(burst_mb * 1e6 / per_passage))
        per_req = max(1, min(10, int(8e6 / per_passage)))  # keep bodies well under the 16 MB limit

        def passage(i: int) -> str:
            text = f"passage {i} " + " ".join(rng.choice(words, size=per_passage // 6))
            return (text + " x" * per_passage)[:per_passage]

        stop = asyncio.Event()
        poll = asyncio.ensure_future(rss_poll(cl, j_url, stop))
        burst_err: list[str] = []
        t0 = time.perf_counter()
        sent = 0
        while sent < n_pass:
            batch = [passage(sent + k) for k in range(min(per_req, n_pass - sent))]
            sent += len(batch)
            body = {"states": [{"question": f"what about passage {sent}?", "evidence": batch}]}
            r = await cl.post(jurl, json=body)
            if r.status_code != 200:
                burst_err.append(f"{r.status_code} {r.text[:100]}")
            del body, batch
        burst_s = time.perf_counter() - t0
        stop.set()
        peak = await poll
        res["judge_burst"] = {"passages": n_pass, "mb": n_pass * per_passage / 1e6, "seconds": burst_s,
                              "errors": burst_err, "rss_before": base, "rss_peak": max(peak or [base]),
                              "rss_after": await _settled_rss(cl, j_url, 5.0)}
        res["judge_health"] = (await cl.get(j_url + "/health")).json()["stats"]
        res["retriever_health"] = (await cl.get(r_url + "/health")).json()["stats"]
    return res


def summarise(res: dict) -> tuple[list[tuple[str, str, str, list[float]]], list[str], bool]:
    """(provider, metric, unit, samples) rows, report lines, and whether every goal held."""
    rows: list[tuple[str, str, str, list[float]]] = []
    lines: list[str] = []
    goals: list[bool] = []

    def pct(a, q):
        return float(np.percentile(a, q) * 1e3) if len(a) else float("nan")

    for phase in ("baseline", "faults", "huge"):
        w = res[phase]
        rows += [(f"retriever/{phase}", "valid_errors", "count", [len(w["errors"])]),
                 (f"retriever/{phase}", "latency_p50", "ms", [pct(w["lat"], 50)]),
                 (f"retriever/{phase}", "latency_p99", "ms", [pct(w["lat"], 99)]),
                 (f"retriever/{phase}", "requests", "count", [len(w["lat"])])]
        lines.append(f"retriever {phase:9s}: {len(w['lat']):5d} ok, {len(w['errors'])} errors for valid clients, "
                     f"p50 {pct(w['lat'], 50):7.1f} ms, p99 {pct(w['lat'], 99):7.1f} ms"
                     + (f"  (first error: {w['errors'][0]})" if w["errors"] else ""))
        goals.append(not w["errors"])
    ratio = pct(res["huge"]["lat"], 99) / pct(res["baseline"]["lat"], 99)
    rows.append(("retriever/huge:baseline", "p99_ratio", "x", [ratio]))
    h = res["huge_requests"]
    lines.append(f"huge 1024-query topk-100 requests completed alongside: {h['done']} "
                 f"(median {np.median(h['lat']) if h['lat'] else float('nan'):.2f} s), errors {len(h['errors'])}; "
                 f"small p99 with/without: {ratio:.2f}x (goal <= 3)")
    goals += [ratio <= 3.0, not h["errors"]]
    for name, kinds in (("retriever", res["fault_kinds"]), ("judge", res["judge_fault_kinds"])):
        bad = {k: v for k, v in kinds.items() if any(not 400 <= s < 500 for s in v)}
        sent = sum(len(v) for v in kinds.values())
        lines.append(f"{name} malformed requests: {sent} sent over {len(kinds)} kinds; all answered 4xx: "
                     f"{'yes' if not bad else 'NO ' + json.dumps(bad)}")
        rows.append((f"{name}/malformed", "non_4xx", "count", [sum(1 for v in bad.values() for _ in v)]))
        goals.append(not bad)
    bl = res["body_limit"]
    rows += [("retriever/200MB-body", "refuse_s", "ms", [t * 1e3 for t in bl["seconds"]]),
             ("retriever/200MB-body", "rss_growth", "MB", [bl["rss_growth"] / 1e6])]
    lines.append(f"200 MB body: statuses {sorted(set(bl['statuses']))}, refused in median "
                 f"{np.median(bl['seconds']) * 1e3:.1f} ms (goal < 100), RSS growth {bl['rss_growth'] / 1e6:.1f} MB "
                 f"(goal < 10)")
    goals += [set(bl["statuses"]) == {413}, float(np.median(bl["seconds"])) < 0.1, bl["rss_growth"] < 10e6]
    rr = res["retriever_rss"]
    lines.append(f"retriever RSS: before {rr['before'] / 1e6:.0f} MB, peak {rr['peak'] / 1e6:.0f} MB, "
                 f"after {rr['after'] / 1e6:.0f} MB")
    rows += [("retriever/rss", k, "MB", [v / 1e6]) for k, v in rr.items()]
    jf = res["judge_faults"]
    rows += [("judge/faults", "valid_errors", "count", [len(jf["errors"])]),
             ("judge/faults", "latency_p50", "ms", [pct(jf["lat"], 50)]),
             ("judge/faults", "latency_p99", "ms", [pct(jf["lat"], 99)])]
    lines.append(f"judge with faults: {len(jf['lat'])} ok, {len(jf['errors'])} errors for valid clients, "
                 f"p50 {pct(jf['lat'], 50):.1f} ms, p99 {pct(jf['lat'], 99):.1f} ms"
                 + (f"  (first error: {jf['errors'][0]})" if jf["errors"] else ""))
    goals.append(not jf["errors"])
    jb = res["judge_burst"]
    grow = (jb["rss_after"] - jb["rss_before"]) / 1e6
    rows += [("judge/burst", "rss_before", "MB", [jb["rss_before"] / 1e6]),
             ("judge/burst", "rss_peak", "MB", [jb["rss_peak"] / 1e6]),
             ("judge/burst", "rss_after", "MB", [jb["rss_after"] / 1e6]),
             ("judge/burst", "rss_after_minus_before", "MB", [grow])]
    lines.append(f"judge burst: {jb['passages']} distinct passages, {jb['mb']:.0f} MB in {jb['seconds']:.1f} s, "
                 f"errors {len(jb['errors'])}; RSS before {jb['rss_before'] / 1e6:.0f} MB, peak "
                 f"{jb['rss_peak'] / 1e6:.0f} MB, after {jb['rss_after'] / 1e6:.0f} MB "
                 f"(+{grow:.0f} MB; goal < 100)")
    goals += [not jb["errors"], grow < 100]
    return rows, lines, all(goals)



# -- idle sockets and slow-loris (python -m bench.server_faults) ----------------------------------
def serve_sockets_retriever(port: int, head_timeout_s: float, ready) -> None:
    """BM25 over the bundled wiki sample behind the production connection settings."""
    import uvicorn

    from ragfast.data import load_corpus
    from ragfast.retrieval.bm25 import BM25Retriever
    from ragfast.retrieval.server import create_app

    retriever = BM25Retriever.build(load_corpus("wiki-sample"))
    retriever.search(["warm-up query"], 3)
    app = create_app(retriever, default_topk=3)
    ready.send("ready")
    ready.close()
    uvicorn.run(app, **uvicorn_options(LOOPBACK, port, head_timeout_s=head_timeout_s), log_level="warning",
                access_log=False)


async def _hold(port: int, n: int, trickle_s: float | None, closed_after: list[float], reopened: list[int]) -> None:
    """Keep ``n`` connections open (until cancelled): idle ones (``trickle_s`` None) or slow-loris ones."""

    async def one(i: int) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
            except OSError:
                await asyncio.sleep(0.1)
                continue
            t0 = time.perf_counter()
            try:
                if trickle_s is None:
                    if not await reader.read(1):  # the server closed it
                        closed_after.append(time.perf_counter() - t0)
                else:
                    writer.write(b"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                    while True:
                        writer.write(b"X-Slow: %d\r\n" % i)
                        await writer.drain()
                        try:
                            if not await asyncio.wait_for(reader.read(1), timeout=trickle_s):
                                break
                        except asyncio.TimeoutError:
                            continue
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()
            reopened[0] += 1

    await asyncio.gather(*(one(i) for i in range(n)))


def attack_process(port: int, idle: int, loris: int, seconds: float, conn) -> None:
    """Hold the attackers' connections for ``seconds`` in a process of their own (not the clients' loop)."""
    closed: list[float] = []
    reopened = [0]

    async def run() -> None:
        task = asyncio.gather(_hold(port, idle, None, closed, reopened), _hold(port, loris, 0.5, [], reopened))
        try:
            await asyncio.wait_for(task, timeout=seconds)
        except asyncio.TimeoutError:
            pass

    asyncio.run(run())
    conn.send({"closed_after": closed, "reopened": reopened[0]})
    conn.close()


async def run_sockets(url: str, port: int, *, clients: int, phase_s: float, reps: int, idle: int, loris: int,
                      max_requests: int) -> dict:
    """Alternating windows: normal clients alone, then with ``idle`` + ``loris`` connections held."""
    import multiprocessing as mp

    import httpx

    queries = ["who wrote the opera", "capital of the country", "river that flows through", "first president"]
    bodies = [{"queries": [q], "topk": 3, "return_scores": True} for q in queries]
    out: dict[str, list] = {"alone": [], "attacked": [], "idle_closed_after": [], "errors": [], "reopened": []}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    ctx = mp.get_context("spawn")
    async with httpx.AsyncClient(timeout=60, limits=limits) as cl:
        await closed_loop(cl, url, bodies, lambda js: "result" in js, clients, 1.0, 200)  # warm-up
        for _ in range(reps):
            w = await closed_loop(cl, url, bodies, lambda js: "result" in js, clients, phase_s, max_requests)
            out["alone"].append(w["lat"])
            out["errors"] += w["errors"]
            parent, child = ctx.Pipe()
            atk = ctx.Process(target=attack_process, args=(port, idle, loris, phase_s + 3.0, child), daemon=True)
            atk.start()
            await asyncio.sleep(2.0)  # the attackers start and connect
            w = await closed_loop(cl, url, bodies, lambda js: "result" in js, clients, phase_s, max_requests)
            got = await asyncio.get_running_loop().run_in_executor(None, parent.recv)
            atk.join(10)
            out["attacked"].append(w["lat"])
            out["errors"] += w["errors"]
            out["idle_closed_after"] += got["closed_after"]
            out["reopened"].append(got["reopened"])
    return out


def main() -> None:
    import argparse
    import multiprocessing as mp
    import os
    import subprocess

    ap = argparse.ArgumentParser(description="Normal clients' latency with idle and slow-loris connections held.")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=15.0, help="Seconds per window (> --head-timeout-s).")
    ap.add_argument("--reps", type=int, default=3, help="Window pairs (alone, attacked), alternating.")
    ap.add_argument("--idle", type=int, default=500)
    ap.add_argument("--loris", type=int, default=50)
    ap.add_argument("--head-timeout-s", type=float, default=10.0)
    ap.add_argument("--max-requests", type=int, default=20000)
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    port = sock.getsockname()[1]
    sock.close()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve_sockets_retriever, args=(port, args.head_timeout_s, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise SystemExit("the server did not start within 300 s")
        parent.recv()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection((LOOPBACK, port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        res = asyncio.run(run_sockets(f"http://{LOOPBACK}:{port}/retrieve", port, clients=args.clients,
                                      phase_s=args.phase_s, reps=args.reps, idle=args.idle, loris=args.loris,
                                      max_requests=args.max_requests))
    finally:
        proc.terminate()
        proc.join(10)
    p99 = [(float(np.percentile(a, 99)), float(np.percentile(b, 99))) for a, b in zip(res["alone"], res["attacked"])]
    ratios = [b / a for a, b in p99]
    closed = np.asarray(res["idle_closed_after"])
    cpu = subprocess.run(["bash", "-c", "lscpu | grep 'Model name'"], capture_output=True, text=True).stdout.strip()
    print(f"{cpu}; load {os.getloadavg()[0]:.2f}; {args.clients} normal clients, {args.idle} idle + {args.loris} "
          f"slow-loris connections held, head timeout {args.head_timeout_s:g} s, {args.reps} window pairs of "
          f"{args.phase_s:g} s")
    for (a, b), r in zip(p99, ratios):
        print(f"  p99 alone {a * 1e3:7.1f} ms, attacked {b * 1e3:7.1f} ms, ratio {r:.2f}")
    print(f"p99 attacked / alone: median {np.median(ratios):.2f}x (goal <= 2); errors seen by normal clients: "
          f"{len(res['errors'])}")
    if len(closed):
        print(f"idle sockets closed by the server: {len(closed)}, after median {np.median(closed):.1f} s, max "
              f"{closed.max():.1f} s (goal <= head timeout {args.head_timeout_s:g} s + 1 s)")
    else:
        print("idle sockets closed by the server: none (windows shorter than the head timeout?)")
    print(f"attacker reconnections per window: {res['reopened']}")


if __name__ == "__main__":
    main()

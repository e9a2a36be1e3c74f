"""Retrieval-server load test: micro-batched vs one-request-at-a-time, on loopback.

Two server processes serve the same retriever over the same corpus on 127.0.0.1: one gathers
concurrent requests into one retriever call (the default), the other answers one request at a
time (``batching=False``, the anchor). N concurrent clients (default 32) send Search-R1-style
single-query requests (``topk=3``, ``return_scores=true``, real HotpotQA dev questions) in
closed loops. The run alternates windows between the two servers (``--reps`` windows each, of
``--duration / --reps`` seconds), so machine noise hits both alike, and reports per mode:
errors, throughput, p50 and p99 latency, the server's mean gathered batch, and the throughput
ratio batched / one-at-a-time (median over window pairs).

Run ``python bench/bench_server.py`` (``--duration 20`` by default; ``--retriever bm25`` for the
sparse server; ``--corpus PATH|SAMPLE`` for another corpus; the default is the ``ragfast bench``
corpus: HotpotQA dev contexts + the 1000-passage Wikipedia sample). Rows go to
bench/results/bench_server.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import print_table, row, write_csv  # noqa: E402


def bench_corpus(spec: str):
    from ragfast.data import Corpus, corpus_from_contexts, load_corpus

    if spec == "bench":
        return Corpus.concat([corpus_from_contexts("hotpotqa-dev"), load_corpus("wiki-sample")])
    return load_corpus(spec)


def _serve(spec: str, kind: str, port: int, batching: bool, threads: int | None, max_wait_ms: float, ready) -> None:
    """Server process: build the retriever (cached embeddings) and run uvicorn on loopback."""
    import uvicorn

    from ragfast.retrieval.server import create_app, set_threads

    set_threads(threads)
    corpus = bench_corpus(spec)
    if kind == "bm25":
        from ragfast.retrieval.bm25 import BM25Retriever

        retriever = BM25Retriever.build(corpus)
    else:
        from ragfast.retrieval.dense import build_default_retriever

        retriever = build_default_retriever(corpus, progress=False)
    retriever.search(["warm-up query"], 3)
    app = create_app(retriever, default_topk=3, batching=batching, max_wait_ms=max_wait_ms)
    ready.send("ready")
    ready.close()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _window(url: str, queries: list[str], clients: int, seconds: float, seed: int) -> dict:
    """Closed-loop clients hitting one server for ``seconds``; latencies of completed requests."""
    import httpx

    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(queries))

    async def client(c: int, cl: httpx.AsyncClient) -> None:
        nonlocal errors
        i = c
        while time.perf_counter() < stop:
            q = queries[order[i % len(order)]]
            i += clients
            t0 = time.perf_counter()
            try:
                r = await cl.post(url + "/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                ok = r.status_code == 200 and len(r.json()["result"][0]) == 3
            except Exception:
                ok = False
            if ok:
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as cl:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, cl) for c in range(clients)))
        wall = time.perf_counter() - t0
        health = (await cl.get(url + "/health")).json()["stats"]
    return {"lat": np.asarray(lat), "errors": errors, "wall": wall, "stats": health}


def _start(target, args: tuple, what: str, ctx) -> tuple[Any, str]:
    """Start a server process on a free loopback port; (process, url) once it answers /health."""
    import httpx

    port = _free_port()
    ready, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, port, child), daemon=True)
    p.start()
    child.close()
    if not ready.poll(timeout=1800):  # the first run may embed the corpus (cached afterwards)
        raise RuntimeError(f"{what} server did not come up")
    try:
        ready.recv()
    except EOFError:
        p.join(5)
        raise RuntimeError(f"{what} server process exited with code {p.exitcode}") from None
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return p, url


def stop_servers(procs, grace_s: float = 15) -> None:
    """Stop server processes: SIGINT lets uvicorn shut down cleanly (its semaphores are
    released), then, after ``grace_s``, make sure."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGINT)
        p.join(grace_s)
        if p.is_alive():
            p.terminate()
            p.join(5)


def run_faults_mode(args) -> None:
    """``--faults``: both servers under malformed, huge and bursty load (bench/server_faults.py)."""
    from bench import server_faults as sf
    from ragfast.data import load_corpus, load_qa

    questions = [q.question for q in load_qa("hotpotqa-dev")]
    wiki = load_corpus("wiki-sample")
    docs = [wiki.row(i)["contents"] for i in range(min(500, len(wiki)))]
    ctx = mp.get_context("spawn")
    procs = []
    try:
        rp, r_url = _start(_serve_faults_retriever, (args.corpus, args.retriever, args.threads or None), "retriever",
                           ctx)
        procs.append(rp)
        jp, j_url = _start(_serve_faults_judge, (args.threads or None, args.judge_passage_chars), "judge", ctx)
        procs.append(jp)
        res = asyncio.run(sf.run_faults(r_url, j_url, questions, [str(d) for d in docs], clients=args.clients,
                                        phase_s=args.phase_s, max_requests=args.max_requests,
                                        burst_mb=args.judge_burst_mb, passage_chars=args.judge_passage_chars))
    finally:
        stop_servers(procs)
    out, lines, ok = sf.summarise(res)
    params = (f"retriever={args.retriever},corpus={args.corpus},clients={args.clients},phase_s={args.phase_s:g},"
              f"threads={args.threads or 'default'},judge_burst_mb={args.judge_burst_mb:g}")
    rows = [row("serve_faults", prov, params, metric, unit, vals) for prov, metric, unit, vals in out]
    write_csv(rows, args.csv)
    for ln in lines:
        print(ln)
    print(f"all goals met: {'yes' if ok else 'NO'}; csv: {args.csv}")


async def qps_window(url: str, bodies: list[dict], clients: int, seconds: float) -> dict:
    """Closed-loop clients posting ``bodies`` for ``seconds``: answered queries per second, errors."""
    import httpx

    done = errors = 0
    stop = time.perf_counter() + seconds

    async def client(c: int, cl) -> None:
        nonlocal done, errors
        i = c
        while time.perf_counter() < stop:
            body = bodies[i % len(bodies)]
            i += clients
            try:
                r = await cl.post(url + "/retrieve", json=body)
                ok = r.status_code == 200 and len(r.json()["result"]) == len(body["queries"])
            except Exception:
                ok = False
            if ok:
                done += len(body["queries"])
            else:
                errors += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=300, limits=limits) as cl:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c, cl) for c in range(clients)))
        wall = time.perf_counter() - t0
    return {"qps": done / wall, "errors": errors}


def server_time_split(url: str, bodies: list[dict]) -> dict[str, float]:
    """Seconds per query the ragfast server spent in each component (the query encoder, the
    search), from its ``return_cost`` answers, beside its whole time per query (``server``:
    from the request's arrival at the batcher to its answer), one request at a time."""
    import httpx

    per: dict[str, float] = {}
    server = queries = 0.0
    for body in bodies:
        r = httpx.post(url + "/retrieve", json=dict(body, return_cost=True), timeout=600)
        r.raise_for_status()
        cost = r.json()["cost"]
        server += cost["server_seconds"]
        queries += len(cost["items"])
        for item in cost["items"]:
            for name, fields in item.items():
                per[name] = per.get(name, 0.0) + fields.get("seconds", 0.0)
    # a query's component seconds are its share of the call's, so per query both sides divide
    return {**{name: v / queries for name, v in sorted(per.items())}, "server": server / queries}


def run_vs_faiss_mode(args, counts: list[int]) -> None:
    """``--vs-faiss``: queries/s of ragfast serve-retriever over a Search-R1-shaped faiss server."""
    import shutil
    import tempfile

    import httpx

    from bench import server_vs_faiss as vf
    from ragfast.data import load_qa

    questions = [q.question for q in load_qa("hotpotqa-dev")] + [q.question for q in load_qa("hotpotqa-train")]
    B = args.batch_queries
    bodies = [{"queries": [questions[(s + j) % len(questions)] for j in range(B)], "topk": 3, "return_scores": True}
              for s in range(0, len(questions), B)]
    threads = args.threads or 1
    data = Path(tempfile.mkdtemp(prefix="ragfast-vs-faiss-"))
    ctx = mp.get_context("spawn")
    procs, urls = [], {}
    try:
        made = vf.build_corpus(data, args.passages)
        for name, target in (("ragfast", vf.serve_ragfast), ("faiss-anchor", vf.serve_anchor)):
            p, urls[name] = _start(target, (str(data), threads), name, ctx)
            procs.append(p)
        # Top-k agreement on every question, tie-aware, at topk 10.
        got = {}
        for name, url in urls.items():
            got[name] = []
            for s in range(0, len(questions), B):
                r = httpx.post(url + "/retrieve", json={"queries": questions[s:s + B], "topk": 10,
                                                        "return_scores": True}, timeout=600)
                if r.status_code != 200:
                    raise RuntimeError(f"{name} answered {r.status_code}: {r.text[:300]}")
                got[name] += r.json()["result"]
        n, same, tied = vf.agree(got["ragfast"], got["faiss-anchor"])
        print(f"top-10 agreement on {n} questions: {same} identical, {tied} equal up to ties, "
              f"{n - same - tied} different", flush=True)
        win = args.duration / args.reps
        res = {(m, c): [] for m in urls for c in counts}
        for c in counts:
            for rep in range(args.reps):
                for m in (("ragfast", "faiss-anchor") if rep % 2 == 0 else ("faiss-anchor", "ragfast")):
                    w = asyncio.run(qps_window(urls[m], bodies, c, win))
                    res[(m, c)].append(w)
                    print(f"  clients {c} window {rep} {m:12s} {w['qps']:8.1f} queries/s  errors {w['errors']}",
                          flush=True)
        split = server_time_split(urls["ragfast"], bodies[:8])
        print("ragfast server time per query, one client (" + ", ".join(
            f"{name} {v * 1e3:.2f} ms ({v / split['server'] * 100:.0f}%)" for name, v in split.items()
            if name != "server") + f", of {split['server'] * 1e3:.2f} ms in the server)", flush=True)
    finally:
        stop_servers(procs)
        shutil.rmtree(data, ignore_errors=True)
    params = (f"passages={args.passages}(real={made['real']},random={made['synthetic']}),batch={B},topk=3,"
              f"threads={threads},window_s={win:g}")
    rows = [row("serve_vs_faiss", "agreement", params, k, "queries", [v])
            for k, v in (("identical_topk", same), ("tied_topk", tied), ("different_topk", n - same - tied))]
    rows += [row("serve_vs_faiss", f"ragfast:{name}", params + ",clients=1", "seconds_per_query", "s", [v])
             for name, v in split.items()]
    for c in counts:
        for m in urls:
            rows.append(row("serve_vs_faiss", m, params + f",clients={c}", "throughput", "queries/s",
                            [w["qps"] for w in res[(m, c)]]))
            rows.append(row("serve_vs_faiss", m, params + f",clients={c}", "errors", "count",
                            [sum(w["errors"] for w in res[(m, c)])]))
        ratios = [a["qps"] / b["qps"] for a, b in zip(res[("ragfast", c)], res[("faiss-anchor", c)]) if b["qps"] > 0]
        rows.append(row("serve_vs_faiss", "ragfast/faiss-anchor", params + f",clients={c}", "throughput_ratio", "x",
                        ratios or [np.nan]))
        print(f"clients {c}: ragfast / Search-R1-shaped faiss server = {np.median(ratios):.2f}x queries/s "
              f"(median of {len(ratios)} window pairs; goal >= 1.3)")
    write_csv(rows, args.csv)
    print_table(rows, title=f"serve-retriever vs faiss anchor ({params})")


def _serve_faults_retriever(spec, kind, threads, port, ready) -> None:
    from bench.server_faults import serve_retriever

    serve_retriever(spec, kind, port, threads, ready)


def _serve_faults_judge(threads, passage_chars, port, ready) -> None:
    from bench.server_faults import serve_judge

    serve_judge(port, threads, passage_chars, ready)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="Seconds of load per mode (split into --reps windows).")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--reps", type=int, default=4, help="Windows per mode (alternating).")
    ap.add_argument("--retriever", choices=("dense", "bm25"), default="dense")
    ap.add_argument("--corpus", default="bench", help="'bench' (HotpotQA dev contexts + wiki-sample), a path or a sample.")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per server process (0: torch's default). 1 avoids OpenMP spinning "
                         "when the clients share the cores.")
    ap.add_argument("--max-wait-ms", type=float, default=2.0,
                    help="How long the first request of a batch waits for company (0: take what is queued).")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_server.csv"))
    ap.add_argument("--faults", action="store_true",
                    help="Hostile-input and mixed-load run of both servers (see bench/server_faults.py).")
    ap.add_argument("--phase-s", type=float, default=10.0, help="--faults: seconds per phase.")
    ap.add_argument("--max-requests", type=int, default=20000, help="--faults: most requests per phase.")
    ap.add_argument("--judge-burst-mb", type=float, default=100.0,
                    help="--faults: MB of distinct passages sent to the judge in the burst phase.")
    ap.add_argument("--judge-passage-chars", type=int, default=1_000_000,
                    help="--faults: characters per burst passage (the judge is started with this limit).")
    ap.add_argument("--vs-faiss", action="store_true",
                    help="Side-by-side against a Search-R1-shaped faiss server (see bench/server_vs_faiss.py).")
    ap.add_argument("--passages", type=int, default=100_000, help="--vs-faiss: corpus size (padded with "
                                                                 "synthetic rows with random vectors).")
    ap.add_argument("--batch-queries", type=int, default=64, help="--vs-faiss: queries per request.")
    ap.add_argument("--client-counts", default="1,8", help="--vs-faiss: concurrent clients, comma-separated.")
    args = ap.parse_args()
    if args.duration <= 0 or args.clients < 1 or args.reps < 1:
        ap.error("--duration, --clients and --reps must be positive")
    if args.vs_faiss:
        try:
            counts = [int(x) for x in args.client_counts.split(",")]
        except ValueError:
            ap.error(f"--client-counts must be integers separated by commas, got {args.client_counts!r}")
        if args.passages < 1 or args.batch_queries < 1 or min(counts) < 1:
            ap.error("--passages, --batch-queries and --client-counts must be positive")
        run_vs_faiss_mode(args, counts)
        return
    if args.faults:
        if args.phase_s <= 0 or args.max_requests < 1 or args.judge_burst_mb <= 0 or args.judge_passage_chars < 1:
            ap.error("--phase-s, --max-requests, --judge-burst-mb and --judge-passage-chars must be positive")
        run_faults_mode(args)
        return

    from ragfast.data import load_qa

    queries = [q.question for q in load_qa("hotpotqa-dev")]
    ctx = mp.get_context("spawn")
    procs, urls = {}, {}
    try:
        for mode, batching in (("batched", True), ("one-at-a-time", False)):
            port = _free_port()
            ready, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_serve, args=(args.corpus, args.retriever, port, batching, args.threads or None,
                                                 args.max_wait_ms, child), daemon=True)
            p.start()
            child.close()
            if not ready.poll(timeout=1800):  # the first run may embed the corpus (cached afterwards)
                raise RuntimeError(f"{mode} server did not come up")
            try:
                ready.recv()
            except EOFError:  # the server process died before it was ready
                p.join(5)
                raise RuntimeError(f"{mode} server process exited with code {p.exitcode}") from None
            procs[mode], urls[mode] = p, f"http://127.0.0.1:{port}"
        import httpx

        for url in urls.values():  # wait for uvicorn to bind
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
        n_passages = httpx.get(urls["batched"] + "/health").json()["retriever"].get("passages")
        win = args.duration / args.reps
        res: dict[str, list[dict]] = {m: [] for m in urls}
        prev = {m: {"batches": 0, "queries": 0} for m in urls}
        for rep in range(args.reps):
            for mode in (("batched", "one-at-a-time") if rep % 2 == 0 else ("one-at-a-time", "batched")):
                w = asyncio.run(_window(urls[mode], queries, args.clients, win, seed=rep))
                st = w["stats"]
                w["batch"] = (st["queries"] - prev[mode]["queries"]) / max(1, st["batches"] - prev[mode]["batches"])
                prev[mode] = st
                res[mode].append(w)
                print(f"  window {rep} {mode:14s} {len(w['lat']) / w['wall']:8.1f} req/s  "
                      f"p50 {np.median(w['lat']) * 1e3 if len(w['lat']) else float('nan'):7.1f} ms  "
                      f"errors {w['errors']}  mean batch {w['batch']:.1f}", flush=True)
    finally:
        stop_servers(procs.values())

    params = (f"retriever={args.retriever},passages={n_passages},clients={args.clients},window_s={win:g},"
              f"threads={args.threads or 'default'},max_wait_ms={args.max_wait_ms:g}")
    rows = []
    tput = {}
    for mode, ws in res.items():
        tput[mode] = [len(w["lat"]) / w["wall"] for w in ws]
        rows.append(row("serve_retrieve", mode, params, "throughput", "req/s", tput[mode]))
        rows.append(row("serve_retrieve", mode, params, "latency_p50", "ms",
                        [np.percentile(w["lat"], 50) * 1e3 for w in ws if len(w["lat"])] or [np.nan]))
        rows.append(row("serve_retrieve", mode, params, "latency_p99", "ms",
                        [np.percentile(w["lat"], 99) * 1e3 for w in ws if len(w["lat"])] or [np.nan]))
        rows.append(row("serve_retrieve", mode, params, "errors", "count", [sum(w["errors"] for w in ws)]))
        rows.append(row("serve_retrieve", mode, params, "mean_batch", "queries", [w["batch"] for w in ws]))
    ratios = [b / a for b, a in zip(tput["batched"], tput["one-at-a-time"]) if a > 0]
    rows.append(row("serve_retrieve", "batched/one-at-a-time", params, "throughput_ratio", "x", ratios or [np.nan]))
    write_csv(rows, args.csv)
    print_table(rows, title=f"retrieval server load test ({params})")
    errs = sum(w["errors"] for ws in res.values() for w in ws)
    print(f"micro-batched vs one-request-at-a-time: {np.median(ratios):.2f}x throughput (median of {len(ratios)} "
          f"window pairs); errors: {errs}; csv: {args.csv}")


if __name__ == "__main__":
    main()

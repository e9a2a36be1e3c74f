"""``bench/bench_capacity.py --measure-full``: the paper-scale int8 index built, searched and served.

Paper scale is 21,015,324 x 768 (wiki-18 embedded with e5-base-v2). Nothing here is scaled:

1. **Build** (once; reused while its fingerprint holds): ``--rows`` random unit vectors, generated
   chunk by chunk from ``--seed`` (chunk ``c`` from its own seeded torch generator, so any chunk
   can be regenerated alone), quantised to ragfast's int8 storage
   (:func:`ragfast.ops.topk_ip.quantize`: codes, per-row scale, row sums, and an fp16 re-score
   copy) and written by :class:`ragfast.retrieval.quantized_store.QuantizedWriter` as ``.npy``
   files that ``DenseIndex.load`` memory-maps. The fp32 chunks never exist together in memory.
   The exact fp32 top-10 of ``--recall-queries`` random unit queries is kept while the chunks
   pass (numpy brute force would need the whole fp32 matrix: 64.6 GB), so recall needs no
   second generation pass. An interrupted build resumes from its last checkpoint (every
   ``CHECKPOINT_CHUNKS`` chunks); a build with another fingerprint (rows, dim, seed, storage,
   re-score copy, chunking, query sample, this file's ``BUILD_VERSION``) starts afresh.
2. **Search**: the mapped index, 2 threads, k=10, B = 1 / 64 / 512 round-robin (median of
   ``--reps``), beside the read floor (a timed pass over the scanned bytes: codes, scales, row
   sums), and the process's private (anonymous) and file-backed resident memory, which shows
   that the kernels read the maps in place. Recall@10 against the exact fp32 top-10, with the
   fp16 re-score copy and with int8 alone (candidates re-scored against the dequantised codes).
3. **Serve**: ``ragfast serve-retriever`` over this index and a memory-mapped ``.arrow`` passage
   store of ``--rows`` synthetic passages, with a BERT-base-shaped encoder (768-d, 12 layers)
   whose weights are **random** (seeded; its vectors mean nothing, its cost is BERT-base's).
   Eight closed-loop clients send one-question requests (real HotpotQA questions, topk 3);
   queries/s per window, and the encoder's and the search's seconds per query from the
   server's ``return_cost`` answers. The anchor is the Search-R1-shaped faiss server
   (``bench/server_vs_faiss.py``: IndexFlatIP fp32, the same encoder and passages) at
   ``--anchor-rows`` (faiss fp32 at 21M would need 64.6 GB), its queries/s **scaled linearly in
   rows** to ``--rows``.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

BUILD_VERSION = 1  # bump when the generation or the stored layout changes: old builds are rebuilt
CHUNK_ROWS = 1 << 18  # 262,144 rows: 0.8 GB of fp32 per chunk at d=768
CHECKPOINT_CHUNKS = 4  # flush the maps and record progress every ~1M rows
K = 10


def _seed_of(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


def chunk_vectors(seed: int, c: int, rows: int, dim: int):
    """Rows ``c * CHUNK_ROWS ..`` of the corpus: float32 unit vectors from chunk ``c``'s own generator."""
    import torch

    n = min(CHUNK_ROWS, rows - c * CHUNK_ROWS)
    g = torch.Generator().manual_seed(_seed_of(seed, 0, c))
    x = torch.randn(n, dim, generator=g)
    return torch.nn.functional.normalize(x, dim=1)


def unit_queries(seed: int, stream: int, n: int, dim: int):
    """``n`` random unit queries of stream ``stream`` (1: the recall sample, 2: the timed batches)."""
    import torch

    g = torch.Generator().manual_seed(_seed_of(seed, stream, n))
    return torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)


def _merge_top(best_s, best_i, s, offset: int):
    """Running top-k: the k best of (kept, this chunk's), ties to the lower row id."""
    import torch

    vs, ix = torch.topk(s, min(K, s.shape[1]), dim=1)
    cs = torch.cat([best_s, vs], dim=1)
    ci = torch.cat([best_i, ix.to(torch.int64) + offset], dim=1)
    # kept ids are all lower than this chunk's: a stable sort keeps them first on equal scores
    o = torch.sort(cs, dim=1, descending=True, stable=True).indices[:, :K]
    return cs.gather(1, o), ci.gather(1, o)


def _atomic_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _save_truth(path: Path, s, i) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, scores=s.numpy(), ids=i.numpy())
    os.replace(tmp, path)


def build_index(workdir: Path, rows: int, dim: int, seed: int, *, rescore: str | None = "fp16",
                recall_queries: int = 64, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build (or reuse, or resume) the int8 index and its exact fp32 top-10 for the recall sample.

    Returns ``{"path", "reused", "seconds", "resumed_from"}``; the truth is ``path/truth.npz``.
    """
    import torch

    from ragfast.retrieval.quantized_store import QuantizedWriter, is_quantized_dir

    fp = {"rows": rows, "dim": dim, "seed": seed, "storage": "int8", "rescore": rescore, "chunk_rows": CHUNK_ROWS,
          "recall_queries": recall_queries, "k": K, "version": BUILD_VERSION}
    key = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:10]
    path = Path(workdir) / f"int8-{rows}x{dim}-seed{seed}-{key}"
    truth_file, progress = path / "truth.npz", path / "progress.json"
    if is_quantized_dir(path) and truth_file.exists() and json.loads((path / "meta.json").read_text()).get(
            "fingerprint") == fp:
        log(f"build: reusing {path}")
        return {"path": path, "reused": True, "seconds": 0.0, "resumed_from": None}
    chunks = -(-rows // CHUNK_ROWS)
    q = unit_queries(seed, 1, recall_queries, dim)
    done = 0
    if progress.exists() and json.loads(progress.read_text()).get("fingerprint") == fp and truth_file.exists():
        done = int(json.loads(progress.read_text())["chunks_done"])
        t = np.load(truth_file)
        best_s, best_i = torch.from_numpy(t["scores"]), torch.from_numpy(t["ids"])
        log(f"build: resuming {path} at chunk {done} of {chunks}")
    else:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        best_s = torch.full((recall_queries, 0), -np.inf)
        best_i = torch.zeros((recall_queries, 0), dtype=torch.int64)
    resumed_from = done or None
    t0 = time.perf_counter()
    w = QuantizedWriter(path, rows, dim, storage="int8", rescore=rescore, resume=done > 0,
                        extra_meta={"fingerprint": fp, "vectors": f"random unit vectors, seed {seed}, chunks of "
                                                                  f"{CHUNK_ROWS} rows (bench/capacity_full.py)"})
    from concurrent.futures import ThreadPoolExecutor

    # torch.randn runs on one thread: generating chunk c+1 on a helper thread while chunk c is
    # quantised and written overlaps the two (torch releases the GIL in both)
    gen = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capacity-gen")
    nxt = gen.submit(chunk_vectors, seed, done, rows, dim) if done < chunks else None
    for c in range(done, chunks):
        x = nxt.result()
        nxt = gen.submit(chunk_vectors, seed, c + 1, rows, dim) if c + 1 < chunks else None
        w.write(c * CHUNK_ROWS, x)
        best_s, best_i = _merge_top(best_s, best_i, q @ x.T, c * CHUNK_ROWS)
        if (c + 1) % CHECKPOINT_CHUNKS == 0 or c + 1 == chunks:
            w.flush()
            _save_truth(truth_file, best_s, best_i)
            _atomic_json(progress, {"fingerprint": fp, "chunks_done": c + 1})
            el = time.perf_counter() - t0
            log(f"build: {min(rows, (c + 1) * CHUNK_ROWS):,} / {rows:,} rows, {el:.0f} s "
                f"({el / (c + 1 - done):.2f} s per chunk)")
    gen.shutdown()
    w.finish()
    progress.unlink()
    return {"path": path, "reused": False, "seconds": time.perf_counter() - t0, "resumed_from": resumed_from}


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                name, val = line.split(":")
                out[name] = int(val.split()[0]) * 1024
    return out


def recall_at_k(ids, truth_ids) -> float:
    """Mean over queries of |returned ∩ exact top-k| / k."""
    ids, truth_ids = np.asarray(ids), np.asarray(truth_ids)
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / truth_ids.shape[1]
                          for a, b in zip(ids, truth_ids)]))


def measure_search(path: Path, *, batches=(1, 64, 512), reps: int = 3, threads: int = 2, seed: int = 0,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Time exact int8 search over the mapped index, its read floor, memory, and recall@10."""
    import torch

    from ragfast.ops.topk_ip import QuantizedCorpus
    from ragfast.retrieval.dense import DenseIndex

    torch.set_num_threads(threads)
    rss0 = _rss()
    t0 = time.perf_counter()
    idx = DenseIndex.load(path, kernel_backend="cpp")
    open_s = time.perf_counter() - t0
    stored = idx.stored
    n, d = stored.shape
    scan_bytes = int(stored.scan_bytes)
    out: dict[str, Any] = {"rows": n, "dim": d, "threads": threads, "open_s": open_s, "scan_bytes": scan_bytes,
                           "held_bytes": int(stored.nbytes)}
    # first scan: pages come from disk unless the build left them cached
    q_all = unit_queries(seed, 2, max(batches), d)
    t0 = time.perf_counter()
    idx.search(q_all[:1], K)
    out["first_scan_s"] = time.perf_counter() - t0
    codes64 = stored.data.view(torch.int64)  # 768 bytes a row: whole 8-byte words, summed as integers

    def read_pass() -> None:
        codes64.sum()
        stored.scale.sum()
        stored.rowsum.sum()

    floor, times = [], {b: [] for b in batches}
    for rep in range(reps):  # round-robin: the load of the shared machine hits every cell alike
        t0 = time.perf_counter()
        read_pass()
        floor.append(time.perf_counter() - t0)
        for b in batches:
            q = q_all[:b].contiguous()
            t0 = time.perf_counter()
            idx.search(q, K)
            times[b].append(time.perf_counter() - t0)
            log(f"search: rep {rep} B={b}: {times[b][-1]:.2f} s")
    out["floor_s"] = floor
    out["search_s"] = {b: v for b, v in times.items()}
    out["rss_after_search"] = _rss()
    out["rss_before_open"] = rss0
    # recall@10 against the exact fp32 top-10 kept by the build
    truth = np.load(Path(path) / "truth.npz")
    qr = unit_queries(seed, 1, truth["ids"].shape[0], d)
    _, ids = idx.search(qr, K)
    out["recall_rescore"] = recall_at_k(ids.numpy(), truth["ids"])
    alone = DenseIndex("flat", stored=QuantizedCorpus(stored.data, "int8", scale=stored.scale, rowsum=stored.rowsum,
                                                      rescore=None, oversample=stored.oversample),
                       kernel_backend="cpp")
    _, ids2 = alone.search(qr, K)
    out["recall_int8_alone"] = recall_at_k(ids2.numpy(), truth["ids"])
    out["rescore_copy"] = stored.rescore is not None
    out["recall_queries"] = int(truth["ids"].shape[0])
    return out


# ----------------------------------------------------------------------------------- serving


def passage_store(workdir: Path, rows: int, log: Callable[[str], None] = print) -> Path:
    """``rows`` synthetic passages as a memory-mapped ``.arrow`` store (made once, streamed in batches)."""
    from ragfast.data.passage_store import write_arrow_corpus

    path = Path(workdir) / f"passages-{rows}.arrow"
    if path.exists():
        return path
    t0 = time.perf_counter()

    import pyarrow as pa
    import pyarrow.compute as pc

    def batches():  # built by Arrow kernels: 21M rows as Python strings took minutes
        for s in range(0, rows, 1 << 20):
            n = pc.cast(pa.array(np.arange(s, min(rows, s + (1 << 20)))), pa.string())
            ids = pc.binary_join_element_wise("syn-", n, "")
            cont = pc.binary_join_element_wise('"Synthetic passage ', n, '"\nfiller text of synthetic passage number ',
                                               n, ".", "")
            yield pa.record_batch([ids, cont], names=["id", "contents"])

    write_arrow_corpus(path, batches())
    log(f"passages: wrote {rows:,} to {path} in {time.perf_counter() - t0:.0f} s")
    return path


def random_bert_base(workdir: Path, seed: int = 0) -> Path:
    """A BERT-base-shaped encoder (768-d, 12 layers, 12 heads, FFN 3072) with seeded RANDOM weights.

    Its vectors mean nothing; its cost is BERT-base's (e5-base-v2, Search-R1's encoder, has this
    shape). The tokenizer is MiniLM's (BERT's uncased 30,522-word vocabulary).
    """
    path = Path(workdir) / f"bert-base-random-768-seed{seed}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from ragfast.encoders.encoder import minilm_path

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, max_position_embeddings=512)
    tmp = path.with_name(path.name + ".tmp")
    BertModel(cfg).save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(minilm_path())).save_pretrained(tmp)
    (tmp / "README.txt").write_text("Random-weight BERT-base-shaped encoder made by bench/capacity_full.py for "
                                    "cost measurements only: its embeddings are meaningless.\n")
    os.replace(tmp, path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _windows(url: str, bodies: list[dict], clients: int, window_s: float, reps: int, log, name: str) -> list[float]:
    from bench.bench_server import qps_window

    import httpx

    httpx.post(url + "/retrieve", json=bodies[0], timeout=600).raise_for_status()  # warm
    out = []
    for rep in range(reps):
        w = asyncio.run(qps_window(url, bodies, clients, window_s))
        if w["errors"]:
            raise RuntimeError(f"{name}: {w['errors']} failed requests in window {rep}")
        out.append(w["qps"])
        log(f"serve: {name} window {rep}: {w['qps']:.2f} queries/s ({clients} clients)")
    return out


def _anchor_process(arrow: str, rows: int, seed: int, dim: int, model: str, threads: int, port: int, ready) -> None:
    """The Search-R1-shaped faiss server over the first ``rows`` vectors and passages."""
    import faiss
    import torch

    from bench.server_vs_faiss import anchor_app, serve_app
    from ragfast.data import load_corpus

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    corpus = load_corpus(arrow)

    class Rows:  # Search-R1 reads rows from a memory-mapped HF dataset; this reads the mapped .arrow store
        def __getitem__(self, j: int) -> dict:
            return corpus.row(j)

    chunks = (chunk_vectors(seed, c, rows, dim).numpy() for c in range(-(-rows // CHUNK_ROWS)))
    app = anchor_app(Rows(), chunks, model)
    ready.send("ready")
    ready.close()
    serve_app(app, port)


def measure_serving(index: Path, arrow: Path, encoder: Path, *, rows: int, seed: int, dim: int, anchor_rows: int,
                    anchor_arrow: Path, clients: int = 8, window_s: float = 30.0, reps: int = 2, threads: int = 2,
                    max_wait_ms: float = 50.0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """queries/s of ``ragfast serve-retriever`` over the index, then of the faiss anchor at ``anchor_rows``."""
    from bench.bench_server import server_time_split, stop_servers
    from ragfast.data import load_qa

    questions = [q.question for q in load_qa("hotpotqa-dev")]
    bodies = [{"queries": [qq], "topk": 3, "return_scores": True} for qq in questions]
    out: dict[str, Any] = {"clients": clients, "window_s": window_s, "reps": reps, "threads": threads}
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ragfast.cli", "serve-retriever", "--corpus", str(arrow), "--index", str(index),
           "--encoder", str(encoder), "--threads", str(threads), "--port", str(port), "--device", "cpu",
           "--max-wait-ms", f"{max_wait_ms:g}"]
    log("serve: " + " ".join(cmd))
    from ragfast.infra.http import wait_until_up

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_up(url, lambda: proc.poll() is None, 1800, what=f"server for {url}", error=RuntimeError)
        out["ragfast_start_s"] = time.perf_counter() - t0
        import httpx

        out["ragfast_health"] = httpx.get(url + "/health", timeout=30).json()
        out["ragfast_qps"] = _windows(url, bodies, clients, window_s, reps, log, "ragfast serve-retriever")
        out["ragfast_stats"] = httpx.get(url + "/health", timeout=30).json()["stats"]
        out["max_wait_ms"] = max_wait_ms
        batch = [{"queries": questions[i:i + clients], "topk": 3, "return_scores": True} for i in (0, clients)]
        out["ragfast_split"] = server_time_split(url, batch)  # seconds per query: encoder, search, server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    ctx = mp.get_context("spawn")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ready, child = ctx.Pipe(duplex=False)
    t0 = time.perf_counter()
    p = ctx.Process(target=_anchor_process, args=(str(anchor_arrow), anchor_rows, seed, dim, str(encoder), threads,
                                                  port, child), daemon=True)
    p.start()
    child.close()
    try:
        if not ready.poll(timeout=1800):
            raise RuntimeError("the faiss anchor server did not come up")
        ready.recv()
        _wait_health_post(url, p.is_alive)
        out["anchor_start_s"] = time.perf_counter() - t0
        out["anchor_qps"] = _windows(url, bodies, clients, window_s, reps, log, f"faiss anchor at {anchor_rows:,}")
    finally:
        stop_servers([p], grace_s=30)
    out["anchor_rows"] = anchor_rows
    out["anchor_qps_scaled"] = [v * anchor_rows / rows for v in out["anchor_qps"]]
    return out


def _wait_health_post(url: str, alive: Callable[[], bool]) -> None:
    """The anchor has no /health: wait until it answers a request."""
    import httpx

    for _ in range(1200):
        if not alive():
            raise RuntimeError("the faiss anchor server exited")
        try:
            if httpx.post(url + "/retrieve", json={"queries": ["warm"], "topk": 3}, timeout=600).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError("the faiss anchor server did not answer")


# ----------------------------------------------------------------------------------- driver


def default_workdir() -> Path:
    """``$RAGFAST_CACHE/capacity`` (default ``~/.cache/ragfast/capacity``)."""
    from ragfast.encoders.encoder import cache_root

    return cache_root() / "capacity"


def machine_facts() -> dict[str, str]:
    """CPU model (lscpu), vCPUs, load averages and the UTC time: what every figure is reported beside."""
    model = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": model, "cores": str(os.cpu_count()), "load": " ".join(f"{v:.2f}" for v in os.getloadavg()),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_full(args, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build, search and (unless ``args.no_serve``) serve; returns every figure and each phase's wall time."""
    workdir = Path(args.workdir) if args.workdir else default_workdir()
    res: dict[str, Any] = {"machine_start": machine_facts(), "phases_s": {}, "rows": args.rows, "dim": args.dim,
                           "seed": args.seed}
    t = time.perf_counter()
    built = build_index(workdir, args.rows, args.dim, args.seed, rescore=None if args.rescore == "none" else "fp16",
                        recall_queries=args.recall_queries, log=log)
    res["phases_s"]["build"] = time.perf_counter() - t
    res["build"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in built.items()}
    res["disk_bytes"] = sum(f.stat().st_size for f in Path(built["path"]).glob("*.npy"))
    if not args.no_search:
        t = time.perf_counter()
        res["search"] = measure_search(built["path"], batches=args.batches, reps=args.reps, threads=args.threads,
                                       seed=args.seed, log=log)
        res["phases_s"]["search_and_recall"] = time.perf_counter() - t
    if not args.no_serve:
        t = time.perf_counter()
        arrow = passage_store(workdir, args.rows, log)
        enc = random_bert_base(workdir, args.seed)
        res["phases_s"]["passages_and_encoder"] = time.perf_counter() - t
        t = time.perf_counter()
        res["serve"] = measure_serving(built["path"], arrow, enc, rows=args.rows, seed=args.seed, dim=args.dim,
                                       anchor_rows=min(args.anchor_rows, args.rows), anchor_arrow=arrow,
                                       clients=args.clients, window_s=args.serve_window, reps=args.serve_reps,
                                       threads=args.threads, max_wait_ms=args.serve_max_wait_ms, log=log)
        res["phases_s"]["serve"] = time.perf_counter() - t
    res["machine_end"] = machine_facts()
    return res


def report_markdown(res: dict[str, Any]) -> str:
    """The measured paper-scale section of docs/capacity.md."""
    m0, m1 = res["machine_start"], res["machine_end"]
    L = [f"Measured {m0['date']} on {m0['cpu']} ({m0['cores']} vCPUs), 1-minute load {m0['load'].split()[0]} at "
         f"the start and {m1['load'].split()[0]} at the end; {res['rows']:,} x {res['dim']} random unit vectors "
         f"(seed {res['seed']}), int8 codes memory-mapped ({res['disk_bytes'] / 1e9:.1f} GB of index files on "
         f"disk), k = {K}.\n"]
    L.append("| phase | wall time |")
    L.append("|---|---|")
    b = res["build"]
    for name, sec in res["phases_s"].items():
        extra = " (reused: built before)" if name == "build" and b["reused"] else ""
        L.append(f"| {name.replace('_', ' ')} | {sec:,.0f} s{extra} |")
    L.append("")
    if "search" in res:
        L += _search_markdown(res["search"])
    if "serve" in res:
        L += _serve_markdown(res)
    return "\n".join(L) + "\n"


def _search_markdown(s: dict[str, Any]) -> list[str]:
    L = []
    floor = float(np.median(s["floor_s"]))
    L.append(f"Read floor: one pass over the {s['scan_bytes'] / 1e9:.2f} GB scanned (codes, scales, row sums; "
             f"median of {len(s['floor_s'])}, same run) took {floor:.2f} s = {s['scan_bytes'] / floor / 1e9:.1f} GB/s. "
             f"First search after opening (pages from disk or the build's page cache): {s['first_scan_s']:.1f} s.\n")
    L.append("| B | s per batch (median) | queries/s | x read floor | all reps, s |")
    L.append("|---|---|---|---|---|")
    for bb, v in s["search_s"].items():
        med = float(np.median(v))
        L.append(f"| {bb} | {med:.2f} | {int(bb) / med:,.1f} | {med / floor:.2f} | "
                 f"{', '.join(f'{x:.2f}' for x in v)} |")
    L.append("")
    r = s["rss_after_search"]
    L.append(f"Memory of the searching process: {r['RssAnon'] / 1e9:.2f} GB private (anonymous), "
             f"{r['RssFile'] / 1e9:.2f} GB of mapped file pages resident (shared page cache), against "
             f"{s['held_bytes'] / 1e9:.1f} GB of index files: the kernels read the maps in place.\n")
    L.append(f"Recall@10 against the exact fp32 top-10 ({s['recall_queries']} random unit queries, the truth kept "
             f"while the build generated every chunk): **{s['recall_rescore']:.4f}** with the "
             f"{'fp16 re-score copy' if s['rescore_copy'] else 'dequantised codes'}, "
             f"{s['recall_int8_alone']:.4f} with int8 alone (candidates re-scored against the dequantised codes).\n")
    return L


def _serve_markdown(res: dict[str, Any]) -> list[str]:
    L = []
    v = res["serve"]
    rq, aq, asc = (float(np.median(v[k])) for k in ("ragfast_qps", "anchor_qps", "anchor_qps_scaled"))
    sp = v["ragfast_split"]
    parts = ", ".join(f"{k} {sp[k] * 1e3:,.0f} ms ({sp[k] / sp['server'] * 100:.0f}%)"
                      for k in sp if k != "server")
    st = v.get("ragfast_stats", {})
    L.append(f"Serving ({v['clients']} closed-loop clients, one question per request, topk 3, "
             f"{v['reps']} windows of {v['window_s']:.0f} s each, {v['threads']} threads per server; the "
             f"encoder is BERT-base-shaped with random weights; ragfast gathers requests for up to "
             f"{v.get('max_wait_ms', 2):g} ms, mean batch {st.get('mean_batch_queries', float('nan')):.1f} "
             f"queries over {st.get('batches', 0)} batches):\n")
    L.append("| server | rows | queries/s (median) | windows |")
    L.append("|---|---|---|---|")
    L.append(f"| ragfast serve-retriever, int8 mapped | {res['rows']:,} | **{rq:.2f}** | "
             f"{', '.join(f'{x:.2f}' for x in v['ragfast_qps'])} |")
    L.append(f"| Search-R1-shaped faiss IndexFlatIP fp32 (measured) | {v['anchor_rows']:,} | {aq:.2f} | "
             f"{', '.join(f'{x:.2f}' for x in v['anchor_qps'])} |")
    L.append(f"| the same, scaled x{res['rows'] / v['anchor_rows']:.2f} linearly in rows (not measured) | "
             f"{res['rows']:,} | {asc:.3f} | |")
    L.append("")
    L.append(f"ragfast / scaled anchor = **{rq / asc:.1f}x** queries/s. ragfast's time per query with "
             f"{v['clients']} questions per request, one request at a time (its `return_cost` answers): "
             f"{parts}, of {sp['server'] * 1e3:,.0f} ms in the server.\n")
    return L

"""Capacity model inputs: this machine's read bandwidth and ragfast's flat-kernel QPS per core.

Measures, on a random unit-norm ``rows x 768`` corpus (default 200k rows):

1. read bandwidth: a summing pass over the fp32 matrix held in private memory, and over the
   same matrix memory-mapped from a warm page cache (how a shard actor reads it), with 1
   thread and with every core;
2. ragfast's flat top-k kernel (the compiled ``cpp`` backend that ``topk_ip`` dispatches to on
   CPU) at batch 1 / 16 / 64, k=10, over fp32 / bf16 / int8 storage, on ONE thread (QPS per
   core) and on all threads; faiss ``IndexFlatIP`` on the same fp32 data is the anchor.

Then it scales the measured per-core times to the paper-scale index (21,015,324 x 768,
wiki-18): a flat scan is linear in the rows, so seconds per batch at 21M = seconds at ``rows``
x 21M / rows. It prints (and with ``--markdown PATH`` writes) the capacity tables used in
docs/capacity.md: bytes per shard, memory, QPS per core (measured here) and per GPU (from the
H200's NOMINAL HBM bandwidth and peak FLOP rates, not measured), and cores/GPUs needed for a
target QPS. Rows go to bench/results/bench_capacity.csv in the harness schema.

Run ``python bench/bench_capacity.py --quick`` (~1 minute on 2 cores) or without ``--quick``
for more repetitions. ``--measure-full`` measures the paper-scale index itself instead of scaling
(bench/capacity_full.py: build once, search, recall@10, serve; ``--rows`` runs it smaller).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, print_table, row, write_csv  # noqa: E402

PAPER_ROWS = 21_015_324  # wiki-18 (Search-R1's corpus): passages
DIM = 768  # e5-base-v2
STORAGES = ("fp32", "bf16", "int8")
BATCHES = (1, 16, 64)
K = 10

# NOMINAL H200 SXM figures (NVIDIA's data sheet; not measured here): HBM3e bandwidth, memory,
# and dense peak rates (no sparsity). fp32 is the CUDA-core rate: an exact fp32 scan does not
# use TF32 tensor cores.
H200 = {"hbm_bytes_per_s": 4.8e12, "memory_bytes": 141e9,
        "peak_flops": {"fp32": 67e12, "bf16": 989e12, "int8": 1979e12}}


def time_wall_cpu(fn, reps: int, warmup: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Wall seconds and this process's CPU seconds of ``reps`` calls after ``warmup``.

    The CPU seconds matter on a shared machine: a one-thread call that waits for a core shows a
    long wall time but only the CPU time it really ran, so B / CPU seconds is the rate of one
    dedicated core (still pessimistic: neighbours share caches and memory bandwidth).
    """
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return np.asarray(wall), np.maximum(np.asarray(cpu), 1e-9)


def _corpus(rows: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g)
    return torch.nn.functional.normalize(x, dim=1).contiguous()


def _stored(x, storage: str):
    from ragfast.ops.topk_ip import quantize

    return x if storage == "fp32" else quantize(x, dtype=storage)


def _resident_bytes(stored) -> int:
    """Bytes the stored corpus occupies (codes plus any scale, row sums and re-score copy)."""
    import torch

    if isinstance(stored, torch.Tensor):
        return stored.numel() * stored.element_size()
    total = 0
    for name in ("data", "scale", "rowsum", "rescore"):
        t = getattr(stored, name)
        if t is not None:
            total += t.numel() * t.element_size()
    return total


def _scan_bytes(stored) -> int:
    import torch

    if isinstance(stored, torch.Tensor):
        return stored.numel() * stored.element_size()
    return int(stored.scan_bytes)


def measure_bandwidth(x, reps: int, threads_all: int) -> list[Row]:
    import torch

    rows = []
    nbytes = x.numel() * 4
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.npy"
        np.save(path, x.numpy())
        mm = np.load(path, mmap_mode="r")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            mt = torch.from_numpy(mm)
        mt.sum()  # first touch: fault the pages in (the page cache is now warm)
        for threads in sorted({1, threads_all}):
            torch.set_num_threads(threads)
            for label, t in (("ram", x), ("mmap-warm", mt)):
                wall, cpu = time_wall_cpu(lambda: t.sum(), reps=reps)
                params = f"bytes={nbytes},threads={threads}"
                rows.append(row("read_bw", f"torch.sum/{label}", params, "bandwidth", "GB/s", nbytes / wall / 1e9))
                # Per CPU second of all threads together: GB/s per busy core.
                rows.append(row("read_bw", f"torch.sum/{label}", params, "bandwidth_per_cpu_s", "GB/cpu-s",
                                nbytes / cpu / 1e9))
        del mt, mm
    torch.set_num_threads(threads_all)
    return rows


def measure_kernel(x, reps: int, threads_all: int, rows_n: int, quick: bool) -> tuple[list[Row], dict]:
    import torch

    # The compiled backend that topk_ip dispatches to on CPU, called with an explicit thread
    # count: its OpenMP pool ignores torch.set_num_threads.
    from ragfast.ops.topk_ip import _cpp_impl

    out_rows: list[Row] = []
    facts: dict = {}
    q_all = _corpus(max(BATCHES), seed=1)
    for storage in STORAGES:
        stored = _stored(x, storage)
        facts[storage] = {"resident_per_row": _resident_bytes(stored) / rows_n,
                          "scan_per_row": _scan_bytes(stored) / rows_n, "sec": {}, "cpu": {}}
        # --quick measures one thread only (the per-core rate the model needs).
        for threads in [1] if quick else sorted({1, threads_all}):
            for b in BATCHES:
                q = q_all[:b].contiguous()
                wall, cpu = time_wall_cpu(lambda: _cpp_impl(q, stored, K, None, None, threads=threads), reps=reps)
                params = f"storage={storage},N={rows_n},d={DIM},B={b},k={K},threads={threads}"
                out_rows.append(row("topk_ip", "ragfast-cpp", params, "qps", "q/s", b / wall))
                out_rows.append(row("topk_ip", "ragfast-cpp", params, "qps_per_cpu_s", "q/cpu-s", b / cpu))
                out_rows.append(row("topk_ip", "ragfast-cpp", params, "scan_bw", "GB/s",
                                    _scan_bytes(stored) / wall / 1e9))
                facts[storage]["sec"][(threads, b)] = float(np.median(wall))
                facts[storage]["cpu"][(threads, b)] = float(np.median(cpu))
        del stored
    # Anchor: faiss exact inner-product flat index on the same fp32 data and queries.
    import faiss

    index = faiss.IndexFlatIP(DIM)
    index.add(x.numpy())
    facts["faiss"] = {"sec": {}, "cpu": {}}
    for threads in [1] if quick else sorted({1, threads_all}):
        faiss.omp_set_num_threads(threads)
        for b in (1, 16) if quick else BATCHES:
            qn = q_all[:b].numpy()
            wall, cpu = time_wall_cpu(lambda: index.search(qn, K), reps=reps)
            params = f"storage=fp32,N={rows_n},d={DIM},B={b},k={K},threads={threads}"
            out_rows.append(row("topk_ip", "faiss-IndexFlatIP", params, "qps", "q/s", b / wall))
            out_rows.append(row("topk_ip", "faiss-IndexFlatIP", params, "qps_per_cpu_s", "q/cpu-s", b / cpu))
            facts["faiss"]["sec"][(threads, b)] = float(np.median(wall))
            facts["faiss"]["cpu"][(threads, b)] = float(np.median(cpu))
    return out_rows, facts


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def capacity_markdown(facts: dict, bw: dict, bw_cpu: dict, rows_n: int, threads_all: int, target_qps: float,
                      ram_per_node: float) -> str:
    """The capacity tables of docs/capacity.md.

    CPU figures come from this machine: the one-thread kernel's CPU seconds per batch at
    ``rows_n`` rows, scaled linearly to the paper-scale row count. GPU figures are NOMINAL:
    ``max(scanned bytes / HBM bandwidth, FLOPs / peak rate)`` of an H200, an upper bound on
    what any kernel reaches.
    """
    scale = PAPER_ROWS / rows_n
    L: list[str] = []
    L.append(f"Inputs measured on this machine: a {rows_n:,} x {DIM} index, k={K}, one thread; every time is "
             f"scaled x{scale:.1f} to {PAPER_ROWS:,} rows (a flat scan is linear in the rows).\n")
    L.append(f"Read bandwidth (summing pass over {rows_n * DIM * 4 / 1e9:.2f} GB): one thread "
             f"{bw_cpu['ram'][1]:.1f} GB per CPU-second from RAM and {bw_cpu['mmap-warm'][1]:.1f} from a warm "
             f"memory map (wall-clock {bw['ram'][1]:.1f} / {bw['mmap-warm'][1]:.1f} GB/s on this shared machine); "
             f"{threads_all} threads: wall-clock {bw['ram'][threads_all]:.1f} / "
             f"{bw['mmap-warm'][threads_all]:.1f} GB/s.\n")
    L.append("### Memory at paper scale\n")
    L.append("| storage | bytes/row held | bytes/row scanned | index GB | GB per shard, S=2 | S=4 | S=8 | S=16 | "
             "fits one H200 (141 GB, nominal) |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    variants = [(s_, facts[s_]["resident_per_row"], facts[s_]["scan_per_row"]) for s_ in STORAGES]
    # int8 without the fp16 re-score copy (quantize(..., rescore=None)): codes + scale + row sum.
    variants.append(("int8, no re-score copy", facts["int8"]["scan_per_row"], facts["int8"]["scan_per_row"]))
    for name, res, scan in variants:
        tot = res * PAPER_ROWS
        L.append(f"| {name} | {res:.0f} | {scan:.0f} | {_gb(tot)} | {_gb(tot / 2)} | {_gb(tot / 4)} | {_gb(tot / 8)} | "
                 f"{_gb(tot / 16)} | {'yes' if tot < H200['memory_bytes'] else 'no'} |")
    L.append("")
    L.append("### Throughput at paper scale\n")
    L.append("`s/batch` is one core's CPU time for one batched scan of all 21M rows (measured here, scaled); "
             "`QPS/core` = batch / that. `QPS/H200` is the nominal bound. Cores and GPUs are for "
             f"**{target_qps:g} QPS**; GPUs are at least what holds the index.\n")
    L.append("| storage | batch | s/batch, 1 core (CPU time) | s/batch, 1 core (wall, shared machine) | QPS/core | "
             "QPS/H200 (nominal) | cores | H200s |")
    L.append("|---|---|---|---|---|---|---|---|")
    for s_ in STORAGES:
        scan_total = facts[s_]["scan_per_row"] * PAPER_ROWS
        res_total = facts[s_]["resident_per_row"] * PAPER_ROWS
        for b in BATCHES:
            cpu21 = facts[s_]["cpu"][(1, b)] * scale
            wall21 = facts[s_]["sec"][(1, b)] * scale
            qps_core = b / cpu21
            gpu_sec = max(scan_total / H200["hbm_bytes_per_s"], 2.0 * PAPER_ROWS * DIM * b / H200["peak_flops"][s_])
            qps_gpu = b / gpu_sec
            cores = math.ceil(target_qps / qps_core)
            gpus = max(math.ceil(target_qps / qps_gpu), math.ceil(res_total / H200["memory_bytes"]))
            L.append(f"| {s_} | {b} | {cpu21:.2f} | {wall21:.2f} | {qps_core:.2f} | {qps_gpu:,.0f} | {cores} "
                     f"| {gpus} |")
    L.append("")
    L.append(f"### Shards and nodes for {target_qps:g} QPS (batch 64, {ram_per_node / 1e9:.0f} GB RAM per node)\n")
    L.append("One shard actor per core, each scanning 1/S of the rows, so S = cores needed; nodes must hold "
             "the index (page cache) and the cores.\n")
    L.append("| storage | shard actors (= cores) | rows per shard | GB per shard | nodes by memory | "
             "nodes by cores (32-core nodes) |")
    L.append("|---|---|---|---|---|---|")
    for s_ in STORAGES:
        res_total = facts[s_]["resident_per_row"] * PAPER_ROWS
        qps_core = 64 / (facts[s_]["cpu"][(1, 64)] * scale)
        cores = math.ceil(target_qps / qps_core)
        L.append(f"| {s_} | {cores} | {math.ceil(PAPER_ROWS / cores):,} | {_gb(res_total / cores)} | "
                 f"{math.ceil(res_total / ram_per_node)} | {math.ceil(cores / 32)} |")
    L.append("")
    fb = max(b for (t, b) in facts["faiss"]["cpu"] if t == 1)
    f1, r1 = facts["faiss"]["cpu"][(1, fb)], facts["fp32"]["cpu"][(1, fb)]
    L.append(f"Anchor (same data, batch {fb}, one thread, CPU time): faiss IndexFlatIP {fb / f1:,.1f} q/s, "
             f"ragfast fp32 {fb / r1:,.1f} q/s at {rows_n:,} rows (ragfast / faiss = {f1 / r1:.2f}).")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions per point (~1 minute on 2 cores)")
    ap.add_argument("--rows", type=int, default=None,
                    help="rows of the measured index (default 200000; with --measure-full 21015324)")
    full = ap.add_argument_group("--measure-full: the paper-scale int8 index built, searched and served "
                                 "(bench/capacity_full.py)")
    full.add_argument("--measure-full", action="store_true", help="build (or reuse) the memory-mapped int8 index of "
                      "--rows x --dim random unit vectors, time exact search, recall@10, and serve it")
    full.add_argument("--dim", type=int, default=DIM, help="--measure-full: vector dimension (default 768)")
    full.add_argument("--seed", type=int, default=0, help="--measure-full: seed of the vectors and queries")
    full.add_argument("--workdir", default=None, help="--measure-full: where the index, passages and encoder live "
                      "(default $RAGFAST_CACHE/capacity; 48 GB at paper scale with the fp16 re-score copy)")
    full.add_argument("--rescore", choices=("fp16", "none"), default="fp16",
                      help="--measure-full: keep an fp16 re-score copy (default) or int8 codes only")
    full.add_argument("--batches", default="1,64,512", help="--measure-full: timed batch sizes")
    full.add_argument("--reps", type=int, default=3, help="--measure-full: timed repetitions per batch size")
    full.add_argument("--threads", type=int, default=2, help="--measure-full: threads for search and servers")
    full.add_argument("--recall-queries", type=int, default=64, help="--measure-full: random queries for recall@10")
    full.add_argument("--no-serve", action="store_true", help="--measure-full: skip the serving measurement")
    full.add_argument("--no-search", action="store_true",
                      help="--measure-full: skip the search timing and recall (e.g. to serve a built index again)")
    full.add_argument("--anchor-rows", type=int, default=2_000_000,
                      help="--measure-full: rows of the faiss fp32 anchor server (6.1 GB at 2M x 768)")
    full.add_argument("--clients", type=int, default=8, help="--measure-full: concurrent closed-loop clients")
    full.add_argument("--serve-window", type=float, default=30.0, help="--measure-full: seconds per load window")
    full.add_argument("--serve-reps", type=int, default=2, help="--measure-full: load windows per server")
    full.add_argument("--serve-max-wait-ms", type=float, default=50.0,
                      help="--measure-full: serve-retriever --max-wait-ms (a scan costs seconds at paper scale: "
                           "waiting 50 ms gathers all clients' requests into one scan)")
    full.add_argument("--json", default=None, help="--measure-full: also write every figure to this JSON file")
    ap.add_argument("--target-qps", type=float, default=100.0, help="target QPS for the sizing tables")
    ap.add_argument("--ram-per-node-gb", type=float, default=256.0, help="RAM per node for the sizing table")
    ap.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "bench_capacity.csv"))
    ap.add_argument("--markdown", default=None, help="also write the capacity tables to this file")
    args = ap.parse_args(argv)
    if args.measure_full:
        return _measure_full(ap, args)
    args.rows = 200_000 if args.rows is None else args.rows
    if args.rows < 10_000:
        ap.error("--rows must be >= 10000 (smaller indexes sit in cache and say nothing about bandwidth)")
    import torch

    reps = 3 if args.quick else 7
    threads_all = os.cpu_count() or 1
    torch.set_num_threads(threads_all)
    t0 = time.perf_counter()
    x = _corpus(args.rows)
    bw_rows = measure_bandwidth(x, reps, threads_all)
    bw: dict = {"ram": {}, "mmap-warm": {}}
    bw_cpu: dict = {"ram": {}, "mmap-warm": {}}
    for r in bw_rows:
        label = r.provider.split("/")[1]
        (bw if r.metric == "bandwidth" else bw_cpu)[label][int(r.params.split("threads=")[1])] = r.p50
    k_rows, facts = measure_kernel(x, reps, threads_all, args.rows, args.quick)
    rows = bw_rows + k_rows
    write_csv(rows, args.csv)
    print_table(rows, title=f"capacity inputs ({args.rows:,} x {DIM}), {time.perf_counter() - t0:.0f} s")
    md = capacity_markdown(facts, bw, bw_cpu, args.rows, threads_all, args.target_qps, args.ram_per_node_gb * 1e9)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    return 0


def _measure_full(ap: argparse.ArgumentParser, args) -> int:
    import json

    from bench import capacity_full as cf

    args.rows = PAPER_ROWS if args.rows is None else args.rows
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        ap.error(f"--batches must be integers separated by commas, got {args.batches!r}")
    if min(args.rows, args.dim, args.reps, args.threads, args.recall_queries, args.anchor_rows, args.clients,
           args.serve_reps, *args.batches) < 1 or args.serve_window <= 0:
        ap.error("--rows, --dim, --batches, --reps, --threads, --recall-queries, --anchor-rows, --clients, "
                 "--serve-reps and --serve-window must be positive")
    if args.dim % 8:
        ap.error(f"--dim must be a multiple of 8 (the read floor sums the codes as 8-byte words), got {args.dim}")
    if not args.no_serve and args.dim != DIM:
        ap.error(f"serving needs --dim {DIM} (the BERT-base-shaped encoder emits {DIM}-d vectors); add --no-serve")
    if K > args.rows:
        ap.error(f"--rows must be at least k={K}")
    t0 = time.perf_counter()
    res = cf.run_full(args, log=lambda m: print(f"[{time.perf_counter() - t0:7.0f} s] {m}", flush=True))
    md = cf.report_markdown(res)
    print(md)
    if args.markdown:
        Path(args.markdown).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    params = f"storage=int8,N={args.rows},d={args.dim},k={K},threads={args.threads}"
    rows = []
    if "search" in res:
        s = res["search"]
        rows += [row("capacity_full", "read-floor", params, "seconds", "s", s["floor_s"]),
                 row("capacity_full", "ragfast-int8-mapped", params, "recall@10", "fraction", [s["recall_rescore"]]),
                 row("capacity_full", "ragfast-int8-alone", params, "recall@10", "fraction", [s["recall_int8_alone"]])]
        rows += [row("capacity_full", "ragfast-int8-mapped", params + f",B={b}", "seconds", "s", v)
                 for b, v in s["search_s"].items()]
    if "serve" in res:
        v = res["serve"]
        p2 = params + f",clients={v['clients']}"
        rows += [row("capacity_full", "ragfast-serve-retriever", p2, "throughput", "queries/s", v["ragfast_qps"]),
                 row("capacity_full", f"faiss-anchor@{v['anchor_rows']}", p2, "throughput", "queries/s",
                     v["anchor_qps"]),
                 row("capacity_full", "faiss-anchor-scaled", p2, "throughput", "queries/s", v["anchor_qps_scaled"])]
    write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

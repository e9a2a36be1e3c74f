"""topk_ip benchmark: ragfast C++ (fp32, fp16, bf16, int8) against faiss IndexFlatIP and torch.

Workload (issue 3): random L2-normalised fp32 corpora N = 200,000 x d = 384 and
N = 100,000 x d = 768, k = 10, batch sizes 1, 4, 16, 64, 256. Every provider runs in this
process on the same data:

* ``faiss-flat`` (anchor): ``faiss.IndexFlatIP`` with ``omp_set_num_threads(cores)``;
* ``torch-mm`` (anchor): ``torch.topk(q @ corpus.T, k)``;
* ``ragfast-fp32`` (exact), ``ragfast-fp16``, ``ragfast-bf16``, ``ragfast-int8`` (with its
  re-scoring), from :func:`ragfast.ops.topk_ip` with ``backend="cpp"``.

Providers are timed round-robin (one call each in turn, repeated), so load spikes on a shared
machine hit all of them alike. Reported per (size, batch, provider): median latency, the speed ratio against the faster
anchor (>1 = faster), recall@10 against exact search, and at batch 1 the ratio of the latency
to the memory-bandwidth floor (bytes scanned / read bandwidth, both measured in this run).

Run ``python bench/bench_topk_ip.py`` (``--quick``: one 50k x 384 corpus, batches 1/16/256,
about a minute). Rows are appended to bench/results/bench_topk_ip.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, row, write_csv  # noqa: E402

from ragfast.ops import quantize, topk_ip  # noqa: E402

OP = "topk_ip"


def timed(fn, reps: int, budget_s: float) -> np.ndarray:
    """Seconds per call: one warm-up, then up to ``reps`` calls (at least 3) within a budget."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    n = max(3, min(reps, int(budget_s / max(first, 1e-6))))
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return np.asarray(out)


def timed_round_robin(fns: dict, reps: int, budget_s: float) -> dict:
    """Like :func:`timed` for several providers, interleaved call by call, so that a load spike
    on a shared machine hits every provider alike instead of whichever ran during it."""
    first = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        first[name] = time.perf_counter() - t0
    n = max(3, min(reps, int(budget_s * len(fns) / max(sum(first.values()), 1e-6))))
    out = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return {name: np.asarray(v) for name, v in out.items()}


def read_bandwidth(nbytes: int, reps: int) -> float:
    """Bytes/s of a full read: the best of a multi-threaded torch sum and a numpy sum over a
    buffer larger than the last-level cache (medians of ``reps``)."""
    n = max(nbytes // 4, 64 << 20)
    a = torch.ones(n, dtype=torch.float32)
    best = 0.0
    for fn in (lambda: float(a.sum()), lambda: float(a.numpy().sum())):
        t = np.median(timed(fn, reps, 5.0))
        best = max(best, a.numel() * 4 / t)
    return best


def recall(ids: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids.tolist(), truth.tolist())]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200000x384,100000x768", help="comma list of NxD")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget", type=float, default=6.0, help="max seconds of timed calls per provider and point")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--providers", default="faiss-flat,torch-mm,ragfast-fp32,ragfast-fp16,ragfast-bf16,ragfast-int8")
    ap.add_argument("--quick", action="store_true", help="50000x384, batches 1,16,256, 3 reps")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_topk_ip.csv"))
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.batches, args.reps, args.budget = "50000x384", "1,16,256", 3, 2.0
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",") if b]
    providers = [p for p in args.providers.split(",") if p]
    torch.set_num_threads(args.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(args.threads)
    except ImportError:
        faiss = None
        providers = [p for p in providers if p != "faiss-flat"]
        print("faiss not installed: faiss-flat skipped")

    rows: list[Row] = []
    bw = read_bandwidth(max(n * d * 4 for n, d in sizes), args.reps)
    print(f"read bandwidth (measured): {bw / 1e9:.1f} GB/s; threads={args.threads}")
    rows.append(row(OP, "memory", "read", "bandwidth", "GB/s", [bw / 1e9]))
    gen = torch.Generator().manual_seed(0)
    for N, d in sizes:
        corpus = torch.nn.functional.normalize(torch.randn(N, d, generator=gen), dim=1).contiguous()
        stores = {"ragfast-fp32": corpus}
        for name, dt in (("ragfast-fp16", "fp16"), ("ragfast-bf16", "bf16"), ("ragfast-int8", "int8")):
            if name in providers:
                stores[name] = quantize(corpus, dt)
        index = None
        if "faiss-flat" in providers:
            index = faiss.IndexFlatIP(d)
            index.add(corpus.numpy())
        scan = {"ragfast-fp32": N * d * 4, "faiss-flat": N * d * 4, "torch-mm": N * d * 4}
        for name, st in stores.items():
            if name != "ragfast-fp32":
                scan[name] = st.scan_bytes
        print(f"\n== N={N} d={d} k={args.k}  (fp32 corpus {N * d * 4 / 1e6:.0f} MB) ==")
        print(f"{'batch':>5} {'provider':<14} {'p50 ms':>9} {'vs best anchor':>15} {'recall@10':>10} "
              f"{'GB/s':>7} {'x bw floor':>10}")
        for B in batches:
            q = torch.nn.functional.normalize(torch.randn(B, d, generator=gen), dim=1).contiguous()
            calls = {
                "faiss-flat": lambda: index.search(q.numpy(), args.k),
                "torch-mm": lambda: torch.topk(q @ corpus.T, args.k, dim=1),
            }
            for name, st in stores.items():
                calls[name] = (lambda st=st: topk_ip(q, st, args.k, backend="cpp"))
            truth = torch.topk(q.double() @ corpus.double().T, args.k, dim=1).indices.numpy()
            params = f"N={N},d={d},k={args.k},B={B}"
            med, rec = {}, {}
            all_samples = timed_round_robin({name: calls[name] for name in providers}, args.reps, args.budget)
            for name in providers:
                samples = all_samples[name]
                med[name] = float(np.median(samples))
                rows.append(row(OP, name, params, "latency", "ms", samples * 1e3))
                res = calls[name]()
                ids = res[1].numpy() if isinstance(res[1], torch.Tensor) else res[1]
                rec[name] = recall(ids, truth)
                rows.append(row(OP, name, params, "recall@10", "fraction", [rec[name]]))
            anchors = [med[a] for a in ("faiss-flat", "torch-mm") if a in med]
            base = min(anchors) if anchors else None
            for name in providers:
                ratio = base / med[name] if base else float("nan")
                gbs = scan[name] / med[name] / 1e9
                floor = med[name] / (scan[name] / bw)
                if base:
                    rows.append(row(OP, name, params, "speedup_vs_best_anchor", "x", [ratio]))
                rows.append(row(OP, name, params, "scan_bandwidth", "GB/s", [gbs]))
                if B == 1:
                    rows.append(row(OP, name, params, "latency_over_bw_floor", "x", [floor]))
                print(f"{B:>5} {name:<14} {med[name] * 1e3:>9.2f} {ratio:>14.2f}x {rec[name]:>10.4f} {gbs:>7.1f} "
                      f"{floor if B == 1 else float('nan'):>10.2f}")
    path = write_csv(rows, args.out)
    print(f"\n{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

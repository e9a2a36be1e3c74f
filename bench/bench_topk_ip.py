"""topk_ip benchmark: ragfast C++ (fp32, fp16, bf16, int8) against faiss IndexFlatIP and torch.

Workload (issue 3): random L2-normalised fp32 corpora N = 200,000 x d = 384 and
N = 100,000 x d = 768, k = 10, batch sizes 1, 4, 16, 64, 256. Every provider runs in this
process on the same data:

* ``faiss-flat`` (anchor): ``faiss.IndexFlatIP`` with ``omp_set_num_threads(cores)``;
* ``torch-mm`` (anchor): ``torch.topk(q @ corpus.T, k)``;
* ``torch-bf16`` (anchor for compressed storage): ``torch.topk(q.bfloat16() @ corpus_bf16.T, k)``,
  which oneDNN runs on AMX tiles where the CPU has them;
* ``ragfast-fp32`` (exact), ``ragfast-fp16``, ``ragfast-bf16``, ``ragfast-int8`` (with its
  re-scoring), from :func:`ragfast.ops.topk_ip` with ``backend="cpp"``.

Providers are timed round-robin (one call each in turn, repeated), so load spikes on a shared
machine hit all of them alike. Reported per (size, batch, provider): median latency, the speed
ratio against the faster anchor (>1 = faster) and against torch-bf16, recall@10 against exact
search, and the ratio of the latency to the read floor of the bytes the provider scans (bytes /
read bandwidth, one pass over a buffer larger than the last-level cache, measured in this run).
Sizes larger than L3 (e.g. ``--sizes 1000000x768``) measure the memory-bound regime;
``--no-faiss-above`` keeps faiss's own fp32 copy out of such sizes.

ISA levels: the run measures ragfast at the level chosen for this CPU, and on an AVX-512 machine
also at the AVX2 level forced (``--levels``), with the anchors restricted the same way: the
forced level runs in a subprocess whose environment is set before torch / faiss import
(``RAGFAST_ISA=avx2``, ``ATEN_CPU_CAPABILITY=avx2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``,
``FAISS_OPT_LEVEL=avx2``). Every CSV row's params carry ``isa=<level>`` and ``aten=<torch CPU
capability>``; the ``ragfast-*`` providers run the default path (compiled kernels or torch, as
the chooser says: ``path=`` in params).

``--calibrate`` also times the compiled kernels forced (``kernel-*``), the torch path on the
same storage (``torchpath-*``) and, for bf16 storage, torch's bf16 mm re-scored exactly
(``torchbf16-bf16``, oneDNN on AMX tiles where the CPU has them), and writes, per level,
storage and batch, the fastest (``cpp``, ``torch`` or ``torch_bf16``, as ``ragfast
calibrate`` chooses) into python/ragfast/ops/topk_ip_choice.json (with the machine and
command), the table the default path reads.

Run ``python bench/bench_topk_ip.py`` (``--quick``: one 50k x 384 corpus, batches 1/16/256,
about a minute). Rows are appended to bench/results/bench_topk_ip.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, row, write_csv  # noqa: E402

from ragfast.ops import quantize, topk_ip  # noqa: E402
from ragfast.ops.topk_ip import NO_NATIVE_BF16, default_path, topk_ip_torch  # noqa: E402
from ragfast.ops.topk_ip_choice import TABLE_PATH, cpu_model, machine_key  # noqa: E402

OP = "topk_ip"
STORAGES = ("fp32", "fp16", "bf16", "int8")
# what a forced level restricts the anchors to (set before torch / faiss import: a subprocess);
# oneDNN (torch's bf16 matmul) is capped too, or a forced level on an AMX Xeon would time
# torch-bf16 on AMX tiles that no CPU of that level has
ANCHOR_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FAISS_OPT_LEVEL": "avx2",
                       "ONEDNN_MAX_CPU_ISA": "AVX2"},
              "generic": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                          "FAISS_OPT_LEVEL": "generic", "ONEDNN_MAX_CPU_ISA": "SSE41"},
              # an AVX-512 CPU without BF16 (Cascade Lake, Ice Lake) still runs the anchors' AVX-512 fp32 code
              "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
              "avx512vnni": {"FAISS_OPT_LEVEL": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
              "avx512bf16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}


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


def fastest_path(meds: dict | list[dict], storage: str) -> str:
    """The chooser's path for one cell from this run's medians (one dict per corpus size):
    ``cpp`` (``kernel-<storage>``), ``torch`` (``torchpath-<storage>``) or ``torch_bf16``
    (``torchbf16-<storage>``, bf16 only), whichever was measured at every size and lost least
    to the size's fastest path (geometric mean over the sizes: a cell is one batch class at any
    d); ties keep the earlier of that order."""
    meds = [meds] if isinstance(meds, dict) else meds
    cand = {"cpp": f"kernel-{storage}", "torch": f"torchpath-{storage}", "torch_bf16": f"torchbf16-{storage}"}
    names = {path: name for path, name in cand.items() if all(name in m for m in meds)}

    def slowdown(name: str) -> float:
        return math.fsum(math.log(m[name] / min(m[n] for n in names.values())) for m in meds)

    return min(names, key=lambda path: slowdown(names[path]))


def read_bandwidth(reps: int) -> float:
    """Bytes/s of a full read: the best of a multi-threaded torch sum and a numpy sum over a
    buffer larger than the last-level cache (medians of ``reps``): 1 GiB, over 3x the 300 MB L3 of
    an Emerald Rapids Xeon, whatever the corpus size (a larger buffer only costs memory)."""
    n = 256 << 20
    a = torch.ones(n, dtype=torch.float32)
    best = 0.0
    for fn in (lambda: float(a.sum()), lambda: float(a.numpy().sum())):
        t = np.median(timed(fn, reps, 5.0))
        best = max(best, a.numel() * 4 / t)
    return best


def exact_topk(q: torch.Tensor, corpus: torch.Tensor, k: int, chunk: int = 1 << 16) -> np.ndarray:
    """Ids of the exact (float64) top k, over row chunks: a float64 copy of a 1M x 768 corpus
    would take 6 GB."""
    qd = q.double()
    best_s = torch.full((q.shape[0], 0), -np.inf, dtype=torch.float64)
    best_i = torch.zeros((q.shape[0], 0), dtype=torch.int64)
    for r0 in range(0, corpus.shape[0], chunk):
        s = qd @ corpus[r0:r0 + chunk].double().T
        v, i = torch.topk(s, min(k, s.shape[1]), dim=1)
        best_s, o = torch.topk(torch.cat([best_s, v], 1), min(k, best_s.shape[1] + v.shape[1]), dim=1)
        best_i = torch.cat([best_i, i + r0], 1).gather(1, o)
    return best_i.numpy()


def recall(ids: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids.tolist(), truth.tolist())]))


def isa_level() -> str:
    from ragfast import _C

    return _C.isa_current()


def cpu_name() -> str:
    return cpu_model()


def cpu_features() -> str:
    from ragfast import _C

    return " ".join(_C.isa_info()["cpu"])


def write_choice(cells: dict, argv: list[str], path: Path) -> None:
    """Merge measured cells {isa: {storage: {B: path}}} into this machine's table in the chooser
    file (one table per machine: CPU model and features), leaving other machines' tables alone."""
    raw = json.loads(path.read_text()) if path.exists() else {}
    machines = raw.get("machines", [raw] if "cells" in raw else [])
    key = machine_key()
    mine = next((t for t in machines if t.get("cpu") == key["cpu"] and sorted(t.get("features", [])) == key["features"]),
                None)
    if mine is None:
        mine = dict(key, cells={}, runs={})
        machines.append(mine)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    run = {  # provenance per level: each level's cells may come from a different run
        "machine": f"{cpu_name()}, {os.cpu_count()} logical CPUs, features: {cpu_features()}",
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_1min_at_write": round(load, 2),
        "command": "python bench/bench_topk_ip.py " + " ".join(argv),
    }
    for lvl, per in cells.items():
        mine["cells"][lvl] = per
        mine.setdefault("runs", {})[lvl] = run
    mine.update(machine=run["machine"], command=run["command"])
    table = {
        "about": "topk_ip default path per machine (CPU model and features) / ISA level / storage / batch class: "
                 "'cpp' (compiled kernels) or 'torch' (mm + topk), whichever was faster; written by "
                 "bench/bench_topk_ip.py --calibrate",
        "machines": machines,
    }
    path.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    print(f"chooser table ({key['cpu']}) -> {path}")


def run_forced_level(level: str, argv: list[str]) -> int:
    """Re-run this script in a subprocess at a forced ISA level, anchors restricted alike."""
    env = dict(os.environ, RAGFAST_ISA=level, **ANCHOR_ENV.get(level, {}))
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--levels", level, "--child"]
    print(f"\n#### ISA level {level} (subprocess: RAGFAST_ISA={level} "
          + " ".join(f"{k}={v}" for k, v in ANCHOR_ENV.get(level, {}).items()) + ")", flush=True)
    return subprocess.run(cmd, env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200000x384,100000x768", help="comma list of NxD")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget", type=float, default=6.0, help="max seconds of timed calls per provider and point")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--providers",
                    default="faiss-flat,torch-mm,torch-bf16,ragfast-fp32,ragfast-fp16,ragfast-bf16,ragfast-int8")
    ap.add_argument("--no-faiss-above", type=float, default=2e9,
                    help="skip faiss-flat on corpora whose fp32 bytes exceed this (faiss keeps its own copy)")
    ap.add_argument("--quick", action="store_true", help="50000x384, batches 1,16,256, 3 reps")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "bench_topk_ip.csv"))
    ap.add_argument("--levels", default=None,
                    help="comma list of ISA levels: 'auto' (this CPU's, in process) and forced ones, each in a "
                         "subprocess (default: auto, plus avx2 when auto is an AVX-512 level)")
    ap.add_argument("--calibrate", action="store_true",
                    help="also time kernels forced and the torch path; write the chooser table")
    ap.add_argument("--choice-out", default=str(TABLE_PATH), help="chooser table written by --calibrate")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if not args.child:
        auto = isa_level()
        default = "auto,avx512bf16" if auto == "amx" else "auto,avx2" if auto.startswith("avx512") else "auto"
        levels = [x for x in (args.levels or default).split(",") if x]
        base_argv = []
        skip = False
        for a in argv:  # drop --levels X from what the children get
            if skip:
                skip = False
                continue
            if a == "--levels":
                skip = True
                continue
            if not a.startswith("--levels="):
                base_argv.append(a)
        rc = 0
        for lvl in levels:
            if lvl in ("auto", auto) and not os.environ.get("RAGFAST_ISA"):
                rc |= run_level(args, argv)
            else:
                rc |= run_forced_level(lvl, base_argv)
        return rc
    return run_level(args, argv)


def run_level(args, argv) -> int:
    if args.quick:
        args.sizes, args.batches, args.reps, args.budget = "50000x384", "1,16,256", 3, 2.0
    level = isa_level()
    aten = torch.backends.cpu.get_cpu_capability()
    print(f"ISA level {level}; torch ATen CPU capability {aten}; "
          f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')} "
          f"FAISS_OPT_LEVEL={os.environ.get('FAISS_OPT_LEVEL', '-')}", flush=True)
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in args.sizes.split(",") if s]
    batches = [int(b) for b in args.batches.split(",") if b]
    providers = [p for p in args.providers.split(",") if p]
    if args.calibrate:
        for st in STORAGES:
            if f"ragfast-{st}" in providers:
                providers += [f"kernel-{st}", f"torchpath-{st}"] + (["torchbf16-bf16"] if st == "bf16" else [])
    if level in NO_NATIVE_BF16 and {"torch-bf16", "torchbf16-bf16"} & set(providers):
        # a CPU of this level multiplies bf16 in torch at well under 1 GFLOP/s: minutes per call
        providers = [p for p in providers if p not in ("torch-bf16", "torchbf16-bf16")]
        print(f"torch-bf16 and the torch_bf16 path skipped at {level}: no native bf16 matmul in torch there")
    cells: dict = {}
    torch.set_num_threads(args.threads)
    try:
        import faiss

        faiss.omp_set_num_threads(args.threads)
    except ImportError:
        faiss = None
        providers = [p for p in providers if p != "faiss-flat"]
        print("faiss not installed: faiss-flat skipped")

    rows: list[Row] = []
    bw = read_bandwidth(args.reps)
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
        corpus_bf16 = None
        if "torch-bf16" in providers:  # the bf16 storage's own tensor when there is one: 1.5 GB less at 1M x 768
            corpus_bf16 = stores["ragfast-bf16"].data if "ragfast-bf16" in stores else corpus.bfloat16()
        size_providers = [p for p in providers if not (p == "faiss-flat" and N * d * 4 > args.no_faiss_above)]
        if "faiss-flat" in size_providers:
            index = faiss.IndexFlatIP(d)
            index.add(corpus.numpy())
        scan = {"ragfast-fp32": N * d * 4, "faiss-flat": N * d * 4, "torch-mm": N * d * 4, "torch-bf16": N * d * 2}
        for name, st in stores.items():
            b = st.scan_bytes if name != "ragfast-fp32" else N * d * 4
            scan[name] = scan["kernel-" + name[8:]] = scan["torchpath-" + name[8:]] = scan["torchbf16-" + name[8:]] = b
        print(f"\n== N={N} d={d} k={args.k}  (fp32 corpus {N * d * 4 / 1e6:.0f} MB) ==")
        print(f"{'batch':>5} {'provider [path]':<22} {'p50 ms':>9} {'vs best anchor':>15} {'vs bf16':>10} "
              f"{'recall@10':>10} {'GB/s':>7} {'x bw floor':>10}")
        for B in batches:
            q = torch.nn.functional.normalize(torch.randn(B, d, generator=gen), dim=1).contiguous()
            calls = {
                "faiss-flat": lambda: index.search(q.numpy(), args.k),
                "torch-mm": lambda: torch.topk(q @ corpus.T, args.k, dim=1),
                "torch-bf16": lambda: torch.topk((q.bfloat16() @ corpus_bf16.T).float(), args.k, dim=1),
            }
            for name, st in stores.items():
                calls[name] = (lambda st=st: topk_ip(q, st, args.k))  # the default path
                calls["kernel-" + name[8:]] = (lambda st=st: topk_ip(q, st, args.k, backend="cpp"))
                calls["torchpath-" + name[8:]] = (lambda st=st: topk_ip_torch(q, st, args.k))
                if name == "ragfast-bf16":
                    calls["torchbf16-bf16"] = (lambda st=st: topk_ip_torch(q, st, args.k, bf16=True))
            truth = exact_topk(q, corpus, args.k)
            params = f"N={N},d={d},k={args.k},B={B},isa={level},aten={aten}"
            paths = {f"ragfast-{st}": default_path(B, st).path for st in STORAGES}
            med, rec = {}, {}
            all_samples = timed_round_robin({name: calls[name] for name in size_providers}, args.reps, args.budget)
            for name in size_providers:
                samples = all_samples[name]
                med[name] = float(np.median(samples))
                pp = params + (f",path={paths[name]}" if name in paths else "")
                rows.append(row(OP, name, pp, "latency", "ms", samples * 1e3))
                res = calls[name]()
                ids = res[1].numpy() if isinstance(res[1], torch.Tensor) else res[1]
                rec[name] = recall(ids, truth)
                rows.append(row(OP, name, pp, "recall@10", "fraction", [rec[name]]))
            anchors = [med[a] for a in ("faiss-flat", "torch-mm") if a in med]
            base = min(anchors) if anchors else None
            for st in STORAGES:
                if f"kernel-{st}" in med:
                    cells.setdefault(level, {}).setdefault(st, {}).setdefault(str(B), []).append(med)
            for name in size_providers:
                pp = params + (f",path={paths[name]}" if name in paths else "")
                ratio = base / med[name] if base else float("nan")
                vs_bf16 = med["torch-bf16"] / med[name] if "torch-bf16" in med else float("nan")
                gbs = scan[name] / med[name] / 1e9
                floor = med[name] / (scan[name] / bw)
                if base:
                    rows.append(row(OP, name, pp, "speedup_vs_best_anchor", "x", [ratio]))
                if "torch-bf16" in med:
                    rows.append(row(OP, name, pp, "speedup_vs_torch_bf16", "x", [vs_bf16]))
                rows.append(row(OP, name, pp, "scan_bandwidth", "GB/s", [gbs]))
                rows.append(row(OP, name, pp, "latency_over_bw_floor", "x", [floor]))
                tag = f" [{paths[name]}]" if name in paths else ""
                print(f"{B:>5} {name + tag:<22} {med[name] * 1e3:>9.2f} {ratio:>14.2f}x {vs_bf16:>9.2f}x "
                      f"{rec[name]:>10.4f} {gbs:>7.1f} {floor:>10.2f}", flush=True)
    path = write_csv(rows, args.out)
    print(f"\n{len(rows)} rows -> {path}")
    if args.calibrate and cells:
        cells = {lvl: {st: {b: fastest_path(meds, st) for b, meds in per_b.items()} for st, per_b in per.items()}
                 for lvl, per in cells.items()}
        write_choice(cells, [a for a in argv if a != "--child"], Path(args.choice_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One call on a GPU machine: build, check every Triton kernel against its reference, time it.

Run from the repository root on a machine with a CUDA GPU::

    python bench/gpu_suite.py            # builds ragfast in place if it is not importable
    python bench/gpu_suite.py --quick    # smaller sizes (about a minute)

It (1) makes sure ``ragfast`` and ``ragfast._C`` import (building with ``pip install -e .
--no-build-isolation --no-deps`` when needed), (2) checks the Triton kernels against the package's
references on fresh random inputs (odd sizes, non-contiguous views, fp32/fp16/bf16, poisoned
outputs), (3) times them against their anchors (torch matmul+topk and faiss-gpu for ``topk_ip``;
dense-mask SDPA and FlexAttention for ``prefix_attention``) with CUDA events, medians of several
repetitions, (4) prints a short table and writes a CSV via ``bench/harness.py``, and (5) runs
``ragfast bench --device cuda`` on the bundled data, checking that every local slot ran on the GPU.
Designed to finish in well under 8 minutes on one H100/H200. Without a GPU it runs the same
checks under ``TRITON_INTERPRET=1`` on tiny sizes (``--cpu-smoke``), to keep the script honest.
"""
from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def ensure_built() -> None:
    try:
        importlib.import_module("ragfast._C")
        return
    except ImportError:
        pass
    print("building ragfast (pip install -e . --no-build-isolation --no-deps) ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(ROOT)],
                   check=True)
    importlib.invalidate_caches()
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)


def cuda_time(fn, reps: int, warmup: int = 3) -> list[float]:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def wall_time(fn, reps: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- checks ------------------------------------------------------------------------------------
def check_topk_ip(device: str, sizes, dtypes) -> list[str]:
    import torch

    from ragfast.ops.topk_ip import topk_ip, topk_ip_ref

    fails = []
    for (B, N, d, k) in sizes:
        for dt in dtypes:
            g = torch.Generator(device="cpu").manual_seed(B * 7919 + N)
            q = torch.randn(B, d + 3, generator=g)[:, :d].to(device)  # non-contiguous rows
            c = torch.randn(N, d, generator=g).to(device=device, dtype=dt)
            s_ref, i_ref = topk_ip_ref(q, c, k)
            s, i = topk_ip(q, c, k, backend="triton")
            tol = 1e-4 if dt == torch.float32 else 2e-2
            ok = bool(torch.isfinite(s).all()) and torch.allclose(s.float().cpu(), s_ref.float().cpu(), atol=tol * d ** 0.5,
                                                                  rtol=tol)
            # tie-aware: ids may differ only where scores tie within tolerance
            diff = (i.cpu() != i_ref.cpu())
            if diff.any():
                ok = ok and bool(((s.float().cpu() - s_ref.float().cpu()).abs()[diff] < tol * d ** 0.5 * 4).all())
            if not ok:
                fails.append(f"topk_ip B={B} N={N} d={d} k={k} {dt}")
    return fails


def check_prefix_attention(device: str, sizes, dtypes) -> list[str]:
    import torch

    from ragfast.ops.prefix_attention import prefix_attention, prefix_attention_ref

    fails = []
    for (B, H, Hkv, Lq, Lk, D) in sizes:
        for dt in dtypes:
            g = torch.Generator(device="cpu").manual_seed(Lq * 31 + Lk)
            q = torch.randn(B, Lq, H, D, generator=g).transpose(1, 2).to(device=device, dtype=dt)  # strided
            k = torch.randn(B, Hkv, Lk, D, generator=g).to(device=device, dtype=dt)
            v = torch.randn(B, Hkv, Lk, D, generator=g).to(device=device, dtype=dt)
            a = torch.arange(Lq) + (Lk - Lq)
            seg_lo = torch.stack([torch.clamp(a - torch.randint(0, 9, (Lq,), generator=g), min=0) for _ in range(B)])
            prefix_hi = torch.randint(0, Lk - Lq + 1, (B, Lq), generator=g)
            seg_lo, prefix_hi = seg_lo.to(device), prefix_hi.to(device)
            ref = prefix_attention_ref(q, k, v, prefix_hi, seg_lo)
            out = prefix_attention(q, k, v, prefix_hi, seg_lo, backend="triton")
            tol = 2e-4 if dt == torch.float32 else 2e-2
            if not (torch.isfinite(out).all() and torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol)):
                fails.append(f"prefix_attention B={B} H={H}/{Hkv} Lq={Lq} Lk={Lk} D={D} {dt}")
    return fails


def check_policy() -> list[str]:
    import numpy as np

    from ragfast.ops.policy import sweep

    rng = np.random.default_rng(0)
    s = rng.normal(size=(123, 7))
    s[rng.random(s.shape) < 0.1] = np.nan
    lengths = rng.integers(0, 8, 123)
    th = np.linspace(-2, 2, 19)
    ok = np.array_equal(sweep(s, th, lengths, backend="cpp"), sweep(s, th, lengths, backend="ref"))
    return [] if ok else ["sweep cpp != ref"]


# -- timings -----------------------------------------------------------------------------------
def time_topk_ip(device: str, N: int, d: int, batches, reps: int, rows: list) -> None:
    import torch

    from harness import row
    from ragfast.ops.topk_ip import topk_ip

    c32 = torch.nn.functional.normalize(torch.randn(N, d, device=device), dim=1)
    c16 = c32.half()
    faiss_idx = None
    try:
        import faiss

        if hasattr(faiss, "StandardGpuResources") and device.startswith("cuda"):
            res = faiss.StandardGpuResources()
            faiss_idx = faiss.GpuIndexFlatIP(res, d)
            faiss_idx.add(c32.cpu().numpy())
    except ImportError:
        pass
    timer = cuda_time if device.startswith("cuda") else wall_time
    for B in batches:
        q = torch.nn.functional.normalize(torch.randn(B, d, device=device), dim=1)
        params = f"N={N},d={d},k=10,B={B}"
        cases = {
            "torch fp32 matmul+topk": lambda: torch.topk(q @ c32.T, 10, dim=1),
            "torch fp16 matmul+topk": lambda: torch.topk(q.half() @ c16.T, 10, dim=1),
            "ragfast triton fp32": lambda: topk_ip(q, c32, 10, backend="triton"),
            "ragfast triton fp16": lambda: topk_ip(q, c16, 10, backend="triton"),
        }
        if faiss_idx is not None:
            qn = q.cpu().numpy()
            cases["faiss-gpu FlatIP"] = lambda: faiss_idx.search(qn, 10)
        for name, fn in cases.items():
            rows.append(row("topk_ip", name, params, "latency", "s", timer(fn, reps)))


def time_prefix_attention(device: str, Lq: int, Lk: int, reps: int, rows: list) -> None:
    import torch

    from harness import row
    from ragfast.ops.prefix_attention import prefix_attention, prefix_attention_ref

    B, H, Hkv, D = 4, 16, 4, 128
    dt = torch.float16 if device.startswith("cuda") else torch.float32
    q = torch.randn(B, H, Lq, D, device=device, dtype=dt)
    k = torch.randn(B, Hkv, Lk, D, device=device, dtype=dt)
    v = torch.randn(B, Hkv, Lk, D, device=device, dtype=dt)
    a = torch.arange(Lq, device=device) + (Lk - Lq)
    seg_lo = (a - 16).clamp(min=0).expand(B, Lq).contiguous()
    prefix_hi = torch.full((B, Lq), Lk // 2, device=device, dtype=torch.int64)
    timer = cuda_time if device.startswith("cuda") else wall_time
    params = f"B={B},H={H}/{Hkv},Lq={Lq},Lk={Lk},D={D},{str(dt).replace('torch.', '')}"
    cases = {
        "dense-mask SDPA (ref)": lambda: prefix_attention_ref(q, k, v, prefix_hi, seg_lo),
        "ragfast triton": lambda: prefix_attention(q, k, v, prefix_hi, seg_lo, backend="triton", check=False),
    }
    if device.startswith("cuda"):
        cases["FlexAttention"] = lambda: prefix_attention(q, k, v, prefix_hi, seg_lo, backend="flex", check=False)
    for name, fn in cases.items():
        try:
            rows.append(row("prefix_attention", name, params, "latency", "s", timer(fn, reps)))
        except Exception as exc:  # e.g. FlexAttention unsupported on this build: say so, keep going
            print(f"  {name}: skipped ({type(exc).__name__}: {exc})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny sizes under TRITON_INTERPRET=1")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    ensure_built()
    import torch

    from harness import print_table, write_csv

    device = "cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu"
    if device == "cpu" and not args.cpu_smoke:
        print("no CUDA GPU here: use --cpu-smoke to run the checks under the Triton interpreter")
        return 2
    import ragfast

    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu (interpreter)'}; "
          f"backends: {ragfast.backends()['available']}", flush=True)
    t0 = time.perf_counter()
    smoke = args.cpu_smoke
    dts = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    fails = []
    fails += check_topk_ip(device, [(1, 19, 7, 1), (3, 123, 32, 5)] if smoke else
                           [(1, 19, 7, 1), (3, 123, 32, 5), (19, 4097, 384, 10), (64, 100003, 768, 10)], dts)
    fails += check_prefix_attention(device, [(1, 2, 1, 5, 9, 16)] if smoke else
                                    [(1, 2, 1, 5, 9, 16), (2, 4, 2, 37, 123, 64), (3, 8, 2, 129, 1025, 128)], dts)
    fails += check_policy()
    print(f"checks: {'all passed' if not fails else 'FAILED: ' + '; '.join(fails)} ({time.perf_counter() - t0:.1f} s)",
          flush=True)
    rows: list = []
    reps = 3 if smoke else args.reps
    if smoke:
        time_topk_ip(device, 2000, 64, [1, 4], reps, rows)
        time_prefix_attention(device, 16, 64, reps, rows)
    else:
        N = 1_000_000 if args.quick else 4_000_000
        time_topk_ip(device, N, 768, [1, 16, 256] if args.quick else [1, 4, 16, 64, 256], reps, rows)
        time_prefix_attention(device, 512, 4096, reps, rows)
        time_prefix_attention(device, 1024, 8192, reps, rows)
    out = write_csv(rows, ROOT / "bench" / "results" / "gpu_suite.csv")
    # ratios against each op's anchor in this same run
    by = {}
    for r in rows:
        by.setdefault((r.op, r.params), {})[r.provider] = r.p50
    print_table(rows, title=f"gpu suite ({device}), median seconds; CSV: {out}")
    for (op, params), prov in by.items():
        anchor = min(v for p, v in prov.items() if not p.startswith("ragfast"))
        for p, v in prov.items():
            if p.startswith("ragfast"):
                print(f"{op:17s} {params:40s} {p:22s} {anchor / v:6.2f}x vs best anchor")
    if not smoke:
        fails += bench_on_device(device)
    print(f"total {time.perf_counter() - t0:.1f} s; {'OK' if not fails else 'CHECKS FAILED'}")
    return 0 if not fails else 1


def bench_on_device(device: str, limit: int = 20) -> list[str]:
    """``ragfast bench --device cuda`` on the bundled data: every local model must run on the GPU.

    Returns the failures (a slot that did not report the GPU, or a failed run).
    """
    import json
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="ragfast-gpu-bench-"))
    cmd = [sys.executable, "-m", "ragfast.cli", "bench", "--device", device, "--limit", str(limit),
           "--reasoner", "tiny", "--judge", "tiny", "--out", str(out / "run")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    print(f"ragfast bench --device {device} --limit {limit}: exit {r.returncode} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    if r.returncode != 0:
        print(r.stderr[-3000:])
        return [f"bench --device {device} exited {r.returncode}"]
    summary = json.loads((out / "run" / "summary.json").read_text())
    fails = [f"bench slot {k} ran on {v.get('device')}" for k, v in summary["slots"].items()
             if v.get("device") not in (device, "remote") and v.get("name") != "none"]
    for m, s in summary["methods"].items():
        print(f"  {m:9s} EM {s['em']:.3f}  " + "  ".join(f"{c} {v['seconds'] * 1e3 / max(1, s['n_questions']):.1f} ms/q"
                                                     for c, v in s["cost"].items()), flush=True)
    return fails


if __name__ == "__main__":
    raise SystemExit(main())

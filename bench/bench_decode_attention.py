"""Decode attention: ragfast's kernel against transformers' SDPA call in the same run.

A batched decode step's attention is, per layer, one query token per row against that row's cached
keys/values under a padding mask. For each model shape (``--shapes``: Qwen2.5-Coder-0.5B's 14 query
heads / 2 key-value heads / head dim 64, and the 1.5B's 12 / 2 / 128), dtype (``--dtypes``), batch
(``--batches``) and cached length (``--lengths``), random inputs with left padding (rows start at
random offsets within the first eighth; batches in ``--unmasked`` also without a mask, as one
unpadded session runs) go through ``ragfast.ops.decode_attention`` (cpp, the level
in use) and transformers' ``sdpa_attention_forward`` as the model calls it (the anchor; the kernel
is off where ``set_decode_attention(model, False)``), round-robin, ``--reps`` times; medians and the
per-repetition ratio. Outputs are checked close first. ``RAGFAST_ISA`` forces a lower kernel level
(set ``ATEN_CPU_CAPABILITY`` alike to restrict the anchor). Rows go to
bench/results/bench_decode_attention.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode_weights import cpu_model  # noqa: E402
from bench.harness import print_table, row, write_csv  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--unmasked", default="1", help="batch sizes also timed with no mask")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_decode_attention.csv"))
    args = ap.parse_args(argv)

    import torch

    from ragfast import _C

    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, kernel level {_C.isa_current()}, torch "
          f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()})", flush=True)
    g = torch.Generator().manual_seed(0)
    out_rows = []
    for shape in args.shapes.split(","):
        H, Hkv, D = SHAPES[shape]
        module = types.SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
        for dname in args.dtypes.split(","):
            dt = dtypes[dname]
            for B in (int(b) for b in args.batches.split(",")):
                for T in (int(t) for t in args.lengths.split(",")):
                    q = torch.randn(B, 1, H, D, generator=g).to(dt).transpose(1, 2)
                    k = torch.randn(B, Hkv, T, D, generator=g).to(dt)
                    v = torch.randn(B, Hkv, T, D, generator=g).to(dt)
                    start = torch.randint(0, max(1, T // 8), (B,), generator=g)
                    padded = torch.arange(T)[None, :] >= start[:, None]
                    for mask in [padded] + ([None] if str(B) in args.unmasked.split(",") else []):
                        out_rows += one(args, module, q, k, v, mask, D, f"{shape},{dname},B={B},T={T}"
                                        f"{'' if mask is not None else ',no mask'}")
    print_table(out_rows, f"decode attention ({cpu_model()}, kernel level {_C.isa_current()})")
    print(f"rows -> {write_csv(out_rows, args.csv)}")
    return 0


def one(args, module, q, k, v, mask, D: int, params: str) -> list:
    """Both providers round-robin on one input; harness rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ragfast.ops.decode_attention import decode_attention

    mask4 = None if mask is None else mask[:, None, None, :]
    fns = {"sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask4, scaling=D ** -0.5)[0],
           "ragfast": lambda: decode_attention(q, k, v, mask, D ** -0.5).transpose(1, 2)}
    a, b = fns["sdpa"]().float(), fns["ragfast"]().float()
    assert float((a - b).abs().max()) < 0.05, "the kernel disagrees with SDPA"
    times = {n: [] for n in fns}
    for _ in range(args.reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    rows = [row("decode_attention", n, params, "latency", "ms", [t * 1e3 for t in ts]) for n, ts in times.items()]
    ratio = [s / r for s, r in zip(times["sdpa"], times["ragfast"])]
    rows.append(row("decode_attention", "ragfast", params, "vs_sdpa", "x", ratio))
    print(f"{params:36s} sdpa {statistics.median(times['sdpa']) * 1e3:8.3f} ms  ragfast "
          f"{statistics.median(times['ragfast']) * 1e3:8.3f} ms  {statistics.median(ratio):5.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

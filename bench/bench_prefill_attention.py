"""Prefill attention: ragfast's kernel against transformers' SDPA call in the same run.

A prefill pass over a KV cache is, per layer, ``new`` query tokens per row against that row's
cached keys/values and their own, under the causal padding mask transformers builds. For each
model shape (``--shapes``: Qwen2.5-Coder-0.5B's 14 query heads / 2 key-value heads / head dim 64,
and the 1.5B's 12 / 2 / 128) and case (``--cases``: rows x cached x new tokens; the default's
first two are Search-R1 turns of the bench, an observation of about 450 tokens after 1,000 and
2,000 cached, the last a prompt alone), random bf16 inputs with left padding (rows start at
random offsets within the first eighth of the cache) go through
``ragfast.ops.prefill_attention`` (cpp, the level in use) and transformers'
``sdpa_attention_forward`` with the same mask as the model calls it (the anchor), round-robin,
``--reps`` times; medians and the per-repetition ratio. Outputs are checked close first.
Rows go to bench/results/bench_prefill_attention.csv in the harness schema.
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
    ap.add_argument("--cases", default="9x1000x450,4x2000x450,1x0x1024",
                    help="rows x cached x new tokens, comma separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_prefill_attention.csv"))
    args = ap.parse_args(argv)

    import torch

    from ragfast import _C

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, kernel level {_C.isa_current()}, torch "
          f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()})", flush=True)
    g = torch.Generator().manual_seed(0)
    out_rows = []
    for shape in args.shapes.split(","):
        H, Hkv, D = SHAPES[shape]
        module = types.SimpleNamespace(num_key_value_groups=H // Hkv, is_causal=True, training=False)
        for case in args.cases.split(","):
            B, P, L = (int(x) for x in case.split("x"))
            T = P + L
            q = torch.randn(B, L, H, D, generator=g).bfloat16().transpose(1, 2)
            k = torch.randn(B, Hkv, T, D, generator=g).bfloat16()
            v = torch.randn(B, Hkv, T, D, generator=g).bfloat16()
            start = torch.randint(0, max(1, P // 8), (B,), generator=g) if P else torch.zeros(B, dtype=torch.long)
            pad = torch.arange(T)[None, :] >= start[:, None]
            out_rows += one(args, module, q, k, v, pad, D, f"{shape},B={B},cached={P},new={L}")
    print_table(out_rows, f"prefill attention ({cpu_model()}, kernel level {_C.isa_current()})")
    print(f"rows -> {write_csv(out_rows, args.csv)}")
    return 0


def one(args, module, q, k, v, pad, D: int, params: str) -> list:
    """Both providers round-robin on one input; harness rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ragfast.ops.prefill_attention import prefill_attention, visible

    L, T = q.shape[2], k.shape[2]
    mask4 = visible(L, T, pad)[:, None]  # [B, 1, L, T]: what transformers' causal padding mask holds
    fns = {"sdpa": lambda: sdpa_attention_forward(module, q, k, v, mask4, scaling=D ** -0.5)[0],
           "ragfast": lambda: prefill_attention(q, k, v, pad, D ** -0.5).transpose(1, 2)}
    a, b = fns["sdpa"]().float(), fns["ragfast"]().float()
    assert float((a - b).abs().max()) < 0.05, "the kernel disagrees with SDPA"
    times = {n: [] for n in fns}
    for _ in range(args.reps):
        for n, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[n].append(time.perf_counter() - t0)
    rows = [row("prefill_attention", n, params, "latency", "ms", [t * 1e3 for t in ts]) for n, ts in times.items()]
    ratio = [s / r for s, r in zip(times["sdpa"], times["ragfast"])]
    rows.append(row("prefill_attention", "ragfast", params, "vs_sdpa", "x", ratio))
    print(f"{params:36s} sdpa {statistics.median(times['sdpa']) * 1e3:9.2f} ms  ragfast "
          f"{statistics.median(times['ragfast']) * 1e3:9.2f} ms  {statistics.median(ratio):5.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

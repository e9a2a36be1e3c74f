"""argmax of a decode step's logits: ragfast's kernel against torch.argmax in the same run.

Greedy decoding ends every step in one argmax over a ``[rows, vocabulary]`` block of logits. For
each logits dtype (``--dtypes``: bf16, what a bf16 model's head writes, and fp32) and each row count
(``--rows``), random logits of ``--vocab`` columns (default 151,936: Qwen2.5's) go through
``ragfast.ops.argmax`` (cpp, the level in use) and ``torch.argmax(dim=-1)`` (the anchor), round-robin,
``--reps`` times; medians and the per-repetition ratio. The answers are checked equal first.
``RAGFAST_ISA`` forces a lower kernel level (set ``ATEN_CPU_CAPABILITY`` alike to restrict the
anchor). Rows go to bench/results/bench_argmax.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode_weights import cpu_model  # noqa: E402
from bench.harness import print_table, row, write_csv  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_argmax.csv"))
    args = ap.parse_args(argv)

    import torch

    from ragfast import _C
    from ragfast.ops.argmax import argmax

    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows = [int(r) for r in args.rows.split(",")]
    names = [d for d in args.dtypes.split(",") if d]
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, kernel level {_C.isa_current()}, torch "
          f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); vocabulary {args.vocab}", flush=True)
    g = torch.Generator().manual_seed(0)
    data = {(d, M): (torch.randn(M, args.vocab, generator=g) * 4).to(dtypes[d]) for d in names for M in rows}
    for x in data.values():
        assert torch.equal(argmax(x), x.argmax(dim=-1)), "ragfast's argmax disagrees with torch's"
    fns = {"torch": lambda x: x.argmax(dim=-1), "ragfast": argmax}
    res: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.reps):
        for key, x in data.items():
            for who, fn in fns.items():
                t0 = time.perf_counter()
                fn(x)
                res.setdefault((*key, who), []).append(time.perf_counter() - t0)
    out = []
    for d, M in data:
        params = f"{d},rows={M},vocab={args.vocab},level={_C.isa_current()}"
        for who in fns:
            out.append(row("argmax", who, params, "seconds", "s", res[(d, M, who)]))
        r = [a / b for a, b in zip(res[(d, M, "torch")], res[(d, M, "ragfast")])]
        out.append(row("argmax", "ragfast", params, "vs_torch", "x", r))
        print(f"{d} rows={M:3d}: torch {statistics.median(res[(d, M, 'torch')]) * 1e3:7.3f} ms, ragfast "
              f"{statistics.median(res[(d, M, 'ragfast')]) * 1e3:7.3f} ms, {statistics.median(r):5.2f}x", flush=True)
    print_table(out, f"argmax over the vocabulary ({cpu_model()})")
    print(f"rows -> {write_csv(out, args.csv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

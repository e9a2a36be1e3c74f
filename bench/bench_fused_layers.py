"""The fused RMSNorm and SiLU-gate kernels against the modules' own torch code, alone and in the generator.

Two parts, one run:

* **ops**: ``rms_norm`` against transformers' ``Qwen2RMSNorm`` module and ``silu_mul`` against
  ``F.silu(gate) * up`` (what ``Qwen2MLP`` computes between its matmuls), on the Qwen2.5-Coder
  0.5B and 1.5B widths (hidden 896 / 1,536, intermediate 4,864 / 8,960), at 1 row (a batch-1
  decode step), 64 (batch-64 decode) and 1,920 (a prefill pass), fp32 and bf16. Round-robin,
  ``--reps`` times; medians of each call's time over ``--calls`` calls.
* **generator**: ``HFGenerator`` on ``--model`` (default the default reasoner, bf16) with the
  kernels in the model (``set_fused_layers(model, True)``) and without (``False``), in one
  process, alternating the order each repetition (ABBA): the Search-R1 prompts of the first
  ``--batch`` bundled dev questions, each followed by an observation of ``--context-tokens`` tokens
  of its own paragraphs (a later turn's prefill), prefill (one token) then ``--tokens`` greedy
  tokens, as in bench/bench_decode_weights.py; greedy tokens compared between the two.

The anchors are the torch code (ops) and the generator without the kernels; every ratio is
against them, measured in the same run. Rows go to bench/results/bench_fused_layers.csv.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode_weights import cpu_model, one  # noqa: E402
from bench.harness import print_table, row, write_csv  # noqa: E402

WIDTHS = {"0.5b": (896, 4864), "1.5b": (1536, 8960)}


def time_calls(fn, calls: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def ops_part(args, torch) -> list:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from ragfast.ops.rms_norm import rms_norm
    from ragfast.ops.silu_mul import silu_mul

    cases = []
    for model, (hidden, inter) in WIDTHS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for rows in args.rows:
                x = torch.randn(rows, hidden).to(dtype)
                norm = Qwen2RMSNorm(hidden, eps=1e-6).to(dtype)
                with torch.no_grad():
                    norm.weight.normal_(1, 0.1)
                g, u = torch.randn(rows, inter).to(dtype), torch.randn(rows, inter).to(dtype)
                tag = f"{model},{str(dtype).replace('torch.', '')},rows={rows}"
                cases.append(("rms_norm", tag, lambda x=x, n=norm: n(x),
                              lambda x=x, n=norm: rms_norm(x, n.weight, n.variance_epsilon)))
                cases.append(("silu_mul", tag, lambda g=g, u=u: torch.nn.functional.silu(g) * u,
                              lambda g=g, u=u: silu_mul(g, u)))
    times: dict[tuple[str, str, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.reps):
            for op, tag, anchor, ours in cases:
                for who, fn in (("torch", anchor), ("ragfast", ours)) if rep % 2 == 0 else (("ragfast", ours),
                                                                                           ("torch", anchor)):
                    times.setdefault((op, tag, who), []).append(time_calls(fn, args.calls))
    out = []
    for op, tag, _, _ in cases:
        t, r = times[(op, tag, "torch")], times[(op, tag, "ragfast")]
        out.append(row(op, "torch", tag, "call", "us", [s * 1e6 for s in t]))
        out.append(row(op, "ragfast", tag, "call", "us", [s * 1e6 for s in r]))
        out.append(row(op, "ragfast", tag, "vs_torch", "x", [a / b for a, b in zip(t, r)]))
        print(f"{op:8s} {tag:28s} torch {statistics.median(t) * 1e6:9.1f} us  ragfast "
              f"{statistics.median(r) * 1e6:9.1f} us  {statistics.median([a / b for a, b in zip(t, r)]):5.2f}x",
              flush=True)
    return out


def generator_part(args, torch) -> list:
    from bench.bench_decode_weights import load
    from ragfast.data import load_qa
    from ragfast.models.fused_layers import set_fused_layers
    from ragfast.protocol import build_prompt

    gen = load(args.model, args.dtype, "native")
    prompts = []
    for q in load_qa("hotpotqa-dev")[:args.batch]:
        # a later turn's prefill: the prompt and an observation of --context-tokens tokens (the
        # question's own paragraphs), as Search-R1 feeds the reasoner after a search
        ctx = q.metadata["context"]
        passages = " ".join(f"{t}: {''.join(sents)}" for t, sents in zip(ctx["title"], ctx["sentences"]))
        obs = gen.tokenizer.decode(gen.tokenizer(passages)["input_ids"][:args.context_tokens])
        prompts.append(gen.format_prompt(build_prompt(q.question)) + f"<information>{obs}</information>")
    one(gen, prompts[:2], 2, "warm")
    res: dict[bool, list[dict]] = {True: [], False: []}
    for rep in range(args.reps):
        for on in (True, False) if rep % 2 == 0 else (False, True):
            set_fused_layers(gen.model, on)
            r = one(gen, prompts, args.tokens, f"r{rep}{on}")
            res[on].append(r)
            print(f"rep {rep} fused={on!s:5s} prefill {r['prefill_tokens'] / r['t_pre']:7.1f} tok/s  decode "
                  f"{r['dec_tokens'] / r['t_dec']:7.1f} tok/s", flush=True)
    out = []
    params = f"{args.model},{args.dtype},B={args.batch},context={args.context_tokens},tokens={args.tokens}"
    for part, key, n in (("prefill", "t_pre", "prefill_tokens"), ("decode", "t_dec", "dec_tokens")):
        on = [r[n] / r[key] for r in res[True]]
        off = [r[n] / r[key] for r in res[False]]
        ratio = [a / b for a, b in zip(on, off)]
        out += [row(part, "torch-layers", params, "tokens_per_s", "tok/s", off),
                row(part, "fused-layers", params, "tokens_per_s", "tok/s", on),
                row(part, "fused-layers", params, "vs_torch_layers", "x", ratio)]
        print(f"generator {part}: fused {statistics.median(on):.1f} tok/s, torch layers {statistics.median(off):.1f} "
              f"tok/s: {statistics.median(ratio):.2f}x (per repetition {', '.join(f'{x:.2f}' for x in ratio)})")
    same = sum(a == b for a, b in zip(res[True][0]["ids"], res[False][0]["ids"]))
    print(f"greedy tokens equal with and without the kernels on {same} of {args.batch} rows")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("ops", "generator", "both"), default="both")
    ap.add_argument("--rows", default="1,64,1920", help="rows per op call (ops part)")
    ap.add_argument("--calls", type=int, default=20, help="calls per timing (ops part)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-searchr1", help="generator part: a bundled reasoner, "
                    "catalogue name or model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context-tokens", type=int, default=400, help="generator part: observation tokens per prompt")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_fused_layers.csv"))
    args = ap.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",") if r]

    import torch

    from ragfast.ops.registry import cpp_module

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, ragfast level "
          f"{cpp_module().isa_current()}", flush=True)
    rows = []
    if args.part in ("ops", "both"):
        rows += ops_part(args, torch)
    if args.part in ("generator", "both"):
        rows += generator_part(args, torch)
    print_table(rows, f"fused layers ({cpu_model()})")
    print(f"rows -> {write_csv(rows, args.csv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

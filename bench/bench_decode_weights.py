"""Local generation by weight precision and matmul: fp32, bf16, weight-only int8; gemv on and off.

The reasoner is the cost of a bench with a real model, and decoding a few sequences reads every
weight once per step, so bytes per weight set the pace there; prefill is matmul-bound. Providers
(the default reasoner, ``qwen2.5-coder-0.5b-searchr1``, its adapter merged; ``--model`` for
another catalogued model or directory), all loaded in this process:

* ``fp32``: ``HFGenerator(dtype="float32")``, what the default bench runs;
* ``bf16``: ``dtype="bfloat16"``;
* ``int8``: ``weights="int8"`` with float32 activations (models/weight_quant.py: one scale per
  output channel);
* ``int8-bf16``: ``weights="int8"`` with bfloat16 activations;
* ``w8a8``, ``w8a8-bf16``: ``weights="w8a8"`` (the same int8 weights; passes of more than 16
  rows round their activations to int8 per token and multiply integers: ``torch._int_mm``, or at
  the amx level ragfast's ``w8a8.matmul`` on codes prepacked into AMX tiles);
* ``fp32-torch``, ``bf16-torch``, ``int8-torch``, ``int8-bf16-torch``, ...: the same on torch's own
  kernels: every pass on torch's matmul (ragfast's gemv kernel off: ``set_gemv_rows(model, 0)``;
  bf16 weights not prepacked for oneDNN nor w8a8 codes for AMX: ``set_packed(model, False)``) and every attention on
  torch's SDPA (ragfast's decode-attention kernel off: ``set_decode_attention(model, False)``) and
  every RMSNorm and SiLU gate on the modules' own code (``set_fused_layers(model, False)``), as
  before those kernels. ``bf16-torch`` is the bf16
  generator that issue 38's batch-64 goal is measured against;
* any of them with a ``+draft`` suffix (``w8a8-bf16+draft``): the generator's prompt-lookup
  drafts on (models/drafts.py: up to two rows feed looked-up tokens after their picked one and
  keep those the pass confirms); every other provider decodes one token a step;
* any of them with a ``+walk`` suffix (``w8a8-bf16+walk``): decode steps through the model's own
  forward (transformers' module walk) instead of the generator's lean step
  (models/lean_step.py: the same modules and logits as one flat loop); the ``-torch`` providers
  walk the modules too, as before either existed.

The anchor is the first provider named (default ``fp32-torch``: the default bench's reasoner
before gemv); every ratio is against it.

Workload, per batch size in ``--batches`` (default 1 and 64): the Search-R1 prompts of the first B
bundled hotpotqa-dev questions (the instruction's keys/values shared, as in a run); one call
generating one token (the prefill: prompt tokens per second), then one generating
``--tokens`` greedy tokens with no stop string (the decode: generated tokens per second, its
first step feeding one token per row). Round-robin over the providers, ``--reps`` times; medians.

Beside them, the read floor: a decode step at B = 1 cannot beat the weight bytes it reads
(``HFGenerator.weight_info.read_bytes``) over the memory read bandwidth, measured in the same run
(a sum over a 1 GiB buffer, once per repetition: each repetition's steps over its own
measure, since this figure swings by 2x within an hour on a shared VM). At B >= 16 the compute floor instead: the step's linear-layer flops
(2 x B x their multiply-adds per token) at the rate torch's matmul reaches on a large product of
the model's MLP shape in the provider's activation dtype, measured in the same run. And the
greedy text: how many of the B=64 rows generate exactly the anchor's tokens, and the mean share
of each row's tokens that agree before the first difference.

Run ``python bench/bench_decode_weights.py`` on a quiet machine (about 15 minutes on 2 cores for
0.5B); rows go to bench/results/bench_decode_weights.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import print_table, row, write_csv  # noqa: E402

PROVIDERS = {"fp32": ("float32", "native"), "bf16": ("bfloat16", "native"), "int8": ("float32", "int8"),
             "int8-bf16": ("bfloat16", "int8"), "w8a8": ("float32", "w8a8"), "w8a8-bf16": ("bfloat16", "w8a8")}
PROVIDERS.update({f"{k}-torch": v for k, v in list(PROVIDERS.items())})
#: Provider suffix: the generator's prompt-lookup drafts on (``HFGenerator(draft_tokens=...)``).
DRAFT = "+draft"
#: Provider suffix: decode steps through the model's forward, not the lean step (``HFGenerator.lean_steps``).
WALK = "+walk"


def cpu_model() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def read_bandwidth(reps: int = 5) -> float:
    """Bytes per second a sum over a 1 GiB float32 buffer reads (median), with torch's threads."""
    import torch

    x = torch.ones(1 << 28)
    x.sum()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return x.nbytes / statistics.median(ts)


def matmul_rate(dtype, hidden: int, inter: int, reps: int = 5) -> float:
    """FLOP/s of torch's matmul on a large product of the model's own MLP shape in ``dtype``
    (512 rows, ``[512, hidden] x [hidden, inter]``; median): the rate a batched decode step's
    linear layers could reach at best."""
    import torch

    x, w = torch.randn(512, hidden).to(dtype), torch.randn(inter, hidden).to(dtype)
    torch.nn.functional.linear(x, w)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.nn.functional.linear(x, w)
        ts.append(time.perf_counter() - t0)
    return 2 * 512 * hidden * inter / statistics.median(ts)


def linear_params(model) -> int:
    """Multiply-adds per token of the model's linear layers (its head included)."""
    return sum(m.in_features * m.out_features for m in model.modules()
               if hasattr(m, "in_features") and hasattr(m, "out_features"))


def load(model: str, dtype: str, weights: str, torch_only: bool = False, draft: bool = False, walk: bool = False):
    from ragfast.models.attention import set_decode_attention
    from ragfast.models.catalogue import resolve
    from ragfast.models.drafts import DRAFT_TOKENS
    from ragfast.models.fused_layers import set_fused_layers
    from ragfast.models.generator import HFGenerator
    from ragfast.models.searchr1_reasoner import SearchR1Reasoner, is_adapter
    from ragfast.models.weight_quant import set_gemv_rows, set_packed

    # One token a step unless the provider asks for drafts: the rows compare kernels, and the
    # generator's prompt-lookup drafts (on by default) read the weights once for several tokens.
    kw = dict(dtype=dtype, weights=weights, memory_budget=None, max_batch=64, draft_tokens=DRAFT_TOKENS if draft else 0)
    gen = SearchR1Reasoner(model, **kw) if is_adapter(model) else HFGenerator(resolve(model), **kw)
    gen.lean_steps = not (walk or torch_only)
    if torch_only:
        gen.weight_info = dataclasses.replace(gen.weight_info, gemv_rows=set_gemv_rows(gen.model, 0),
                                              packed_layers=set_packed(gen.model, False))
        set_decode_attention(gen.model, False)
        set_fused_layers(gen.model, False)
    return gen


def one(gen, prompts: list[str], tokens: int, tag: str) -> dict:
    """Prefill (one token) then decode (``tokens`` tokens) over ``prompts``; seconds and token counts."""
    sids = [f"{tag}-{i}" for i in range(len(prompts))]
    gen.start(sids, prompts)
    fresh = sum(len(gen.session_tokens(s)) for s in sids)
    t0 = time.perf_counter()
    gen.generate(sids, stop=[], max_new_tokens=1)
    t_pre = time.perf_counter() - t0
    t0 = time.perf_counter()
    gen.generate(sids, stop=[], max_new_tokens=tokens)
    t_dec = time.perf_counter() - t0
    out = [list(gen.last_generated[s]) for s in sids]
    gen.end(sids)
    return {"prefill_tokens": fresh, "t_pre": t_pre, "t_dec": t_dec, "dec_tokens": sum(map(len, out)), "ids": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-searchr1",
                    help="a bundled reasoner adapter, a catalogue name or a model directory")
    ap.add_argument("--providers", default="fp32-torch,fp32,bf16-torch,bf16,int8-torch,int8,int8-bf16",
                    help="comma-separated, the anchor first, of " + ", ".join(PROVIDERS) + f"; a {DRAFT} suffix "
                    "turns the generator's prompt-lookup drafts on (every other provider decodes one token a step), "
                    f"a {WALK} suffix runs decode steps through the model's forward instead of the lean step")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens per row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_decode_weights.csv"))
    args = ap.parse_args(argv)

    import torch

    from ragfast.data import load_qa
    from ragfast.protocol import build_prompt

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [p for p in args.providers.split(",") if p]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()}); model {args.model}", flush=True)
    gens = {}
    for n in names:
        t0 = time.perf_counter()
        base = n.split("+")[0]
        gens[n] = load(args.model, *PROVIDERS[base], torch_only=base.endswith("-torch"), draft=DRAFT in n,
                       walk=WALK in n)
        print(f"loaded {n}: {gens[n].describe()['weights']}, {gens[n].weight_info.read_bytes / 1e6:.0f} MB read per "
              f"pass ({time.perf_counter() - t0:.0f} s)", flush=True)
    qs = load_qa("hotpotqa-dev")
    g0 = next(iter(gens.values()))
    prompts = [g0.format_prompt(build_prompt(q.question)) for q in qs[:max(batches)]]
    for n, g in gens.items():  # warm-up: faults the weights in and keeps the shared instruction's prefix
        one(g, prompts[:2], 2, "warm")
    bw = []
    res: dict[tuple[str, int], list[dict]] = {}
    act = {n: "bfloat16" if PROVIDERS[n.split("+")[0]][0] == "bfloat16" else "float32" for n in names}
    rate: dict[str, list[float]] = {a: [] for a in set(act.values())}
    cfg = g0.config
    for rep in range(args.reps):
        bw.append(read_bandwidth())
        for a in rate:
            rate[a].append(matmul_rate(getattr(torch, a), cfg.hidden_size, cfg.intermediate_size))
        for b in batches:
            for n, g in gens.items():
                r = one(g, prompts[:b], args.tokens, f"r{rep}")
                res.setdefault((n, b), []).append(r)
                print(f"rep {rep} B={b:3d} {n:10s} prefill {r['prefill_tokens'] / r['t_pre']:7.1f} tok/s  decode "
                      f"{r['dec_tokens'] / r['t_dec']:7.1f} tok/s", flush=True)
    bw_med = statistics.median(bw)
    rows = [row("read_bandwidth", "torch sum 1 GiB", "", "bandwidth", "GB/s", [x / 1e9 for x in bw])]
    print(f"\nread bandwidth {bw_med / 1e9:.1f} GB/s (median of {len(bw)}); CPU {cpu_model()}")
    for a, rs_ in rate.items():
        rows.append(row("matmul_rate", f"torch {a}", f"512x{cfg.hidden_size}x{cfg.intermediate_size}", "flops", "GFLOP/s",
                        [x / 1e9 for x in rs_]))
        print(f"torch {a} matmul [512 x {cfg.hidden_size}] x [{cfg.hidden_size} x {cfg.intermediate_size}]: "
              f"{statistics.median(rs_) / 1e9:.0f} GFLOP/s (median of {len(rs_)})")
    for b in batches:
        anchor = res.get((names[0], b))
        for n in names:
            rs = res[(n, b)]
            dec = [r["dec_tokens"] / r["t_dec"] for r in rs]
            pre = [r["prefill_tokens"] / r["t_pre"] for r in rs]
            params = f"B={b},tokens={args.tokens}"
            rows.append(row("decode", n, params, "tokens_per_s", "tok/s", dec))
            rows.append(row("prefill", n, params, "tokens_per_s", "tok/s", pre))
            line = f"B={b:3d} {n:10s} decode {statistics.median(dec):7.1f} tok/s  prefill {statistics.median(pre):7.1f} tok/s"
            if anchor:
                rd = [x / (a["dec_tokens"] / a["t_dec"]) for x, a in zip(dec, anchor)]
                rp = [x / (a["prefill_tokens"] / a["t_pre"]) for x, a in zip(pre, anchor)]
                rows.append(row("decode", n, params, f"vs_{names[0]}", "x", rd))
                rows.append(row("prefill", n, params, f"vs_{names[0]}", "x", rp))
                line += f"  ({statistics.median(rd):.2f}x / {statistics.median(rp):.2f}x {names[0]})"
                same = [x == y for x, y in zip(rs[0]["ids"], anchor[0]["ids"])]
                agree = []
                for x, y in zip(rs[0]["ids"], anchor[0]["ids"]):
                    k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                    agree.append(k / max(len(y), 1))
                line += (f"  greedy = {names[0]} on {sum(same)}/{len(same)} rows, {statistics.mean(agree):.0%} of tokens "
                         "before a change")
            if b == 1:
                floors = [gens[n].weight_info.read_bytes / x for x in bw]  # each repetition's own
                step = statistics.median([r["t_dec"] / r["dec_tokens"] for r in rs])
                # With drafts a pass reads the weights once for several tokens: the figure is per token.
                per = "token" if DRAFT in n else "step"
                ratio = [r["t_dec"] / r["dec_tokens"] / f for r, f in zip(rs, floors)]
                rows.append(row("decode", n, params, f"{per}_vs_read_floor", "x", ratio))
                line += (f"  {per} {step * 1e3:.1f} ms = {statistics.median(ratio):.2f}x the read floor "
                         f"(median of the repetitions' own; {statistics.median(floors) * 1e3:.1f} ms)")
            if b >= 16:  # batched: the linear layers' flops at the best matmul rate of the run
                floor = 2 * b * linear_params(gens[n].model) / statistics.median(rate[act[n]])
                step = statistics.median([r["t_dec"] / (r["dec_tokens"] / b) for r in rs])
                rows.append(row("decode", n, params, "step_vs_compute_floor", "x",
                                [r["t_dec"] / (r["dec_tokens"] / b) / floor for r in rs]))
                line += f"  step {step * 1e3:.1f} ms = {step / floor:.2f}x the compute floor ({floor * 1e3:.1f} ms)"
            print(line)
    print_table(rows, f"decode by weight precision ({args.model}; {cpu_model()})")
    print(f"rows -> {write_csv(rows, args.csv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

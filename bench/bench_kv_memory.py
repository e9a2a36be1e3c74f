"""HFGenerator's memory: growing KV buffers and the memory budget against the preallocating path.

Workload: the Search-R1 prompts of the first N bundled hotpotqa-dev questions, on a catalogued
model (default ``qwen2.5-coder-0.5b``; ``ragfast models get`` first), ``--turns`` turns of
``--max-new-tokens`` greedy tokens each, ended by the protocol's stop strings (``</search>``,
``</answer>``) or end of sequence; after every turn but the last, each session gets the
observation of a real search (BM25 over the questions' own context paragraphs, top 3, for the
query the session wrote, or its question when it wrote none; the protocol's ``<information>``
block cut at ``--obs-tokens``). Every session goes on to the next turn, so the batch stays full. Providers, each in a fresh process
(so each has its own peak resident size), round-robin over ``--reps`` repetitions:

* ``prealloc`` (anchor): ``HFGenerator(kv_step=0, memory_budget=None, prefill_tokens=0)``: every
  turn's batch cache sized for the longest possible turn and its prefill in one pass, the path
  before issue 40;
* ``grow``: the default buffers, grown by ``kv_step`` tokens as decoding goes, and a long
  prefill in row groups (``prefill_tokens``); no budget;
* ``budget``: ``grow`` under ``--memory-budget`` (default ``auto``), which may split a turn into
  smaller chunks.

Each process loads the model, runs a two-token warm-up (which faults the weights in), then
resets its resident high-water mark (``/proc/self/clear_refs``) and runs the workload.
Reported per provider: generated tokens per second (load excluded; per wall second and per
CPU second of the process, the better guide on a shared machine) and their ratios to
``prealloc`` (medians of the repetitions), the peak resident size during generation and of the
whole process (load included), the generator's own KV peak and the chunk sizes. The script
checks that the greedy text is identical across providers (fp32) and says so.

Run ``nice -n 15 python bench/bench_kv_memory.py`` (``--quick`` for a smoke run). Rows go to
bench/results/bench_kv_memory.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, print_table, row, write_csv  # noqa: E402

PROVIDERS = {"prealloc": {"kv_step": 0, "memory_budget": None, "prefill_tokens": 0}, "grow": {"memory_budget": None}, "budget": {}}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(args: argparse.Namespace) -> int:
    """One provider in this process: prints one JSON line with its measurements."""
    import torch

    from ragfast.data import corpus_from_contexts, load_qa
    from ragfast.models.catalogue import resolve
    from ragfast.models.generator import HFGenerator
    from ragfast.models.memory_budget import rss_peak_bytes
    from ragfast.protocol import STOP, build_prompt, format_observation, parse_action
    from ragfast.retrieval.bm25 import BM25Retriever

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    questions = load_qa("hotpotqa-dev")[:args.questions]
    kw = dict(PROVIDERS[args.child])
    kw.setdefault("memory_budget", args.memory_budget)
    path = resolve(args.model)
    gen = HFGenerator(path, dtype=args.dtype, max_batch=args.batch, **kw)
    gen.start(["warm"], ["warm up"])
    gen.generate(["warm"], stop=[], max_new_tokens=2)  # faults the weights in (they are memory-mapped)
    gen.end(["warm"])
    gen.forget_prefix()
    for k in gen.stats:
        gen.stats[k] = 0
    load_peak = rss_peak_bytes()
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from here
    base = _status("VmRSS")
    retriever = BM25Retriever.build(corpus_from_contexts(questions))
    sids = [q.id for q in questions]
    gen.start(sids, [gen.format_prompt(build_prompt(q.question)) for q in questions])
    produced, seconds, cpu, chunks, texts, lens = 0, 0.0, 0.0, [], [], []
    for turn in range(args.turns):
        t0, c0 = time.perf_counter(), time.process_time()
        out = gen.generate(sids, stop=STOP, max_new_tokens=args.max_new_tokens)
        seconds, cpu = seconds + time.perf_counter() - t0, cpu + time.process_time() - c0
        lens.append([len(gen.last_generated[s]) for s in sids])
        produced += sum(lens[-1])
        chunks.append(list(gen.last_chunks))
        texts.append(out)
        if turn + 1 < args.turns:
            # the query the session wrote, else (it answered or wrote none) its question: every session
            # goes on, so the batch stays full
            acts = [parse_action(t) for t in out]
            hits = retriever.search([a[1] if a[0] == "search" and a[1] else q.question
                                     for a, q in zip(acts, questions)], 3)
            obs = gen.truncate_tokens([format_observation(h) for h in hits], args.obs_tokens)
            gen.append(sids, obs)
    mem = gen.describe()["memory"]
    print(json.dumps({"provider": args.child, "tokens": produced, "seconds": seconds, "cpu_seconds": cpu,
                      "turn_tokens": lens, "rss_base": base,
                      "rss_peak_run": _status("VmHWM"), "rss_peak_load": load_peak, "kv_peak": mem["kv_peak_bytes"],
                      "planned_peak": mem["planned_peak_bytes"], "budget": mem["budget_bytes"],
                      "budget_note": mem["budget"], "chunks": chunks, "prefill_groups": mem["prefill_groups"], "context_tokens": max(
                          len(gen.session_tokens(s)) for s in sids),
                      "text_sha": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:16]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a catalogue name or a model directory")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--batch", type=int, default=None, help="max_batch (default: --questions)")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=500, help="new tokens per turn (the protocol's: 500)")
    ap.add_argument("--obs-tokens", type=int, default=500, help="observation cap in tokens (the protocol's: 500)")
    ap.add_argument("--memory-budget", default="auto", help="the budget provider's --memory-budget")
    ap.add_argument("--providers", default=",".join(PROVIDERS), help="comma-separated, of " + ", ".join(PROVIDERS))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (0 = torch's default); with 1, CPU seconds are compute seconds")
    ap.add_argument("--quick", action="store_true", help="2 questions, 1 turn of 4 tokens, 1 repetition")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_kv_memory.csv"))
    ap.add_argument("--child", choices=tuple(PROVIDERS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.questions, args.turns, args.max_new_tokens, args.reps = 2, 1, 4, 1
    args.batch = args.batch or args.questions
    if args.child:
        return child(args)
    providers = [p for p in args.providers.split(",") if p]
    bad = [p for p in providers if p not in PROVIDERS]
    if bad or "prealloc" not in providers:
        print(f"error: --providers must name prealloc (the anchor) and only {', '.join(PROVIDERS)}; got {bad or providers}",
              file=sys.stderr)
        return 2
    params = (f"{args.model},{args.dtype},N={args.questions},batch={args.batch},turns={args.turns},"
              f"max_new={args.max_new_tokens},obs={args.obs_tokens},threads={args.threads or 'default'}")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    print(f"{params}; CPU {cpu}, {os.cpu_count()} CPUs; load {os.getloadavg()}")
    runs: dict[str, list[dict]] = {p: [] for p in providers}
    me = [sys.executable, str(Path(__file__).resolve())]
    for rep in range(args.reps):
        for p in providers:
            cmd = me + ["--child", p, "--model", args.model, "--dtype", args.dtype, "--questions", str(args.questions),
                        "--batch", str(args.batch), "--turns", str(args.turns), "--max-new-tokens",
                        str(args.max_new_tokens), "--obs-tokens", str(args.obs_tokens), "--memory-budget",
                        args.memory_budget, "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"error: {p} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(done.stdout.strip().splitlines()[-1])
            runs[p].append(r)
            print(f"  rep {rep} {p}: {r['tokens'] / r['seconds']:.2f} tok/s, {r['tokens'] / r['cpu_seconds']:.2f} "
                  f"tok/CPU-s, RSS {r['rss_base'] / 1e9:.2f} -> "
                  f"{r['rss_peak_run'] / 1e9:.2f} GB (load peak {r['rss_peak_load'] / 1e9:.2f}), KV peak "
                  f"{r['kv_peak'] / 1e9:.3f} GB, chunks {r['chunks']}, prefill groups {r['prefill_groups']}, tokens {r['turn_tokens']}, budget {r['budget']} ({r['budget_note']}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    anchor = [r["tokens"] / r["seconds"] for r in runs["prealloc"]]
    anchor_cpu = [r["tokens"] / r["cpu_seconds"] for r in runs["prealloc"]]
    rows: list[Row] = []
    for p, rs in runs.items():
        rate = [r["tokens"] / r["seconds"] for r in rs]
        rate_cpu = [r["tokens"] / r["cpu_seconds"] for r in rs]
        rows += [row("kv_memory", p, params, "tokens_per_s", "tok/s", rate),
                 row("kv_memory", p, params, "ratio_to_prealloc", "x", [a / b for a, b in zip(rate, anchor)]),
                 row("kv_memory", p, params, "tokens_per_cpu_s", "tok/CPU-s", rate_cpu),
                 row("kv_memory", p, params, "cpu_ratio_to_prealloc", "x",
                     [a / b for a, b in zip(rate_cpu, anchor_cpu)]),
                 row("kv_memory", p, params, "rss_peak_generation", "GB", [r["rss_peak_run"] / 1e9 for r in rs]),
                 row("kv_memory", p, params, "rss_growth_generation", "GB",
                     [(r["rss_peak_run"] - r["rss_base"]) / 1e9 for r in rs]),
                 row("kv_memory", p, params, "rss_peak_process", "GB",
                     [max(r["rss_peak_run"], r["rss_peak_load"]) / 1e9 for r in rs]),
                 row("kv_memory", p, params, "kv_peak", "GB", [r["kv_peak"] / 1e9 for r in rs])]
    print_table(rows, title=f"HFGenerator KV memory ({args.model}, {args.dtype}, CPU)")
    same = len({r["text_sha"] for rs in runs.values() for r in rs}) == 1
    print(f"identical greedy text across providers and repetitions: {same}; load now {os.getloadavg()}; "
          f"csv: {write_csv(rows, args.csv)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

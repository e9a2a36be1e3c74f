"""Judge scoring, prefix-packed against naive, on a causal judge: a tiny random-weight Qwen2 by
default, or a real one (``--judge qwen2.5-coder-0.5b``, a catalogue name, or a judge directory
such as ``train-judge --kind causal``'s ``OUT/merged``).

Workload (issue 5): 64 trajectories, T = 4 states each, every turn adding one observation of
3 documents of about 150 tokens, and a system prompt of about 250 tokens. The naive path scores
every state as its own full prompt; the packed path scores each trajectory in one forward pass
(prefix/segment mask) on a system-prompt KV cache computed once.

Reported, from the ledger and from medians of interleaved repetitions in one process:
fresh tokens computed (naive / packed), analytic FLOPs (naive / packed), wall time
(naive / packed), and the largest score difference between the two paths. Targets: >= 2.5x
fewer tokens, >= 2x wall time on the CPU, scores equal within 1e-4. With the tiny judge the
scores mean nothing, only the compute path is measured.

    python bench/bench_judge.py [--quick] [--judge SPEC] [--attention ref|flex|triton] [--dtype fp32|bf16]
                                [--csv PATH]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from harness import print_table, row, write_csv  # noqa: E402


def build_states(tokenizer, n_traj: int, turns: int, docs_per_turn: int, doc_tokens: int, seed: int = 0):
    """Trajectories over real HotpotQA paragraphs, each document cut to about ``doc_tokens`` tokens."""
    from ragfast.data import load_qa, sample
    from ragfast.types import State

    qs = load_qa(sample("hotpotqa-train"))
    paras = []
    for q in qs:
        ctx = q.metadata["context"]
        for t, s in zip(ctx["title"], ctx["sentences"]):
            paras.append((t, "".join(s).strip()))
    rng = np.random.default_rng(seed)

    def doc(i: int, title: str, text: str) -> str:
        words = text.split()
        while len(words) < 400:  # short paragraphs are padded with more of the corpus
            words += paras[int(rng.integers(len(paras)))][1].split()
        lo, hi = 20, len(words)
        while lo < hi:  # longest word prefix within the token budget
            mid = (lo + hi + 1) // 2
            if len(tokenizer(f'Doc {i}(Title: "{title}") ' + " ".join(words[:mid]), add_special_tokens=False)["input_ids"]) <= doc_tokens:
                lo = mid
            else:
                hi = mid - 1
        return f'Doc {i}(Title: "{title}") ' + " ".join(words[:lo])

    states = []
    for t in range(n_traj):
        q = qs[t % len(qs)]
        ev = []
        for turn in range(turns):
            picks = rng.choice(len(paras), size=docs_per_turn, replace=False)
            body = "\n".join(doc(i + 1, *paras[p]) for i, p in enumerate(picks))
            ev.append(f"\n\n<information>{body}</information>\n\n")
            states.append(State(q.question, list(ev), trajectory_id=f"{q.id}-{t}", index=turn + 1))
    order = rng.permutation(len(states))  # trajectories arrive interleaved
    return [states[i] for i in order]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 trajectories, 3 repetitions")
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention", default="ref", choices=["ref", "flex", "triton"])
    ap.add_argument("--judge", default="tiny", help="tiny (random weights) | a catalogue name | a causal-LM "
                                                    "judge directory")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                    help="judge weights and compute (bf16: the scores of the two paths round apart)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "bench_judge.csv"))
    args = ap.parse_args()
    if args.quick:
        args.trajectories, args.reps = 16, 3

    import torch

    from ragfast.accounting.ledger import CostLedger
    from ragfast.judges.causal import CausalJudge
    from ragfast.models.hub import local_model
    from ragfast.models.tiny import tiny_path

    if args.threads:
        torch.set_num_threads(args.threads)
    path = tiny_path("qwen2") if args.judge == "tiny" else local_model(args.judge, "--judge")
    judge = CausalJudge(path, attention=args.attention, dtype=args.dtype)
    states = build_states(judge.tokenizer, args.trajectories, args.turns, 3, 150)
    S = len(judge._sys_ids)
    lens = [len(judge.prompt_ids(s)) for s in states]
    print(f"judge: {judge.describe()['name']}" + (" (random weights: scores are meaningless; compute path only)"
                                                  if args.judge == "tiny" else ""))
    print(f"{args.trajectories} trajectories x {args.turns} states = {len(states)} states; system prompt {S} tokens; "
          f"state prompts {min(lens)}..{max(lens)} tokens; attention={args.attention}; torch threads "
          f"{torch.get_num_threads()}; {args.dtype}")

    # Warm-up: also computes the system-prompt KV once (the packed path's only one-off cost).
    led_first = CostLedger()
    judge.stop_scores(states[:8], ledger=led_first)
    judge.stop_scores(states[:8], packed=False)

    t_naive, t_packed = [], []
    led_n, led_p = CostLedger(), CostLedger()
    diff = 0.0
    for r in range(args.reps):
        # Interleaved, so that load from other processes hits both paths alike.
        ln, lp = CostLedger(), CostLedger()
        t0 = time.perf_counter()
        sn = judge.stop_scores(states, packed=False, ledger=ln)
        t_naive.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sp = judge.stop_scores(states, ledger=lp)
        t_packed.append(time.perf_counter() - t0)
        diff = max(diff, float(np.abs(sn - sp).max()))
        if r == 0:
            led_n, led_p = ln, lp
    n, p = led_n.totals()["judge"], led_p.totals()["judge"]
    tok_ratio = n["input_tokens"] / p["input_tokens"]
    tok_ratio_total = (n["input_tokens"] + n["cached_tokens"]) / (p["input_tokens"] + p["cached_tokens"])
    flop_ratio = n["flops"] / p["flops"]
    wall = np.asarray(t_naive) / np.asarray(t_packed)
    params = (f"judge={args.judge},traj={args.trajectories},T={args.turns},docs/turn=3,doc_tok~150,sys={S},"
              f"attn={args.attention},dtype={args.dtype}")
    rows = [
        row("judge_score", "naive", params, "seconds", "s", t_naive),
        row("judge_score", "packed", params, "seconds", "s", t_packed),
        row("judge_score", "packed", params, "wall_speedup_vs_naive", "x", wall),
        row("judge_score", "packed", params, "fresh_tokens_ratio_vs_naive", "x", [tok_ratio]),
        row("judge_score", "packed", params, "flops_ratio_vs_naive", "x", [flop_ratio]),
        row("judge_score", "naive", params, "fresh_tokens", "tokens", [n["input_tokens"]]),
        row("judge_score", "packed", params, "fresh_tokens", "tokens", [p["input_tokens"]]),
        row("judge_score", "packed", params, "cached_tokens", "tokens", [p["cached_tokens"]]),
        row("judge_score", "packed", params, "max_abs_score_diff_vs_naive", "logit", [diff]),
    ]
    print_table(rows, "judge scoring: packed vs naive")
    write_csv(rows, args.csv)
    print(f"fresh tokens: naive {int(n['input_tokens'])} / packed {int(p['input_tokens'])} = {tok_ratio:.2f}x "
          f"(target >= 2.5x); counting the cached system prompt too: {tok_ratio_total:.2f}x")
    print(f"FLOPs (ledger, analytic): {n['flops'] / 1e9:.3f} / {p['flops'] / 1e9:.3f} GFLOP = {flop_ratio:.2f}x")
    print(f"wall: naive {np.median(t_naive):.3f} s, packed {np.median(t_packed):.3f} s, median ratio "
          f"{np.median(wall):.2f}x (target >= 2x on CPU; {args.reps} interleaved reps)")
    print(f"max |packed - naive| score difference: {diff:.2e}; the one-off system prefill ({S} tokens) was paid "
          f"in the warm-up call ({int(led_first.totals()['judge']['input_tokens'])} fresh tokens for 8 states)")
    print(f"csv: {args.csv}")


if __name__ == "__main__":
    main()

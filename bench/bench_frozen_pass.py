"""The LoRA trainers' one pass over the frozen lower layers: shared prefixes once, on ragfast's
kernels, against one example at a time on the model's own modules.

``train-judge --kind causal --top-layers K`` (and ``train-reasoner``) run the decoder's frozen
layers once per example before the first step (python/ragfast/models/frozen_layers.py). A judge's
examples are a question's nested states: one system prompt, one question, documents added turn by
turn, and a short end. Three ways to compute every example's hidden state entering the first
adapted layer, in one process, round-robin ``--reps`` times:

* ``one-at-a-time`` (the anchor, the pass before prefix sharing): each example alone, from its
  first token, on the model's own modules (SDPA, torch's norms and MLPs);
* ``shared``: the examples in prefix order, each running only the tokens it does not share with
  the one before (on that one's key/value cache), on the model's own modules;
* ``shared+kernels``: the same on ragfast's fused norms, SiLU gate and prefill attention (the
  default in training).

Examples: ``--labels FILE`` (a ``ragfast label-states`` output: the real training examples of
``train-judge --label-source gold``), else nested states built over the bundled HotpotQA train
paragraphs as bench/bench_judge.py builds them. Reported: tokens run, median wall time, the
ratio to the anchor, and the largest relative difference of the states from the anchor's.

    python bench/bench_frozen_pass.py [--base qwen2.5-coder-0.5b] [--top-layers 4] [--labels FILE]
                                      [--limit 60] [--reps 3] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.bench_decode_weights import cpu_model  # noqa: E402
from bench.bench_judge import build_states  # noqa: E402
from bench.harness import print_table, row, write_csv  # noqa: E402


def examples(judge, labels: str | None, limit: int) -> list[list[int]]:
    """Token ids of the examples: the gold-labelled states' training examples, or built states'
    prompts with a short verdict after them."""
    if labels:
        from ragfast.judges.train.causal import sft_examples
        from ragfast.judges.train.labelled import load_labelled_states

        return [e["input_ids"] for e in sft_examples(judge, load_labelled_states(labels), "gold", 8192)][:limit]
    tail = judge.tokenizer(' true, "gap_items": []}', add_special_tokens=False)["input_ids"]
    states = build_states(judge.tokenizer, max(1, limit // 4), 4, 3, 150)[:limit]
    return [judge.prompt_ids(s) + tail for s in states]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="qwen2.5-coder-0.5b", help="a catalogue name or a causal-LM directory")
    ap.add_argument("--top-layers", type=int, default=4, help="adapted layers; the ones below are the frozen pass")
    ap.add_argument("--labels", default=None, help="labelled_states.jsonl (default: built nested states)")
    ap.add_argument("--limit", type=int, default=60, help="examples")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "bench_frozen_pass.csv"))
    args = ap.parse_args()

    import torch

    from ragfast.judges.causal import CausalJudge
    from ragfast.models.frozen_layers import frozen_inputs, tokens_run
    from ragfast.models.hub import local_model

    torch.set_num_threads(args.threads)
    judge = CausalJudge(local_model(args.base, "--base"), dtype="bf16")  # as train-judge --bf16 holds it
    decoder = judge.model.get_decoder()
    first = int(judge.model.config.num_hidden_layers) - args.top_layers
    ex = examples(judge, args.labels, args.limit)
    total, fresh = sum(map(len, ex)), tokens_run(ex)
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731 (train-judge's context)
    ways = {
        "one-at-a-time": lambda: [frozen_inputs(decoder, first, [e], context=autocast, kernels=False)[0] for e in ex],
        "shared": lambda: frozen_inputs(decoder, first, ex, context=autocast, kernels=False),
        "shared+kernels": lambda: frozen_inputs(decoder, first, ex, context=autocast),
    }
    tokens = {"one-at-a-time": total, "shared": fresh, "shared+kernels": fresh}
    times: dict[str, list[float]] = {k: [] for k in ways}
    states: dict[str, list] = {}
    print(f"{len(ex)} examples, {total:,} tokens ({fresh:,} not shared with the example before in prefix order); "
          f"{first} frozen layers of {args.base}; CPU {cpu_model()}, {args.threads} threads", flush=True)
    for rep in range(args.reps):
        for name, fn in (list(ways.items()) if rep % 2 == 0 else list(reversed(ways.items()))):
            t0 = time.perf_counter()
            states[name] = fn()
            times[name].append(time.perf_counter() - t0)
            print(f"  rep {rep + 1}: {name} {times[name][-1]:.1f} s", flush=True)
    anchor = statistics.median(times["one-at-a-time"])
    rows, table = [], []
    for name in ways:
        med = statistics.median(times[name])
        diff = max(float((b.float() - a.float()).norm() / a.float().norm())
                   for a, b in zip(states["one-at-a-time"], states[name]))
        params = f"{args.base},first={first},examples={len(ex)}"
        rows.append(row("frozen_pass", name, params, "seconds", "s", times[name]))
        table.append([name, f"{tokens[name]:,}", f"{med:.1f}", f"{anchor / med:.2f}x", f"{diff:.2e}"])
    print_table(rows, title="frozen pass")
    print(f"{'way':<16} {'tokens run':>11} {'median s':>9} {'vs one-at-a-time':>17} {'max rel diff':>13}")
    for t in table:
        print(f"{t[0]:<16} {t[1]:>11} {t[2]:>9} {t[3]:>17} {t[4]:>13}")
    write_csv(rows, args.csv)


if __name__ == "__main__":
    main()

"""Search-R1 loop benchmark: batched vs question-at-a-time, KV reuse vs full re-encoding.

Workload: the tiny random-weight Qwen2 (``ragfast.models.tiny``) as the reasoner, BM25 over the
questions' own HotpotQA contexts as the retriever, the first N questions of the bundled
hotpotqa-dev sample, the reference loop (4 search turns + the final one, top-3). Providers, all
in this process on the same model and questions:

* ``one-at-a-time`` (anchor): the loop run with batch_size=1 (every generation and retrieval
  call covers one question), KV reuse on;
* ``batched``: batch_size=N, one batched generator call and one batched retrieval call per
  turn, KV reuse on;
* ``batched-reencode``: batched, but every turn re-encodes each whole session
  (``HFGenerator(kv_reuse=False)``), the baseline of the KV-reuse ratio.

Reported: questions/s of each (median of the repetitions) and its ratio to the anchor
(target >= 4x at N=64), and the input tokens computed with KV reuse vs with re-encoding (the
ledger's fresh input tokens; deterministic, one run suffices). The three providers must produce
the same trajectories; the script checks that and says so.

The weights are random, so the model never writes a valid tag: every turn is an invalid action
and the context grows by the invalid-action observation, no retrieval happens. The numbers
measure the loop and reasoner compute path, not a trained model's behaviour.

Run ``python bench/bench_searchr1.py`` (``--quick`` for a small smoke run). Rows go to
bench/results/bench_searchr1.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Row, print_table, row, write_csv  # noqa: E402


def _trajectory_key(trajs):
    return [(t.id, [(x.generated, x.action) for x in t.turns], t.answer) for t in trajs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    ap.add_argument("--questions", type=int, default=None, help="questions (default 64; 16 with --quick)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="new tokens per turn (default 32; 12 with --quick); the reference uses 500")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per provider (default 3; 1 with --quick)")
    ap.add_argument("--device", default="cpu")
    # One thread by default on the CPU: on a shared 2-core box a tiny 3x64 @ 64x128 linear took
    # 20 ms with two OpenMP threads spinning against each other and 0.1 ms with one.
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_searchr1.csv"))
    args = ap.parse_args(argv)

    import torch

    from ragfast.cost import CostLedger
    from ragfast.data import corpus_from_contexts, load_qa
    from ragfast.models.generator import HFGenerator
    from ragfast.models.tiny import tiny_path
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.retrieval.bm25 import BM25Retriever

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    n = args.questions or (16 if args.quick else 64)
    max_new = args.max_new_tokens or (12 if args.quick else 32)
    reps = args.reps or (1 if args.quick else 3)
    questions = load_qa("hotpotqa-dev")[:n]
    retriever = BM25Retriever.build(corpus_from_contexts(questions))
    model = tiny_path("qwen2")
    params = f"N={n},max_new={max_new},turns=4+1,topk=3,threads={torch.get_num_threads()}"
    print(f"reasoner: tiny random-weight Qwen2 ({model}): answers NOT meaningful; retriever: BM25 over the "
          f"contexts of {n} hotpotqa-dev questions; {params}")

    def run_once(batch: int, kv_reuse: bool):
        gen = HFGenerator(model, device=args.device, max_batch=batch, kv_reuse=kv_reuse)
        led = CostLedger()
        cfg = SearchR1Config(max_new_tokens=max_new, batch_size=batch)
        loop = SearchR1Loop(gen, retriever, cfg, ledger=led)
        t0 = time.perf_counter()
        trajs = loop.run(questions)
        return time.perf_counter() - t0, trajs, led

    providers = {"one-at-a-time": (1, True), "batched": (n, True), "batched-reencode": (n, False)}
    run_once(n, True)  # warm-up: first-call allocations and lazy imports out of the timings
    secs: dict[str, list[float]] = {k: [] for k in providers}
    keys, ledgers = {}, {}
    # Alternate providers inside each repetition so slow drifts of a shared machine hit all alike.
    for _ in range(reps):
        for name, (batch, reuse) in providers.items():
            s, trajs, led = run_once(batch, reuse)
            secs[name].append(s)
            keys[name], ledgers[name] = _trajectory_key(trajs), led
    same = keys["one-at-a-time"] == keys["batched"] == keys["batched-reencode"]
    print(f"identical trajectories across providers: {same}")

    rows: list[Row] = []
    anchor = statistics.median(secs["one-at-a-time"])
    for name in providers:
        qps = [n / s for s in secs[name]]
        rows.append(row("searchr1", name, params, "questions_per_s", "q/s", qps))
        rows.append(row("searchr1", name, params, "speedup_vs_one_at_a_time", "x",
                        [anchor / s for s in secs[name]]))
    tok = {k: ledgers[k].totals()["reasoner"] for k in ("batched", "batched-reencode")}
    reuse_in, full_in = tok["batched"]["input_tokens"], tok["batched-reencode"]["input_tokens"]
    rows.append(row("searchr1", "batched", params, "input_tokens_computed", "tokens", [reuse_in]))
    rows.append(row("searchr1", "batched-reencode", params, "input_tokens_computed", "tokens", [full_in]))
    rows.append(row("searchr1", "batched", params, "reencode_over_kv_reuse_input_tokens", "x", [full_in / reuse_in]))
    rows.append(row("searchr1", "batched", params, "reencode_over_kv_reuse_flops", "x",
                    [tok["batched-reencode"]["flops"] / tok["batched"]["flops"]]))
    print_table(rows, title="Search-R1 loop (tiny random-weight Qwen2; answers not meaningful)")
    path = write_csv(rows, args.csv)
    speed = statistics.median(anchor / s for s in secs["batched"])
    print(f"batched vs one-at-a-time: {speed:.2f}x questions/s (target >= 4x at N=64); "
          f"input tokens computed, re-encoding / KV reuse: {full_in / reuse_in:.2f}x "
          f"({full_in} vs {reuse_in}); trajectories identical: {same}; csv: {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

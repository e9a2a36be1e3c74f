"""ragfast's tiny NLI cross-encoder on the CPU: torch vs ONNX Runtime, round-robin medians.

The bench's StepGap uses it on (evidence, claim) pairs; this times one ``score`` call over
real HotpotQA context paragraphs paired with questions, alternating backends so that load
from other processes hits both alike.

    python bench/bench_nli_backends.py --reps 5 --pairs 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=64)
    args = ap.parse_args()

    from ragfast.data import load_qa
    from ragfast.models.nli import NLIScorer
    from ragfast.models.tiny import tiny_path

    qs = load_qa("hotpotqa-dev")[: args.pairs]
    prem = ["".join(q.metadata["context"]["sentences"][0]) for q in qs]
    hyp = [q.question for q in qs]
    path = tiny_path("deberta-v2")
    t0 = time.perf_counter()
    scorers = {"torch": NLIScorer(path, backend="torch"), "onnx": NLIScorer(path, backend="onnx")}
    setup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {k: [] for k in scorers}
    for _ in range(args.reps):
        for name, sc in scorers.items():
            s = time.perf_counter()
            sc.score(prem, hyp)
            times[name].append(time.perf_counter() - s)
    mt, mo = statistics.median(times["torch"]), statistics.median(times["onnx"])
    print(json.dumps({"load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "pairs": len(prem),
                      "setup_s_both": setup_s, "torch_median_s": mt, "onnx_median_s": mo,
                      "onnx_speedup_vs_torch": mt / mo}, indent=1))


if __name__ == "__main__":
    main()

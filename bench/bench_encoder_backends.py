"""MiniLM on the CPU: torch vs ONNX Runtime, for queries (short) and passages (long).

Round-robin timing (torch, onnx, torch, onnx, ...) so that load from other processes hits both
alike; the result is the median ratio, not absolute seconds. The one-off ONNX export is timed
separately: it is paid once per machine (cached under ``$RAGFAST_CACHE/onnx``).

    python bench/bench_encoder_backends.py --reps 5 --passages 256 --queries 64
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--passages", type=int, default=256)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    from ragfast.data import load_corpus, load_qa
    from ragfast.encoders.encoder import Encoder

    corpus = load_corpus("wiki-sample")
    passages = corpus.contents(range(min(args.passages, len(corpus))))
    queries = [q.question for q in load_qa("hotpotqa-dev")[: args.queries]]
    torch_enc = Encoder("minilm", batch_size=args.batch_size)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        onnx_enc = Encoder("minilm", batch_size=args.batch_size, backend="onnx", onnx_path=os.path.join(tmp, "m"))
        export_s = time.perf_counter() - t0
        times: dict[str, dict[str, list[float]]] = {k: {"torch": [], "onnx": []} for k in ("queries", "passages")}
        for _ in range(args.reps):
            for kind, texts in (("queries", queries), ("passages", passages)):
                for name, enc in (("torch", torch_enc), ("onnx", onnx_enc)):
                    s = time.perf_counter()
                    enc.encode(texts, kind="query" if kind == "queries" else "passage")
                    times[kind][name].append(time.perf_counter() - s)
    out = {"load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count(), "onnx_export_and_load_s": export_s}
    for kind, d in times.items():
        mt, mo = statistics.median(d["torch"]), statistics.median(d["onnx"])
        out[kind] = {"n": len(queries) if kind == "queries" else len(passages), "torch_median_s": mt,
                     "onnx_median_s": mo, "onnx_speedup_vs_torch": mt / mo}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""NLI scoring benchmark: length bucketing, ONNX Runtime, dynamic int8.

Workload: (premise, hypothesis) pairs built from the bundled HotpotQA dev contexts, shaped like
StepGap's traffic. Premises are a single context sentence (a stage-D quote), a paragraph (a
stage-E document) or three paragraphs (a whole observation), mixed 50/35/15, so the lengths
are long-tailed; hypotheses are supporting-fact sentences or "The answer to <question> is
<answer>." claims. The model is a random-weight DeBERTa-v2 with deberta-v3-xsmall's shape
(12 layers, hidden 384, 6 heads, FFN 1536, relative attention with p2c+c2p), built from its
config with the MiniLM WordPiece vocabulary: the compute is a real checkpoint's, the labels
mean nothing.

Providers, all in this process on the same model and pairs:

1. ``naive`` (anchor) vs ``bucketed``: :class:`ragfast.models.NLIScorer` in torch eager, input
   order in fixed batches of 32 padded to their longest pair, against length-sorted batches cut
   by a token budget. Reported: pairs/s of each, the ratio (target >= 2x), and the padding
   share of each.
2. ``torch`` (anchor) vs ``onnxruntime``: one 16 x 128-token batch, the exported model in ONNX
   Runtime against the same forward in torch eager (target >= 1.5x).
3. ``onnxruntime-int8``: the export after ``onnxruntime.quantization.quantize_dynamic`` on the
   same 16 x 128 batch (speed ratio against fp32 ONNX Runtime), and its label agreement
   (argmax) with fp32 over the benchmark pairs. With random weights the agreement only says
   how much int8 rounding moves the logits relative to their spread; a trained checkpoint's
   agreement must be measured on it.

Torch and ONNX Runtime get the same thread count (``--threads``). Every ratio is a median over
repetitions measured in this run. Rows go to bench/results/bench_nli.csv in the harness schema.

Run ``python bench/bench_nli.py`` (``--quick`` for a small smoke run).

Measured on the shared 2-core CPU box (load 2-20 from other jobs; ratios are medians of
interleaved repetitions):

- ``--pairs 128 --reps 3`` (1 thread): bucketed 4.97x naive pairs/s, padding 72.1% -> 12.2%;
  ONNX Runtime 1.23x torch at 16x128 (max |logit diff| 1.0e-7); int8 1.72x fp32 ORT, 96.1%
  label agreement.
- ``--pairs 32 --reps 5 --threads 2``: bucketed 2.53x (padding 71.6% -> 9.6%); ONNX Runtime
  2.85x torch; int8 1.54x, 100% agreement.
- ``--quick`` (48 pairs, 1 thread, load ~20): 2.48x, 1.57x, 1.80x / 95.8%.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import print_table, row, time_fn, write_csv  # noqa: E402

XSMALL = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
              max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=-1,
              pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True, position_biased_input=False,
              type_vocab_size=0, hidden_act="gelu")


def build_model(out: Path, seed: int = 0) -> Path:
    """A random-weight DeBERTa-v2 NLI classifier of deberta-v3-xsmall's shape, saved to ``out``."""
    import torch
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    from ragfast.models.tiny import tiny_path

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(str(tiny_path("deberta-v2")))
    labels = {0: "contradiction", 1: "entailment", 2: "neutral"}
    cfg = DebertaV2Config(vocab_size=len(tok), num_labels=3, id2label=labels,
                          label2id={v: k for k, v in labels.items()}, pad_token_id=tok.pad_token_id, **XSMALL)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DebertaV2ForSequenceClassification(cfg).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "ragfast_tiny.json").write_text(json.dumps(
        {"kind": "deberta-v2 (xsmall shape)", "seed": seed, "random_weights": True,
         "note": "random weights: exercises the compute path only; outputs are meaningless"}))
    return out


def hotpot_pairs(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """StepGap-shaped NLI pairs from the bundled HotpotQA dev contexts (long-tailed lengths)."""
    from ragfast.data import load_qa, sample

    rng = random.Random(seed)
    qs = load_qa(sample("hotpotqa-dev"))
    paras, sents, claims = [], [], []
    for q in qs:
        ctx = q.metadata["context"]
        for title, ss in zip(ctx["title"], ctx["sentences"]):
            paras.append(f"{title}: {''.join(ss).strip()}")
            sents.extend(s.strip() for s in ss if len(s.split()) >= 4)
        sf = q.metadata.get("supporting_facts") or {}
        for t, i in zip(sf.get("title", []), sf.get("sent_id", [])):
            for title, ss in zip(ctx["title"], ctx["sentences"]):
                if title == t and i < len(ss):
                    claims.append(ss[i].strip())
        claims.append(f"The answer to \"{q.question.strip()}\" is {q.golden_answers[0]}.")
    prem, hyp = [], []
    for _ in range(n):
        u = rng.random()
        if u < 0.50:
            prem.append(rng.choice(sents))
        elif u < 0.85:
            prem.append(rng.choice(paras))
        else:
            prem.append(" ".join(rng.sample(paras, 3)))
        hyp.append(rng.choice(claims))
    return prem, hyp


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    ap.add_argument("--pairs", type=int, default=None, help="benchmark pairs (default 256; 48 with --quick)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per provider (default 3; 2 with --quick)")
    # One thread by default: on the shared 2-core box two spinning OpenMP threads per runtime spent
    # more time in the kernel than in the matmuls (first --quick run: 3m19s user, 1m53s sys).
    ap.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime intra-op threads")
    ap.add_argument("--token-budget", type=int, default=8192, help="bucketed batches: padded tokens per batch")
    ap.add_argument("--naive-batch", type=int, default=32, help="naive batches: pairs per batch")
    ap.add_argument("--model-dir", default=None, help="NLI model directory (default: build the random xsmall shape)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_nli.csv"))
    args = ap.parse_args(argv)
    n = args.pairs or (48 if args.quick else 256)
    reps = args.reps or (2 if args.quick else 3)

    import torch

    from ragfast.encoders.export import export_onnx, ort_session, quantize_int8
    from ragfast.models.nli import NLIScorer

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_nli_"))
    model_dir = Path(args.model_dir) if args.model_dir else build_model(work / "xsmall")
    prem, hyp = hotpot_pairs(n)
    rows = []

    # 1. bucketed vs naive, torch eager -------------------------------------------------------
    scorer = NLIScorer(model_dir, backend="torch", max_length=512, token_budget=args.token_budget)
    print(f"NLI slot: {scorer.name}  meaningful: {'yes' if scorer.meaningful else 'NO (random weights)'}")
    lens = np.array([len(x) for x in scorer.tokenize(prem, hyp)["input_ids"]])
    print(f"{n} pairs, tokens per pair: median {np.median(lens):.0f}, p90 {np.percentile(lens, 90):.0f}, "
          f"max {lens.max()}", flush=True)
    stats = {}
    samples = {"naive": [], "bucketed": []}
    # Interleave the two providers so load changes on the shared machine hit both alike.
    scorer.score(prem[:16], hyp[:16])
    for _ in range(reps):
        for strat in ("naive", "bucketed"):
            t0 = time.perf_counter()
            p = scorer.score(prem, hyp, strategy=strat, batch_size=args.naive_batch)
            samples[strat].append(n / (time.perf_counter() - t0))
            stats[strat] = dict(scorer.last_stats)
            if strat == "naive":
                ref = p
            else:
                assert np.abs(p - ref).max() < 1e-4, "bucketed scores differ from naive ones"
    params = f"pairs={n} threads={args.threads} budget={args.token_budget} naive_batch={args.naive_batch}"
    for strat in ("naive", "bucketed"):
        rows.append(row("nli_batching", f"torch-{strat}", params, "pairs_per_s", "pairs/s", samples[strat]))
        rows.append(row("nli_batching", f"torch-{strat}", params, "padding_share", "fraction",
                        [stats[strat]["padding_share"]]))
    ratio_b = [b / a for a, b in zip(samples["naive"], samples["bucketed"])]
    print(f"[1/3] bucketed/naive {np.median(ratio_b):.2f}x", flush=True)
    rows.append(row("nli_batching", "bucketed/naive", params, "speedup", "x", ratio_b))

    # 2. ONNX Runtime vs torch eager at 16 x 128 ------------------------------------------------
    onnx_file = export_onnx(model_dir, work / "onnx", max_length=512)
    sess = ort_session(onnx_file, threads=args.threads, providers=["CPUExecutionProvider"])
    g = np.random.default_rng(0)
    ids = g.integers(1000, scorer.config.vocab_size, size=(16, 128), dtype=np.int64)
    mask = np.ones_like(ids)
    feed = {"input_ids": ids, "attention_mask": mask}
    model = scorer._model
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)

    def run_torch():
        with torch.inference_mode():
            return model(input_ids=tids, attention_mask=tmask).logits

    def run_ort():
        return sess.run(None, feed)[0]

    with torch.inference_mode():
        diff = float(np.abs(run_ort() - run_torch().numpy()).max())
    t_torch, t_ort = [], []
    for _ in range(reps):
        t_torch.extend(time_fn(run_torch, reps=1, warmup=1 if not t_torch else 0))
        t_ort.extend(time_fn(run_ort, reps=1, warmup=1 if not t_ort else 0))
    p2 = f"batch=16 seq=128 threads={args.threads}"
    rows.append(row("nli_forward", "torch-eager", p2, "seconds", "s", t_torch))
    rows.append(row("nli_forward", "onnxruntime-fp32", p2, "seconds", "s", t_ort))
    rows.append(row("nli_forward", "onnxruntime/torch", p2, "speedup", "x", [a / b for a, b in zip(t_torch, t_ort)]))
    rows.append(row("nli_forward", "onnxruntime-fp32", p2, "max_abs_diff_vs_torch", "logit", [diff]))
    print(f"[2/3] onnxruntime/torch {np.median(t_torch) / np.median(t_ort):.2f}x", flush=True)

    # 3. dynamic int8 ---------------------------------------------------------------------------
    q_file = quantize_int8(onnx_file, work / "int8")
    sess8 = ort_session(q_file, threads=args.threads, providers=["CPUExecutionProvider"])
    t_ort2, t_int8 = [], []
    for _ in range(reps):
        t_ort2.extend(time_fn(run_ort, reps=1, warmup=0))
        t_int8.extend(time_fn(lambda: sess8.run(None, feed)[0], reps=1, warmup=1 if not t_int8 else 0))
    rows.append(row("nli_forward", "onnxruntime-int8", p2, "seconds", "s", t_int8))
    rows.append(row("nli_forward", "int8/fp32-onnxruntime", p2, "speedup", "x", [a / b for a, b in zip(t_ort2, t_int8)]))
    s32 = NLIScorer(work / "onnx", backend="onnx", max_length=512, token_budget=args.token_budget, threads=args.threads)
    s8 = NLIScorer(work / "int8", backend="onnx", max_length=512, token_budget=args.token_budget, threads=args.threads)
    p32, p8 = s32.score(prem, hyp), s8.score(prem, hyp)
    agree = float((p32.argmax(1) == p8.argmax(1)).mean())
    rows.append(row("nli_int8", "onnxruntime-int8", f"pairs={n}", "label_agreement_vs_fp32", "fraction", [agree]))
    rows.append(row("nli_int8", "onnxruntime-int8", f"pairs={n}", "max_abs_prob_diff_vs_fp32", "prob",
                    [float(np.abs(p32 - p8).max())]))
    spread = float(np.std(p32, axis=0).mean())
    rows.append(row("nli_int8", "onnxruntime-fp32", f"pairs={n}", "prob_std_across_pairs", "prob", [spread]))

    write_csv(rows, args.csv)
    print_table(rows, title="bench_nli")
    med = lambda xs: float(np.median(xs))  # noqa: E731
    print(f"bucketed vs naive (torch eager): {med(ratio_b):.2f}x pairs/s (target >= 2x); padding share "
          f"{stats['naive']['padding_share']:.1%} -> {stats['bucketed']['padding_share']:.1%}")
    print(f"onnxruntime vs torch eager at 16x128: {med(t_torch) / med(t_ort):.2f}x (target >= 1.5x); "
          f"max |logit diff| {diff:.2e}")
    print(f"int8 vs fp32 onnxruntime: {med(t_ort2) / med(t_int8):.2f}x; label agreement {agree:.1%} over {n} pairs "
          f"(random weights: see the docstring)")
    print(f"rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

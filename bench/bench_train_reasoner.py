"""train-reasoner step time: fp32 against bf16 autocast (oneDNN AMX where the CPU has it), and LoRA depth.

Each variant trains the same examples from the same LoRA initialisation for ``--steps`` steps;
variants run round-robin, ``--reps`` times, so load drifts hit them alike. Prints, per
variant, the median seconds per step, its ratio to the fp32/all-layers anchor of the same run,
and the mean loss of its steps (same data and init, so a precision that hurts shows up there),
with the CPU model and the load.

Usage::

    python bench/bench_train_reasoner.py --data OUT/data.jsonl [--examples 8] [--steps 2] [--reps 2]
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="train-reasoner's OUT/data.jsonl")
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--top-layers", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the rows as JSON here")
    a = ap.parse_args()

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragfast.models.lora_sft import lora_sft
    from ragfast.models.catalogue import is_catalogued, resolve

    torch.set_num_threads(a.threads)
    base = resolve(a.base) if is_catalogued(a.base) else Path(a.base)
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    ex = [json.loads(x) for x in Path(a.data).read_text().splitlines()[:a.examples]]
    variants = {"fp32 all layers": (False, None), "bf16 all layers": (True, None),
                f"fp32 top {a.top_layers}": (False, a.top_layers), f"bf16 top {a.top_layers}": (True, a.top_layers)}
    rows: dict[str, dict[str, list[float]]] = {k: {"sec": [], "loss": []} for k in variants}
    for _ in range(a.reps):
        for name, (bf16, top) in variants.items():
            model = AutoModelForCausalLM.from_pretrained(str(base), local_files_only=True, dtype=torch.float32)
            with tempfile.TemporaryDirectory() as d:
                run = lora_sft(model, ex, d, pad_id=tok.pad_token_id or 0, identity={}, epochs=1, lr=3e-4, r=16,
                               batch_size=a.batch_size, micro_batch=1, max_steps=a.steps, dropout=0.0,
                               save_every=10**6, bf16=bf16, top_layers=top, log=lambda m: None)
            rows[name]["sec"] += run.step_seconds
            rows[name]["loss"] += run.losses
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    anchor = float(np.median(rows["fp32 all layers"]["sec"]))
    tokens = sum(len(e["input_ids"]) for e in ex[:a.batch_size])
    print(f"CPU: {cpu}; threads {a.threads}; load {os.getloadavg()}; {a.batch_size} examples/step, "
          f"{tokens} tokens in the first step")
    out = []
    for name, r in rows.items():
        med = float(np.median(r["sec"]))
        out.append({"variant": name, "median_s_per_step": round(med, 2), "ratio_to_fp32_all": round(anchor / med, 3),
                    "mean_loss": round(float(np.mean(r["loss"])), 4), "steps": len(r["sec"])})
        print(f"{name:>18}: {med:7.2f} s/step  speed x{anchor / med:5.2f}  mean loss {np.mean(r['loss']):.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"cpu": cpu, "load": os.getloadavg(), "time": time.time(), "rows": out},
                                          indent=2))


if __name__ == "__main__":
    main()

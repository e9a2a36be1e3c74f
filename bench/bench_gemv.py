"""gemv against torch on one decode step's linear layers, with the memory read floor beside them.

Every linear layer of a model (``--model``: a catalogue name or a directory with a transformers
``config.json``; only the shapes are read, the weights are random) is run once per "step" at M
rows of activations, for each weight storage:

* ``bf16``: ``ragfast.ops.gemv`` (cpp) against ``torch.nn.functional.linear`` (the anchor: oneDNN's
  matmul, what a bf16 model runs) and against the same with oneDNN off (``torch-native``: torch's
  own kernels, whose one-row bf16 path is a bandwidth-bound dot product);
* ``int8``: gemv on int8 codes with per-row scales against torch's ``_weight_int8pack_mm``
  (what ``HFGenerator(weights="int8")`` ran before; bf16 activations), and ``gemv-packed``: gemv on
  the same codes in w8a8's packed layout (``ragfast.ops.gemv.gemv_packed``, what a w8a8 reasoner's
  few-row passes run at VNNI levels; a layer whose depth is not a multiple of 64 keeps the
  row-major gemv there; not run where the level has no VNNI);
* ``fp32``: gemv against ``F.linear`` in fp32, with and without oneDNN.

Round-robin over the providers, ``--reps`` times; medians. Beside them the read floor: the step's
weight bytes over the read bandwidth of a sum over a 1 GiB buffer, measured before each
repetition (the ratio's median is over the repetitions' own ratios).
``RAGFAST_ISA`` forces a lower kernel level (the anchors are torch's whatever it is, unless
restricted too: ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``). Rows
go to bench/results/bench_gemv.csv in the harness schema. ``--write-table`` also writes this
machine's rows per storage at the level in use (gemv faster than torch at every measured row count
up to them) into ``python/ragfast/ops/gemv_rows.json``, the table the generator's layers read.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_decode_weights import cpu_model, read_bandwidth  # noqa: E402
from bench.harness import print_table, row, write_csv  # noqa: E402
from ragfast.ops.gemv_rows import TABLE_PATH, rows_from_ratios  # noqa: E402
from ragfast.ops.machine import machine_key, match_table  # noqa: E402


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear layer a decode step runs (the lm head included)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        from ragfast.models.catalogue import model_dir

        path = model_dir(model)
    c = json.loads((path / "config.json").read_text())
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads) * hd
    per = [(heads * hd, h), (kv, h), (kv, h), (h, heads * hd), (inter, h), (inter, h), (h, inter)]
    return per * layers + [(c["vocab_size"], h)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a catalogue name or a model directory")
    ap.add_argument("--rows", default="1,2,3,4,6,8,16", help="activation rows M, comma-separated")
    ap.add_argument("--storage", default="bf16,int8,fp32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", default=str(Path(__file__).parent / "results" / "bench_gemv.csv"))
    ap.add_argument("--write-table", nargs="?", const=str(TABLE_PATH), default=None, metavar="PATH",
                    help="write this machine's rows per storage (gemv faster than torch at every measured "
                         f"row count up to them) into the shipped table (default {TABLE_PATH.name})")
    args = ap.parse_args(argv)

    import torch

    from ragfast import _C
    from ragfast.models.weight_quant import quantize_int8
    from ragfast.ops.gemv import GemvWeight, gemv_packed
    from ragfast.ops.w8a8 import MATMUL_LEVELS, pack_codes

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = layer_shapes(args.model)
    rows_list = [int(m) for m in args.rows.split(",")]
    stores = [s for s in args.storage.split(",") if s]
    print(f"CPU: {cpu_model()}, {torch.get_num_threads()} threads, kernel level {_C.isa_current()}, torch "
          f"{torch.__version__}; {args.model}: {len(shapes)} linear layers", flush=True)

    layers: dict[str, list] = {}
    for st in stores:
        ls = []
        for n, k in shapes:
            w = torch.randn(n, k) * k ** -0.5
            if st == "int8":
                codes, scales = quantize_int8(w)
                packed = pack_codes(codes) if k % 64 == 0 and _C.isa_current() in MATMUL_LEVELS else None
                ls.append((GemvWeight(codes, scales), codes, scales.to(torch.bfloat16), packed))
            else:
                w = w.to(torch.bfloat16 if st == "bf16" else torch.float32)
                ls.append((GemvWeight(w), w, None, None))
        layers[st] = ls
    nbytes = {st: sum(g.weight.nbytes + (0 if g.scales is None else g.scales.nbytes) for g, _, _, _ in ls)
              for st, ls in layers.items()}

    def step(st: str, M: int, who: str) -> float:
        x = torch.randn(M, max(k for _, k in shapes)).to(torch.float32 if st == "fp32" else torch.bfloat16)
        xs = {k: x[:, :k].contiguous() for _, k in shapes}
        with torch.backends.mkldnn.flags(enabled=who != "torch-native"):
            t0 = time.perf_counter()
            for g, w, s, packed in layers[st]:
                xk = xs[g.K]
                if who == "gemv-packed" and packed is not None:
                    gemv_packed(xk, packed, g.scales)
                elif who.startswith("gemv"):
                    g(xk)
                elif st == "int8":
                    torch.ops.aten._weight_int8pack_mm(xk, w, s)
                else:
                    torch.nn.functional.linear(xk, w)
            return time.perf_counter() - t0

    has_packed = any(p is not None for _, _, _, p in layers.get("int8", []))
    whos = {st: (("torch", "gemv", "gemv-packed") if has_packed else ("torch", "gemv")) if st == "int8"
            else ("torch", "torch-native", "gemv") for st in stores}
    for st in stores:  # warm-up: faults the weights in
        for who in whos[st]:
            step(st, 1, who)
    res: dict[tuple[str, int, str], list[float]] = {}
    bw = []
    for _ in range(args.reps):
        bw.append(read_bandwidth(reps=3))
        for st in stores:
            for M in rows_list:
                for who in whos[st]:
                    res.setdefault((st, M, who), []).append(step(st, M, who))
    bw_med = statistics.median(bw)
    out = [row("read_bandwidth", "torch sum 1 GiB", "", "bandwidth", "GB/s", [b / 1e9 for b in bw])]
    print(f"\nread bandwidth {bw_med / 1e9:.1f} GB/s (median of {len(bw)})")
    for st in stores:
        floor = nbytes[st] / bw_med
        floors = [nbytes[st] / b for b in bw]  # each repetition's own: the VM's read rate swings within minutes
        for M in rows_list:
            params = f"{args.model},{st},M={M},level={_C.isa_current()}"
            line = f"{st:5s} M={M:3d}"
            for who in whos[st]:
                t = res[(st, M, who)]
                out.append(row("gemv_step", who, params, "seconds", "s", t))
                line += f"  {who} {statistics.median(t) * 1e3:6.2f} ms ({nbytes[st] / statistics.median(t) / 1e9:4.1f} GB/s)"
            for ours in (w for w in whos[st] if w.startswith("gemv")):
                t_o = res[(st, M, ours)]
                for who in (w for w in whos[st] if not w.startswith("gemv")):
                    r = [a / b for a, b in zip(res[(st, M, who)], t_o)]
                    out.append(row("gemv_step", ours, params, f"vs_{who}", "x", r))
                    line += f"  {ours} {statistics.median(r):4.2f}x {who}"
                r = [t / f for t, f in zip(t_o, floors)]
                out.append(row("gemv_step", ours, params, "vs_read_floor", "x", r))
                line += f"  {ours} {statistics.median(r):4.2f}x the read floor"
            print(f"{line} ({floor * 1e3:.2f} ms)", flush=True)
    print_table(out, f"one decode step's linear layers ({args.model}; {cpu_model()})")
    print(f"rows -> {write_csv(out, args.csv)}")
    if args.write_table:
        rows = {st: rows_from_ratios({M: statistics.median(res[(st, M, "torch")]) / statistics.median(res[(st, M, "gemv")])
                                      for M in rows_list}) for st in stores}
        write_table(rows, _C.isa_current(), ["bench/bench_gemv.py", *(argv if argv is not None else sys.argv[1:])],
                    Path(args.write_table))
    return 0


def write_table(rows: dict[str, int], level: str, argv: list[str], path: Path) -> None:
    """Merge this machine's measured rows at ``level`` into the table file (one entry per machine:
    CPU model and features), leaving other machines' entries alone."""
    import datetime
    import os

    raw = json.loads(path.read_text()) if path.exists() else {}
    machines = raw.get("machines", [])
    key = machine_key()
    mine = match_table(machines, key)
    if mine is None:
        mine = dict(key, rows={}, runs={})
        machines.append(mine)
    mine["machine"] = f"{key['cpu']}, {os.cpu_count()} logical CPUs, features: {' '.join(key['features'])}"
    mine.setdefault("rows", {})[level] = rows
    mine.setdefault("runs", {})[level] = {
        "measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_1min_at_write": round(os.getloadavg()[0], 2), "command": "python " + " ".join(argv)}
    table = {"about": "gemv rows per machine (CPU model and features) / ISA level / weight storage: gemv runs "
                      "passes of up to that many rows (it beat torch's matmul at every measured row count up to "
                      "it); written by bench/bench_gemv.py --write-table", "machines": machines}
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"gemv rows at {level} ({key['cpu']}): {rows} -> {path}")


if __name__ == "__main__":
    raise SystemExit(main())

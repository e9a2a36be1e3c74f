"""RELOOP benchmark: guided iterator vs run-everything, and structural-neighbour throughput.

Part 1, neighbour expansion throughput (rows/s), in this process on the same data:

* ``hseq-vectorised``: :meth:`ragfast.methods.reloop.hseq.HSeq.expand` (parent, children, siblings, same row,
  same column) over a batch of segment rows of one big HSEQ (every bundled TAT-QA document and
  the HotpotQA dev contexts), as CSR index gathers;
* ``python-dict`` (anchor): the same neighbours from plain Python dicts of lists (parent map,
  children lists, (table, column) lists) walked row by row; the two results are checked equal;
* the same pair for one KG relation hop over the MetaQA KB (``KGraph.hop`` vs a dict of sets).

Part 2, end-to-end per dataset (HotpotQA dev text, TAT-QA dev table+text, MetaQA 3-hop KG):

* ``reloop``: the guided loop (plan, sliding window, judge stop, step/token budgets);
* ``run-everything`` (anchor): the same machinery reading every candidate segment of the
  question's neighbourhood (no stop, no budget: ceil(N/k) steps); for MetaQA, every triple
  within the hop radius of the topic entity (all relations, both directions) is read before
  the answer path is applied.

Reported: seconds per question (median of the repetitions) and the speed ratio, steps and
segments read per question, EM beside them. The text head is the rule-based extractive picker
(NOT an LLM) and the quick run uses the lexical hashing encoder: EM there measures the evidence,
not a language model. ``--encoder minilm`` uses the bundled MiniLM.

Run ``python bench/bench_reloop.py`` (``--quick`` for a smoke run); rows go to
bench/results/bench_reloop.csv in the harness schema.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import print_table, row, time_fn, write_csv  # noqa: E402


# ------------------------------------------------------------------------------------ part 1
def _big_hseq():
    from ragfast.data import load_qa, sample
    from ragfast.methods.reloop.hseq import HSeq, from_tatqa, from_text

    docs = json.loads(sample("tatqa-dev").read_text(encoding="utf-8"))
    parts = [from_tatqa(d, f"tat{i}") for i, d in enumerate(docs)]
    for qi, q in enumerate(load_qa("hotpotqa-dev")):
        ctx = q.metadata["context"]
        for j, (t, s) in enumerate(zip(ctx["title"], ctx["sentences"])):
            parts.append(from_text(f"h{qi}.{j}", t, "".join(s), sentences=s))
    return HSeq.concat(parts)


def _dict_tables(seq):
    parent = {i: int(p) for i, p in enumerate(seq.parent.tolist())}
    kids = defaultdict(list)
    for i, p in parent.items():
        if p >= 0:
            kids[p].append(i)
    is_cell = {i: seq.level_name(i) == "cell" for i in range(len(seq))}
    col = {}
    cols = defaultdict(list)
    for i in range(len(seq)):
        if is_cell[i]:
            key = (parent[parent[i]], int(seq.col[i]))
            col[i] = key
            cols[key].append(i)
    return parent, kids, is_cell, col, cols


def _dict_expand(rows, parent, kids, is_cell, col, cols):
    out = set()
    rs = set(rows)
    for r in rows:
        p = parent[r]
        if p >= 0:
            out.add(p)
            out.update(s for s in kids[p] if s != r)
        out.update(kids[r])
        if is_cell[r]:
            out.update(s for s in cols[col[r]] if s != r)
    return sorted(out - rs)


def bench_neighbours(batch: int, reps: int, rows_out: list) -> None:
    from ragfast.data import load_triples, sample
    from ragfast.methods.reloop.hseq import METAQA_RELATIONS, from_triples

    seq = _big_hseq()
    tables = _dict_tables(seq)
    rng = np.random.default_rng(0)
    rows = rng.choice(len(seq), size=min(batch, len(seq)), replace=False)
    kinds = ("parent", "children", "siblings", "row", "column")
    got = seq.expand(rows, kinds)
    want = _dict_expand(rows.tolist(), *tables)
    assert got.tolist() == want, "vectorised and dict neighbours differ"
    params = f"segments={len(seq)},batch={len(rows)}"
    tv = time_fn(lambda: seq.expand(rows, kinds), reps=reps)
    td = time_fn(lambda: _dict_expand(rows.tolist(), *tables), reps=reps)
    rows_out.append(row("hseq_expand", "hseq-vectorised", params, "rows_per_s", "rows/s", len(rows) / tv))
    rows_out.append(row("hseq_expand", "python-dict", params, "rows_per_s", "rows/s", len(rows) / td))
    rows_out.append(row("hseq_expand", "hseq-vectorised", params, "speedup_vs_dict", "x", td / tv))

    triples = load_triples(sample("metaqa-kb"))
    kg = from_triples(triples, relations=METAQA_RELATIONS).kg
    fwd = defaultdict(set)
    for h, r, t in triples:
        fwd[(h, r)].add(t)
    movies = np.unique(kg.head)
    front = rng.choice(movies, size=min(batch, len(movies)), replace=False)
    names = [kg.entities[i] for i in front]
    got = {kg.entities[i] for i in kg.hop(front, "starred_actors")}
    assert got == set().union(*(fwd[(n, "starred_actors")] for n in names))
    p2 = f"triples={len(triples)},frontier={len(front)}"
    tv = time_fn(lambda: kg.hop(front, "starred_actors"), reps=reps)
    td = time_fn(lambda: set().union(*(fwd[(n, "starred_actors")] for n in names)), reps=reps)
    rows_out.append(row("kg_hop", "csr-vectorised", p2, "entities_per_s", "entities/s", len(front) / tv))
    rows_out.append(row("kg_hop", "python-dict", p2, "entities_per_s", "entities/s", len(front) / td))
    rows_out.append(row("kg_hop", "csr-vectorised", p2, "speedup_vs_dict", "x", td / tv))


# ------------------------------------------------------------------------------------ part 2
class _NoStop:
    """Judge of the run-everything baseline: never sufficient (so every segment gets read)."""

    name = "never stop (run-everything baseline)"
    meaningful = True

    def stop_scores(self, states, **_):
        return np.full(len(states), -1.0)


def _text_runs(name: str, n: int, encoder, reps: int, rows_out: list, summary: list) -> None:
    from ragfast.accounting.ledger import CostLedger
    from ragfast.data import load_qa, sample
    import ragfast.methods.reloop as rl

    qs = load_qa(name, limit=n)
    if name.startswith("tatqa"):
        docs = json.loads(sample(name).read_text(encoding="utf-8"))
        make = lambda: [rl.tatqa_workspace(q, docs[q.metadata["doc_index"]]) for q in qs]  # noqa: E731
    else:
        make = lambda: [rl.text_workspace(q) for q in qs]  # noqa: E731
    guided = rl.ReloopConfig()
    sizes = [len(w.cand) for w in make()]
    everything = rl.ReloopConfig(k=guided.k, window=max(guided.window, guided.k), max_steps=max(
        math.ceil(s / guided.k) for s in sizes), max_tokens=10 ** 9, verify=False)
    results = {}
    for prov, cfg in (("reloop", guided), ("run-everything", everything)):
        times, out = [], None
        for _ in range(reps):
            wss = make()  # fresh workspaces: each repetition encodes its candidates again
            judge = rl.HeuristicSufficiency(multi_doc=not name.startswith("tatqa")) if prov == "reloop" else _NoStop()
            t0 = time.perf_counter()
            out = rl.run_text(wss, encoder=encoder, judge=judge, generator=rl.ExtractiveHead(), cfg=cfg,
                              ledger=CostLedger())
            times.append((time.perf_counter() - t0) / len(qs))
        results[prov] = (times, out)
    _report(name, len(qs), results, rows_out, summary,
            seg=lambda r: sum(len(t["read"]) + len(t.get("context", [])) for t in r["turns"]))


def _kg_runs(name: str, n: int, reps: int, rows_out: list, summary: list) -> None:
    from ragfast.data import load_qa
    import ragfast.methods.reloop as rl

    qs = load_qa(name, limit=n)
    seq = rl.metaqa_kg()
    kg = seq.kg
    cfg = rl.ReloopConfig(planner="kg-path")

    def everything():
        # read the whole hop-radius neighbourhood (all relations, both directions), then answer
        rows = []
        for q in qs:
            plan = rl.kg_path_plan(q.metadata["raw_question"], kg)
            front = kg.ids([plan.topic]) if plan.topic else np.zeros(0, np.int64)
            read = 0
            for _ in range(max(plan.hops, 1)):
                nxt = [front]
                for rel in kg.relations:
                    for inv in (False, True):
                        t, _ = kg.hop_triples(front, rel, inverse=inv)
                        read += len(t)
                        nxt.append((kg.head if inv else kg.tail)[t])
                front = np.unique(np.concatenate(nxt))
            res = rl.walk_path(plan, seq, cfg)
            ans = res.pack[0]["reached"] if res.pack else ""
            from ragfast.scoring.metrics import exact_match

            rows.append({"em": exact_match(ans, q.golden_answers), "steps": max(plan.hops, 1),
                         "segments": read})
        return rows

    results = {}
    times = []
    out = None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = rl.run_kg_path(qs, seq, cfg=cfg)
        times.append((time.perf_counter() - t0) / len(qs))
    for r in out:
        r["segments"] = sum(s["triples"] for s in r["turns"])
    results["reloop"] = (times, out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = everything()
        times.append((time.perf_counter() - t0) / len(qs))
    results["run-everything"] = (times, out)
    _report(name, len(qs), results, rows_out, summary, seg=lambda r: r["segments"])


def _report(name, n, results, rows_out, summary, seg) -> None:
    params = f"data={name},n={n}"
    med = {}
    for prov, (times, out) in results.items():
        med[prov] = statistics.median(times)
        rows_out.append(row("reloop_e2e", prov, params, "s_per_question", "s", times))
        rows_out.append(row("reloop_e2e", prov, params, "steps_per_question", "steps", [np.mean([r["steps"] for r in out])]))
        rows_out.append(row("reloop_e2e", prov, params, "segments_read_per_question", "segments",
                            [np.mean([seg(r) for r in out])]))
        rows_out.append(row("reloop_e2e", prov, params, "em", "fraction", [np.mean([r["em"] for r in out])]))
    ratio = med["run-everything"] / med["reloop"]
    rows_out.append(row("reloop_e2e", "reloop", params, "speedup_vs_run_everything", "x", [ratio]))
    summary.append(f"{name}: reloop {med['reloop'] * 1e3:.2f} ms/q, "
                   f"{np.mean([r['steps'] for r in results['reloop'][1]]):.2f} steps/q, "
                   f"EM {np.mean([r['em'] for r in results['reloop'][1]]):.3f} | run-everything "
                   f"{med['run-everything'] * 1e3:.2f} ms/q, "
                   f"{np.mean([r['steps'] for r in results['run-everything'][1]]):.2f} steps/q, "
                   f"EM {np.mean([r['em'] for r in results['run-everything'][1]]):.3f} | ratio {ratio:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions (smoke run)")
    ap.add_argument("--encoder", default="hashing", help="hashing (lexical, default) or minilm")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_reloop.csv"))
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)
    import ragfast.methods.reloop as rl

    encoder = rl.default_encoder(args.encoder)
    rows_out: list = []
    summary: list[str] = []
    bench_neighbours(1024 if args.quick else 8192, reps, rows_out)
    n_text, n_tat, n_kg = (12, 24, 100) if args.quick else (100, 200, 300)
    _text_runs("hotpotqa-dev", n_text, encoder, reps, rows_out, summary)
    _text_runs("tatqa-dev", n_tat, encoder, reps, rows_out, summary)
    _kg_runs("metaqa-3hop", n_kg, reps, rows_out, summary)
    print_table(rows_out, title=f"bench_reloop (encoder: {getattr(encoder, 'name', args.encoder)}; "
                                "text head: extractive rule, NOT an LLM)")
    for line in summary:
        print(line)
    path = write_csv(rows_out, args.out)
    print(f"rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bench report: the side-by-side table, summary CSV, report.md/report.html and PNG plots.

Everything here reads the numbers ``ragfast.bench`` computed (``summary.json`` plus the per-method
trajectory files); nothing is recomputed or invented at render time.
"""
from __future__ import annotations

import csv
import html
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ragfast.cost import COMPONENTS

METHOD_LABELS = {
    "searchr1": "Search-R1 (native)",
    "s2g": "S2G stopping",
    "stepgap": "StepGap",
    "reloop": "RELOOP",
}


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if not np.isfinite(v):
            return "-"
        return f"{v:.{nd}f}"
    return str(v)


def _ci(d: Mapping[str, Any] | None, scale: float = 1.0, nd: int = 3) -> str:
    if not d:
        return "-"
    return f"{d['delta'] * scale:+.{nd}f} [{d['low'] * scale:+.{nd}f}, {d['high'] * scale:+.{nd}f}]"


def table_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """One row per method: the columns of the terminal table, report.md and report.html."""
    rows = []
    for m, s in summary["methods"].items():
        cost = s["cost"]
        per_q = max(1, s["n_questions"])
        tot = cost.get("total", {})
        comp_tok = " ".join(f"{c}:{cost[c]['tokens'] / per_q:.0f}" for c in COMPONENTS if c in cost and cost[c]["tokens"])
        comp_fl = " ".join(f"{c}:{cost[c]['flops'] / per_q / 1e9:.2f}" for c in COMPONENTS if c in cost and cost[c]["flops"])
        comp_s = " ".join(f"{c}:{cost[c]['seconds'] / per_q * 1e3:.1f}" for c in COMPONENTS if c in cost and cost[c]["seconds"])
        rows.append([
            METHOD_LABELS.get(m, m), str(s["n_questions"]), _fmt(s["em"]), _fmt(s["f1"]),
            _fmt(s["searches_per_question"], 2), comp_tok or "-", comp_fl or "-", comp_s or "-",
            f"{tot.get('flops', 0) / per_q / 1e9:.2f} GF, {tot.get('seconds', 0) / per_q * 1e3:.1f} ms",
            _ci(s.get("delta_em")), _ci(s.get("delta_flops"), 1e-9, 2), _ci(s.get("delta_seconds"), 1e3, 1),
        ])
    return rows


HEADERS = ["method", "n", "EM", "F1", "searches/q", "tokens/q by component", "GFLOPs/q by component",
           "ms/q by component", "total cost/q", "ΔEM vs native [95% CI]", "ΔGFLOPs/q [CI]", "Δms/q [CI]"]


def quality_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """Compact per-method rows for the terminal: quality, total cost and deltas."""
    rows = []
    for m, s in summary["methods"].items():
        n = max(1, s["n_questions"])
        tot = s["cost"].get("total", {})
        rows.append([METHOD_LABELS.get(m, m), str(s["n_questions"]), _fmt(s["em"]), _fmt(s["f1"]),
                     _fmt(s["searches_per_question"], 2), f"{tot.get('flops', 0) / n / 1e9:.2f}",
                     f"{tot.get('seconds', 0) / n * 1e3:.1f}", _ci(s.get("delta_em")),
                     _ci(s.get("delta_seconds"), 1e3, 1)])
    return rows


def component_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """(method, component) rows: tokens, GFLOPs and milliseconds per question."""
    rows = []
    for m, s in summary["methods"].items():
        n = max(1, s["n_questions"])
        for c in COMPONENTS:
            v = s["cost"].get(c)
            if not v:
                continue
            rows.append([METHOD_LABELS.get(m, m), c, f"{v['calls'] / n:.2f}", f"{v['tokens'] / n:.0f}",
                         f"{v['flops'] / n / 1e9:.3f}", f"{v['seconds'] / n * 1e3:.2f}"])
    return rows


def print_table(summary: Mapping[str, Any], console: Any = None) -> None:
    """The side-by-side tables on the terminal: methods, then cost per component."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title="ragfast bench: same questions, one row per method")
    for h in ("method", "n", "EM", "F1", "searches/q", "GFLOPs/q", "ms/q", "ΔEM vs native [95% CI]", "Δms/q [CI]"):
        t.add_column(h, justify="left" if h == "method" else "right")
    for r in quality_rows(summary):
        t.add_row(*r)
    console.print(t)
    c = Table(title="cost per question by component")
    for h in ("method", "component", "calls/q", "tokens/q", "GFLOPs/q", "ms/q"):
        c.add_column(h, justify="left" if h in ("method", "component") else "right")
    for r in component_rows(summary):
        c.add_row(*r)
    console.print(c)
    for slot, d in summary.get("slots", {}).items():
        console.print(f"  slot [bold]{slot}[/]: {d.get('name')} — answers meaningful: "
                      f"{d.get('answers_meaningful', d.get('meaningful'))}")
    for key in ("break_even", "stepgap_balance"):
        if summary.get(key):
            console.print(summary[key]["text"])


def write_csv(summary: Mapping[str, Any], path: Path) -> Path:
    """Long-format CSV: one row per (method, component) with calls, tokens, FLOPs, seconds."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", "n_questions", "em", "f1", "searches_per_question", "component", "calls", "tokens",
                    "flops", "seconds"])
        for m, s in summary["methods"].items():
            for comp, c in s["cost"].items():
                w.writerow([m, s["n_questions"], s["em"], s["f1"], s["searches_per_question"], comp, c["calls"],
                            c["tokens"], c["flops"], c["seconds"]])
    return path


# -- plots -------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: files only
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(summary: Mapping[str, Any], path: Path) -> Path:
    """Cost-accuracy plane: total GFLOPs per question against EM, with the Pareto front."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.2))
    pts = []
    for m, s in summary["methods"].items():
        n = max(1, s["n_questions"])
        x = s["cost"].get("total", {}).get("flops", 0.0) / n / 1e9
        pts.append((x, s["em"], METHOD_LABELS.get(m, m)))
        ax.scatter([x], [s["em"]], s=60)
        ax.annotate(METHOD_LABELS.get(m, m), (x, s["em"]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front, best = [], -1.0
    for x, y, _ in sorted(pts):
        if y > best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        ax.plot(*zip(*front), "--", color="grey", lw=1, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("total GFLOPs per question (all components)")
    ax.set_ylabel("exact match")
    ax.set_title("cost vs accuracy")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_threshold_sweep(sweep: Mapping[str, Sequence[float]], path: Path, threshold: float | None = None) -> Path:
    """EM, searches per question and unsafe-stop fraction against the STOP threshold (replay)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    th = np.asarray(sweep["thresholds"], dtype=float)
    for ax, key, label in zip(axes, ("em", "searches", "unsafe"), ("EM", "searches / question", "unsafe early stops")):
        ax.plot(th, np.asarray(sweep[key], dtype=float), lw=1.5)
        if threshold is not None and np.isfinite(threshold):
            ax.axvline(threshold, color="red", ls=":", lw=1, label="frozen threshold")
            ax.legend(fontsize=7)
        ax.set_xlabel("STOP threshold")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("threshold sweep (counterfactual replay on native trajectories)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(table: Sequence[Mapping[str, float]], path: Path) -> Path:
    """The judge's reliability diagram: mean predicted STOP probability vs observed frequency."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    xs = [r["mean_prob"] for r in table if r["count"] > 0]
    ys = [r["frac_positive"] for r in table if r["count"] > 0]
    ns = [r["count"] for r in table if r["count"] > 0]
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="perfect calibration")
    if xs:
        ax.scatter(xs, ys, s=[10 + 3 * n for n in ns], alpha=0.7, label="bins (size = states)")
        ax.plot(xs, ys, lw=1)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted P(sufficient)")
    ax.set_ylabel("observed sufficient fraction")
    ax.set_title("judge reliability")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cost_bars(summary: Mapping[str, Any], path: Path, metric: str = "seconds") -> Path:
    """Stacked per-component cost bars (per question), one bar per method."""
    plt = _plt()
    methods = list(summary["methods"])
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bottom = np.zeros(len(methods))
    scale = 1e3 if metric == "seconds" else 1e-9
    unit = "ms" if metric == "seconds" else "GFLOPs"
    for comp in COMPONENTS:
        vals = np.array([summary["methods"][m]["cost"].get(comp, {}).get(metric, 0.0)
                         / max(1, summary["methods"][m]["n_questions"]) * scale for m in methods])
        if vals.sum() == 0:
            continue
        ax.bar([METHOD_LABELS.get(m, m) for m in methods], vals, bottom=bottom, label=comp)
        bottom += vals
    ax.set_ylabel(f"{unit} per question")
    ax.set_title(f"cost by component ({metric})")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=15, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- documents ---------------------------------------------------------------------------------
def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(summary: Mapping[str, Any], out_dir: Path, plots: Sequence[str]) -> Path:
    """report.md: slots, the table, S2G threshold details, what the numbers mean, plots."""
    lines = ["# ragfast bench report", ""]
    meta = summary.get("run", {})
    if meta:
        lines += [f"- data: `{meta.get('data')}`, {meta.get('n_questions')} questions; corpus: {meta.get('corpus_size')} passages",
                  f"- budget: {meta.get('budget')} searches, top-k {meta.get('topk')}; wall time {meta.get('wall_seconds', 0):.1f} s",
                  ""]
    lines += ["## Slots", ""]
    lines += _md_table(["slot", "model", "meaningful"],
                       [[k, str(v.get("name")), str(v.get("answers_meaningful", v.get("meaningful")))]
                        for k, v in summary.get("slots", {}).items()]).splitlines()
    lines += ["", "## Methods", ""]
    lines += _md_table(HEADERS, table_rows(summary)).splitlines()
    s2g = summary.get("s2g_threshold")
    if s2g:
        lines += ["", "## S2G threshold", "",
                  f"Frozen threshold {s2g.get('threshold')} selected on {s2g.get('n_val_questions')} validation questions "
                  f"({s2g.get('source')}) for STOP precision ≥ {s2g.get('min_precision')}: validation precision "
                  f"{_fmt(s2g.get('val_precision'))}, recall {_fmt(s2g.get('val_recall'))}; judge AP {_fmt(s2g.get('val_ap'))}, "
                  f"Brier {_fmt(s2g.get('val_brier'))}.", ""]
    for key, title in (("break_even", "Does the judge pay for itself?"),
                       ("stepgap_balance", "Does StepGap's checker pay for itself?")):
        if summary.get(key):
            lines += [f"## {title}", "", summary[key]["text"], ""]
    lines += ["", "## What the numbers mean", "",
              "- EM/F1 follow Search-R1's normalisation; ΔEM and Δcost are paired over the same questions, "
              "with 95% paired-bootstrap confidence intervals.",
              "- Costs come from one ledger: every component records calls, tokens, analytic FLOPs and wall "
              "seconds per question; totals are the sums of the per-question records.",
              "- A slot marked not meaningful (scripted oracle, random weights) exercises the compute path only: "
              "its accuracy says how reachable the evidence is, not how well a model reasons.", ""]
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_html(summary: Mapping[str, Any], out_dir: Path, plots: Sequence[str]) -> Path:
    """report.html: the same content as report.md, self-contained apart from the PNG files."""
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>ragfast bench</title>",
             "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:4px 6px}img{max-width:48%;margin:4px}</style></head><body>",
             "<h1>ragfast bench report</h1><h2>Slots</h2><table><tr><th>slot</th><th>model</th><th>meaningful</th></tr>"]
    for k, v in summary.get("slots", {}).items():
        parts.append(f"<tr><td>{e(k)}</td><td>{e(str(v.get('name')))}</td>"
                     f"<td>{e(str(v.get('answers_meaningful', v.get('meaningful'))))}</td></tr>")
    parts.append("</table><h2>Methods</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in HEADERS) + "</tr>")
    for r in table_rows(summary):
        parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>")
    parts.append("</table>")
    for key, title in (("break_even", "Does the judge pay for itself?"),
                       ("stepgap_balance", "Does StepGap's checker pay for itself?")):
        if summary.get(key):
            parts.append(f"<h2>{title}</h2><pre>{e(summary[key]['text'])}</pre>")
    parts.append("<h2>Plots</h2>" + "".join(f"<img src='{e(p)}' alt='{e(p)}'>" for p in plots))
    parts.append("<h2>summary.json</h2><pre>" + e(json.dumps(summary.get("methods", {}), indent=1)[:20000]) + "</pre>")
    parts.append("</body></html>")
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path

"""Bench report: the side-by-side table, summary CSV, report.md/report.html and PNG plots.

Everything here reads the numbers ``ragfast.comparison.pipeline`` computed (``summary.json`` plus the per-method
trajectory files); nothing is recomputed or invented at render time.
"""
from __future__ import annotations

import csv
import html
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ragfast.comparison.verdict import verdict_blocks, verdict_lines
from ragfast.accounting.ledger import COMPONENTS
from ragfast.outputs.failures import FAILED_SCORE

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


def component_rows(summary: Mapping[str, Any], short: bool = False) -> list[list[str]]:
    """(method, component) rows: tokens, GFLOPs and milliseconds per question."""
    rows = []
    names = SHORT_LABELS if short else METHOD_LABELS
    for m, s in summary["methods"].items():
        n = max(1, s["n_questions"])
        for c in COMPONENTS:
            v = s["cost"].get(c)
            if not v:
                continue
            rows.append([names.get(m, m), c, f"{v['calls'] / n:.2f}", f"{v['tokens'] / n:.0f}",
                         f"{v['flops'] / n / 1e9:.3f}", f"{v['seconds'] / n * 1e3:.2f}"])
    return rows


# -- plots -------------------------------------------------------------------------------------
# One colour per component and per method, the same in every plot.
COMPONENT_COLORS = {"reasoner": "#1f77b4", "encoder": "#ff7f0e", "search": "#2ca02c", "judge": "#d62728",
                    "nli": "#9467bd", "other": "#7f7f7f"}
METHOD_COLORS = {"searchr1": "#4c72b0", "s2g": "#dd8452", "stepgap": "#55a868", "reloop": "#c44e52"}

CAPTIONS = {
    "pareto.png": "Each point is a method: its total cost per question (x, all components) against exact match "
                  "(y), with 95% bootstrap confidence intervals as whiskers. Up and to the left is better; the "
                  "dashed line joins the methods that no other method beats on both axes (the Pareto front). "
                  "Overlapping whiskers mean the run cannot tell those methods apart.",
    "cost_bars.png": "Wall-clock milliseconds per question, stacked by component (each component has the same "
                     "colour in every plot). Bar height is the method's total; the segments show where its time goes.",
    "cost_bars_flops.png": "Analytic GFLOPs per question, stacked by component (same colours as the time bars). "
                           "Compare with the time bars: a component that is cheap in FLOPs but slow in time is "
                           "waiting on something other than arithmetic.",
    "threshold_sweep.png": "Replaying the native trajectories under each STOP threshold: EM, searches per question "
                           "and unsafe early stops (stops whose answer-only probe is wrong). The red dotted line is "
                           "the frozen threshold. A useful threshold region saves searches while EM stays flat.",
    "reliability.png": "The judge's calibration on the test states: mean predicted P(sufficient) per bin against "
                       "the fraction of states in that bin that really were sufficient; the number by each point "
                       "is how many states fell in the bin. On the diagonal = calibrated. ECE and Brier score "
                       "(lower is better) are in the legend.",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: files only
    import matplotlib.pyplot as plt

    return plt


def _per_q(s: Mapping[str, Any], field: str) -> float:
    return s["cost"].get("total", {}).get(field, 0.0) / max(1, s["n_questions"])


def plot_pareto(summary: Mapping[str, Any], path: Path) -> Path:
    """Cost-accuracy plane: total cost per question against EM, with CI whiskers and the Pareto front.

    The x axis is GFLOPs when any method reports FLOPs, else milliseconds (remote components
    are measured in time only).
    """
    plt = _plt()
    methods = summary["methods"]
    use_flops = any(_per_q(s, "flops") > 0 for s in methods.values())
    field, scale, unit = ("flops", 1e-9, "GFLOPs") if use_flops else ("seconds", 1e3, "ms")
    ci_key = "flops_per_q" if use_flops else "seconds_per_q"
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    pts = []
    for i, (m, s) in enumerate(methods.items()):
        x, y = _per_q(s, field) * scale, s["em"]
        ci = s.get("ci", {})
        xe = ci.get(ci_key)
        ye = ci.get("em")
        xerr = [[max(0.0, x - xe["low"] * scale)], [max(0.0, xe["high"] * scale - x)]] if xe else None
        yerr = [[max(0.0, y - ye["low"])], [max(0.0, ye["high"] - y)]] if ye else None
        color = METHOD_COLORS.get(m, f"C{i}")
        ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", ms=7, color=color, ecolor=color, elinewidth=1,
                    capsize=3, alpha=0.9, zorder=2, label=METHOD_LABELS.get(m, m))
        pts.append((x, y, m))
    front, best = [], -np.inf
    for x, y, _ in sorted(pts):
        if y > best:
            front.append((x, y))
            best = y
    if len(front) > 1:
        # drawn above the markers, so the front stays visible where it passes through them
        ax.plot(*zip(*front), "--", color="black", lw=1.2, zorder=4, label="Pareto front")
    ax.set_xlabel(f"total {unit} per question (all components)")
    ax.set_ylabel("exact match")
    ax.set_title(f"cost ({unit}/question) vs accuracy (EM), 95% CIs")
    ax.grid(alpha=0.3)
    ax.margins(x=0.15, y=0.15)
    # a legend instead of labels next to the points: labels of nearby methods overlapped
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_threshold_sweep(sweep: Mapping[str, Sequence[float]], path: Path, threshold: float | None = None) -> Path:
    """EM, searches per question and unsafe-stop fraction against the STOP threshold (replay)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    th = np.asarray(sweep["thresholds"], dtype=float)
    # summary.json writes an infinite threshold (never stop) as the string "inf"
    threshold = None if threshold is None else float(threshold)
    for ax, key, label in zip(axes, ("em", "searches", "unsafe"),
                              ("EM", "searches per question", "unsafe early stops (fraction of questions)")):
        ax.plot(th, np.asarray(sweep[key], dtype=float), lw=1.5, color="#4c72b0")
        if threshold is not None and np.isfinite(threshold):
            ax.axvline(threshold, color="red", ls=":", lw=1.2, label=f"frozen threshold {fmt_num(threshold)}")
            ax.legend(fontsize=7)
        ax.set_xlabel("STOP threshold (judge score)")
        ax.set_ylabel(label)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("threshold sweep: counterfactual replay on the native trajectories", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reliability(table: Sequence[Mapping[str, float]], path: Path, *, ece: float | None = None,
                     brier_score: float | None = None) -> Path:
    """The judge's reliability diagram: mean predicted P(sufficient) vs observed frequency, per bin."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5, 5.2))
    rows = [r for r in table if r["count"] > 0]
    xs = [r["mean_prob"] for r in rows]
    ys = [r["frac_positive"] for r in rows]
    ns = [int(r["count"]) for r in rows]
    ax.plot([0, 1], [0, 1], "--", color="grey", lw=1, label="perfect calibration")
    if xs:
        stats = []
        if ece is not None and np.isfinite(ece):
            stats.append(f"ECE {ece:.3f}")
        if brier_score is not None and np.isfinite(brier_score):
            stats.append(f"Brier {brier_score:.3f}")
        label = f"judge ({sum(ns)} states{'; ' + ', '.join(stats) if stats else ''})"
        ax.plot(xs, ys, "-o", lw=1, ms=5, color="#d62728", label=label, clip_on=False, zorder=3)
        for x, y, n in zip(xs, ys, ns):
            ax.annotate(str(n), (x, y), textcoords="offset points", xytext=(4, -10 if y > 0.9 else 5), fontsize=7)
    # a small margin so points at 0 or 1 are drawn whole
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("predicted P(sufficient), bin mean")
    ax.set_ylabel("observed fraction sufficient")
    ax.set_title("judge reliability (numbers = states per bin)", fontsize=10)
    # below the axes: inside, it covered points in whichever corner it went
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_cost_bars(summary: Mapping[str, Any], path: Path, metric: str = "seconds") -> Path | None:
    """Stacked per-component cost bars (per question), one bar per method.

    Returns None, and writes nothing, when no component reports this metric (e.g. FLOPs of
    remote components): an empty plot is never written.
    """
    methods = list(summary["methods"])
    scale = 1e3 if metric == "seconds" else 1e-9
    unit = "ms" if metric == "seconds" else "GFLOPs"
    series = {}
    for comp in COMPONENTS:
        vals = np.array([summary["methods"][m]["cost"].get(comp, {}).get(metric, 0.0)
                         / max(1, summary["methods"][m]["n_questions"]) * scale for m in methods])
        if vals.sum() > 0:
            series[comp] = vals
    if not series:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    bottom = np.zeros(len(methods))
    labels = [METHOD_LABELS.get(m, m) for m in methods]
    for comp, vals in series.items():
        ax.bar(labels, vals, bottom=bottom, label=comp, color=COMPONENT_COLORS.get(comp))
        bottom += vals
    ax.set_ylabel(f"{unit} per question")
    ax.set_title(f"cost by component ({unit} per question)")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=15, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(summary: Mapping[str, Any], out_dir: Path) -> tuple[list[str], dict[str, str]]:
    """Every plot the summary supports; returns (written file names, name -> why it is missing)."""
    plots: list[str] = []
    missing: dict[str, str] = {}
    plots.append(plot_pareto(summary, out_dir / "pareto.png").name)
    for name, metric in (("cost_bars.png", "seconds"), ("cost_bars_flops.png", "flops")):
        p = plot_cost_bars(summary, out_dir / name, metric)
        if p is None:
            missing[name] = (f"no component reported {metric} (remote components are measured in wall time only, "
                             "so FLOPs are unknown for them)" if metric == "flops" else "no component reported time")
            (out_dir / name).unlink(missing_ok=True)
        else:
            plots.append(p.name)
    an = summary.get("s2g_analysis") or {}
    if an.get("sweep"):
        plots.append(plot_threshold_sweep(an["sweep"], out_dir / "threshold_sweep.png",
                                          (summary.get("s2g_threshold") or {}).get("threshold")).name)
    elif "s2g" in summary.get("methods", {}):
        missing["threshold_sweep.png"] = "the S2G analysis has no scored states (no native trajectory to replay)"
    if an.get("calibration") and any(r["count"] > 0 for r in an["calibration"]):
        plots.append(plot_reliability(an["calibration"], out_dir / "reliability.png", ece=an.get("ece"),
                                      brier_score=an.get("brier")).name)
    elif "s2g" in summary.get("methods", {}):
        missing["reliability.png"] = an.get("calibration_missing") or "no judge-scored test states to calibrate"
    return plots, missing


# -- documents ---------------------------------------------------------------------------------
def fmt_num(x: Any, sig: int = 4) -> str:
    """A number for people: 4 significant digits (4.170672377972388 -> 4.171), '-' for None/NaN."""
    if x is None:
        return "-"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    if not np.isfinite(v):
        return "-" if np.isnan(v) else ("+inf" if v > 0 else "-inf")
    return f"{v:.{sig}g}"


def run_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """(setting, value) rows of the run info."""
    r = summary.get("run", {})
    labels = [("data", "data"), ("n_questions", "test questions"), ("val_limit", "S2G validation questions (max)"),
              ("corpus_size", "corpus passages"), ("budget", "search budget per question"), ("topk", "documents per search"),
              ("seed", "seed"), ("wall_seconds", "wall time (s)"), ("started", "started"), ("ragfast", "ragfast"),
              ("torch", "torch"), ("torch_threads", "torch threads"), ("python", "python"), ("machine", "machine"),
              ("cpus", "CPUs"), ("load_avg_1m", "1-min load average at the end")]
    rows = []
    for k, label in labels:
        if k in r:
            v = r[k]
            rows.append([label, f"{v:.1f}" if k == "wall_seconds" else str(v)])
    return rows


def slot_label(d: Mapping[str, Any]) -> str:
    """Do a slot's answers mean anything, in words (an empty slot says so, never a bare False)."""
    from ragfast.outputs.results import answers_label

    return str(d.get("answers_meaningful") or answers_label(d))


def slot_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """(slot, what fills it, do its answers mean anything) rows."""
    return [[k, str(v.get("name")), slot_label(v)] for k, v in summary.get("slots", {}).items()]


# Terminal tables use short names so that they fit 80 columns.
SHORT_LABELS = {"searchr1": "Search-R1", "s2g": "S2G", "stepgap": "StepGap", "reloop": "RELOOP"}


def method_rows(summary: Mapping[str, Any], short: bool = False) -> list[list[str]]:
    """Per method: n, EM with its 95% CI, F1, searches, total GFLOPs and ms per question."""
    rows = []
    names = SHORT_LABELS if short else METHOD_LABELS
    for m, s in summary["methods"].items():
        em_ci = s.get("ci", {}).get("em")
        rows.append([names.get(m, m), str(s["n_questions"]), _fmt(s["em"]),
                     f"[{em_ci['low']:.3f}, {em_ci['high']:.3f}]" if em_ci else "-", _fmt(s["f1"]),
                     _fmt(s["searches_per_question"], 2), f"{_per_q(s, 'flops') / 1e9:.2f}",
                     f"{_per_q(s, 'seconds') * 1e3:.1f}"])
    return rows


METHOD_HEADERS = ["method", "n", "EM", "EM 95% CI", "F1", "searches/q", "GFLOPs/q", "ms/q"]


def delta_rows(summary: Mapping[str, Any], short: bool = False) -> list[list[str]]:
    """(method, quantity, Δ, 95% CI) rows against native Search-R1, paired by question."""
    rows = []
    names = SHORT_LABELS if short else METHOD_LABELS
    spec = (("delta_em", "EM", 1.0, 3), ("delta_searches", "searches/q", 1.0, 2),
            ("delta_flops", "GFLOPs/q", 1e-9, 3), ("delta_seconds", "ms/q", 1e3, 1))
    for m, s in summary["methods"].items():
        for key, label, scale, nd in spec:
            d = s.get(key)
            if d:
                rows.append([names.get(m, m), label, f"{d['delta'] * scale:+.{nd}f}",
                             f"[{d['low'] * scale:+.{nd}f}, {d['high'] * scale:+.{nd}f}]"])
        if s.get("n_failed_either"):  # scored 0 where they failed (FAILED_SCORE)
            rows.append([names.get(m, m), "failed in either", f"{s['n_failed_either']} of {s['n_paired']}", "-"])
    return rows


def _failures(s: Mapping[str, Any]) -> Mapping[str, Any]:
    return s.get("failures") or {"count": 0, "by_component": {}}


def failure_rows(summary: Mapping[str, Any]) -> list[list[str]]:
    """(method, failed of n, by component) rows, for the methods with a failed question."""
    rows = []
    for m, s in summary["methods"].items():
        f = _failures(s)
        if f["count"]:
            rows.append([METHOD_LABELS.get(m, m), f"{f['count']} of {s['n_questions']}",
                         ", ".join(f"{c}: {k}" for c, k in f["by_component"].items())])
    return rows


def failures_line(summary: Mapping[str, Any]) -> str | None:
    """One line counting the failed questions of every method (None when none failed)."""
    parts = [f"{m} {_failures(s)['count']} of {s['n_questions']} ("
             + ", ".join(f"{c} {k}" for c, k in _failures(s)["by_component"].items()) + ")"
             for m, s in summary["methods"].items() if _failures(s)["count"]]
    if not parts:
        return None
    return ("failed questions: " + "; ".join(parts) + "; recorded with their errors in "
            "trajectories/<method>.jsonl and scored 0 (--resume --retry-failed runs them again)")


DELTA_HEADERS = ["method", "Δ vs native", "estimate", "95% CI"]
COMPONENT_HEADERS = ["method", "component", "calls/q", "tokens/q", "GFLOPs/q", "ms/q"]


def print_table(summary: Mapping[str, Any], console: Any = None) -> None:
    """The results on the terminal, narrow enough for 80 columns: methods, deltas, components."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i == 0 or h in ("component", "Δ vs native") else "right",
                         no_wrap=i != 0)
        for r in rows:
            t.add_row(*r)
        console.print(t)

    table("ragfast bench: same questions, one row per method",
          ["method", "n", "EM", "EM 95% CI", "F1", "search/q", "GFLOP/q", "ms/q"], method_rows(summary, True))
    drows = delta_rows(summary, True)
    if drows:
        table("against native Search-R1 (paired over the same questions)", DELTA_HEADERS, drows)
    table("cost per question by component", COMPONENT_HEADERS, component_rows(summary, True))
    for slot, d in summary.get("slots", {}).items():
        console.print(f"  slot [bold]{slot}[/]: {d.get('name')} — answers meaningful: {slot_label(d)}",
                      highlight=False)
    lines = verdict_lines(summary)
    if lines:  # last, so it is what the terminal shows; the whole account is in report.md
        console.print("[bold]Verdict[/] (paired against native Search-R1, 95% CIs; projected = not measured):")
        for line in lines:
            console.print(f"  {line}", highlight=False)


def write_csv(summary: Mapping[str, Any], path: Path) -> Path:
    """Long-format CSV: one row per (method, component) with calls, tokens, FLOPs, seconds.

    Method-level columns repeat on each row: EM with its 95% CI, and ΔEM / ΔGFLOPs / Δseconds
    per question against native Search-R1 with their paired 95% CIs (empty for native).
    """
    def ci(d: Mapping[str, Any] | None, *keys: str) -> list[Any]:
        return [d.get(k) if d else "" for k in keys]

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["method", "n_questions", "n_failed", "em", "em_ci_low", "em_ci_high", "f1", "searches_per_question",
                    "delta_em", "delta_em_low", "delta_em_high", "delta_flops_per_q", "delta_flops_low",
                    "delta_flops_high", "delta_seconds_per_q", "delta_seconds_low", "delta_seconds_high",
                    "component", "calls", "tokens", "flops", "seconds"])
        for m, s in summary["methods"].items():
            em_ci = s.get("ci", {}).get("em")
            common = [m, s["n_questions"], _failures(s)["count"], s["em"], *ci(em_ci, "low", "high"), s["f1"],
                      s["searches_per_question"],
                      *ci(s.get("delta_em"), "delta", "low", "high"), *ci(s.get("delta_flops"), "delta", "low", "high"),
                      *ci(s.get("delta_seconds"), "delta", "low", "high")]
            for comp, c in s["cost"].items():
                w.writerow([*common, comp, c["calls"], c["tokens"], c["flops"], c["seconds"]])
    return path


MEANING = [
    "EM and F1 follow Search-R1's answer normalisation. ΔEM and Δcost are paired over the same questions, "
    "with 95% paired-bootstrap confidence intervals; an interval that contains 0 means this run cannot tell "
    "the method from native Search-R1.",
    "A question whose component failed is data, not the end of the run: it is recorded with its error, "
    f"{FAILED_SCORE}.",
    "Costs come from one ledger: every component records calls, tokens, analytic FLOPs and wall seconds per "
    "question, and every total is the sum of the per-question records. Wall seconds depend on the machine and "
    "its load (see Run); FLOPs do not.",
    "The method and component tables show the FLOPs actually computed (KV and prefix-cache hits cost none). "
    "The checker verdicts are given in cache-independent FLOPs and tokens (every prompt token counted as "
    "computed), so a server's cache warmth cannot make identical work look cheaper; what was computed and the "
    "wall-clock difference stand beside them, never as a saving.",
    "A slot marked NO does not answer like a real model. The scripted oracle knows the gold answers, so its EM "
    "measures whether retrieval reached the evidence, not reasoning. A random-weight model exercises the "
    "compute path only. A judge is only called meaningful when it ranks validation states better than "
    "counting the documents read so far, measured in this run.",
]


@dataclass
class Section:
    """One part of the report: a title and blocks ``("p", text)``, ``("list", items)``,
    ``("table", headers, rows)``, ``("img", file, caption)`` or ``("note", text)``."""

    title: str
    blocks: list[tuple[Any, ...]] = field(default_factory=list)


def report_sections(summary: Mapping[str, Any], plots: Sequence[str],
                    missing: Mapping[str, str] | None = None) -> list[Section]:
    """The report's content, shared by report.md and report.html."""
    secs: list[Section] = [Section("Verdict", verdict_blocks(summary))]
    runr = run_rows(summary)
    if runr:
        secs.append(Section("Run", [("table", ["setting", "value"], runr)]))
    secs.append(Section("Slots: what filled each one, and do its answers mean anything?", [
        ("table", ["slot", "what fills it", "answers meaningful?"], slot_rows(summary)),
        ("p", "The verdicts are measured where they can be (the judge against counting documents on the "
              "validation questions of this run) and say plainly what a scripted or random-weight slot is.")]))
    secs.append(Section("Methods", [("table", METHOD_HEADERS, method_rows(summary)),
                                    ("p", f"EM 95% CI: bootstrap over questions. Failed questions: {FAILED_SCORE}.")]))
    frows = failure_rows(summary)
    if frows:
        secs.append(Section("Failed questions", [
            ("table", ["method", "failed", "by component"], frows),
            ("p", f"A question whose component failed (refused its input, or spent its retries) is recorded in "
                  f"trajectories/<method>.jsonl with the component and the error, and the run went on: {FAILED_SCORE}. "
                  "`--resume --retry-failed` runs them again.")]))
    drows = delta_rows(summary)
    if drows:
        secs.append(Section("Against native Search-R1 (paired over the same questions)",
                            [("table", DELTA_HEADERS, drows),
                             ("p", f"Failed questions: {FAILED_SCORE}; 'failed in either' counts the paired "
                                   "questions that failed in one method or both.")]))
    secs.append(Section("Cost per question by component", [("table", COMPONENT_HEADERS, component_rows(summary))]))
    s2g = summary.get("s2g_threshold")
    if s2g:
        blocks: list[tuple[Any, ...]] = []
        finite = np.isfinite(float(s2g.get("threshold") if s2g.get("threshold") is not None else np.nan))
        if s2g.get("val_states") is not None:
            what = (f"Frozen STOP threshold {fmt_num(s2g.get('threshold'))}" if s2g.get("feasible")
                    else f"No threshold reached the rule (never stop: highest score + 1 = "
                         f"{fmt_num(s2g.get('threshold'))})")
            blocks.append(("p", f"{what}, chosen per state on {s2g.get('val_questions')} validation questions "
                                f"({s2g.get('source')}, {s2g.get('val_states')} states 0..S-1, {s2g.get('val_positives')} "
                                f"right to stop) for STOP precision ≥ {s2g.get('min_precision')} with ≥ "
                                f"{s2g.get('min_stops')} STOP states"
                                + (f": validation precision {_fmt(s2g.get('val_precision'))} over "
                                   f"{s2g.get('val_stops')} STOP states, recall {_fmt(s2g.get('val_recall'))}"
                                   if s2g.get("feasible") else "")
                                + f"; stop AP {_fmt(s2g.get('val_ap'))}, Brier "
                                f"{_fmt(s2g.get('val_brier'))}, ECE-10 {_fmt(s2g.get('val_ece10'))}. "
                                f"Labels: {s2g.get('labels', '-')} (answer-only probe EM)."))
        elif s2g.get("reason"):
            blocks.append(("note", f"No S2G threshold: {s2g['reason']} ({s2g.get('source')})."))
        else:
            blocks.append(("p", f"STOP threshold {fmt_num(s2g.get('threshold'))} ({s2g.get('source')})."))
        if s2g.get("val_failed"):
            blocks.append(("note", f"{s2g['val_failed']} validation question(s) failed (a component refused them, or "
                                   "spent its retries) and are left out of the threshold's states."))
        if s2g.get("val_ranking_missing"):
            blocks.append(("note", s2g["val_ranking_missing"] + "."))
        v = s2g.get("judge_vs_doc_count")
        if v and not v.get("measured", True):
            blocks.append(("p", f"Judge against counting documents on the same validation states: {v['label']}."))
        elif v:
            blocks.append(("p", f"Judge against counting documents on the same validation states: stop AP "
                                f"{v['judge_ap']:.3f} vs {v['doc_count_ap']:.3f}, difference {v['delta']:+.3f} "
                                f"(95% CI over questions [{v['low']:+.3f}, {v['high']:+.3f}]); merged-tie AP "
                                f"{v.get('judge_ap_merged_ties', float('nan')):.3f} vs "
                                f"{v.get('doc_count_ap_merged_ties', float('nan')):.3f}. Verdict: {v['label']}."))
        if not finite or s2g.get("feasible") is False:
            blocks.append(("note", "S2G never stops early on this threshold's rule and equals native Search-R1 "
                                   "(the live hook can still stop at a state scoring above every validation score)."
                                   if finite else "S2G never stops early and equals native Search-R1."))
        secs.append(Section("S2G threshold", blocks))
    for key, title in (("break_even", "Does the judge pay for itself?"),
                       ("stepgap_balance", "Does StepGap's checker pay for itself?")):
        if summary.get(key):
            head, *rest = summary[key]["text"].split("\n")
            secs.append(Section(title, [("p", head), ("list", [x.removeprefix("- ") for x in rest])]))
    secs.append(Section("What the numbers mean", [("list", MEANING)]))
    pblocks: list[tuple[Any, ...]] = [("img", p, CAPTIONS.get(p, "")) for p in plots]
    for name, why in (missing or {}).items():
        pblocks.append(("note", f"{name} was not drawn: {why}."))
    secs.append(Section("Plots", pblocks))
    return secs


def _md_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def cell(x: str) -> str:
        return str(x).replace("|", "\\|")

    out = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_markdown(summary: Mapping[str, Any], out_dir: Path, plots: Sequence[str],
                   missing: Mapping[str, str] | None = None) -> Path:
    """report.md: verdict, run, slots, tables with CIs, S2G threshold, break-even, meaning, captioned plots."""
    lines = ["# ragfast bench report", ""]
    for sec in report_sections(summary, plots, missing):
        lines += [f"## {sec.title}", ""]
        for b in sec.blocks:
            if b[0] == "p":
                lines += [b[1], ""]
            elif b[0] == "note":
                lines += [f"> {b[1]}", ""]
            elif b[0] == "list":
                lines += [f"- {x}" for x in b[1]] + [""]
            elif b[0] == "table":
                lines += [_md_table(b[1], b[2]), ""]
            elif b[0] == "img":
                lines += [f"![{b[1]}]({b[1]})", "", f"*{b[2]}*" if b[2] else "", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return path


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
table{border-collapse:collapse;font-size:13px;margin:.6em 0}td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top}
th{background:#f3f3f3;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
figure{margin:1.2em 0;max-width:760px}figure img{max-width:100%;border:1px solid #eee}
figcaption{font-size:13px;color:#444;margin-top:.3em}.note{background:#fff8e1;border-left:4px solid #f0b400;
padding:.4em .8em;font-size:14px}nav a{margin-right:1em;font-size:14px}.sub{color:#666;font-size:14px}
"""


def _is_num(s: str) -> bool:
    t = str(s).strip().lstrip("[+-").replace(",", "").replace("]", "")
    try:
        float(t.split()[0])
        return True
    except (ValueError, IndexError):
        return False


def write_html(summary: Mapping[str, Any], out_dir: Path, plots: Sequence[str],
               missing: Mapping[str, str] | None = None) -> Path:
    """report.html: one self-contained page (plots inline as base64) with everything of report.md."""
    import base64

    e = html.escape
    secs = report_sections(summary, plots, missing)
    parts = ["<!doctype html><html lang='en'><head><meta charset='utf-8'>",
             "<meta name='viewport' content='width=device-width, initial-scale=1'>",
             "<title>ragfast bench report</title><style>" + _CSS + "</style></head><body>",
             "<h1>ragfast bench report</h1>"]
    run = summary.get("run", {})
    if run:
        parts.append(f"<p class='sub'>{e(str(run.get('n_questions')))} questions of {e(str(run.get('data')))}, "
                     f"{e(str(run.get('corpus_size')))} passages; {len(summary.get('methods', {}))} methods. "
                     "Numbers come from summary.json in the same directory; nothing is recomputed here.</p>")
    parts.append("<nav>" + "".join(f"<a href='#s{i}'>{e(s.title.split(':')[0])}</a>" for i, s in enumerate(secs))
                 + "</nav>")
    for i, sec in enumerate(secs):
        parts.append(f"<h2 id='s{i}'>{e(sec.title)}</h2>")
        for b in sec.blocks:
            if b[0] == "p":
                parts.append(f"<p>{e(b[1])}</p>")
            elif b[0] == "note":
                parts.append(f"<p class='note'>{e(b[1])}</p>")
            elif b[0] == "list":
                parts.append("<ul>" + "".join(f"<li>{e(x)}</li>" for x in b[1]) + "</ul>")
            elif b[0] == "table":
                parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in b[1]) + "</tr>")
                for r in b[2]:
                    parts.append("<tr>" + "".join(
                        f"<td class='num'>{e(str(c))}</td>" if j and _is_num(c) else f"<td>{e(str(c))}</td>"
                        for j, c in enumerate(r)) + "</tr>")
                parts.append("</table>")
            elif b[0] == "img":
                data = base64.b64encode((out_dir / b[1]).read_bytes()).decode("ascii")
                parts.append(f"<figure><img src='data:image/png;base64,{data}' alt='{e(b[1])}'>"
                             f"<figcaption><b>{e(b[1])}</b>: {e(b[2])}</figcaption></figure>")
    parts.append("</body></html>")
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path

"""``ragfast bench``: all four methods on the same questions, with every cost measured.

One run = one output directory::

    trajectories/<method>.jsonl   one line per finished question (written as it finishes)
    ledgers/<method>.jsonl        every cost record of that method (question-attributed ones are
                                  appended when their question finishes, so a crash loses none)
    s2g_threshold.json            the frozen STOP threshold and how it was chosen
    s2g_states.jsonl              the study's states 0..S-1 (validation and test), one line each
    s2g_judges.json               the study's S2G figures, computed from s2g_states.jsonl
    summary.json, summary.csv, report.md, report.html, *.png

``--resume`` re-reads what is on disk and runs only the questions each method has not finished;
a finished bench resumed does no new work.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.comparison.verdict import CHECKS, checker_balance, projection, verdict
from ragfast.accounting.ledger import COMPONENTS
from ragfast.errors import DataError, RagfastError
from ragfast.outputs.failures import FAILED_SCORE, answered, failure_counts, failure_of
from ragfast.methods.base import BUILTIN_PACKAGES, Slots, get
from ragfast.methods.s2g.method import s2g_analysis, select_s2g_threshold
from ragfast.outputs.outdir import LOCK_FILE
from ragfast.runner.recording import load_ledger
from ragfast.runner.run_methods import (build_slots, check_resumable, in_question_order, run_config, run_fingerprint,
                                    run_methods)
from ragfast.runner.settings import PRESETS, RunSettings, check_paths, make_config
from ragfast.outputs.results import dumps as json_dumps

log = logging.getLogger(__name__)

#: The built-in methods, in the order the bench runs them (the registry: :mod:`ragfast.methods.base`).
METHODS = BUILTIN_PACKAGES

#: The bench's settings are the one :class:`~ragfast.runner.settings.RunSettings` (the old name stays).
BenchConfig = RunSettings

__all__ = ["BenchConfig", "RunSettings", "METHODS", "PRESETS", "make_config", "check_paths", "Slots", "build_slots",
           "select_s2g_threshold", "s2g_analysis", "bench_fingerprint", "load_ledger", "run_bench", "summarise",
           "method_summary", "write_outputs", "in_question_order"]


def bench_fingerprint(cfg: RunSettings, run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a bench's results (:func:`ragfast.runner.run_methods.run_fingerprint`)."""
    return run_fingerprint(cfg, run_cfg)


# -- summary ---------------------------------------------------------------------------------
def _cost_row(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {"calls": 0.0, "tokens": 0.0, "flops": 0.0, "seconds": 0.0}
    for r in rows:
        out["calls"] += r.get("calls", 0)
        out["tokens"] += r.get("tokens", r.get("input_tokens", 0) + r.get("cached_tokens", 0) + r.get("output_tokens", 0))
        out["flops"] += r.get("flops", 0)
        out["seconds"] += r.get("seconds", 0)
        if r.get("unknown"):
            # calls whose compute a remote server did not report: FLOPs and tokens are a floor
            out["unknown"] = out.get("unknown", 0) + r["unknown"]
    return out


def question_cost(traj: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """component -> {calls, tokens, flops, seconds} of one trajectory record."""
    return {c: _cost_row([v]) for c, v in traj.get("cost", {}).items()}


def method_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """EM, F1, searches and per-component cost totals of one method's trajectory records, and its
    failed questions by component (each scores 0 in EM and F1; its cost is what it spent)."""
    n = len(records)
    failed = failure_counts(records)
    per_comp: dict[str, list[dict[str, float]]] = {}
    for r in records:
        for c, v in question_cost(r).items():
            per_comp.setdefault(c, []).append(v)
    cost = {c: _cost_row(per_comp[c]) for c in COMPONENTS if c in per_comp}
    cost["total"] = _cost_row(list(cost.values()))
    return {
        "em": float(np.mean([r["em"] for r in records])) if n else float("nan"),
        "f1": float(np.mean([r["f1"] for r in records])) if n else float("nan"),
        "searches_per_question": float(np.mean([r["searches"] for r in records])) if n else float("nan"),
        "n_questions": n,
        "failures": {"count": sum(failed.values()), "by_component": failed, "scored": FAILED_SCORE},
        "cost": cost,
    }


def _paired(a: np.ndarray, b: np.ndarray, cfg: RunSettings) -> dict[str, float] | None:
    from ragfast.scoring.stats import paired_bootstrap

    if len(a) < 2:
        return None
    r = paired_bootstrap(a, b, n_resamples=cfg.n_resamples, seed=cfg.seed)
    return {"delta": float(r.delta), "low": float(r.low), "high": float(r.high)}


def method_cis(records: Sequence[Mapping[str, Any]], cfg: RunSettings) -> dict[str, dict[str, float]]:
    """95% bootstrap CIs (over questions) of a method's EM and its total FLOPs / seconds per question."""
    from ragfast.scoring.stats import paired_bootstrap

    if len(records) < 2:
        return {}
    cols = {"em": [r["em"] for r in records],
            "flops_per_q": [sum(v["flops"] for v in question_cost(r).values()) for r in records],
            "seconds_per_q": [sum(v["seconds"] for v in question_cost(r).values()) for r in records]}
    out = {}
    for k, v in cols.items():
        b = paired_bootstrap(np.asarray(v, dtype=np.float64), n_resamples=min(cfg.n_resamples, 5000), seed=cfg.seed)
        out[k] = {"low": float(b.low), "high": float(b.high)}
    return out


def compare_to_native(records: Mapping[str, Sequence[Mapping[str, Any]]], cfg: RunSettings) -> dict[str, dict[str, Any]]:
    """ΔEM, ΔFLOPs and Δseconds per question against native Search-R1, paired by question id."""
    if "searchr1" not in records:
        return {}
    base = {r["id"]: r for r in records["searchr1"]}
    out = {}
    for m, recs in records.items():
        if m == "searchr1":
            continue
        ids = [r["id"] for r in recs if r["id"] in base]
        if not ids:
            continue
        mine = {r["id"]: r for r in recs}
        failed_either = sum(1 for i in ids if failure_of(mine[i]) is not None or failure_of(base[i]) is not None)

        def col(src: Mapping[str, Any], key: Callable[[Mapping[str, Any]], float]) -> np.ndarray:
            return np.array([key(src[i]) for i in ids], dtype=np.float64)

        def tot(field: str) -> Callable[[Mapping[str, Any]], float]:
            return lambda r: sum(v[field] for v in question_cost(r).values())

        out[m] = {
            "n_paired": len(ids),
            "n_failed_either": failed_either,  # scored 0 where they failed (FAILED_SCORE)
            "delta_em": _paired(col(mine, lambda r: r["em"]), col(base, lambda r: r["em"]), cfg),
            "delta_searches": _paired(col(mine, lambda r: r["searches"]), col(base, lambda r: r["searches"]), cfg),
            "delta_flops": _paired(col(mine, tot("flops")), col(base, tot("flops")), cfg),
            "delta_seconds": _paired(col(mine, tot("seconds")), col(base, tot("seconds")), cfg),
        }
    return out


# -- the main job ----------------------------------------------------------------------------
def run_bench(cfg: RunSettings, *, resume: bool = False, console: Any = None, progress: bool = True,
              table: bool = True, components: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run every method of ``cfg`` on the same questions and write the report.

    Parameters
    ----------
    cfg : RunSettings
    resume : bool
        Continue the run in ``cfg.out``: finished questions are read back, not run again.
    console : rich.console.Console, optional
    progress : bool
        Show progress bars (False: messages only; ``--no-progress``).
    table : bool
        Print the results table on stdout (``--json`` prints the summary instead).
    components : mapping, optional
        Slots filled with objects the caller built (:func:`ragfast.runner.run_methods.build_slots`).

    Returns
    -------
    dict
        The content of ``summary.json``.
    """
    from rich.console import Console

    from ragfast.infra.logs import run_log

    console = console or Console(stderr=True)
    check_paths(cfg, tuple(components or ()))
    out = Path(cfg.out)
    # The log of a run that failed before doing any work does not make the directory a run.
    if out.exists() and any(p.name not in ("ragfast.log", LOCK_FILE) for p in out.iterdir()) and not resume:
        raise DataError(f"{out} already holds a bench run; pass --resume to continue it, or choose another --out")
    fp = run_fingerprint(cfg, run_config(cfg))
    if resume:  # refused before the log opens: a refused resume leaves every file as it was
        check_resumable(out, fp, cfg.methods)
    out.mkdir(parents=True, exist_ok=True)
    with run_log(out):
        log.info("bench: %s -> %s (resume=%s)", cfg.data, out, resume)
        return _run_bench(cfg, out, resume, console, progress, fp, table, components)


def _run_bench(cfg: RunSettings, out: Path, resume: bool, console: Any, progress: bool,
               fp: Mapping[str, Any], table: bool, components: Mapping[str, Any] | None) -> dict[str, Any]:
    from rich.console import Console

    t0 = time.perf_counter()
    done = run_methods(cfg, cfg.methods, out, resume=resume, console=console, progress=progress, fingerprint=fp,
                       components=components)
    judge_verdict(done.slot_info, out)
    summary = summarise(cfg, done.records, done.slot_info, out)
    summary["run"] = run_info(cfg, done.slots, time.perf_counter() - t0)
    # What this process ran (the rest was read back on --resume) and, on Ray, how.
    summary["run"]["this_run_questions"] = done.this_run
    if done.ray:
        summary["run"]["ray"] = done.ray
    write_outputs(summary, out, done.records)
    from ragfast.comparison import report

    if table:
        report.print_table(summary, Console())
    console.print(f"results in [bold]{out}[/]: summary.json, summary.csv, report.md, report.html, plots, "
                  f"trajectories/, ragfast.log")
    line = report.failures_line(summary)
    if line:
        console.print(line, highlight=False, soft_wrap=True)  # one line, whatever the terminal's width
    check_not_all_failed(summary, done.records)
    return summary


def check_not_all_failed(summary: Mapping[str, Any], records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """Refuse a run in which some method answered none of its questions (every one failed).

    Raises
    ------
    RagfastError
        One line naming the method, the components and the last error (the files are written).
    """
    for m, recs in records.items():
        s = summary["methods"][m]
        if recs and s["failures"]["count"] == len(recs):
            last = failure_of(recs[-1]) or {}
            by = ", ".join(f"{c} {k}" for c, k in s["failures"]["by_component"].items())
            raise RagfastError(f"{m}: every one of its {len(recs)} questions failed ({by}; last: "
                               f"{last.get('component')}: {last.get('error')}: {last.get('message')}); nothing was "
                               "answered: fix the component, then rerun with --resume --retry-failed")


def run_info(cfg: RunSettings, slots: Slots, wall_seconds: float) -> dict[str, Any]:
    """What a reader needs to reproduce the run: data, sizes, settings, versions, machine."""
    import platform

    import ragfast

    info: dict[str, Any] = {"data": cfg.data, "n_questions": len(slots.questions),
                            "corpus_size": len(slots.corpus or ()),
                            "budget": cfg.budget, "topk": cfg.topk, "wall_seconds": wall_seconds,
                            "val_limit": cfg.val_limit, "seed": cfg.seed, "ragfast": ragfast.__version__,
                            "python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    from ragfast.models.memory_budget import rss_peak_bytes

    info["memory_budget"] = cfg.memory_budget
    info["rss_peak_bytes"] = rss_peak_bytes()  # this process's peak so far (the reasoner's own: slots.reasoner.memory)
    return info


def judge_verdict(slot_info: dict[str, Any], out: Path) -> None:
    """Set the judge slot's verdict from its measured validation ranking (s2g_threshold.json).

    Without a validation pass (a given --threshold, or no s2g method) the verdict says it was
    not measured; the judge's own description is never taken as the verdict.
    """
    from ragfast.outputs.results import answers_label

    judge = slot_info.get("judge")
    if not judge or judge.get("name") == "none":
        return
    path = out / "s2g_threshold.json"
    measured = json.loads(path.read_text(encoding="utf-8")).get("judge_vs_doc_count") if path.exists() else None
    if measured and measured.get("measured", True):
        judge["meaningful"] = bool(measured["meaningful"]) and judge.get("meaningful", True)
        judge["verdict"] = measured["label"] if judge["meaningful"] or measured["label"].startswith("NO") else \
            answers_label({k: v for k, v in judge.items() if k != "verdict"})
        judge["ranking_vs_doc_count"] = measured
    elif judge.get("meaningful", True):
        judge["verdict"] = (measured or {}).get("label") or "not measured in this run (no S2G validation pass)"
    judge["answers_meaningful"] = answers_label(judge)


def summarise(cfg: RunSettings, records: Mapping[str, Sequence[Mapping[str, Any]]], slot_info: Mapping[str, Any],
              out: Path) -> dict[str, Any]:
    """summary.json's content: per-method metrics and costs, deltas against native, slots."""
    methods = {m: method_summary(recs) for m, recs in records.items()}
    for m, recs in records.items():
        methods[m]["ci"] = method_cis(recs, cfg)
    for m, d in compare_to_native(records, cfg).items():
        methods[m].update(d)
    for m, recs in records.items():  # each method's own section (StepGap's labels and checker cost...)
        section = get(m)(cfg).report(answered(recs))
        if section is not None:
            methods[m]["report"] = section
    summary: dict[str, Any] = {"methods": methods, "slots": dict(slot_info)}
    for path in (out / "s2g_threshold.json", out / "s2g_analysis.json", out / "s2g_judges.json"):
        if path.exists():
            summary[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    if "searchr1" in records:
        for method, key, _ in CHECKS:
            if method in records:
                summary[key] = checker_balance(records["searchr1"], records[method], method, slot_info, cfg)
    # the verdict the report opens with: measured above, projected for a 7B on an H200 here
    summary["projection"] = projection(records, slot_info, cfg)
    summary["verdict"] = verdict(summary)
    return summary


def write_outputs(summary: dict[str, Any], out: Path, records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """summary.json, summary.csv, the plots, report.md and report.html."""
    from ragfast.comparison import report

    plots, missing = report.write_plots(summary, out)
    summary["plots"] = plots
    summary["plots_missing"] = missing
    tmp = out / "summary.json.tmp"
    # NaN (an undefined statistic) as null: bare NaN is not JSON (JSON.parse refuses the file).
    tmp.write_text(json_dumps(summary, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    report.write_csv(summary, out / "summary.csv")
    report.write_markdown(summary, out, plots, missing)
    report.write_html(summary, out, plots, missing)


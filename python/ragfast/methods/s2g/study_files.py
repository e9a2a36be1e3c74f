"""``s2g_states.jsonl`` and ``s2g_judges.json`` in a results directory, and their report section.

The figures of ``s2g_judges.json`` are computed from exactly the lines of ``s2g_states.jsonl``
(:func:`ragfast.methods.s2g.study.evaluate_lines`), re-read from disk.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ragfast.errors import DataError
from ragfast.methods.s2g.study import (JUDGES_FILE, STATES_FILE, ThresholdError, choose_threshold, evaluate_lines,
                                       json_clean, ranking_metrics, read_state_lines, state_arrays, state_lines,
                                       threshold_record, write_state_lines)

__all__ = ["ensure_state_lines", "validation_threshold", "add_test_states", "write_judges", "given_threshold",
           "merge_teacher_labels", "render_study", "fmt_figure"]


def ensure_state_lines(results_dir: str | Path, recorded: Any, judge: str = "recorded") -> list[dict[str, Any]]:
    """The directory's ``s2g_states.jsonl``; built from ``recorded`` (the directory's
    :class:`~ragfast.methods.s2g.states.RecordedStates`, scores under ``judge``) and the native
    trajectories, and written, when a run predates it."""
    d = Path(results_dir)
    p = d / STATES_FILE
    if p.exists():
        return read_state_lines(p)
    write_state_lines(p, state_lines(recorded, judge, trajectories=_native(d)))
    return read_state_lines(p)


def validation_threshold(lines: Sequence[Mapping[str, Any]], judge: str, *, min_precision: float = 0.90,
                         val_questions: int, source: str, n_resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """``s2g_threshold.json`` of a bench: the frozen threshold on the validation lines, their
    ranking figures, and the judge's ranking against counting documents (the slot's verdict).

    Where no threshold can be chosen (no validation question searched, one label class) the
    threshold is ``inf`` (S2G never stops) and ``reason`` says why: the bench's other methods
    still run.
    """
    from ragfast.methods.s2g.doc_count import judge_vs_doc_count

    try:
        info = threshold_record(choose_threshold(lines, judge, "probe", min_precision=min_precision), judge=judge,
                                source=source, val_questions=val_questions)
    except ThresholdError as e:
        info = threshold_record(None, judge=judge, source=source, val_questions=val_questions, given=float("inf"),
                                reason=f"{e}; S2G runs without stopping early")
        info["min_precision"] = min_precision
    a = state_arrays([x for x in lines if x["split"] == "val"])
    none = np.full(a["lines"], np.nan)
    sc, lab = a["scores"].get(judge, none), a["labels"].get("probe", none)
    keep = ~np.isnan(a["state"]) & ~np.isnan(sc) & ~np.isnan(lab)
    sc, lab, grp = sc[keep], lab[keep], a["q"][keep]
    if sc.size:
        r = ranking_metrics(lab, sc)
        info.update(val_ap=r["ap"], val_brier=r["brier"], val_ece10=r["ece10"])
    else:
        info["val_ranking_missing"] = "no scored validation state: no AP, Brier or calibration figure"
    # The judge's slot label comes from this measurement, not from what the judge says of itself.
    verdict = (judge_vs_doc_count(sc, lab.astype(np.int64), grp, n_resamples=n_resamples, seed=seed)
               if sc.size else None)
    info["judge_vs_doc_count"] = verdict.to_dict() if verdict is not None else None
    return info


def add_test_states(out: str | Path, rec: Any, trajectories: Sequence[Any], judge: str, *,
                    min_precision: float = 0.90, n_resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """A bench's test states join its validation states in ``s2g_states.jsonl``; ``s2g_judges.json``
    is computed from that file. Returns the calibration figure's fields (the test ECE-10 bins)
    or ``calibration_missing`` with the reason."""
    p = Path(out) / STATES_FILE
    lines = [x for x in read_state_lines(p) if x["split"] == "val"] if p.exists() else []
    write_state_lines(p, lines + state_lines(rec, judge, trajectories=trajectories))
    study = write_judges(out, min_precision=min_precision, n_resamples=n_resamples, seed=seed)
    test = ((study["judges"].get(judge) or {}).get("probe") or {}).get("test")
    if test and test["states"]:
        return {"calibration": test["calibration"], "ece": test["ece10"], "brier": test["brier"], "ap": test["ap"],
                "calibration_states": f"test states 0..S-1 ({STATES_FILE})"}
    return {"calibration_missing": "no judge-scored test state (no test question searched): no calibration figure"}


def _native(d: Path) -> list[Any]:
    from ragfast.methods.s2g.labelling import native_trajectories

    try:
        return native_trajectories(d)[0]
    except DataError:
        return []


def given_threshold(results_dir: str | Path) -> float | None:
    """The threshold of ``s2g_threshold.json`` when it was given, not selected (else None)."""
    p = Path(results_dir) / "s2g_threshold.json"
    if not p.exists():
        return None
    info = json.loads(p.read_text(encoding="utf-8"))
    if str(info.get("source", "")).startswith("given"):
        return float(info["threshold"])
    return None


def write_judges(results_dir: str | Path, *, min_precision: float = 0.90, min_stops: int = 10,
                 n_resamples: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Compute ``s2g_judges.json`` from the directory's ``s2g_states.jsonl`` and write it."""
    d = Path(results_dir)
    lines = read_state_lines(d / STATES_FILE)
    if merge_teacher_labels(d, lines):
        write_state_lines(d / STATES_FILE, lines)
    out = evaluate_lines(lines, min_precision=min_precision, min_stops=min_stops,
                         given_threshold=given_threshold(d), n_resamples=n_resamples, seed=seed)
    out["states_file"] = STATES_FILE
    (d / JUDGES_FILE).write_text(json.dumps(json_clean(out), indent=1) + "\n", encoding="utf-8")
    return out


def merge_teacher_labels(results_dir: str | Path, lines: list[dict[str, Any]]) -> int:
    """Copy ``teacher`` labels from the directory's ``labelled_states.jsonl`` (``ragfast
    label-states``) into the lines with the same question and state; returns how many changed.

    A labelled state ``s`` holds the evidence after ``s`` searches, as a study state does.
    """
    from ragfast.methods.s2g.labelling import load_labelled_states

    p = Path(results_dir) / "labelled_states.jsonl"
    if not p.exists():
        return 0
    teacher = {(x.id, x.state): x.labels["teacher"] for x in load_labelled_states(p)
               if x.labels.get("teacher") is not None}
    n = 0
    for x in lines:
        v = teacher.get((x["question_id"], x["state"]))
        if v is not None and x["labels"].get("teacher") != int(v):
            x["labels"]["teacher"] = int(v)
            n += 1
    return n


def fmt_figure(x: Any, nd: int = 4) -> str:
    """A figure for a table: ``n/a`` for None/NaN, ``never`` for +inf, else ``nd`` significant digits."""
    if x is None:
        return "n/a"
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return str(x)
    if math.isnan(xf):
        return "n/a"
    if math.isinf(xf):
        return "never" if xf > 0 else "-inf"
    return f"{xf:.{nd}g}"


_f = fmt_figure


def render_study(study: Mapping[str, Any], title: str = "## State ranking and system level, as the study defines them") -> str:
    """Markdown: the study's ranking and system-level tables, per judge and label source."""
    L = [f"{title} ({STATES_FILE}: states 0..S-1; {JUDGES_FILE})", "",
         f"Frozen threshold per validation state: precision >= {study['min_precision']} with >= "
         f"{study['min_stops']} STOP states, else never stop (highest score + 1). Stop AP keeps ties in input "
         "order; the merged-tie AP (sklearn) is an extra view.", "",
         "| judge | labels | split | states | positives | stop AP | AP, merged ties (extra) | Brier | ECE-10 | "
         "recall @P0.90 (threshold) | recall @P0.95 (threshold) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for j, per in study["judges"].items():
        for lab, e in per.items():
            for sp in ("val", "test"):
                if sp not in e:
                    continue
                r = e[sp]
                L.append(f"| {j} | {lab} | {sp} | {r['states']} | {r['positives']} | {_f(r['ap'])} | "
                         f"{_f(r['extra_ap_merged_ties_sklearn'])} | {_f(r['brier'])} | {_f(r['ece10'])} | "
                         f"{_f(r['recall_at_p90'])} ({_f(r['threshold_at_p90'])}) | "
                         f"{_f(r['recall_at_p95'])} ({_f(r['threshold_at_p95'])}) |")
    L += ["", "| judge | labels | frozen threshold | val precision (STOP states) | early stops: safe / unsafe | "
              "EM (native) | searches/q (native) | saved/q [95% CI] | first-safe-stop delay | "
              "per-question precision (extra) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for j, per in study["judges"].items():
        for lab, e in per.items():
            if "error" in e:
                L.append(f"| {j} | {lab} | none: {e['error']} | | | | | | | |")
                continue
            t, sy = e.get("threshold", {}), (e.get("test") or {}).get("system")
            vp = (f"{_f(t.get('val_precision'))} ({t.get('val_stops')})" if t.get("source") == "selected"
                  else "given")
            if sy is None:
                L.append(f"| {j} | {lab} | {_f(t.get('threshold'))} | {vp} | no test states | | | | | |")
                continue
            ci = sy.get("searches_saved_ci")
            L.append(f"| {j} | {lab} | {_f(t.get('threshold'))} | {vp} | {sy['safe_early_stops']} / "
                     f"{sy['unsafe_early_stops']} | {_f(sy['em'])} ({_f(sy['native_em'])}) | {_f(sy['searches'])} "
                     f"({_f(sy['native_searches'])}) | {_f(sy['searches_saved'])}"
                     + (f" [{_f(ci['low'])}, {_f(ci['high'])}]" if ci else "")
                     + f" | {_f(sy['first_safe_stop_delay'])} | "
                       f"{_f(e['test'].get('extra_first_crossing_precision_per_question'))} |")
    return "\n".join(L) + "\n"

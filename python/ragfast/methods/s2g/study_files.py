"""``s2g_states.jsonl`` and ``s2g_judges.json`` in a results directory, and their report section.

The figures of ``s2g_judges.json`` are computed from exactly the lines of ``s2g_states.jsonl``
(:func:`ragfast.methods.s2g.study.evaluate_lines`), re-read from disk.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from ragfast.errors import DataError
from ragfast.methods.s2g.study import (JUDGES_FILE, STATES_FILE, evaluate_lines, json_clean, read_state_lines,
                                       state_lines, write_state_lines)

__all__ = ["ensure_state_lines", "write_judges", "given_threshold", "render_study"]


def ensure_state_lines(results_dir: str | Path, judge: str = "recorded") -> list[dict[str, Any]]:
    """The directory's ``s2g_states.jsonl``; built from ``states.jsonl`` and the native
    trajectories (scores under ``judge``) and written when a run predates it."""
    from ragfast.methods.s2g.loop import RecordedStates

    d = Path(results_dir)
    p = d / STATES_FILE
    if p.exists():
        return read_state_lines(p)
    rec = RecordedStates.load(d / "states.jsonl")
    trs = _native(d)
    write_state_lines(p, state_lines(rec, judge, trajectories=trs))
    return read_state_lines(p)


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
    out = evaluate_lines(lines, min_precision=min_precision, min_stops=min_stops,
                         given_threshold=given_threshold(d), n_resamples=n_resamples, seed=seed)
    out["states_file"] = STATES_FILE
    (d / JUDGES_FILE).write_text(json.dumps(json_clean(out), indent=1) + "\n", encoding="utf-8")
    return out


def _f(x: Any, nd: int = 4) -> str:
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

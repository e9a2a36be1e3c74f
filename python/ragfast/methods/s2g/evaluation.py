"""S2G's evaluation of a results directory: the reachability audit, the replay of the live
rule, the paired quality-cost-risk comparison and the cost balance (``ragfast report s2g``).

:func:`reachability` labels each state safe (probe EM = 1) or unsafe, and reports the fraction
of questions answerable before the native stop and the searches removable without changing the
answer. :func:`evaluate` assembles the four-part evaluation and the cost balance;
:func:`render_markdown` prints it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ragfast.errors import DataError
from ragfast.methods.s2g.states import RecordedStates, replay, replay_cost

__all__ = ["reachability", "cost_balance", "evaluate", "render_markdown", "NON_INFERIORITY_MARGIN"]

#: The S2G study's non-inferiority margin on EM: 2 points.
NON_INFERIORITY_MARGIN = 0.02

# ---------------------------------------------------------------------------------------------
# audit and evaluation
# ---------------------------------------------------------------------------------------------
def reachability(rec: RecordedStates) -> dict[str, Any]:
    """Candidate reachability: what an oracle stopping rule could gain.

    A state is safe when the answer-only probe from it is right (EM 1).

    Returns
    -------
    dict
        ``questions``; ``answerable_before_native_stop`` (fraction with a safe state before
        the native stop); ``native_correct``; ``searches``; ``removable_same_answer`` (searches
        after the earliest state whose probe gives the native answer, normalised) and its
        fraction; ``removable_no_em_loss`` (after the earliest state with probe EM >= native
        EM); ``safe_state_fraction`` over all states; ``oracle_em`` (stop at the earliest safe
        state, else native).
    """
    from ragfast.scoring.metrics import normalize_answer

    B, T = rec.scores.shape
    S = rec.native_searches.astype(np.int64)
    t_idx = np.arange(T)[None, :]
    valid = t_idx < rec.lengths[:, None]
    before = t_idx < S[:, None]
    safe = (rec.probe_em > 0) & valid
    same = np.zeros((B, T), dtype=bool)
    for b in range(B):
        nat = normalize_answer(rec.native_answers[b]) if rec.native_answers[b] is not None else None
        for t in range(int(rec.lengths[b])):
            a = rec.probe_answers[b][t]
            same[b, t] = (a is None and nat is None) or (a is not None and nat is not None and normalize_answer(a) == nat)
    same[np.arange(B), np.minimum(S, T - 1)] = True  # the native stop itself never changes the answer
    no_loss = ((rec.probe_em >= rec.native_em[:, None]) & valid) | same

    def first(mask: np.ndarray) -> np.ndarray:
        return np.where(mask.any(1), mask.argmax(1), S)

    rem_same = np.maximum(S - first(same & valid), 0)
    rem_noloss = np.maximum(S - first(no_loss & valid), 0)
    tot = int(S.sum())
    earliest_safe = np.where((safe & (t_idx <= S[:, None])).any(1), (safe & (t_idx <= S[:, None])).argmax(1), -1)
    oracle_em = np.where(earliest_safe >= 0, 1.0, rec.native_em)
    return {
        "questions": int(B), "searches": tot, "native_correct": float(rec.native_em.mean()) if B else float("nan"),
        "answerable_before_native_stop": float((safe & before).any(1).mean()) if B else float("nan"),
        "removable_same_answer": int(rem_same.sum()),
        "removable_same_answer_fraction": float(rem_same.sum() / tot) if tot else float("nan"),
        "removable_no_em_loss": int(rem_noloss.sum()),
        "removable_no_em_loss_fraction": float(rem_noloss.sum() / tot) if tot else float("nan"),
        "safe_state_fraction": float(safe.sum() / valid.sum()) if valid.sum() else float("nan"),
        "oracle_em": float(oracle_em.mean()) if B else float("nan"),
        "oracle_searches": float(np.where(earliest_safe >= 0, earliest_safe, S).mean()) if B else float("nan"),
    }


def _policy(rec: RecordedStates, threshold: float) -> dict[str, Any]:
    from ragfast.methods.s2g.policy import stop_precision_recall

    r = replay(rec, threshold)
    s, y, g = rec.state_table()
    p_state, r_state, n_state = stop_precision_recall(s, y, [threshold])
    p_first, r_first, _ = stop_precision_recall(s, y, [threshold], groups=g)
    early = int(r.early.sum())
    idx = r.stop_state
    at = np.where(idx >= 0, rec.probe_em[np.arange(idx.size), np.maximum(idx, 0)], 0.0)
    unsafe = int((r.early & (at <= 0)).sum())
    harmful = int((r.early & (rec.native_em > 0) & (r.em <= 0)).sum())
    return {"threshold": threshold, "questions": int(idx.size), "stops": int((idx >= 0).sum()), "early_stops": early,
            "unsafe_early_stops": unsafe, "unsafe_fraction": unsafe / early if early else float("nan"),
            "harmful_early_stops": harmful, "searches_saved": float((rec.native_searches - r.searches).sum()),
            "state_precision": float(p_state[0]), "state_recall": float(r_state[0]), "states_stopped": int(n_state[0]),
            "first_crossing_precision": float(p_first[0]), "first_crossing_recall": float(r_first[0])}


def _paired(em_new, em_old, sr_new, sr_old, *, n_resamples: int, seed: int, margin: float) -> dict[str, Any]:
    from ragfast.scoring.stats import non_inferiority, paired_bootstrap

    out: dict[str, Any] = {"questions": int(len(em_new)), "em_new": float(np.mean(em_new)),
                           "em_native": float(np.mean(em_old)), "searches_new": float(np.mean(sr_new)),
                           "searches_native": float(np.mean(sr_old))}
    if len(em_new) < 2:
        return out
    d_em = paired_bootstrap(em_new, em_old, n_resamples=n_resamples, seed=seed)
    d_sr = paired_bootstrap(np.asarray(sr_new, float), np.asarray(sr_old, float), n_resamples=n_resamples, seed=seed)
    ni = non_inferiority(d_em, margin)
    out.update(d_em=d_em.to_dict(), d_searches=d_sr.to_dict(), non_inferiority=ni.to_dict(),
               d_search_calls=int(np.sum(sr_new) - np.sum(sr_old)),
               d_searches_pct=float((np.sum(sr_new) - np.sum(sr_old)) / np.sum(sr_old) * 100) if np.sum(sr_old) else float("nan"))
    return out


def _sweep(rec: RecordedStates, threshold: float, *, n_resamples: int, seed: int, margin: float,
           n_thresholds: int = 41) -> list[dict[str, Any]]:
    """Replay of a grid of thresholds (score quantiles plus the frozen one and +inf), with
    paired CIs for every row from one shared set of resamples."""
    from ragfast.methods.s2g.policy import threshold_curve

    s, _, _ = rec.state_table()
    fin = s[np.isfinite(s)]
    grid = np.quantile(fin, np.linspace(0.0, 1.0, n_thresholds)) if fin.size else np.zeros(0)
    grid = np.unique(np.concatenate([grid, [threshold, np.inf]]))
    grid = grid[~np.isnan(grid)]
    cur = threshold_curve(rec.live_scores(), rec.probe_em, rec.native_em, rec.native_searches, grid, rec.lengths,
                          n_resamples=n_resamples, seed=seed, margin=margin)
    rows = cur.rows()
    for r in rows:
        r["frozen"] = bool(r["thresholds"] == threshold)
    return rows


def _comp(traj: Mapping[str, Any], comp: str, f: str) -> float:
    return float(traj.get("cost", {}).get(comp, {}).get(f, 0.0))


def cost_balance(native: Sequence[Mapping[str, Any]], s2g: Sequence[Mapping[str, Any]], *,
                 components: Mapping[str, str] | None = None, n_resamples: int = 10000,
                 seed: int = 0) -> dict[str, Any]:
    """Judge compute against the reasoner + retrieval compute the early stops saved.

    Paired by question id over the questions both runs finished, in FLOPs, tokens and seconds,
    each with a paired-bootstrap interval (:func:`ragfast.accounting.savings.balance`): a saving whose
    interval includes 0 is "no measurable saving", never a negative number. ``lines`` is the
    verdict as text; ``components`` marks which ones were measured, unknown or free.
    """
    from ragfast.accounting.savings import balance

    b = balance(native, s2g, spender="judge", components=components, n_resamples=n_resamples, seed=seed)
    out = b.to_dict()
    out["judge_calls"] = sum(float(((r.get("cost") or {}).get("judge") or {}).get("calls", 0)) for r in s2g)
    out["lines"] = b.lines()
    return out


def evaluate(results_dir: str | Path, *, n_resamples: int = 10000, seed: int = 0,
             margin: float = NON_INFERIORITY_MARGIN) -> dict[str, Any]:
    """The four-part S2G evaluation of a results directory written by ``ragfast study s2g``.

    Reads ``states.jsonl`` (recorded native states: scores and probe answers, split val/test),
    ``s2g_threshold.json``, and where present ``native.jsonl`` and ``s2g.jsonl`` (the live run)
    for measured costs.

    Returns
    -------
    dict
        ``reachability``, ``ranking`` (test states; val too), ``policy`` (val and test, with
        validation-versus-test precision), ``paired`` (replay on test, and live where run),
        ``cost`` (live run), ``threshold`` and ``replay_equals_live`` (per-question agreement).
    """
    from ragfast.outputs.results import read_results

    d = Path(results_dir)
    if not d.is_dir():
        raise DataError(f"{d} is not a directory")
    rec = RecordedStates.load(d / "states.jsonl")
    thr_path = d / "s2g_threshold.json"
    if not thr_path.exists():
        raise DataError(f"{thr_path} is missing (the frozen threshold of the run)")
    thr = json.loads(thr_path.read_text())
    threshold = float(thr["threshold"])
    split = np.array(rec.split)
    test = rec.subset(split == "test")
    val = rec.subset(split == "val") if (split == "val").any() else None
    out: dict[str, Any] = {"threshold": thr, "margin": margin}
    # The study's figures: from s2g_states.jsonl (built from states.jsonl for an older run).
    from ragfast.methods.s2g.study_files import ensure_state_lines, write_judges

    judge = str(thr.get("judge") or "recorded")
    ensure_state_lines(d, rec, judge)
    out["study"] = write_judges(d, min_precision=float(thr.get("min_precision") or 0.90),
                                min_stops=int(thr.get("min_stops") or 10), n_resamples=n_resamples, seed=seed)
    out["ranking"] = {sp: r for sp, r in (out["study"]["judges"].get(judge, {}).get("probe") or {}).items()
                      if sp in ("val", "test")}
    out["reachability"] = {"test": reachability(test)}
    out["policy"] = {"test": _policy(test, threshold)}
    if val is not None:
        out["reachability"]["val"] = reachability(val)
        out["policy"]["val"] = _policy(val, threshold)
    out["sweep"] = _sweep(test, threshold, n_resamples=n_resamples, seed=seed, margin=margin)
    rc = replay_cost(test, threshold)
    if rc is not None:
        out["cost_replay"] = rc
    r = replay(test, threshold)
    out["paired"] = {"replay": _paired(r.em, test.native_em, r.searches, test.native_searches,
                                       n_resamples=n_resamples, seed=seed, margin=margin)}
    live_path, nat_path = d / "s2g.jsonl", d / "native.jsonl"
    if live_path.exists() and nat_path.exists():
        live = read_results(live_path)
        native = read_results(nat_path)
        nat = {x["id"]: x for x in native}
        lv = [x for x in live if x["id"] in nat]
        out["paired"]["live"] = _paired(np.array([x["em"] for x in lv]), np.array([nat[x["id"]]["em"] for x in lv]),
                                        np.array([x["searches"] for x in lv]),
                                        np.array([nat[x["id"]]["searches"] for x in lv]),
                                        n_resamples=n_resamples, seed=seed, margin=margin)
        out["paired"]["live"]["judge_stops"] = sum(1 for x in lv if x.get("stop_reason") == "judge")
        out["cost"] = cost_balance(native, live, n_resamples=n_resamples, seed=seed)
        pos = {q: i for i, q in enumerate(test.ids)}
        agree = [(x["em"] == r.em[pos[x["id"]]]) and (x["searches"] == r.searches[pos[x["id"]]])
                 for x in lv if x["id"] in pos]
        out["replay_equals_live"] = {"questions": len(agree), "agree": int(sum(agree))}
    return out


def _f(x: Any, nd: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    try:
        xf = float(x)
    except (TypeError, ValueError):
        return str(x)
    return "n/a" if math.isnan(xf) else f"{xf:.{nd}g}"


def render_markdown(ev: Mapping[str, Any], manifest: Mapping[str, Any] | None = None) -> str:
    """The report as markdown (what ``ragfast report s2g`` writes to ``s2g_report.md``)."""
    L: list[str] = ["# S2G evaluation", ""]
    thr = ev["threshold"]
    L += [f"Frozen STOP threshold **{_f(thr.get('threshold'))}** ({thr.get('source', 'given')}"
          + (f"; min precision {thr['min_precision']} on {thr.get('val_questions')} validation questions"
             if thr.get("source") == "selected" else "") + ").", ""]
    if manifest:
        slots = manifest.get("slots", {})
        L += ["| slot | what fills it | meaningful |", "|---|---|---|"]
        for k, v in slots.items():
            L.append(f"| {k} | {v.get('name')} ({v.get('class')}) | {v.get('answers_meaningful', v.get('meaningful'))} |")
        L.append("")
    L += ["## 1. Candidate reachability (answer-only probe from every state)", "",
          "| split | questions | native EM | answerable before native stop | searches | removable, same answer | "
          "removable, no EM loss | safe states | oracle EM | oracle searches/q |", "|---|---|---|---|---|---|---|---|---|---|"]
    for sp, r in ev["reachability"].items():
        L.append(f"| {sp} | {r['questions']} | {_f(r['native_correct'])} | {_f(r['answerable_before_native_stop'])} | "
                 f"{r['searches']} | {r['removable_same_answer']} ({_f(r['removable_same_answer_fraction'])}) | "
                 f"{r['removable_no_em_loss']} ({_f(r['removable_no_em_loss_fraction'])}) | "
                 f"{_f(r['safe_state_fraction'])} | {_f(r['oracle_em'])} | {_f(r['oracle_searches'])} |")
    from ragfast.methods.s2g.study_files import render_study

    L += ["", render_study(ev["study"], "## 2. State ranking and system level, as the study defines them")]
    L += ["", "## 3. First-crossing replay of the live rule (the live loop judges states 0..S-1, before each search)", "",
          "| split | stops | early stops | unsafe early stops | unsafe fraction | harmful | searches saved | "
          "state precision | first-crossing precision | first-crossing recall |", "|---|---|---|---|---|---|---|---|---|---|"]
    for sp, r in ev["policy"].items():
        L.append(f"| {sp} | {r['stops']} | {r['early_stops']} | {r['unsafe_early_stops']} | {_f(r['unsafe_fraction'])} | "
                 f"{r['harmful_early_stops']} | {_f(r['searches_saved'])} | {_f(r['state_precision'])} "
                 f"({r['states_stopped']} states) | {_f(r['first_crossing_precision'])} | {_f(r['first_crossing_recall'])} |")
    if "val" in ev["policy"]:
        L += ["", f"Validation precision {_f(ev['policy']['val']['state_precision'])} vs test "
                  f"{_f(ev['policy']['test']['state_precision'])} (per state)."]
    L += ["", f"## 4. Paired quality-cost-risk (non-inferiority margin {ev['margin'] * 100:g} EM points)", "",
          "| run | questions | EM | native EM | ΔEM [95% CI] | searches/q | native | Δsearches/q [95% CI] | Δcalls | verdict |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for kind, p in ev["paired"].items():
        if "d_em" not in p:
            L.append(f"| {kind} | {p['questions']} | {_f(p['em_new'])} | {_f(p['em_native'])} | n/a | "
                     f"{_f(p['searches_new'])} | {_f(p['searches_native'])} | n/a | n/a | too few questions |")
            continue
        de, ds = p["d_em"], p["d_searches"]
        L.append(f"| {kind} | {p['questions']} | {_f(p['em_new'])} | {_f(p['em_native'])} | {_f(de['delta'])} "
                 f"[{_f(de['low'])}, {_f(de['high'])}] | {_f(p['searches_new'])} | {_f(p['searches_native'])} | "
                 f"{_f(ds['delta'])} [{_f(ds['low'])}, {_f(ds['high'])}] | {p['d_search_calls']} "
                 f"({_f(p['d_searches_pct'], 3)}%) | {p['non_inferiority']['verdict']} |")
    if ev.get("sweep"):
        rows = ev["sweep"]
        step = max(1, len(rows) // 12)
        show = [r for i, r in enumerate(rows) if i % step == 0 or r["frozen"] or i == len(rows) - 1]
        L += ["", "### Threshold sweep (replay on test; every threshold in s2g_report.json)", "",
              "| threshold | stops | early | unsafe early | EM | searches/q | ΔEM [95% CI] | Δsearches/q [95% CI] | non-inferior |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in show:
            mark = " (frozen)" if r["frozen"] else ""
            L.append(f"| {_f(r['thresholds'])}{mark} | {r['stops']} | {r['early_stops']} | {r['unsafe_early_stops']} | "
                     f"{_f(r['em'])} | {_f(r['searches'])} | {_f(r['d_em'])} [{_f(r['d_em_low'])}, {_f(r['d_em_high'])}] | "
                     f"{_f(r['d_searches'])} [{_f(r['d_searches_low'])}, {_f(r['d_searches_high'])}] | "
                     f"{'yes' if r['non_inferior'] else 'no'} |")
    if "replay_equals_live" in ev:
        a = ev["replay_equals_live"]
        L += ["", f"Replay agrees with the live run on {a['agree']} of {a['questions']} questions (EM and searches)."]
    if "cost_replay" in ev:
        c = ev["cost_replay"]
        L += ["", "## Cost estimate from replay (recorded per-state costs)", "",
              "| measure | saved (reasoner + retrieval, net of the answer-only turn) | judge | net | judge / saved | "
              "break-even judge cost | per judged state |", "|---|---|---|---|---|---|---|"]
        for f, unit in (("flops", "FLOPs"), ("seconds", "s")):
            x = c[f]
            saved = _f(x["saved"]) if x["saved"] >= 0 else f"none ({_f(-x['saved'])} extra)"
            L.append(f"| {unit} | {saved} | {_f(x['judge'])} | {_f(x['net'])} | {_f(x['judge_over_saved'])} | "
                     f"{_f(max(0.0, x['break_even_judge']))} | {_f(max(0.0, x['break_even_per_judge_call']))} |")
        L += ["", f"{c['judge_states']} judged states over {c['questions']} questions; the answer-only turn is "
                  "costed as the probe from that state (after the cached prefix where the reasoner shares "
                  "nested prefixes, as a local one does; re-reading the prefix otherwise, which makes the "
                  "saving conservative)."]
    if "cost" in ev:
        c = ev["cost"]
        L += ["", "## Total cost: does the judge pay for the searches it saves?", "",
              f"Paired over {c['questions']} questions ({c['checked_states']} judged states, "
              f"{int(c['judge_calls'])} judge ledger calls), per question with 95% bootstrap intervals:", ""]
        L += [f"- {line}" for line in c["lines"]]
    return "\n".join(L) + "\n"

"""How a trained reasoner behaves: protocol validity, searches, EM with and without search.

Reads two ``ragfast run searchr1`` output directories on the same questions: one with search
(the reference budget) and one closed-book (``--budget 0``), and reports:

- the fraction of generated turns that are valid Search-R1 actions (a ``<search>`` or an
  ``<answer>`` the reference's pattern parses; a search written in the answer-only turn is
  valid syntax and counted so), over all turns and over the free turns only (every turn but a
  final answer-only one, which the reasoner may open with a forced ``<answer>``);
- searches per question, EM, F1 and sub-EM;
- the paired 95% bootstrap CI (:func:`ragfast.scoring.stats.paired_bootstrap`, questions resampled) of
  the EM gain of search over closed-book;
- seconds per question of each run.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.errors import DataError
from ragfast.types import Trajectory

__all__ = ["load_trajectories", "protocol_stats", "evaluate_reasoner"]


def load_trajectories(run_dir: str | Path) -> list[Trajectory]:
    """The Search-R1 trajectories of a run directory: ``results.jsonl`` of ``run searchr1``, or
    ``trajectories/searchr1.jsonl`` of ``ragfast bench`` (:func:`ragfast.outputs.results.trajectories_path`)."""
    from ragfast.outputs.results import trajectories_path

    p = trajectories_path(run_dir, "searchr1")
    out = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (ValueError, TypeError, KeyError) as exc:
                raise DataError(f"{p}:{n}: not a trajectory ({exc})") from None
    if not out:
        raise DataError(f"{p} holds no trajectory")
    return out


def _valid(t: Any) -> bool:
    return t.action in ("search", "answer") or bool(t.extra.get("search_disabled")) or \
        bool(t.extra.get("search_cancelled"))


def protocol_stats(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """Valid-action fractions, searches per question, EM/F1 of ``trajs``."""
    turns = [t for tr in trajs for t in tr.turns]
    free = [t for tr in trajs for i, t in enumerate(tr.turns)
            if not (i == len(tr.turns) - 1 and tr.stop_reason not in ("answer", ""))]
    n = len(trajs)
    return {"questions": n, "turns": len(turns),
            "valid_action_fraction": float(np.mean([_valid(t) for t in turns])) if turns else None,
            "free_turns": len(free),
            "valid_action_fraction_free_turns": float(np.mean([_valid(t) for t in free])) if free else None,
            "searches_per_question": float(np.mean([tr.searches for tr in trajs])),
            "answered_fraction": float(np.mean([tr.answer is not None and tr.answer != "" for tr in trajs])),
            "stop_reasons": {r: sum(1 for tr in trajs if tr.stop_reason == r) for r in sorted({tr.stop_reason
                                                                                              for tr in trajs})},
            "em": float(np.mean([tr.em for tr in trajs])), "f1": float(np.mean([tr.f1 for tr in trajs])),
            "sub_em": float(np.mean([float(tr.extra.get("sub_em", 0.0)) for tr in trajs]))}


def _seconds_per_question(run_dir: Path, trajs: Sequence[Trajectory]) -> float | None:
    p = run_dir / "summary.json"
    if p.is_file():
        qps = json.loads(p.read_text()).get("questions_per_second")
        if qps:
            return round(1.0 / qps, 3)
    # No summary (a run stopped early): the seconds its ledger gave each question, all components.
    per = [sum(float(c.get("seconds", 0.0)) for c in tr.cost.values() if isinstance(c, dict)) for tr in trajs]
    return round(float(np.mean(per)), 3) if per and any(per) else None


def evaluate_reasoner(search_dir: str | Path, closed_dir: str | Path, *, n_resamples: int = 10000,
                      seed: int = 0) -> dict[str, Any]:
    """Protocol and EM of the search run, the closed-book run, and the paired CI of the EM gain.

    The closed-book run may hold more questions than the search run (a search run stopped
    early): both are then read on the search run's questions only.

    Raises
    ------
    DataError
        When the closed-book run lacks a question of the search run.
    """
    from ragfast.scoring.stats import paired_bootstrap

    sd, cd = Path(search_dir), Path(closed_dir)
    s, c = load_trajectories(sd), load_trajectories(cd)
    cs = {t.id: t for t in c}
    missing = [t.id for t in s if t.id not in cs]
    if missing:
        raise DataError(f"{cd} lacks {len(missing)} of the {len(s)} questions of {sd} (e.g. {missing[0]}): run it "
                        "closed-book on the same questions")
    # A closed-book run over more questions (it is cheap) is paired on the search run's ones.
    c = [cs[t.id] for t in s]
    em_s = np.array([t.em for t in s])
    em_c = np.array([cs[t.id].em for t in s])
    ci = paired_bootstrap(em_s, em_c, n_resamples=n_resamples, seed=seed)
    return {"search": {**protocol_stats(s), "seconds_per_question": _seconds_per_question(sd, s),
                       "dir": str(sd)},
            "closed_book": {**protocol_stats(c), "seconds_per_question": _seconds_per_question(cd, c),
                            "dir": str(cd)},
            "em_gain": {"delta": float(ci.delta), "low": float(ci.low), "high": float(ci.high),
                        "excludes_0": bool(ci.low > 0 or ci.high < 0),
                        "method": f"paired bootstrap over questions, {n_resamples} resamples, 95%"}}

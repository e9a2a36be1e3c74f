"""S2G on Search-R1: the STOP judge in the live loop.

:func:`run_s2g` runs the Search-R1 loop (:mod:`ragfast.methods.searchr1.loop`) with a
:class:`JudgeStopHook` as a pre-search hook. Whenever the reasoner decides to search, the judge
scores the state it searches from (batched: one judge call per turn over every trajectory about
to search). These are the study's states ``0..S-1``: state ``s`` holds the evidence after ``s``
searches, state 0 (nothing retrieved yet) included, and the state where the reasoner answers is
never judged. The FIRST state whose score is ``>=`` the frozen threshold stops the trajectory:
its search is not made, the session is rebuilt as it stood at that state (the generated search
turn is dropped, as the answer-only probe of :func:`ragfast.methods.s2g.states.probe_states`
never saw it), the next generation is the answer-only one, and ``stop_reason`` is ``"judge"``.
A stop at state ``s`` therefore means ``s`` searches, exactly as
:func:`ragfast.methods.s2g.states.replay` computes from ``s2g_states.jsonl``.

With ``gap_queries`` a judge that writes verdicts (``verdicts()``, e.g.
:class:`~ragfast.judges.causal.CausalJudge`) also steers: after each turn, for
trajectories it did not stop, the first three gap items (``"target slot"``, else the
description) are appended to the question and searched at once (an injected search, counted
against the budget). The state an injected search leads to is judged when the reasoner next
searches from it.

Recording, replay and the evaluation live in :mod:`ragfast.methods.s2g.states` and
:mod:`ragfast.methods.s2g.evaluation`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, blame
from ragfast.methods.s2g.states import prefix_pieces
from ragfast.types import Question, Trajectory

__all__ = ["JudgeStopHook", "run_s2g", "gap_query"]


def gap_query(question: str, gap_items: Sequence[Mapping[str, Any]], max_items: int = 3) -> str:
    """The next query from a verdict's gap items: the question plus ``"target slot"`` (or the
    description) of the first ``max_items`` items (PROTOCOLS.md, S2G)."""
    parts = []
    for g in list(gap_items)[:max_items]:
        ts = " ".join(str(g.get(k, "")).strip() for k in ("target", "slot")).strip()
        parts.append(ts or str(g.get("description", "")).strip())
    extra = " ".join(p for p in parts if p)
    return f"{question.strip()} {extra}".strip()


class JudgeStopHook:
    """Search-R1 loop hooks: judge the state each search starts from, stop at the first
    crossing (:meth:`pre_search`), optionally steer after a turn (``__call__``).

    Parameters
    ----------
    judge : ragfast.judges.base.Judge
    threshold : float
        Frozen STOP threshold (a state stops when ``score >= threshold``; NaN never stops).
    gap_queries : bool
        Inject a gap-item search for trajectories the judge lets continue (needs
        ``judge.verdicts``).

    Notes
    -----
    Every score lands in ``traj.extra["judge_scores"]`` (index = state; ``None`` for a state
    not judged, e.g. one left by an injected search, and for NaN), the number of judged states
    in ``traj.extra["judged_states"]``, and the stopping state in
    ``traj.extra["judge_stop_state"]``.
    """

    def __init__(self, judge: Any, threshold: float, *, gap_queries: bool = False, gap_max_new_tokens: int = 160):
        if threshold is None or (isinstance(threshold, float) and math.isnan(threshold)):
            raise ConfigError("the S2G threshold must be a number (+inf = never stop)")
        if gap_queries and not hasattr(judge, "verdicts"):
            raise ConfigError(f"gap_queries needs a judge that writes verdicts; {type(judge).__name__} has no verdicts()")
        self.judge = judge
        self.threshold = float(threshold)
        self.gap_queries = gap_queries
        self.gap_max_new_tokens = gap_max_new_tokens
        self.calls = 0
        self.states_scored = 0

    def pre_search(self, ctx: Any) -> None:
        """Judge, in one call, the state every trajectory in ``ctx.active`` is about to search
        from; stop those whose score reaches the threshold at that state."""
        items = [it for it in ctx.active if "judge_stop_state" not in it.traj.extra]
        if not items:
            return
        # The pending search is already the last turn: the state it starts from is the one before.
        states = [it.traj.states()[-2] for it in items]
        ids = [it.qid for it in items]
        with blame("judge", ids):
            scores = np.asarray(self.judge.stop_scores(states, ledger=ctx.ledger, question_ids=ids), dtype=np.float64)
        if scores.shape != (len(items),):
            raise RuntimeError(f"judge returned {scores.shape} scores for {len(items)} states")
        self.calls += 1
        self.states_scored += len(items)
        stop = []
        for it, st, s in zip(items, states, scores):
            ex = it.traj.extra
            sc = ex.setdefault("judge_scores", [])
            sc.extend([None] * (st.index - len(sc)))
            sc.append(None if math.isnan(s) else float(s))
            ex["judged_states"] = ex.get("judged_states", 0) + 1
            if s >= self.threshold:
                ex["judge_stop_state"] = st.index
                stop.append(it)
        if stop:
            ctx.restart(stop, [prefix_pieces(it.traj, it.traj.extra["judge_stop_state"]) for it in stop])
            ctx.force_answer(stop, "judge")

    def __call__(self, ctx: Any) -> None:
        if not self.gap_queries:
            return
        cont = [it for it in ctx.active if not it.done and not it.final
                and it.turns_used < ctx.loop.config.max_turns]
        if not cont:
            return
        states = [it.traj.states()[-1] for it in cont]
        with blame("judge", [it.qid for it in cont]):
            verdicts = self.judge.verdicts(states, self.gap_max_new_tokens, ledger=ctx.ledger,
                                           question_ids=[it.qid for it in cont])
        steer = [(it, v) for it, v in zip(cont, verdicts) if not v.sufficient and v.gap_items]
        if steer:
            ctx.search([it for it, _ in steer], [gap_query(it.traj.question, v.gap_items) for it, v in steer],
                       reason="gap")


def run_s2g(questions: Sequence[Question], generator: Any, retriever: Any, judge: Any, threshold: float,
            config: Any = None, *, gap_queries: bool = False, ledger: CostLedger | None = None,
            on_finish: Callable[[Trajectory], None] | None = None, skip_ids: Iterable[str] = ()) -> list[Trajectory]:
    """Run Search-R1 with the STOP judge in the loop.

    Parameters
    ----------
    questions : sequence of Question
    generator, retriever : the reasoner and retrieval slots (as for Search-R1)
    judge : ragfast.judges.base.Judge
    threshold : float
        The frozen STOP threshold.
    config : SearchR1Config, optional
    gap_queries : bool
        See :class:`JudgeStopHook`.
    ledger : CostLedger, optional
        Receives reasoner, retrieval and judge costs, per question.

    Returns
    -------
    list of Trajectory
        ``stop_reason == "judge"`` where the judge stopped it; ``extra["judge_scores"]``.
    """
    from ragfast.methods.searchr1.loop import SearchR1Loop

    hook = JudgeStopHook(judge, threshold, gap_queries=gap_queries)
    loop = SearchR1Loop(generator, retriever, config, ledger=ledger, hooks=[hook] if gap_queries else [],
                        pre_search_hooks=[hook.pre_search])
    trajs = loop.run(list(questions), on_finish=on_finish, skip_ids=skip_ids)
    for t in trajs:
        t.extra.setdefault("judge_scores", [])
        t.extra.setdefault("judged_states", 0)
        t.extra["threshold"] = float(threshold)
    return trajs

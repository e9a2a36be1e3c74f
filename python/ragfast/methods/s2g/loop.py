"""S2G on Search-R1: a STOP judge in the loop, counterfactual replay, and the reachability audit.

Live mode
---------
:func:`run_s2g` runs the Search-R1 loop (:mod:`ragfast.methods.searchr1.loop`) with a
:class:`JudgeStopHook`. After every turn the judge scores each running trajectory's new
retrieval states, batched over trajectories. The FIRST state whose score is ``>=`` the frozen
threshold stops the trajectory: its next generation is the answer-only one (search disabled),
and ``stop_reason`` is ``"judge"``. State 0 (nothing retrieved) is never scored: the judge
runs after retrievals. With ``gap_queries`` a judge that writes verdicts (``verdicts()``, e.g.
:class:`~ragfast.models.causal_judge.CausalJudge`) also steers: for trajectories it does not stop, the
first three gap items (``"target slot"``, else the description) are appended to the question
and searched at once (an injected search, counted against the budget).

Replay mode
-----------
:func:`record_states` takes native trajectories and records, per state ``t = 0..S``: the
judge's score (state 0 too, for the study's states 0..S-1; the live hook never sees it, so
:func:`replay` leaves it out) and the answer of the answer-only probe. The probe continues
the native session as it stood at state ``t`` (prompt, generated turns and observations up to
the t-th retrieval) with one forced final generation: exactly what the live loop does when the
judge stops at ``t``. So :func:`replay` evaluates any threshold counterfactually without
rerunning the reasoner, and equals the live run for a deterministic reasoner and judge.

Replay models the stop rule only: a live run with ``gap_queries`` changes the searches
themselves, which no recording of the native run can replay.

Audit
-----
:func:`reachability` labels each state safe (probe EM = 1) or unsafe, and reports the fraction
of questions answerable before the native stop and the searches removable without changing the
answer. :func:`evaluate` assembles the four-part evaluation and the cost balance that
``ragfast report s2g`` prints.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ragfast.cost import CostLedger
from ragfast.errors import ConfigError, DataError
from ragfast.types import Question, State, Trajectory

__all__ = ["JudgeStopHook", "run_s2g", "gap_query", "state_prefixes", "probe_states", "score_states",
           "RecordedStates", "record_states", "replay", "ReplayResult", "replay_cost", "reachability", "cost_balance",
           "evaluate", "render_markdown", "NON_INFERIORITY_MARGIN"]

#: The S2G study's non-inferiority margin on EM: 2 points.
NON_INFERIORITY_MARGIN = 0.02


# ---------------------------------------------------------------------------------------------
# live: the judge in the loop
# ---------------------------------------------------------------------------------------------
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
    """Search-R1 loop hook: score new states, stop at the first crossing, optionally steer.

    Parameters
    ----------
    judge : ragfast.models.Judge
    threshold : float
        Frozen STOP threshold (a state stops when ``score >= threshold``; NaN never stops).
    gap_queries : bool
        Inject a gap-item search for trajectories the judge lets continue (needs
        ``judge.verdicts``).

    Notes
    -----
    Every score lands in ``traj.extra["judge_scores"]`` (index = state, ``None`` for state 0
    and for NaN) and the stopping state in ``traj.extra["judge_stop_state"]``.
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

    def _score_pending(self, ctx: Any, items: Sequence[Any]) -> list[Any]:
        """Score every state not yet scored; return the items whose new states cross."""
        pend: list[tuple[Any, State]] = []
        for it in items:
            sc = it.traj.extra.setdefault("judge_scores", [None])
            for st in it.traj.states()[len(sc):]:
                pend.append((it, st))
        if not pend:
            return []
        scores = np.asarray(self.judge.stop_scores([st for _, st in pend], ledger=ctx.ledger,
                                                   question_ids=[it.qid for it, _ in pend]), dtype=np.float64)
        if scores.shape != (len(pend),):
            raise RuntimeError(f"judge returned {scores.shape} scores for {len(pend)} states")
        self.calls += 1
        self.states_scored += len(pend)
        stop: list[Any] = []
        for (it, st), s in zip(pend, scores):
            sc = it.traj.extra["judge_scores"]
            sc.append(None if math.isnan(s) else float(s))
            if "judge_stop_state" not in it.traj.extra and s >= self.threshold:
                it.traj.extra["judge_stop_state"] = st.index
                stop.append(it)
        return stop

    def __call__(self, ctx: Any) -> None:
        items = [it for it in ctx.active if not it.done and not it.final]
        stop = self._score_pending(ctx, items)
        if stop:
            ctx.force_answer(stop, "judge")
        if not self.gap_queries:
            return
        cont = [it for it in items if it not in stop and it.turns_used < ctx.loop.config.max_turns]
        if not cont:
            return
        states = [it.traj.states()[-1] for it in cont]
        verdicts = self.judge.verdicts(states, self.gap_max_new_tokens, ledger=ctx.ledger,
                                       question_ids=[it.qid for it in cont])
        steer = [(it, v) for it, v in zip(cont, verdicts) if not v.sufficient and v.gap_items]
        if not steer:
            return
        ctx.search([it for it, _ in steer], [gap_query(it.traj.question, v.gap_items) for it, v in steer],
                   reason="gap")
        again = self._score_pending(ctx, [it for it, _ in steer])
        if again:
            ctx.force_answer(again, "judge")


def run_s2g(questions: Sequence[Question], generator: Any, retriever: Any, judge: Any, threshold: float,
            config: Any = None, *, gap_queries: bool = False, ledger: CostLedger | None = None,
            on_finish: Callable[[Trajectory], None] | None = None, skip_ids: Iterable[str] = ()) -> list[Trajectory]:
    """Run Search-R1 with the STOP judge in the loop.

    Parameters
    ----------
    questions : sequence of Question
    generator, retriever : the reasoner and retrieval slots (as for Search-R1)
    judge : ragfast.models.Judge
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
    loop = SearchR1Loop(generator, retriever, config, ledger=ledger, hooks=[hook])
    trajs = loop.run(list(questions), on_finish=on_finish, skip_ids=skip_ids)
    for t in trajs:
        t.extra.setdefault("judge_scores", [None])
        t.extra["threshold"] = float(threshold)
    return trajs


# ---------------------------------------------------------------------------------------------
# replay: per-state probe answers and scores of recorded native trajectories
# ---------------------------------------------------------------------------------------------
def _as_traj(t: Trajectory | Mapping[str, Any]) -> Trajectory:
    return t if isinstance(t, Trajectory) else Trajectory.from_dict(dict(t))


def state_prefixes(traj: Trajectory | Mapping[str, Any]) -> list[str]:
    """The session text after the prompt, as it stood at each retrieval state ``0..S``.

    Prefix ``t`` holds every turn up to and including the t-th search: generated text,
    observation, and anything hooks appended, in the order the loop appended them.
    """
    tr = _as_traj(traj)
    out = [""]
    acc: list[str] = []
    for t in tr.turns:
        acc.append(t.generated or "")
        acc.append(t.observation or "")
        acc.extend(t.extra.get("appended", []) if isinstance(t.extra, dict) else [])
        if t.action == "search":
            out.append("".join(acc))
    return out


def _user_prompt(generator: Any, question: str) -> str:
    from ragfast.methods.searchr1.loop import build_prompt

    u = build_prompt(question)
    fmt = getattr(generator, "format_prompt", None)
    return fmt(u) if fmt else u


def probe_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], generator: Any, *,
                 max_new_tokens: int = 500, batch_size: int = 64, ledger: CostLedger | None = None
                 ) -> list[list[dict[str, Any]]]:
    """Answer-only probe from every state of every trajectory.

    Each probe continues the trajectory's session as it stood at state ``t`` and makes one
    forced final generation (the loop's answer-only turn: ``mark_final`` where the generator
    has it). Batched over all (trajectory, state) pairs.

    Returns
    -------
    list of list of dict
        Per trajectory, per state: ``{"answer", "em", "f1", "text", "flops", "seconds"}`` (the
        probe's own generation cost; it re-reads the state's prefix, which a live session has
        cached, so it overstates the live answer-only turn).
    """
    from ragfast.metrics import exact_match, extract_answer, f1
    from ragfast.methods.searchr1.loop import STOP

    trs = [_as_traj(t) for t in trajectories]
    jobs: list[tuple[int, int, str, str]] = []  # (traj, state, session id, prefix)
    for i, tr in enumerate(trs):
        for s, pre in enumerate(state_prefixes(tr)):
            jobs.append((i, s, f"{tr.id}\x00probe{s}", pre))
    out: list[list[dict[str, Any]]] = [[{} for _ in state_prefixes(tr)] for tr in trs]
    for lo in range(0, len(jobs), max(1, batch_size)):
        chunk = jobs[lo:lo + batch_size]
        ids = [j[2] for j in chunk]
        if hasattr(generator, "bind_questions"):
            generator.bind_questions({sid: Question(sid, trs[i].question, list(trs[i].golden_answers))
                                      for i, _, sid, _ in chunk})
        generator.start(ids, [_user_prompt(generator, trs[i].question) for i, _, _, _ in chunk])
        try:
            nonempty = [(sid, pre) for _, _, sid, pre in chunk if pre]
            if nonempty:
                generator.append([a for a, _ in nonempty], [b for _, b in nonempty])
            if hasattr(generator, "mark_final"):
                generator.mark_final(ids)
            sub = CostLedger()
            texts = generator.generate(ids, stop=STOP, max_new_tokens=max_new_tokens, ledger=sub)
        finally:
            generator.end(ids)
        per = sub.per_question()
        if ledger is not None:
            names = {sid: trs[i].id for i, _, sid, _ in chunk}
            for r in sub.records:
                r.question_id = names.get(r.question_id, r.question_id)
            ledger.merge(sub)
        for (i, s, sid, pre), text in zip(chunk, texts):
            ans = extract_answer(pre + text)
            golds = trs[i].golden_answers
            c = per.get(sid, {}).get("reasoner", {})
            out[i][s] = {"answer": ans, "em": float(exact_match(ans, golds)), "f1": float(f1(ans, golds)),
                         "text": text, "flops": float(c.get("flops", 0.0)), "seconds": float(c.get("seconds", 0.0))}
    return out


def score_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], judge: Any, *,
                 ledger: CostLedger | None = None, score_initial: bool = False) -> list[np.ndarray]:
    """Judge scores of every state of every trajectory, in one batched call.

    State 0 (nothing retrieved) is NaN unless ``score_initial``: the live judge never sees it.
    """
    return _score_states(trajectories, judge, ledger=ledger, score_initial=score_initial)[0]


def _score_states(trajectories, judge, *, ledger=None, score_initial=False):
    """Scores, plus the judge's (flops, seconds) per state from a per-state split of its ledger."""
    trs = [_as_traj(t) for t in trajectories]
    states, where = [], []
    for i, tr in enumerate(trs):
        for st in tr.states():
            if st.index == 0 and not score_initial:
                continue
            states.append(st)
            where.append((i, st.index))
    out = [np.full(len(tr.states()), np.nan) for tr in trs]
    costs = [np.zeros((len(tr.states()), 2)) for tr in trs]
    if states:
        sids = [f"{trs[i].id}\x00state{t}" for i, t in where]
        sub = CostLedger()
        sc = np.asarray(judge.stop_scores(states, ledger=sub, question_ids=sids), dtype=np.float64)
        if sc.shape != (len(states),):
            raise RuntimeError(f"judge returned {sc.shape} scores for {len(states)} states")
        per = sub.per_question()
        for (i, t), sid, s in zip(where, sids, sc):
            out[i][t] = s
            c = per.get(sid, {}).get("judge", {})
            costs[i][t] = (c.get("flops", 0.0), c.get("seconds", 0.0))
        if ledger is not None:
            names = dict(zip(sids, (trs[i].id for i, _ in where)))
            for r in sub.records:
                r.question_id = names.get(r.question_id, r.question_id)
            ledger.merge(sub)
    return out, costs


@dataclass
class RecordedStates:
    """Per-state scores and probe outcomes of recorded native trajectories (the replay table).

    Arrays are ``[B, T]`` with ``T`` = the most states any trajectory has; ``lengths[b] =
    S_b + 1`` (states 0..S_b). Padding is NaN in ``scores`` and 0 in ``probe_em``.
    """

    ids: list[str]
    scores: np.ndarray
    probe_em: np.ndarray
    probe_answers: list[list[str | None]]
    lengths: np.ndarray
    native_em: np.ndarray
    native_searches: np.ndarray
    native_answers: list[str | None]
    split: list[str] = field(default_factory=list)
    #: Optional [B, T, 2] (flops, seconds) per state: the judge scoring it, the probe's
    #: answer-only generation from it, and the native run's reasoner + retrieval cost after it.
    judge_cost: np.ndarray | None = None
    probe_cost: np.ndarray | None = None
    rest_cost: np.ndarray | None = None

    def __post_init__(self) -> None:
        B = len(self.ids)
        if self.scores.shape != self.probe_em.shape or self.scores.shape[0] != B:
            raise DataError(f"RecordedStates: scores {self.scores.shape} and probe_em {self.probe_em.shape} "
                            f"for {B} trajectories")
        if not self.split:
            self.split = ["test"] * B

    def subset(self, mask: Sequence[bool] | np.ndarray) -> "RecordedStates":
        m = np.asarray(mask, dtype=bool)
        pick = np.flatnonzero(m)
        cut = (lambda a: None if a is None else a[m])
        return RecordedStates([self.ids[i] for i in pick], self.scores[m], self.probe_em[m],
                              [self.probe_answers[i] for i in pick], self.lengths[m], self.native_em[m],
                              self.native_searches[m], [self.native_answers[i] for i in pick],
                              [self.split[i] for i in pick], cut(self.judge_cost), cut(self.probe_cost),
                              cut(self.rest_cost))

    def state_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flattened scored states: (scores, labels = probe EM, group = row index); state 0 and
        padding left out."""
        B, T = self.scores.shape
        valid = (np.arange(T)[None, :] < self.lengths[:, None]) & (np.arange(T)[None, :] >= 1)
        rows = np.broadcast_to(np.arange(B)[:, None], (B, T))
        return self.scores[valid], self.probe_em[valid].astype(np.int64), rows[valid]

    def live_scores(self) -> np.ndarray:
        """Scores as the live hook sees them: state 0 never scored (NaN), states 1..S as recorded."""
        sc = self.scores.copy()
        if sc.shape[1]:
            sc[:, 0] = np.nan
        return sc

    def to_records(self) -> list[dict[str, Any]]:
        out = []
        for b, qid in enumerate(self.ids):
            n = int(self.lengths[b])
            out.append({"id": qid, "split": self.split[b],
                        "scores": [None if math.isnan(x) else float(x) for x in self.scores[b, :n]],
                        "probe_em": [float(x) for x in self.probe_em[b, :n]],
                        "probe_answers": self.probe_answers[b][:n], "native_em": float(self.native_em[b]),
                        "native_searches": int(self.native_searches[b]), "native_answer": self.native_answers[b]})
            for name in ("judge_cost", "probe_cost", "rest_cost"):
                a = getattr(self, name)
                if a is not None:
                    out[-1][name] = a[b, :n].tolist()
        return out

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]]) -> "RecordedStates":
        if not records:
            raise DataError("no recorded states")
        T = max(len(r["scores"]) for r in records)
        B = len(records)
        sc = np.full((B, T), np.nan)
        pe = np.zeros((B, T))
        for b, r in enumerate(records):
            if len(r["probe_em"]) != len(r["scores"]):
                raise DataError(f"record {r.get('id')!r}: {len(r['scores'])} scores but {len(r['probe_em'])} probes")
            sc[b, :len(r["scores"])] = [np.nan if x is None else x for x in r["scores"]]
            pe[b, :len(r["probe_em"])] = r["probe_em"]
        costs = {}
        for name in ("judge_cost", "probe_cost", "rest_cost"):
            if all(name in r for r in records):
                a = np.zeros((B, T, 2))
                for b, r in enumerate(records):
                    a[b, :len(r[name])] = r[name]
                costs[name] = a
        return cls([str(r["id"]) for r in records], sc, pe, [list(r["probe_answers"]) for r in records],
                   np.array([len(r["scores"]) for r in records], dtype=np.int64),
                   np.array([r["native_em"] for r in records], dtype=np.float64),
                   np.array([r["native_searches"] for r in records], dtype=np.float64),
                   [r.get("native_answer") for r in records], [r.get("split", "test") for r in records], **costs)

    def save(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for r in self.to_records():
                f.write(json.dumps(r) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "RecordedStates":
        p = Path(path)
        if not p.exists():
            raise DataError(f"{p} does not exist (record states with `ragfast run s2g` first)")
        return cls.from_records([json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()])


def record_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], judge: Any, generator: Any, *,
                  max_new_tokens: int = 500, batch_size: int = 64, judge_ledger: CostLedger | None = None,
                  probe_ledger: CostLedger | None = None, split: Sequence[str] | None = None) -> RecordedStates:
    """Score and probe every state of native trajectories: the table :func:`replay` needs."""
    trs = [_as_traj(t) for t in trajectories]
    if not trs:
        raise DataError("record_states: no trajectories")
    # State 0 is scored too: the study's states are 0..S-1 (the live hook never sees state 0;
    # replay() masks it, see RecordedStates.live_scores).
    scores, jcost = _score_states(trs, judge, ledger=judge_ledger, score_initial=True)
    probes = probe_states(trs, generator, max_new_tokens=max_new_tokens, batch_size=batch_size, ledger=probe_ledger)
    recs = []
    for b, tr in enumerate(trs):
        recs.append({"id": tr.id, "split": split[b] if split else "test",
                     "scores": [None if math.isnan(x) else float(x) for x in scores[b]],
                     "probe_em": [p["em"] for p in probes[b]], "probe_answers": [p["answer"] for p in probes[b]],
                     "native_em": float(tr.em), "native_searches": tr.searches, "native_answer": tr.answer,
                     "judge_cost": jcost[b].tolist(),
                     "probe_cost": [[p["flops"], p["seconds"]] for p in probes[b]],
                     "rest_cost": _rest_cost(tr)})
    return RecordedStates.from_records(recs)


def _rest_cost(tr: Trajectory) -> list[list[float]]:
    """(flops, seconds) of reasoner + encoder + search the native run spent after each state,
    from the per-turn costs the loop attaches (``turn.extra["cost"]``)."""
    per_turn = []
    for t in tr.turns:
        c = t.extra.get("cost", {}) if isinstance(t.extra, dict) else {}
        per_turn.append([sum(float(c.get(k, {}).get(f, 0.0)) for k in ("reasoner", "encoder", "search"))
                         for f in ("flops", "seconds")])
    after = np.cumsum(np.asarray(per_turn[::-1] or [[0.0, 0.0]]), axis=0)[::-1]  # cost of turns k..end
    out = []
    for k, t in enumerate(tr.turns):
        if t.action == "search":
            out.append(after[k + 1].tolist() if k + 1 < len(tr.turns) else [0.0, 0.0])
    first = after[0].tolist() if tr.turns else [0.0, 0.0]
    return [first] + out


@dataclass
class ReplayResult:
    """Counterfactual outcome of one threshold: per question."""

    threshold: float
    stop_state: np.ndarray  # -1 = never stopped
    em: np.ndarray
    searches: np.ndarray
    answers: list[str | None]
    early: np.ndarray


def replay(rec: RecordedStates, threshold: float, *, backend: str | None = None) -> ReplayResult:
    """What the live S2G run would have done at ``threshold``, from recorded states."""
    from ragfast.methods.s2g.policy import evaluate_policy, first_crossing

    idx = first_crossing(rec.live_scores(), threshold, rec.lengths, backend=backend)
    out = evaluate_policy(idx, rec.probe_em, rec.native_em, rec.native_searches)
    answers = [rec.probe_answers[b][i] if i >= 0 else rec.native_answers[b] for b, i in enumerate(idx.tolist())]
    return ReplayResult(float(threshold), idx, out.em, out.searches, answers, out.early)


def replay_cost(rec: RecordedStates, threshold: float) -> dict[str, Any] | None:
    """Estimated cost balance of a threshold from recorded per-state costs (no live run).

    For a trajectory stopped at state t: saved = what the native run spent after t (reasoner,
    encoder, search) minus the answer-only generation from t (the probe's cost: an
    overestimate, as the probe re-reads the prefix a live session has cached, so ``saved`` is
    conservative). Judge cost = scoring states 1..t (or 1..S when it never stops), from the
    recording pass's per-state split. None when the recording has no costs.
    """
    if rec.judge_cost is None or rec.probe_cost is None or rec.rest_cost is None:
        return None
    r = replay(rec, threshold)
    B, T = rec.scores.shape
    idx = r.stop_state
    stopped = idx >= 0
    rows = np.arange(B)
    at = np.maximum(idx, 0)
    saved = np.where(stopped[:, None], rec.rest_cost[rows, at] - rec.probe_cost[rows, at], 0.0)  # [B, 2]
    last = np.where(stopped, idx, rec.native_searches.astype(np.int64))
    upto = (np.arange(T)[None, :] <= last[:, None]) & (np.arange(T)[None, :] >= 1)
    judge = (rec.judge_cost * upto[:, :, None]).sum(1)  # [B, 2]
    calls = int(upto.sum())
    out: dict[str, Any] = {"questions": int(B), "judge_states": calls, "estimate": True}
    for j, f in enumerate(("flops", "seconds")):
        sv, jd = float(saved[:, j].sum()), float(judge[:, j].sum())
        out[f] = {"saved": sv, "judge": jd, "net": sv - jd,
                  "judge_over_saved": jd / sv if sv > 0 else (float("inf") if jd > 0 else float("nan")),
                  "break_even_judge": sv, "break_even_per_judge_call": sv / calls if calls else float("nan"),
                  "pays_for_itself": bool(sv - jd > 0)}
    return out


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
    from ragfast.metrics import normalize_answer

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
    from ragfast.stats import non_inferiority, paired_bootstrap

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
    each with a paired-bootstrap interval (:func:`ragfast.savings.balance`): a saving whose
    interval includes 0 is "no measurable saving", never a negative number. ``lines`` is the
    verdict as text; ``components`` marks which ones were measured, unknown or free.
    """
    from ragfast.savings import balance

    b = balance(native, s2g, spender="judge", components=components, n_resamples=n_resamples, seed=seed)
    out = b.to_dict()
    out["judge_calls"] = sum(float(((r.get("cost") or {}).get("judge") or {}).get("calls", 0)) for r in s2g)
    out["lines"] = b.lines()
    return out


def evaluate(results_dir: str | Path, *, n_resamples: int = 10000, seed: int = 0,
             margin: float = NON_INFERIORITY_MARGIN) -> dict[str, Any]:
    """The four-part S2G evaluation of a results directory written by ``ragfast run s2g``.

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
    from ragfast.results import read_results

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
    L += ["", "## 3. First-crossing replay of the live rule (the live hook judges states 1..S after each retrieval)", "",
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
                  "costed as the probe, which re-reads the prefix, so the saving is conservative."]
    if "cost" in ev:
        c = ev["cost"]
        L += ["", "## Total cost: does the judge pay for the searches it saves?", "",
              f"Paired over {c['questions']} questions ({c['checked_states']} judged states, "
              f"{int(c['judge_calls'])} judge ledger calls), per question with 95% bootstrap intervals:", ""]
        L += [f"- {line}" for line in c["lines"]]
    return "\n".join(L) + "\n"

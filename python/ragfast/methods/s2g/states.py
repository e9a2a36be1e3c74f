"""S2G's recorded states: per-state judge scores and answer-only probes of native runs, and
the counterfactual replay of the live stop rule on them.

:func:`record_states` takes native trajectories and records, per state ``t = 0..S``: the
judge's score and the answer of the answer-only probe. The probe continues the native session
as it stood at state ``t`` (prompt, generated turns and observations up to the t-th retrieval)
with one forced final generation: exactly what the live loop does when the judge stops at
``t`` (:class:`ragfast.methods.s2g.loop.JudgeStopHook` restarts the session from that prefix).

The study's states, and the live loop's, are ``0..S-1``: the states whose next action was a
search. State ``S`` (where the native run answered) is recorded for the reachability audit and
never judged by the live loop, so :func:`replay` leaves it out
(:meth:`RecordedStates.live_scores`). A stop at state ``s`` means ``s`` searches were made, so
:func:`replay` equals the live run for a deterministic reasoner and judge.

Replay models the stop rule only: a live run with ``gap_queries`` changes the searches
themselves, which no recording of the native run can replay.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError
from ragfast.types import Question, Trajectory

__all__ = ["state_prefixes", "prefix_pieces", "probe_states", "score_states", "RecordedStates", "record_states",
           "rest_cost", "ReplayResult", "replay", "replay_cost"]

# ---------------------------------------------------------------------------------------------
# replay: per-state probe answers and scores of recorded native trajectories
# ---------------------------------------------------------------------------------------------
def _as_traj(t: Trajectory | Mapping[str, Any]) -> Trajectory:
    return t if isinstance(t, Trajectory) else Trajectory.from_dict(dict(t))


def prefix_pieces(traj: Trajectory | Mapping[str, Any], state: int) -> list[str]:
    """The session text after the prompt at retrieval state ``state``, as the pieces the loop
    appended (generated text, observation, hook text per turn, up to the ``state``-th search).

    Raises
    ------
    ValueError
        When the trajectory has fewer than ``state`` searches.
    """
    tr = _as_traj(traj)
    acc: list[str] = []
    done = 0
    for t in tr.turns:
        if done == state:
            break
        acc.append(t.generated or "")
        acc.append(t.observation or "")
        acc.extend(t.extra.get("appended", []) if isinstance(t.extra, dict) else [])
        if t.action == "search":
            done += 1
    if done != state:
        raise ValueError(f"trajectory {tr.id!r} has {done} searches, no state {state}")
    return acc


def state_prefixes(traj: Trajectory | Mapping[str, Any]) -> list[str]:
    """The session text after the prompt, as it stood at each retrieval state ``0..S``.

    Prefix ``t`` holds every turn up to and including the t-th search: generated text,
    observation, and anything hooks appended, in the order the loop appended them.
    """
    tr = _as_traj(traj)
    return ["".join(prefix_pieces(tr, s)) for s in range(tr.searches + 1)]


def _generate_ending(generator: Any, ids: list[str], max_new_tokens: int, ledger: CostLedger) -> list[str]:
    """The answer-only turns of ``ids``. A generator with partial turns returns finished probes
    early and their sessions end at once: 415 probes' kept keys/values (up to ~18 MB each on
    the 0.5B) are not held until the last one finishes."""
    from ragfast.methods.searchr1.loop import STOP

    if not getattr(generator, "partial_turns", False):
        return generator.generate(ids, stop=STOP, max_new_tokens=max_new_tokens, ledger=ledger)
    out: dict[str, str] = {}
    todo = list(ids)
    while todo:
        texts = generator.generate(todo, stop=STOP, max_new_tokens=max_new_tokens, ledger=ledger, partial=True)
        done = {i: t for i, t in zip(todo, texts) if t is not None}
        generator.end(list(done))
        out.update(done)
        todo = [i for i in todo if i not in done]
    return [out[i] for i in ids]


def probe_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], generator: Any, *,
                 max_new_tokens: int = 500, batch_size: int = 64, ledger: CostLedger | None = None
                 ) -> list[list[dict[str, Any]]]:
    """Answer-only probe from every state of every trajectory.

    Each probe continues the trajectory's session as it stood at state ``t`` and makes one
    forced final generation (the loop's answer-only turn: ``mark_final`` where the generator
    has it). Batched over all (trajectory, state) pairs: ``batch_size`` at a time, or all in one
    call to a generator that keeps its batch full itself (``partial_turns``).

    Returns
    -------
    list of list of dict
        Per trajectory, per state: ``{"answer", "em", "f1", "text", "flops", "seconds"}``: the
        probe's own generation cost. On a generator that shares nested prefixes (HFGenerator) a
        trajectory's longest state pays for computing the prefix and the other states pay for
        their answer-only turn after it, as a live session with its cache does (and inside
        ``HFGenerator.keep_ended``, after the trajectories' own sessions ended, no state pays for
        its prefix); on any other generator each probe re-reads its prefix, which overstates the
        live turn.
    """
    from ragfast.scoring.metrics import exact_match, extract_answer, f1
    from ragfast.methods.searchr1.loop import open_sessions

    trs = [_as_traj(t) for t in trajectories]
    jobs: list[tuple[int, int, str, list[str]]] = []  # (traj, state, session id, prefix pieces)
    for i, tr in enumerate(trs):
        for s in range(tr.searches + 1):
            jobs.append((i, s, f"{tr.id}\x00probe{s}", prefix_pieces(tr, s)))
    out: list[list[dict[str, Any]]] = [[{} for _ in range(tr.searches + 1)] for tr in trs]
    # A generator that admits sessions as rows finish (HFGenerator's running batch) takes every
    # probe in one call: a probe that runs to max_new_tokens then holds up no fixed chunk of others.
    step = len(jobs) if getattr(generator, "partial_turns", False) else max(1, batch_size)
    for lo in range(0, len(jobs), step):
        chunk = jobs[lo:lo + step]
        ids = [j[2] for j in chunk]
        if hasattr(generator, "bind_questions"):
            generator.bind_questions({sid: Question(trs[i].id, trs[i].question, list(trs[i].golden_answers))
                                      for i, _, sid, _ in chunk})
        # The pieces one by one, as the live session appended them: a state's tokens are then a
        # prefix of the next state's, and a generator that shares nested prefixes
        # (HFGenerator) computes each trajectory's longest state once for all its probes.
        open_sessions(generator, ids, [trs[i].question for i, _, _, _ in chunk], [j[3] for j in chunk])
        try:
            if hasattr(generator, "mark_final"):
                generator.mark_final(ids)
            sub = CostLedger()
            texts = _generate_ending(generator, ids, max_new_tokens, sub)
        finally:
            generator.end(ids)
        per = sub.per_question()
        if ledger is not None:
            names = {sid: trs[i].id for i, _, sid, _ in chunk}
            for r in sub.records:
                r.question_id = names.get(r.question_id, r.question_id)
            ledger.merge(sub)
        for (i, s, sid, pieces), text in zip(chunk, texts):
            ans = extract_answer("".join(pieces) + text)
            golds = trs[i].golden_answers
            c = per.get(sid, {}).get("reasoner", {})
            out[i][s] = {"answer": ans, "em": float(exact_match(ans, golds)), "f1": float(f1(ans, golds)),
                         "text": text, "flops": float(c.get("flops", 0.0)), "seconds": float(c.get("seconds", 0.0))}
    return out


def score_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], judge: Any, *,
                 ledger: CostLedger | None = None, score_initial: bool = True) -> list[np.ndarray]:
    """Judge scores of every state ``0..S`` of every trajectory, in one batched call.

    ``score_initial=False`` leaves state 0 (nothing retrieved) NaN, for a judge that cannot
    score it; the live loop judges it (it is a study state whenever the run searched).
    """
    return _score_states(trajectories, judge, ledger=ledger, score_initial=score_initial)[0]


def _score_states(trajectories, judge, *, ledger=None, score_initial=True):
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
        """Flattened judged states: (scores, labels = probe EM, group = row index).

        The study's states ``0..S-1`` (those whose next action was a search); state ``S`` and
        padding left out.
        """
        B, T = self.scores.shape
        valid = np.arange(T)[None, :] < np.minimum(self.lengths, self.native_searches)[:, None]
        rows = np.broadcast_to(np.arange(B)[:, None], (B, T))
        return self.scores[valid], self.probe_em[valid].astype(np.int64), rows[valid]

    def live_scores(self) -> np.ndarray:
        """Scores as the live loop judges them: states ``0..S-1`` as recorded, state ``S`` NaN
        (the native run answered there; the live judge runs only when the reasoner searches)."""
        sc = self.scores.copy()
        T = sc.shape[1]
        sc[np.arange(T)[None, :] >= self.native_searches[:, None]] = np.nan
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
            raise DataError(f"{p} does not exist (record states with `ragfast study s2g` first)")
        return cls.from_records([json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()])


def record_states(trajectories: Sequence[Trajectory | Mapping[str, Any]], judge: Any, generator: Any, *,
                  max_new_tokens: int = 500, batch_size: int = 64, judge_ledger: CostLedger | None = None,
                  probe_ledger: CostLedger | None = None, split: Sequence[str] | None = None) -> RecordedStates:
    """Score and probe every state of native trajectories: the table :func:`replay` needs."""
    trs = [_as_traj(t) for t in trajectories]
    if not trs:
        raise DataError("record_states: no trajectories")
    # Every state 0..S is scored: the study's (and the live loop's) states are 0..S-1; state S
    # is kept for the audit and masked by replay() (RecordedStates.live_scores).
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
                     "rest_cost": rest_cost(tr)})
    return RecordedStates.from_records(recs)


def rest_cost(tr: Trajectory) -> list[list[float]]:
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
    """What the live S2G run would have done at ``threshold``, from recorded states.

    The first state ``s`` in ``0..S-1`` whose score is ``>= threshold`` stops: ``s`` searches,
    the probe's answer and EM at ``s``. Otherwise the native answer and searches.
    """
    from ragfast.methods.s2g.policy import evaluate_policy, first_crossing

    idx = first_crossing(rec.live_scores(), threshold, rec.lengths, backend=backend)
    out = evaluate_policy(idx, rec.probe_em, rec.native_em, rec.native_searches)
    answers = [rec.probe_answers[b][i] if i >= 0 else rec.native_answers[b] for b, i in enumerate(idx.tolist())]
    return ReplayResult(float(threshold), idx, out.em, out.searches, answers, out.early)


def replay_cost(rec: RecordedStates, threshold: float) -> dict[str, Any] | None:
    """Estimated cost balance of a threshold from recorded per-state costs (no live run).

    For a trajectory stopped at state t: saved = what the native run spent after t (reasoner,
    encoder, search) minus the answer-only generation from t (the probe's cost: the turn after
    a cached prefix where the generator shares nested prefixes, as the live loop's rewound
    session does; otherwise an overestimate that re-reads the prefix, so ``saved`` is
    conservative). Judge cost = scoring states 0..t (or 0..S-1 when it never stops: the live
    loop judges each state the reasoner searches from), from the recording pass's per-state split. None when the recording has no costs.
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
    last = np.where(stopped, idx, rec.native_searches.astype(np.int64) - 1)
    upto = np.arange(T)[None, :] <= last[:, None]
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


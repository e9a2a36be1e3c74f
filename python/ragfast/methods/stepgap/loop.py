"""StepGap in the loop: Search-R1 with the step checker after every turn and typed repairs.

After each search-enabled turn, one batched :func:`ragfast.methods.stepgap.checker.check` call labels the new
steps of every running trajectory (stages A-C in one generator call each, D-E in one NLI call
each). For each trajectory the first gap of that turn gets its repair:

- ``CONTRADICTED_CLAIM`` -> retract: a short check note naming the claim (and the
  contradicting quote) is appended to the reasoner's context; no search is spent.
- ``IRRELEVANT_EVIDENCE`` -> re-search on the step's entity (with the question).
- ``MISSING_BRIDGE`` -> bridge search: the quoted document's title plus the claim's words the
  quote leaves unexplained.

Repair searches are injected through the loop's hook API, so they are recorded as turns, count
against ``max_turns`` (the search budget) and are skipped when it is spent. At most
``max_repairs`` repairs per question. When a trajectory finishes, its remaining steps (the
answer turn) are checked in one batch per loop batch, and every step's label and process
reward travel in ``trajectory.extra["stepgap"]``.

Costs: the checker's LLM stages are booked as ledger component "judge", its NLI pairs as
"nli", and repair searches under "search"/"encoder" like any search; each repair record
carries the search seconds and calls it used.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ragfast.accounting.ledger import CostLedger, sum_cost_dicts
from ragfast.errors import ConfigError
from ragfast.methods.searchr1.loop import ActiveTrajectory, SearchR1Config, SearchR1Loop, TurnContext
from ragfast.methods.stepgap.checker import CC, GAP_LABELS, IE, MB, REPAIRS, STAGES, CheckResult, StepLabel, check
from ragfast.methods.stepgap.repairs import repair_query, retraction_text
from ragfast.methods.stepgap.rewards import RewardConfig, process_rewards
from ragfast.types import Question, Trajectory

__all__ = ["StepGapConfig", "StepGapHook", "StepGapPipeline", "run_stepgap"]


@dataclass
class StepGapConfig:
    """Settings of the StepGap loop.

    Parameters
    ----------
    searchr1 : SearchR1Config
        The underlying loop (max_turns is the search budget repairs count against).
    stages : str
        Checker stages (see :func:`ragfast.methods.stepgap.checker.check`).
    thresholds : (float, float)
        Entailment and contradiction thresholds of the NLI stages.
    repair : bool
        Inject repairs (False: label steps only, the reasoner is left alone).
    max_repairs : int
        Repairs per question.
    llm_max_new_tokens : dict, optional
        Per-stage generation budgets of the checker's LLM stages.
    rewards : RewardConfig
        Process-reward magnitudes.
    """

    searchr1: SearchR1Config = field(default_factory=SearchR1Config)
    stages: str = STAGES
    thresholds: tuple[float, float] = (0.5, 0.5)
    repair: bool = True
    max_repairs: int = 2
    llm_max_new_tokens: dict[str, int] | None = None
    rewards: RewardConfig = field(default_factory=RewardConfig)

    def __post_init__(self) -> None:
        if self.max_repairs < 0:
            raise ConfigError(f"max_repairs must be >= 0, got {self.max_repairs}")
        bad = set(self.stages.upper()) - set(STAGES)
        if bad:
            raise ConfigError(f"unknown StepGap stages {''.join(sorted(bad))!r}")
        self.thresholds = tuple(float(x) for x in self.thresholds)  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _record_delta(led: CostLedger, start: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for r in led.records[start:]:
        if r.question_id is None:
            continue
        row = out.setdefault(r.question_id, {"calls": 0, "seconds": 0.0})
        row["calls"] += r.calls
        row["seconds"] += r.seconds
    return out


class StepGapHook:
    """The per-turn hook: check the newest steps of every running trajectory, inject repairs.

    Parameters
    ----------
    checker : Generator or None
        The LLM of stages A-C (None: those stages are skipped).
    nli : NLIScorer-like or None
        The NLI of stages D-E.
    config : StepGapConfig
    """

    def __init__(self, checker: Any, nli: Any, config: StepGapConfig) -> None:
        self.checker = checker
        self.nli = nli
        self.config = config
        self.checked_upto: dict[str, int] = {}
        self.steps: dict[tuple[str, int], Any] = {}  # (trajectory id, step index) -> Step
        self.checks = 0
        self.failures: Counter = Counter()
        self.memo: dict = {}  # the LLM stages' completions by prompt, across rounds (check's memo)

    def _state(self, traj: Trajectory) -> dict[str, Any]:
        return traj.extra.setdefault("stepgap", {"labels": [], "repairs": [], "failures": {}})

    def check_new(self, trajs: Sequence[Trajectory], ledger: CostLedger) -> dict[str, list[StepLabel]]:
        """Label the steps of turns not checked yet, in one batched check; returns new labels per id."""
        cfg = self.config
        todo = [t for t in trajs if self.checked_upto.get(t.id, 0) < len(t.turns)]
        if not todo:
            return {}
        res = check(todo, self.checker, self.nli, cfg.stages, cfg.thresholds, ledger=ledger,
                    from_turn={t.id: self.checked_upto.get(t.id, 0) for t in todo},
                    max_new_tokens=cfg.llm_max_new_tokens, memo=self.memo)
        self.checks += 1
        by = res.by_trajectory()
        steps = {(s.trajectory_id, s.index): s for s in res.steps}
        for t in todo:
            self.checked_upto[t.id] = len(t.turns)
            st = self._state(t)
            st["labels"].extend(lab.to_dict() for lab in by.get(t.id, []))
        self.steps.update(steps)
        # Parse failures belong to the check call (one batch over many questions): run-level counts.
        self.failures.update(res.failures)
        return by

    def __call__(self, ctx: TurnContext) -> None:
        cfg = self.config
        items = list(ctx.active)
        new = self.check_new([it.traj for it in items], ctx.ledger)
        if not cfg.repair:
            return
        retract: list[tuple[ActiveTrajectory, str]] = []
        searches: dict[str, list[tuple[ActiveTrajectory, str, StepLabel]]] = {IE: [], MB: []}
        for it in items:
            st = self._state(it.traj)
            if len(st["repairs"]) >= cfg.max_repairs:
                continue
            gap = next((lab for lab in new.get(it.qid, []) if lab.label in GAP_LABELS), None)
            if gap is None:
                continue
            step = self.steps[(it.qid, gap.step)]
            rec = {"turn": it.generations - 1, "step": gap.step, "label": gap.label, "repair": REPAIRS[gap.label]}
            if gap.label == CC:
                retract.append((it, retraction_text(step, gap)))
                rec["done"] = True
                st["repairs"].append(rec)
                continue
            if it.turns_used >= ctx.loop.config.max_turns:
                rec.update(done=False, skipped="search budget spent")
                st["repairs"].append(rec)
                continue
            q = repair_query(step, gap)
            rec.update(query=q, done=True)
            st["repairs"].append(rec)
            searches[gap.label].append((it, q, gap))
        if retract:
            ctx.append([it for it, _ in retract], [tx for _, tx in retract])
        for label, rows in searches.items():
            if not rows:
                continue
            start = len(ctx.ledger.records)
            ctx.search([it for it, _, _ in rows], [q for _, q, _ in rows], reason=f"stepgap:{REPAIRS[label]}")
            delta = _record_delta(ctx.ledger, start)
            for it, _, _ in rows:
                d = delta.get(it.qid, {"calls": 0, "seconds": 0.0})
                self._state(it.traj)["repairs"][-1]["cost"] = {"retrieval_calls": d["calls"],
                                                               "seconds": round(d["seconds"], 6)}


class StepGapPipeline:
    """Search-R1 plus the StepGap checker and typed repairs.

    Parameters
    ----------
    generator : Generator
        The reasoner.
    retriever : Retriever
    checker : Generator or None
        The LLM of stages A-C; may be the reasoner itself (its stateless ``complete`` opens
        separate sessions). None skips A-C.
    nli : NLIScorer-like or None
        The NLI cross-encoder of stages D-E. None skips D-E.
    config : StepGapConfig, optional
    ledger : CostLedger, optional
    """

    def __init__(self, generator: Any, retriever: Any, checker: Any = None, nli: Any = None,
                 config: StepGapConfig | None = None, *, ledger: CostLedger | None = None) -> None:
        self.config = config or StepGapConfig()
        self.ledger = ledger if ledger is not None else CostLedger()
        self.hook = StepGapHook(checker, nli, self.config)
        # An LLM checker is a generation per loop iteration, whatever its rows: partial turns (more
        # iterations, fewer rows each) took the default bench's checker from 97 to 149 s.
        self.loop = SearchR1Loop(generator, retriever, self.config.searchr1, ledger=self.ledger, hooks=[self.hook],
                                 partial_turns=checker is None)
        self.checker, self.nli = checker, nli

    def slots(self) -> dict[str, Any]:
        def d(x: Any) -> Any:
            if x is None:
                return None
            return x.describe() if hasattr(x, "describe") else {"name": type(x).__name__}

        return {"reasoner": d(self.loop.generator), "checker_llm": d(self.checker), "nli": d(self.nli)}

    def run(self, questions: Sequence[Question], *, on_finish: Callable[[Trajectory], None] | None = None,
            skip_ids: Iterable[str] = ()) -> list[Trajectory]:
        """Run every question (except ``skip_ids``); returns trajectories with ``extra["stepgap"]``."""
        skip = {str(s) for s in skip_ids}
        todo = [q for q in questions if q.id not in skip]
        bs = self.config.searchr1.batch_size
        out: list[Trajectory] = []
        for i in range(0, len(todo), bs):
            batch = self.loop.run(todo[i:i + bs])
            self._finish(batch)
            for t in batch:
                if on_finish is not None:
                    on_finish(t)
            out.extend(batch)
        return out

    def _finish(self, trajs: list[Trajectory]) -> None:
        # The answer turn (and anything after the last hook) is checked here, in one batch.
        led = CostLedger()
        self.hook.check_new(trajs, led)
        self.hook.memo.clear()  # its prompts hold these questions: no later batch reads them
        self.ledger.merge(led)
        for t in trajs:
            st = self.hook._state(t)
            extra_cost = led.for_question(t.id)
            if extra_cost:
                t.cost = sum_cost_dicts([t.cost, extra_cost])
            labels = [StepLabel(**{k: v for k, v in lab.items() if k != "repair"}) for lab in st["labels"]]
            res = CheckResult([self.hook.steps.pop((t.id, lab.step)) for lab in labels], labels, self.config.stages)
            st["rewards"] = process_rewards(res, self.config.rewards)
            st["label_counts"] = dict(Counter(lab.label for lab in labels))
            st["repair_counts"] = dict(Counter(r["repair"] for r in st["repairs"] if r.get("done")))
            st["repairs_skipped"] = sum(1 for r in st["repairs"] if not r.get("done"))


def run_stepgap(questions: Sequence[Question], generator: Any, retriever: Any, *, checker: Any = None,
                nli: Any = None, config: StepGapConfig | None = None, ledger: CostLedger | None = None,
                on_finish: Callable[[Trajectory], None] | None = None,
                skip_ids: Iterable[str] = ()) -> list[Trajectory]:
    """Convenience wrapper around :class:`StepGapPipeline`."""
    return StepGapPipeline(generator, retriever, checker, nli, config, ledger=ledger).run(
        questions, on_finish=on_finish, skip_ids=skip_ids)

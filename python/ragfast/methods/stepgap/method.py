"""StepGap as a registered :class:`~ragfast.methods.base.Method`."""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragfast.methods.base import Method, RayPipeline, Recorder, Slots, register
from ragfast.methods.searchr1.method import searchr1_config
from ragfast.methods.stepgap.loop import StepGapConfig, StepGapPipeline
from ragfast.types import Question

log = logging.getLogger(__name__)

__all__ = ["StepGapMethod", "REWARDS_FILE", "stepgap_report"]

#: The process rewards of every checked step, one JSON line each (what GRPO-style trainers read),
#: rewritten from the trajectories after each run.
REWARDS_FILE = "stepgap_rewards.jsonl"


def _stepgap(r: Mapping[str, Any]) -> Mapping[str, Any]:
    return (r.get("extra") or {}).get("stepgap") or {}


def stepgap_report(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The checker's labels, repairs and cost per question beside the reasoner's, over finished records.

    Costs are read from each record (every finished question, resumed ones included), so a
    resumed run reports what a clean one does.
    """
    labels = [lab["label"] for r in records for lab in _stepgap(r).get("labels", [])]
    reps = [rep for r in records for rep in _stepgap(r).get("repairs", [])]
    n = max(1, len(records))

    def per_q(comp: str, *keys: str) -> float:
        return sum(float((r.get("cost") or {}).get(comp, {}).get(k, 0.0)) for r in records for k in keys) / n

    checker = {"judge_seconds": per_q("judge", "seconds"), "nli_seconds": per_q("nli", "seconds"),
               "judge_tokens": per_q("judge", "input_tokens", "output_tokens"), "nli_pairs": per_q("nli", "calls"),
               "nli_flops": per_q("nli", "flops"), "judge_flops": per_q("judge", "flops")}
    reasoner = {"seconds": per_q("reasoner", "seconds"), "flops": per_q("reasoner", "flops"),
                "tokens": per_q("reasoner", "input_tokens", "output_tokens")}
    ratio = ((checker["judge_seconds"] + checker["nli_seconds"]) / reasoner["seconds"]
             if reasoner["seconds"] > 0 else None)
    return {"steps": len(labels),
            "label_mix": {k: v / len(labels) for k, v in sorted(Counter(labels).items())} if labels else {},
            "repairs": dict(sorted(Counter(rep["repair"] for rep in reps if rep.get("done")).items())),
            "repairs_skipped_budget": sum(1 for rep in reps if not rep.get("done")),
            "checker_cost_per_question": checker, "reasoner_cost_per_question": reasoner,
            "checker_to_reasoner_seconds": ratio, "rewards_file": REWARDS_FILE}


@register
class StepGapMethod(Method):
    """Search-R1 with the StepGap checker after every turn and typed repairs.

    The checker's LLM (stages A-C) is the ``checker`` slot (``checker_llm``: by default the
    reasoner when it is a language model); without one (the scripted reasoner, or ``none``)
    only the NLI stages D-E run, and the config says so.
    """

    name = "stepgap"
    slots = ("reasoner", "retriever", "nli", "checker")
    config_type = StepGapConfig

    def _has_llm(self) -> bool:
        s = self.settings
        return s.checker_llm != "none" and not (s.checker_llm == "reasoner" and s.reasoner == "scripted")

    def config(self) -> StepGapConfig:
        s = self.settings
        stages = "".join(c for c in s.stages.upper() if self._has_llm() or c not in "ABC")
        return StepGapConfig(searchr1=searchr1_config(s), stages=stages, thresholds=(s.entail, s.contra),
                             repair=s.repair, max_repairs=s.max_repairs)

    def check(self) -> None:
        self.config()  # unknown stages, max_repairs < 0: one line each

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        pipe = StepGapPipeline(slots.make_generator(), slots.retriever, slots.checker, slots.nli, self.config(),
                               ledger=recorder.ledger)
        trajs = pipe.run(list(questions), on_finish=recorder.finish, skip_ids=recorder.done)
        if pipe.hook.failures:  # parse failures belong to batched check calls: run-level counts
            log.warning("stepgap: checker parse failures %s", dict(pipe.hook.failures))
        return trajs

    def ray_pipeline(self) -> RayPipeline:
        from ragfast.methods.stepgap.loop import run_stepgap

        s = self.settings
        checker = {} if not self._has_llm() else {"checker": "reasoner" if s.checker_llm == "reasoner" else
                                                  ("checker", s.checker_llm, {})}
        return RayPipeline(run_stepgap, self.config(), {"nli": ("nli", s.nli, {"backend": s.nli_backend}), **checker},
                           {})

    def report(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return {"stages": self.config().stages, **stepgap_report(records)}

    def after_run(self, slots: Slots, records: Mapping[str, Sequence[Mapping[str, Any]]], out: Path,
                  progress: Any = None) -> None:
        """``stepgap_rewards.jsonl``: every finished question's per-step process rewards."""
        path = Path(out) / REWARDS_FILE
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records.get(self.name, ()):
                for rw in _stepgap(r).get("rewards", []):
                    f.write(json.dumps(rw) + "\n")
        os.replace(tmp, path)

"""StepGap as a registered :class:`~ragfast.methods.base.Method`."""
from __future__ import annotations

from typing import Any, Sequence

from ragfast.methods.base import Method, RayPipeline, Recorder, Slots, register
from ragfast.methods.searchr1.method import searchr1_config
from ragfast.methods.stepgap.loop import StepGapConfig, run_stepgap
from ragfast.types import Question

__all__ = ["StepGapMethod"]


@register
class StepGapMethod(Method):
    """Search-R1 with the StepGap checker after every turn and typed repairs.

    With the scripted reasoner there is no LLM to run stages A-C, so only the NLI stages D-E
    run (and the report says so); any real reasoner also serves as the checker's LLM.
    """

    name = "stepgap"
    slots = ("reasoner", "retriever", "nli")
    config_type = StepGapConfig

    def _scripted(self) -> bool:
        return self.settings.reasoner == "scripted"

    def config(self) -> StepGapConfig:
        return StepGapConfig(searchr1=searchr1_config(self.settings), stages="DE" if self._scripted() else "ABCDE")

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        gen = slots.make_generator()
        checker = None if self._scripted() else gen
        return run_stepgap(list(questions), gen, slots.retriever, checker=checker, nli=slots.nli, config=self.config(),
                           ledger=recorder.ledger, on_finish=recorder.finish, skip_ids=recorder.done)

    def ray_pipeline(self) -> RayPipeline:
        s = self.settings
        extra = {} if self._scripted() else {"checker": "reasoner"}
        return RayPipeline(run_stepgap, self.config(), {"nli": ("nli", s.nli, {"backend": s.nli_backend}), **extra},
                           {})

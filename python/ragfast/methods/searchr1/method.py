"""Native Search-R1 as a registered :class:`~ragfast.methods.base.Method`."""
from __future__ import annotations

from typing import Any, Sequence

from ragfast.methods.base import Method, RayPipeline, Recorder, Slots, register
from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
from ragfast.types import Question

__all__ = ["SearchR1Method", "searchr1_config"]


def searchr1_config(settings: Any) -> SearchR1Config:
    """The Search-R1 loop's config from a run's settings (the base loop of S2G and StepGap too)."""
    return SearchR1Config(max_turns=settings.budget, topk=settings.topk, max_new_tokens=settings.max_new_tokens,
                          max_obs_tokens=settings.max_obs_tokens, prompt_budget=settings.prompt_budget,
                          batch_size=settings.batch_size, seed=settings.seed, refill=settings.refill)


@register
class SearchR1Method(Method):
    """Native Search-R1: the reasoner searches until it answers or the budget is spent."""

    name = "searchr1"
    slots = ("reasoner", "retriever")
    config_type = SearchR1Config

    def config(self) -> SearchR1Config:
        return searchr1_config(self.settings)

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        loop = SearchR1Loop(slots.make_generator(), slots.retriever, self.config(), ledger=recorder.ledger)
        return loop.run(list(questions), on_finish=recorder.finish, skip_ids=recorder.done)

    def ray_pipeline(self) -> RayPipeline:
        return RayPipeline(None, self.config(), {}, {})

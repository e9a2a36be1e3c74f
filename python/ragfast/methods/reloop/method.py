"""RELOOP as a registered :class:`~ragfast.methods.base.Method` (in the driver process; no Ray path)."""
from __future__ import annotations

from typing import Any, Sequence

from ragfast.methods.base import Method, Recorder, Slots, register
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.types import Question

__all__ = ["ReloopMethod", "MAX_K"]

#: RELOOP reads at most this many segments per step whatever ``--topk`` says: its window ranks
#: segments of one question's own sources (a few dozen), not a corpus, so a search engine's top-k
#: has no meaning beyond a handful (the bench's setting since RELOOP joined it).
MAX_K = 8


@register
class ReloopMethod(Method):
    """RELOOP over each question's own sources as one HSEQ: guided iterator, judge, evidence-pack head.

    The head is the reasoner when it is a real model; with the scripted reasoner it is RELOOP's
    extractive head (a span picker, not an LLM: marked not meaningful). It returns result rows
    that carry every trajectory field the summary reads (id, answer, em, f1, searches, cost)
    plus RELOOP's own (the evidence pack).
    """

    name = "reloop"
    slots = ("reasoner", "retriever", "judge")
    config_type = ReloopConfig

    def config(self) -> ReloopConfig:
        s = self.settings
        return ReloopConfig(planner="heuristic", max_steps=max(1, s.budget), k=max(1, min(s.topk, MAX_K)))

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        from ragfast.methods.reloop import ExtractiveHead, HeuristicSufficiency, run_text, text_workspace

        head = ExtractiveHead() if self.settings.reasoner == "scripted" else slots.make_generator()
        encoder = getattr(slots.retriever, "encoder", None)
        if encoder is None:
            from ragfast.retrieval import Encoder

            encoder = Encoder(self.settings.encoder)
        judge = slots.judge if slots.judge is not None else HeuristicSufficiency(multi_doc=True)
        return run_text([text_workspace(q) for q in questions], encoder=encoder, judge=judge, generator=head,
                        cfg=self.config(), ledger=recorder.ledger, on_result=recorder.finish)

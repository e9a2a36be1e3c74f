"""RELOOP as a registered :class:`~ragfast.methods.base.Method` (in the driver process; no Ray path).

``ragfast run reloop`` and ``ragfast bench --method reloop`` both run it. The data file's layout
decides what it walks: MetaQA questions the knowledge graph (``kb``, default the bundled MetaQA
KB), TAT-QA each document's table and paragraphs, HotpotQA (any layout with
``metadata["context"]``) the question's context documents.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragfast.errors import DataError
from ragfast.methods.base import Method, Recorder, Slots, register
from ragfast.methods.reloop.config import ReloopConfig
from ragfast.types import Question

__all__ = ["ReloopMethod", "MAX_K", "data_path"]

#: RELOOP reads at most this many segments per step whatever ``--topk`` says: its window ranks
#: segments of one question's own sources (a few dozen), not a corpus, so a search engine's top-k
#: has no meaning beyond a handful (the bench's setting since RELOOP joined it).
MAX_K = 8


def data_path(data: str) -> Path:
    """A QA file path or bundled sample name as the file's path.

    Raises
    ------
    DataError
        Neither a file nor a sample.
    """
    from ragfast.data import SAMPLES, sample

    path = Path(sample(data)) if data in SAMPLES else Path(data)
    if not path.exists():
        raise DataError(f"no such data file or sample: {data!r} (samples: {', '.join(SAMPLES)})")
    return path


@register
class ReloopMethod(Method):
    """RELOOP over each question's own sources as one HSEQ: guided iterator, judge, evidence-pack head.

    The head is the ``head`` slot: by default the reasoner when it is a real model, else RELOOP's
    extractive head (a span picker, not an LLM: marked not meaningful). It returns result rows
    that carry every trajectory field the summary reads (id, answer, em, f1, searches, cost)
    plus RELOOP's own (the evidence pack, the plan, the steps).
    """

    name = "reloop"
    slots = ("reasoner", "judge", "head", "planner")  # the run's encoder ranks each question's own segments
    config_type = ReloopConfig

    def config(self) -> ReloopConfig:
        s = self.settings
        return ReloopConfig(planner=s.planner, max_steps=max(1, s.budget), k=max(1, min(s.topk, MAX_K)),
                            window=s.window, max_tokens=s.evidence_tokens, verify=s.verify, batch_size=s.batch_size)

    def kind(self) -> str:
        """What RELOOP walks for the run's data: ``kg`` (MetaQA), ``tatqa`` or ``text``."""
        from ragfast.data import detect_layout
        from ragfast.methods.reloop.loop import dataset_kind

        return dataset_kind(detect_layout(data_path(self.settings.data)))

    def check(self) -> None:
        from ragfast.errors import ConfigError
        from ragfast.methods.reloop.loop import check_setup

        cfg = self.config()  # window >= k, planner... one line each
        if cfg.planner == "llm" and self.settings.planner_model is None:
            raise ConfigError("--planner llm needs --planner-model PATH (a local causal LM); none is bundled")
        try:
            kind = self.kind()
        except DataError:
            return  # a missing data file is named with every other missing file (check_paths)
        check_setup(kind, cfg, [])  # the planner against the data's kind, before --out exists

    def prepare(self, slots: Slots, out: Path, console: Any = None) -> None:
        from ragfast.methods.reloop.loop import check_setup

        check_setup(self.kind(), self.config(), slots.questions, f"{self.settings.data}")

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        from ragfast.methods.reloop import HeuristicSufficiency, metaqa_kg, run_questions

        kind, rows = self.kind(), []
        encoder = judge = kg = docs = None
        if kind == "kg":
            kg = metaqa_kg(self.settings.kb)
        else:
            encoder = slots.encoder
            if encoder is None:  # a URL index: the encoder runs here
                from ragfast.retrieval import Encoder

                encoder = Encoder(self.settings.encoder)
            judge = slots.judge
            # "auto": the trained judge on text; on tables, where no trained judge exists, the rule.
            if judge is None or (kind != "text" and (isinstance(judge, HeuristicSufficiency)
                                                     or self.settings.judge == "auto")):
                judge = HeuristicSufficiency(multi_doc=kind == "text")  # one table is one document
            if kind == "tatqa":
                raw = json.loads(data_path(self.settings.data).read_text(encoding="utf-8"))
                docs = raw if isinstance(raw, list) else raw["data"]

        def finish(row: Mapping[str, Any]) -> None:
            rows.append(row)
            recorder.finish(row)

        run_questions(list(questions), kind, self.config(), head=slots.head, ledger=recorder.ledger, encoder=encoder,
                      judge=judge, planner_generator=slots.planner, kg=kg, tatqa_docs=docs, on_result=finish)
        return rows

    def report(self, records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """What RELOOP walked and read: kind, planner, steps, evidence tokens, refinements, stop reasons
        (and set-level precision / recall / F1 on MetaQA)."""
        from ragfast.methods.reloop import summarise_rows

        section = {k: v for k, v in summarise_rows(list(records), 0.0).items()
                   if k not in ("em", "f1", "cost", "wall_seconds_this_run")}
        return {"kind": self.kind(), "planner": self.settings.planner, **section}

"""RELOOP: a guided, budget-aware iterator over one HSEQ and a canonical-evidence head.

The loop, per question (batched over questions at every step):

1. **Plan.** A short guidance plan: the entities to cover, the expected number of hops, the
   answer type that tells when to stop (the stopping cue), and for knowledge graphs the relation
   path. It comes from heuristic templates of the question (:func:`heuristic_plan`), from the
   deterministic MetaQA template parser (:func:`kg_path_plan`, planner ``kg-path``), or from an
   LLM asked for a JSON plan (:func:`llm_plans`, planner ``llm``).
2. **Iterate.** The candidates are the leaf segments of the question's HSEQ (sentences and
   non-header table cells; MetaQA questions take the knowledge-graph walk described below). Each
   step ranks the unread candidates by dense score against the guided query (an
   :class:`~ragfast.retrieval.Encoder` plus :func:`ragfast.ops.topk_ip.topk_ip` with the
   already-read rows excluded): the top ``window`` form the sliding window, the best ``k`` of
   the window (dense score plus guidance bonuses) are read, each one pulls in its structural
   context (the lead sentence of its paragraph; a cell's row-label cell, its headers being part
   of the cell's view) through the vectorised neighbour operations of :mod:`ragfast.methods.reloop.hseq`; for
   multi-hop plans the next query adds bridge names met in the evidence; a
   :class:`~ragfast.judges.base.Judge` scores the state (``judge="auto"``: the trained EncoderJudge
   on text when its weights are installed, else :class:`~ragfast.methods.reloop.sufficiency.HeuristicSufficiency`, a documented
   rule). The loop stops at the first sufficient state, or when the step or token budget is
   spent, or when nothing is left to read. Budgets are hard: a segment that would cross the
   token budget is never added.
3. **Head.** :func:`canonicalise` packs the selected segments with provenance (segment id, source
   document id, char offsets / cell coordinates / triple index, the exact snippet); the prompt
   holds only that pack, and a :class:`~ragfast.models.Generator` answers from it. Without an
   LLM the generator is :class:`~ragfast.models.extractive.ExtractiveHead`, a rule-based span/cell picker that is NOT a
   language model (``meaningful = False``; its answers measure the evidence, not reasoning). An
   optional verifier (:func:`verify`) checks the answer against the pack and, on a
   contradiction, runs one refinement with a reduced budget.

For MetaQA the ``kg-path`` planner follows the parsed relation path from the topic entity by
path-count propagation over the per-relation CSR adjacency (as
:meth:`ragfast.methods.reloop.hseq.KGraph.hop_counts`, one iterator step per hop); the answer set is every entity
reached, and the single answer string is the first of them in a deterministic order (most
supporting paths first, then earliest supporting triple in the KB file): EM is then Hits@1
against the gold list, and set-level precision/recall/F1 against the gold set are reported too.

Modules: :mod:`.config` (settings), :mod:`.planners` (MetaQA path parser, LLM planner; the
template planner is :mod:`.plan`), :mod:`.sufficiency` (the rule judge), :mod:`.hseq` (the HSEQ format),
:mod:`.workspace` (candidates),
:mod:`.iterate` (the budgeted iterator), :mod:`.pack` (evidence pack and provenance), :mod:`.kg`
(knowledge-graph runs), :mod:`.loop` (head, verifier, text/table runs, the end-to-end driver).
The generic pieces live in components: :class:`~ragfast.encoders.hashing.HashingEncoder`,
:class:`~ragfast.models.extractive.ExtractiveHead` and :func:`~ragfast.models.extractive.render_pack`.
"""
from __future__ import annotations

from ragfast.methods.reloop.config import ReloopConfig
from ragfast.methods.reloop.iterate import CachedEncoding, Track, iterate
from ragfast.methods.reloop.kg import KGPathResult, metaqa_kg, run_kg_path, set_scores, walk_path
from ragfast.methods.reloop.loop import (answer, check_setup, dataset_kind, run_questions, run_text, summarise_rows,
                                        verify)
from ragfast.methods.reloop.pack import canonicalise, item_view, resolve_provenance
from ragfast.methods.reloop.planners import LLM_PLAN_PROMPT, kg_path_plan, llm_plans, lm_complete
from ragfast.methods.reloop.workspace import Workspace, tatqa_workspace, text_workspace, workspace_key
from ragfast.models.extractive import ExtractiveHead, render_pack
from ragfast.methods.reloop.plan import Plan, answer_type_of, heuristic_plan
from ragfast.methods.reloop.sufficiency import HeuristicSufficiency
from ragfast.encoders.hashing import HashingEncoder, default_encoder

__all__ = [
    "ReloopConfig",
    "Plan",
    "heuristic_plan",
    "kg_path_plan",
    "llm_plans",
    "lm_complete",
    "LLM_PLAN_PROMPT",
    "Workspace",
    "Track",
    "CachedEncoding",
    "text_workspace",
    "tatqa_workspace",
    "workspace_key",
    "HashingEncoder",
    "default_encoder",
    "answer_type_of",
    "HeuristicSufficiency",
    "ExtractiveHead",
    "canonicalise",
    "render_pack",
    "resolve_provenance",
    "item_view",
    "verify",
    "iterate",
    "answer",
    "run_text",
    "run_kg_path",
    "walk_path",
    "KGPathResult",
    "set_scores",
    "metaqa_kg",
    "run_questions",
    "check_setup",
    "dataset_kind",
    "summarise_rows",
]

"""The Search-R1 loop: batched multi-turn search and reasoning, exactly as the reference runs it.

Protocol (PeterGriffinJin/Search-R1, ``search_r1/llm_agent/generation.py`` and
``scripts/nq_hotpotqa/evaluate.sh``; summarised in PROTOCOLS.md):

1. the user message is :func:`build_prompt` (question stripped, "?" appended), sent through the
   reasoner's chat template with ``add_generation_prompt=True`` when it has one, raw otherwise;
2. each turn, greedy generation stops after the first ``</search>`` or ``</answer>`` (or EOS, or
   ``max_new_tokens``); the action is the first match of ``<(search|answer)>(.*?)</\\1>``;
3. a search retrieves ``topk`` documents; the observation ``\\n\\n<information>Doc 1(Title: ..)
   ..</information>\\n\\n`` is truncated to ``max_obs_tokens`` tokens and appended; anything that is
   neither action gets the fixed invalid-action observation;
4. after ``max_turns`` turns, trajectories still running get one last generation with search
   disabled (a search there is not executed);
5. the answer is the content of the last ``<answer>`` block of the response (never the prompt's
   example); EM and F1 use :mod:`ragfast.scoring.metrics`.

Every turn is ONE batched generator call and ONE batched retrieval call over all active
trajectories; the active set shrinks as trajectories answer.

Hooks for pipelines built on top of this loop (S2G stopping, StepGap repairs)
--------------------------------------------------------------------------------
Pass ``hooks=[fn, ...]`` to :class:`SearchR1Loop`. After every search-enabled turn, once the
turn's observations are appended, each hook is called as ``fn(ctx)`` with a
:class:`TurnContext` whose ``active`` list holds the trajectories that are still running. A hook
may, for any subset of them:

- ``ctx.force_answer(items, reason)``: stop searching; the next turn is the final answer-only
  generation (search disabled), and ``stop_reason`` becomes ``reason`` (e.g. ``"judge"``). An
  optional ``text`` is appended to the session first (e.g. a nudge towards answering).
- ``ctx.finish(items, reason)``: stop now, without another generation.
- ``ctx.search(items, queries, reason=...)``: run one extra batched retrieval and append its
  observations (e.g. a StepGap repair search). Each extra search is recorded as its own turn
  with ``extra["injected"] = reason`` and counts against ``max_turns``.
- ``ctx.append(items, texts)``: append any other text to the sessions (e.g. a retraction).

Pass ``pre_search_hooks=[fn, ...]`` for hooks that act where the reasoner has decided to search:
after a search-enabled turn's generation, before its retrieval, ``fn(ctx)`` sees in
``ctx.active`` the trajectories whose action was a search (the pending search is the last turn;
``item.traj.states()[-2]`` is the state it searches from). A trajectory a pre-search hook sends
to ``force_answer`` or ``finish`` does not search: its turn keeps the generated text, becomes
``action="none"`` with ``extra["search_cancelled"] = reason``, and the search is not counted.
``ctx.restart(items, pieces)`` rebuilds a session from its prompt and the given text, dropping
what was generated since (S2G stops from the state as it stood, as its replay probes it).

Everything a hook spends should go to ``ctx.ledger`` with the item's ``qid``: it is split per
question and per turn like the loop's own costs. ``item.traj`` (a :class:`~ragfast.types.Trajectory`)
gives the turns so far and ``item.traj.states()`` the retrieval states.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import deque
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from ragfast.accounting.ledger import NUMERIC_FIELDS, CostLedger
from ragfast.errors import ConfigError, blame
from ragfast.protocol import (INVALID_OBSERVATION, PROMPT_TEMPLATE, STOP, build_prompt, format_docs,
                              format_observation, parse_action)
from ragfast.text import truncate_whitespace_tokens
from ragfast.types import Question, Trajectory, Turn, check_questions

__all__ = [
    "PROMPT_TEMPLATE",
    "INVALID_OBSERVATION",
    "STOP",
    "SearchR1Config",
    "SearchR1Loop",
    "TurnContext",
    "ActiveTrajectory",
    "build_prompt",
    "parse_action",
    "format_docs",
    "format_observation",
    "truncate_whitespace_tokens",
    "run_searchr1",
]

@dataclass
class SearchR1Config:
    """Settings of the Search-R1 loop; the defaults are the reference evaluation's.

    Parameters
    ----------
    max_turns : int
        Generation turns with search enabled (reference: 4). Injected hook searches count too.
    topk : int
        Documents per search (reference: 3).
    max_new_tokens : int
        New tokens per turn (reference: 500).
    max_obs_tokens : int
        Observation length cap in reasoner tokens (reference: 500).
    prompt_budget : int
        Context cap in tokens (reference: 4096). Enforced by generators that hold token ids
        (``HFGenerator(max_context=...)``); the CLI passes it on.
    batch_size : int
        Questions run together through one multi-turn loop.
    seed : int
        Seeds Python, numpy and torch before a run; generators that sample take it too.
    exclude_read : bool
        Skip documents a trajectory already read (False in the reference).
    refill : bool
        Continuous batching: keep up to ``batch_size`` trajectories running and start a queued
        question as soon as one finishes, instead of running fixed batches to completion (whose
        last turns hold only the slowest trajectories). Trajectories are the same either way;
        with refill, trajectories in one turn can be at different turn indices, so hooks should
        read ``item.generations`` / ``item.turns_used`` rather than ``ctx.turn``. A generator
        with ``partial_turns`` (:class:`~ragfast.models.generator.HFGenerator`) then goes
        further: each call returns the turns that have finished while the others keep
        decoding, so one question's 500-token turn no longer holds up the others' next turns.
    """

    max_turns: int = 4
    topk: int = 3
    max_new_tokens: int = 500
    max_obs_tokens: int = 500
    prompt_budget: int = 4096
    batch_size: int = 64
    seed: int = 0
    exclude_read: bool = False
    refill: bool = False

    def __post_init__(self) -> None:
        for name in ("max_turns", "topk", "max_new_tokens", "max_obs_tokens", "prompt_budget", "batch_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"SearchR1Config.{name} must be an int, got {type(v).__name__}")
        if self.max_turns < 0:
            raise ConfigError(f"SearchR1Config.max_turns must be >= 0, got {self.max_turns}")
        for name in ("topk", "max_new_tokens", "max_obs_tokens", "prompt_budget", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"SearchR1Config.{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ActiveTrajectory:
    """One running trajectory inside the loop (what hooks see).

    Attributes
    ----------
    traj : Trajectory
        The record being built (turns so far).
    question : Question
        The question, with its gold answers.
    turns_used : int
        Search-enabled generations plus injected searches; the trajectory gets its final
        answer-only generation once this reaches ``max_turns``.
    final : bool
        The next generation is the final one (search disabled).
    final_reason : str
        ``stop_reason`` recorded when the final generation runs.
    done : bool
        Finished; no more generation.
    response : list of str
        Generated text and observations in order: the "response" the answer is taken from.
    read_ids : list of str
        Documents retrieved so far.
    generations : int
        Turns generated so far (the loop's turn index of the last one is ``generations - 1``
        when every question runs every turn together).
    mid_turn : bool
        Its turn is still being generated (a generator's ``partial`` call returned without it).
    """

    traj: Trajectory
    question: Question
    turns_used: int = 0
    final: bool = False
    final_reason: str = "max_turns"
    done: bool = False
    response: list[str] = field(default_factory=list)
    read_ids: list[str] = field(default_factory=list)
    generations: int = 0
    mid_turn: bool = False

    @property
    def qid(self) -> str:
        return self.traj.id


def open_sessions(gen: Any, ids: Sequence[str], questions: Sequence[str], pieces: Sequence[Sequence[str]]) -> None:
    """Start one session per id on the Search-R1 prompt of its question (in the generator's
    chat format where it has one) and append its ``pieces`` one by one, as the loop appended
    them, so the session holds the tokens the live one held."""
    fmt = getattr(gen, "format_prompt", None)
    user = [build_prompt(q) for q in questions]
    gen.start(list(ids), [fmt(u) for u in user] if fmt else user)
    for k in range(max((len(p) for p in pieces), default=0)):
        rows = [(i, p[k]) for i, p in zip(ids, pieces) if k < len(p) and p[k]]
        if rows:
            gen.append([i for i, _ in rows], [t for _, t in rows])


class TurnContext:
    """What a hook gets after each turn: the running trajectories and ways to steer them.

    Attributes
    ----------
    turn : int
        Index of the loop iteration that just ran (0-based).
    active : list of ActiveTrajectory
        Trajectories still running after this turn.
    loop : SearchR1Loop
        The loop (``loop.generator``, ``loop.retriever``, ``loop.config``).
    ledger : CostLedger
        Where hooks record their own costs (per question id).
    """

    def __init__(self, loop: "SearchR1Loop", turn: int, active: list[ActiveTrajectory], ledger: CostLedger):
        self.loop = loop
        self.turn = turn
        self.active = active
        self.ledger = ledger

    def force_answer(self, items: Iterable[ActiveTrajectory], reason: str, text: str | Sequence[str] | None = None) -> None:
        """Send ``items`` to the final answer-only generation next turn, recording ``reason``.

        Parameters
        ----------
        items : iterable of ActiveTrajectory
        reason : str
            Becomes the trajectory's ``stop_reason`` (e.g. ``"judge"``).
        text : str or sequence of str, optional
            Appended to each session before the final generation (one string for all, or one
            per item).
        """
        items = [it for it in items if not it.done]
        if text is not None:
            texts = [text] * len(items) if isinstance(text, str) else list(text)
            self.append(items, texts)
        for it in items:
            it.final = True
            it.final_reason = reason

    def finish(self, items: Iterable[ActiveTrajectory], reason: str) -> None:
        """Stop ``items`` now, without another generation; ``stop_reason`` = ``reason``."""
        for it in items:
            if not it.done:
                it.done = True
                it.traj.stop_reason = reason

    def search(self, items: Sequence[ActiveTrajectory], queries: Sequence[str], *, reason: str) -> list[list[Any]]:
        """One extra batched retrieval for ``items``; observations are appended to their sessions.

        Each search is recorded as a turn with ``action="search"`` and ``extra["injected"] =
        reason``, and counts against ``max_turns``.

        Returns
        -------
        list of list of Hit
        """
        items = list(items)
        if len(items) != len(queries):
            raise ValueError(f"TurnContext.search: {len(items)} items but {len(queries)} queries")
        if not items:
            return []
        turns = []
        for it, q in zip(items, queries):
            t = Turn(index=len(it.traj.turns), generated="", action="search", content=q,
                     extra={"injected": reason})
            it.traj.turns.append(t)
            it.turns_used += 1
            turns.append(t)
        return self.loop._retrieve_and_observe(items, turns, list(queries), self.ledger)

    def restart(self, items: Sequence[ActiveTrajectory], pieces: Sequence[Sequence[str]]) -> None:
        """Rebuild each item's session from its prompt plus ``pieces`` (the text after the
        prompt, in the order it was appended); what the session held beyond it is dropped.

        The turns stay in ``item.traj`` as they were recorded; ``item.response`` becomes
        ``pieces``. A generator with ``rewind`` (:class:`ragfast.models.generator.HFGenerator`)
        cuts the session back and keeps the keys/values of the prefix; any other is rebuilt
        (``end``, ``start``, the pieces appended one by one as the loop appended them) and
        re-reads the prefix at the next generation (its cost lands in the ledger with that
        generation).
        """
        items = list(items)
        if len(items) != len(pieces):
            raise ValueError(f"TurnContext.restart: {len(items)} items but {len(pieces)} prefixes")
        if not items:
            return
        gen = self.loop.generator
        ids = [it.qid for it in items]
        with blame("reasoner", ids):
            if hasattr(gen, "rewind"):
                gen.rewind(ids, [list(p) for p in pieces])
            else:
                gen.end(ids)
                open_sessions(gen, ids, [it.question for it in items], pieces)
        for it, p in zip(items, pieces):
            it.response = list(p)

    def append(self, items: Sequence[ActiveTrajectory], texts: Sequence[str]) -> None:
        """Append raw text to each item's session (and to its response)."""
        items = list(items)
        if len(items) != len(texts):
            raise ValueError(f"TurnContext.append: {len(items)} items but {len(texts)} texts")
        if not items:
            return
        with blame("reasoner", [it.qid for it in items]):
            self.loop.generator.append([it.qid for it in items], list(texts))
        for it, tx in zip(items, texts):
            it.response.append(tx)
            if it.traj.turns:
                it.traj.turns[-1].extra.setdefault("appended", []).append(tx)


Hook = Callable[[TurnContext], None]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass
    # Only seed torch when something already loaded it: the scripted path never imports torch.
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)


def _round_cost(row: dict[str, float]) -> dict[str, float]:
    return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in row.items()}


class SearchR1Loop:
    """Runs Search-R1 over batches of questions.

    Parameters
    ----------
    generator : ragfast.models.Generator
        The reasoner. Optional capabilities used when present: ``format_prompt(user_text)``
        (chat template), ``truncate_tokens(texts, n)`` (observation cap in its own tokens; else
        whitespace tokens), ``bind_questions(questions)`` (oracle scripts that need the gold
        answers) and ``mark_final(ids)`` (scripts that must be told the next turn is the
        answer-only one; real models get no such signal, as in the reference).
    retriever : ragfast.retrieval.Retriever
        Batched top-k search.
    config : SearchR1Config, optional
    ledger : CostLedger, optional
        Receives every cost record of the run (reasoner, encoder, search, hooks).
    hooks : sequence of callables, optional
        Called as ``hook(ctx)`` after each search-enabled turn; see the module docstring.
    pre_search_hooks : sequence of callables, optional
        Called as ``hook(ctx)`` with the trajectories about to search, before the retrieval;
        see the module docstring.
    partial_turns : bool
        With ``config.refill``, let a generator that can (``partial_turns``) return finished
        turns while other rows keep decoding (default). False for hooks whose every call is
        costly whatever its rows (an LLM checker), since partial turns make more, smaller calls.

    Examples
    --------
    >>> loop = SearchR1Loop(gen, retriever, SearchR1Config(max_turns=4, topk=3))  # doctest: +SKIP
    >>> trajs = loop.run(questions, on_finish=writer_callback)  # doctest: +SKIP
    """

    def __init__(self, generator: Any, retriever: Any, config: SearchR1Config | None = None, *,
                 ledger: CostLedger | None = None, hooks: Sequence[Hook] = (),
                 pre_search_hooks: Sequence[Hook] = (), partial_turns: bool = True):
        self.generator = generator
        self.partial_turns = partial_turns
        self.retriever = retriever
        self.config = config or SearchR1Config()
        self.ledger = ledger if ledger is not None else CostLedger()
        self.hooks = list(hooks)
        self.pre_search_hooks = list(pre_search_hooks)

    # -- public ------------------------------------------------------------------------------
    def run(self, questions: Sequence[Question], *, on_finish: Callable[[Trajectory], None] | None = None,
            skip_ids: Iterable[str] = ()) -> list[Trajectory]:
        """Run every question (except ``skip_ids``) in batches of ``config.batch_size``.

        Parameters
        ----------
        questions : sequence of Question
        on_finish : callable, optional
            Called with each trajectory as soon as it finishes (e.g. to write it to disk).
        skip_ids : iterable of str
            Question ids already done (resume).

        Returns
        -------
        list of Trajectory
            In the order of ``questions`` (skipped ones left out).

        Raises
        ------
        DataError
            On duplicate question ids or questions without gold answers.
        """
        _seed_everything(self.config.seed)
        skip = {str(s) for s in skip_ids}
        questions = check_questions(questions, "SearchR1Loop.run")
        todo = [q for q in questions if q.id not in skip]
        bs = self.config.batch_size
        if self.config.refill:
            return self._drive(todo, on_finish, cap=bs)
        out: list[Trajectory] = []
        for i in range(0, len(todo), bs):
            out.extend(self._drive(todo[i:i + bs], on_finish, cap=None))
        return out

    def run_batch(self, questions: Sequence[Question], *,
                  on_finish: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Run one batch of questions through the whole multi-turn loop together."""
        return self._drive(list(questions), on_finish, cap=None)

    def _admit(self, pending: deque, active: list[ActiveTrajectory], cap: int | None) -> list[ActiveTrajectory]:
        room = len(pending) if cap is None else max(0, cap - len(active))
        new = [pending.popleft() for _ in range(min(room, len(pending)))]
        if not new:
            return []
        gen = self.generator
        items = [ActiveTrajectory(Trajectory(id=q.id, question=q.question, golden_answers=list(q.golden_answers),
                                             supporting_titles=list(q.supporting_titles)), q) for q in new]
        if hasattr(gen, "bind_questions"):
            gen.bind_questions(new)
        user = [build_prompt(q) for q in new]
        fmt = getattr(gen, "format_prompt", None)
        # Every component call names its questions: a failure is recorded for them and the run
        # goes on (ragfast.outputs.failures).
        ids = [it.qid for it in items]
        with blame("reasoner", ids):
            try:
                gen.start(ids, [fmt(u) for u in user] if fmt else user)
            except Exception:
                # not active yet, so the loop's clean-up would miss them: a rerun must find none open
                with contextlib.suppress(Exception):
                    gen.end(ids)
                raise
        active.extend(items)
        return items

    def _drive(self, questions: list[Question], on_finish: Callable[[Trajectory], None] | None,
               cap: int | None) -> list[Trajectory]:
        # cap=None: every question starts at once (one batch). cap=n: at most n run at a time and
        # a finished trajectory's slot is refilled from the queue at the next turn.
        cfg = self.config
        gen = self.generator
        led = CostLedger()  # this run's records; per-turn costs are the records added per turn
        partial = cap is not None and self.partial_turns and bool(getattr(gen, "partial_turns", False))
        acc: dict[str, dict[str, dict[str, float]]] = {}  # question id -> component -> sums
        pending = deque(questions)
        active: list[ActiveTrajectory] = []
        every: list[ActiveTrajectory] = []
        try:
            turn = 0
            while True:
                every.extend(self._admit(pending, active, cap))
                act = [it for it in active if not it.done]
                if not act:
                    break
                n_rec = len(led.records)
                for it in act:
                    if it.turns_used >= cfg.max_turns and not it.final:
                        it.final, it.final_reason = True, "max_turns"
                finals = [it for it in act if it.final and not it.mid_turn]
                if finals and hasattr(gen, "mark_final"):
                    gen.mark_final([it.qid for it in finals])
                kw = {"partial": True} if partial else {}
                with blame("reasoner", [it.qid for it in act]):
                    texts = gen.generate([it.qid for it in act], stop=STOP, max_new_tokens=cfg.max_new_tokens,
                                         ledger=led, **kw)
                if len(texts) != len(act):
                    raise RuntimeError(f"generator returned {len(texts)} texts for {len(act)} sessions")
                for it, text in zip(act, texts):
                    it.mid_turn = text is None
                # With partial turns, this iteration handles the turns that finished; the rest go on.
                act, texts = [it for it in act if not it.mid_turn], [t for t in texts if t is not None]
                searchers, s_turns, s_queries = [], [], []
                invalid = []
                new_turns: list[tuple[ActiveTrajectory, Turn]] = []
                for it, text in zip(act, texts):
                    it.generations += 1
                    action, content = parse_action(text)
                    t = Turn(index=len(it.traj.turns), generated=text, action=action, content=content)
                    it.traj.turns.append(t)
                    it.response.append(text)
                    new_turns.append((it, t))
                    if it.final:
                        # Reference: the last rollout runs with do_search=False; a search is not
                        # executed, an invalid action still gets the invalid observation.
                        if action == "search":
                            t.action, t.extra["search_disabled"] = "none", True
                        elif action == "invalid":
                            t.observation = INVALID_OBSERVATION
                        it.done = True
                        it.traj.stop_reason = it.final_reason
                        continue
                    it.turns_used += 1
                    if action == "answer":
                        it.done = True
                        it.traj.stop_reason = "answer"
                    elif action == "search":
                        searchers.append(it)
                        s_turns.append(t)
                        s_queries.append(content)
                    else:
                        invalid.append((it, t))
                if searchers and self.pre_search_hooks:
                    searchers, s_turns, s_queries = self._pre_search(turn, searchers, s_turns, s_queries, led)
                if searchers:
                    self._retrieve_and_observe(searchers, s_turns, s_queries, led)
                if invalid:
                    for it, t in invalid:
                        t.observation = INVALID_OBSERVATION
                        it.response.append(INVALID_OBSERVATION)
                    with blame("reasoner", [it.qid for it, _ in invalid]):
                        gen.append([it.qid for it, _ in invalid], [INVALID_OBSERVATION] * len(invalid))
                running = [it for it in act if not it.done]
                if self.hooks and running:
                    ctx = TurnContext(self, turn, running, led)
                    for hook in self.hooks:
                        hook(ctx)
                        ctx.active = [it for it in ctx.active if not it.done]
                self._attach_turn_costs(new_turns, led, n_rec, acc)
                finished = [it for it in act if it.done]
                if finished:
                    gen.end([it.qid for it in finished])
                    # Hand a finished question's records to the run's ledger now, so that an
                    # on_finish callback (e.g. a crash-safe writer) sees all of its costs.
                    ids = {it.qid for it in finished}
                    done_recs = [r for r in led.records if r.question_id in ids]
                    led.records = [r for r in led.records if r.question_id not in ids]
                    self.ledger.extend(done_recs)
                for it in finished:
                    self._finalise(it, acc)
                    if on_finish is not None:
                        on_finish(it.traj)
                active = [it for it in active if not it.done]
                turn += 1
        except BaseException:
            # Free every session still open before the error propagates (a crash must not leak caches).
            open_ids = [it.qid for it in active if not it.done]
            if open_ids:
                try:
                    gen.end(open_ids)
                except Exception:
                    pass
            self.ledger.merge(led)
            raise
        self.ledger.merge(led)
        return [it.traj for it in every]

    # -- internals ---------------------------------------------------------------------------
    def _pre_search(self, turn: int, items: list[ActiveTrajectory], turns: list[Turn], queries: list[str],
                    led: CostLedger) -> tuple[list[ActiveTrajectory], list[Turn], list[str]]:
        """Run the pre-search hooks; return the searches still to make."""
        ctx = TurnContext(self, turn, list(items), led)
        for hook in self.pre_search_hooks:
            hook(ctx)
            ctx.active = [it for it in ctx.active if not it.done and not it.final]
        keep: tuple[list[ActiveTrajectory], list[Turn], list[str]] = ([], [], [])
        for it, t, q in zip(items, turns, queries):
            if it.done or it.final:
                t.action = "none"
                t.extra["search_cancelled"] = it.traj.stop_reason if it.done else it.final_reason
            else:
                keep[0].append(it)
                keep[1].append(t)
                keep[2].append(q)
        return keep

    def _retrieve_and_observe(self, items: list[ActiveTrajectory], turns: list[Turn], queries: list[str],
                              led: CostLedger) -> list[list[Any]]:
        cfg = self.config
        exclude = [list(it.read_ids) for it in items] if cfg.exclude_read else None
        ids = [it.qid for it in items]
        with blame("retriever", ids):
            hits = self.retriever.search(queries, cfg.topk, exclude=exclude, ledger=led, question_ids=ids)
        if len(hits) != len(items):
            raise RuntimeError(f"retriever returned {len(hits)} result lists for {len(items)} queries")
        obs = [format_observation(h) for h in hits]
        trunc = getattr(self.generator, "truncate_tokens", None)
        if trunc is not None:
            with blame("reasoner", ids):
                obs = trunc(obs, cfg.max_obs_tokens)
        else:
            obs = [truncate_whitespace_tokens(o, cfg.max_obs_tokens) for o in obs]
        for it, t, h, o in zip(items, turns, hits, obs):
            t.retrieved_ids = [str(x.id) for x in h]
            t.retrieved_titles = [x.title for x in h]
            t.scores = [float(x.score) for x in h]
            t.observation = o
            it.response.append(o)
            it.read_ids.extend(t.retrieved_ids)
        with blame("reasoner", ids):
            self.generator.append(ids, obs)
        return hits

    @staticmethod
    def _attach_turn_costs(new_turns: list[tuple[ActiveTrajectory, Turn]], led: CostLedger, start: int,
                           acc: dict[str, dict[str, dict[str, float]]]) -> None:
        # Records added since `start` belong to this turn (generation, retrieval, hooks); they are
        # also added to the per-question sums, so a trajectory's cost never rescans the ledger.
        per_q: dict[str, dict[str, dict[str, float]]] = {}
        for r in led.records[start:]:
            if r.question_id is None:
                continue
            row = per_q.setdefault(r.question_id, {}).setdefault(r.component, {k: 0 for k in NUMERIC_FIELDS})
            tot = acc.setdefault(r.question_id, {}).setdefault(r.component, {k: 0 for k in NUMERIC_FIELDS})
            for k in NUMERIC_FIELDS:
                v = getattr(r, k)
                row[k] += v
                tot[k] += v
        for it, t in new_turns:
            t.extra["cost"] = {c: _round_cost(v) for c, v in per_q.get(it.qid, {}).items()}

    def _finalise(self, it: ActiveTrajectory, acc: dict[str, dict[str, dict[str, float]]]) -> None:
        from ragfast.scoring.metrics import exact_match, extract_answer, f1, sub_exact_match

        tr = it.traj
        # The answer is the last <answer> of the response (generated text and observations),
        # never the prompt's "<answer> Beijing </answer>" example.
        # The invalid-action notice quotes "<answer> and </answer>": it is not the model's answer.
        tr.answer = extract_answer("".join(p for p in it.response if p != INVALID_OBSERVATION))
        tr.em = exact_match(tr.answer, tr.golden_answers)
        tr.f1 = f1(tr.answer, tr.golden_answers)
        tr.extra["sub_em"] = sub_exact_match(tr.answer, tr.golden_answers)
        tr.extra["turns_used"] = it.turns_used
        tr.cost = {c: _round_cost(v) for c, v in acc.get(tr.id, {}).items()}


def run_searchr1(questions: Sequence[Question], generator: Any, retriever: Any,
                 config: SearchR1Config | None = None, *, ledger: CostLedger | None = None,
                 hooks: Sequence[Hook] = (), on_finish: Callable[[Trajectory], None] | None = None,
                 skip_ids: Iterable[str] = (), pre_search_hooks: Sequence[Hook] = ()) -> list[Trajectory]:
    """Convenience wrapper: ``SearchR1Loop(generator, retriever, config, ...).run(questions)``."""
    loop = SearchR1Loop(generator, retriever, config, ledger=ledger, hooks=hooks, pre_search_hooks=pre_search_hooks)
    return loop.run(questions, on_finish=on_finish, skip_ids=skip_ids)

"""Search-R1 trajectories to train a reasoner on (``ragfast train-reasoner``).

The trajectories are the scripted evidence oracle's (:class:`~ragfast.models.generator.ScriptedGenerator`)
run through the real Search-R1 loop: the exact prompt and chat template, real retrieval over
the default corpus (the training questions' own paragraphs plus the bundled wiki sample), the
reference observation format, capped in the reasoner's own tokens. The oracle knows the gold
answers, so every trajectory searches with real queries, reads real documents and answers
when the answer is in what it read (or guesses when its searches are spent).

Behaviour mix. RL-trained Search-R1 models over-search: in the S2G study, 0.251 of Search-R1
7B's eligible states (states it searched from) were already answerable. An oracle that
answers at its first answerable state never does that, and a model trained on it gives a
stopping judge nothing to save. So each training question gets a minimum number of searches
``m`` (:class:`ScriptedGenerator`'s ``min_searches``): it answers a found answer only after
``m`` searches. ``m`` is ``a`` or ``a + 1``; :func:`choose_mix` picks ``a`` and the fraction
that gets ``a + 1`` so that the safe-early-stop prevalence **on the training questions** is the
study's 0.251 (no dev or test question is looked at). Which questions get ``a + 1`` is a hash
of the question id.

Each trajectory becomes one token sequence exactly as :class:`~ragfast.models.generator.HFGenerator`
builds a session (every piece tokenised on its own, without special tokens): the templated
prompt, then each generated turn (in the loss) and each observation (label -100, out of the
loss), then the end-of-turn token after the answer (in the loss).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError
from ragfast.types import Question, Trajectory

__all__ = ["TRAIN_PARTS", "STUDY_SEARCHES_PER_QUESTION", "STUDY_SAFE_PREVALENCE", "TokenCapOracle", "MixChoice",
           "training_questions", "oracle_trajectories", "safe_eligible", "choose_mix", "assign_min_searches",
           "repeated_queries", "sft_example", "build_training_set"]

#: The bundled training questions: HotpotQA train sample (300) and train-split extra (315).
TRAIN_PARTS: tuple[str, ...] = ("hotpotqa-train", "hotpotqa-train-extra")

#: Searches per question of Search-R1 Qwen2.5-7B PPO v0.2 on HotpotQA in the S2G study
#: (PROTOCOLS.md), reported beside the mix.
STUDY_SEARCHES_PER_QUESTION = 2.60125

#: The study's safe-early-stop prevalence: 0.251 of its 2,081 eligible states (states followed
#: by a search) were already answerable. It is what a stopping judge can save, so the mix
#: reproduces it.
STUDY_SAFE_PREVALENCE = 0.251


class TokenCapOracle:
    """The scripted oracle with observations capped in a real model's tokens.

    The loop truncates observations with the generator's ``truncate_tokens``; the oracle alone
    counts whitespace tokens, so its answers could come from text the trained model would
    never see. This wrapper cuts with the reasoner's tokenizer, as
    :meth:`HFGenerator.truncate_tokens <ragfast.models.generator.HFGenerator.truncate_tokens>` does.

    Parameters
    ----------
    oracle : ScriptedGenerator
    tokenizer : transformers tokenizer
    """

    def __init__(self, oracle: Any, tokenizer: Any):
        self.oracle = oracle
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.oracle, name)

    def truncate_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        out = []
        for t in texts:
            ids = self.tokenizer(t, add_special_tokens=False)["input_ids"]
            if len(ids) > max_tokens:
                t = self.tokenizer.decode(ids[:max_tokens], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
            out.append(t)
        return out


def training_questions(parts: Sequence[str] = TRAIN_PARTS, limit: int | None = None) -> list[Question]:
    """The training questions of ``parts`` (sample names or QA files), ids checked disjoint."""
    from ragfast.data import load_qa

    qs: list[Question] = []
    for p in parts:
        qs.extend(load_qa(p))
    seen: set[str] = set()
    for q in qs:
        if q.id in seen:
            raise DataError(f"training question id {q.id!r} appears twice in {list(parts)}")
        seen.add(q.id)
    return qs[:limit] if limit else qs


def oracle_trajectories(questions: Sequence[Question], retriever: Any, tokenizer: Any, *, min_searches: int = 1,
                        max_turns: int = 4, topk: int = 3, max_obs_tokens: int = 500,
                        batch_size: int = 64, quote_words: int | None = 0,
                        distinct_queries: bool = False, final_answer_only: bool = False) -> list[Trajectory]:
    """The oracle's Search-R1 trajectories of ``questions`` with a given ``min_searches`` (claims
    quote ``quote_words`` words at most; ``distinct_queries``: no query searched twice;
    ``final_answer_only``: the turn the loop forces written as ``<answer> X </answer>``:
    :class:`~ragfast.models.scripted.ScriptedGenerator`)."""
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.models.scripted import ScriptedGenerator

    gen = TokenCapOracle(ScriptedGenerator(max_searches=max_turns, min_searches=min_searches,
                                             quote_words=quote_words, distinct_queries=distinct_queries,
                                             final_answer_only=final_answer_only), tokenizer)
    cfg = SearchR1Config(max_turns=max_turns, topk=topk, max_obs_tokens=max_obs_tokens, batch_size=batch_size)
    return SearchR1Loop(gen, retriever, cfg).run(list(questions))


@dataclass
class MixChoice:
    """The behaviour mix: minimum searches ``low`` for most questions, ``low + 1`` for a fraction.

    Attributes
    ----------
    low : int
    fraction_high : float
        Share of questions (by id hash) with ``low + 1``.
    target : float
        Safe-early-stop prevalence aimed at.
    expected : float
        The prevalence the mix gives on the training questions.
    prevalence_by_min : dict
        Prevalence of each pure ``min_searches`` run, for the card.
    """

    low: int
    fraction_high: float
    target: float
    expected: float
    prevalence_by_min: dict[int, float] = field(default_factory=dict)


def _unit(qid: str, seed: int) -> float:
    return zlib.crc32(f"{seed}:{qid}".encode()) / 2.0**32


def assign_min_searches(qids: Sequence[str], mix: MixChoice, seed: int = 0) -> list[int]:
    """Each question's ``min_searches`` under ``mix``: ``low + 1`` where its id hash is below the fraction."""
    return [mix.low + (1 if _unit(q, seed) < mix.fraction_high else 0) for q in qids]


def safe_eligible(searches: Sequence[int], first_answerable: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Per question: eligible states (those followed by a search: ``0..S-1``) and the safe ones among them.

    A state is safe when the oracle could have answered there: from the first answerable
    state ``f`` on (its document stays in the evidence), so ``max(0, S - f)`` of the ``S``
    eligible states; none where no state was answerable (``None``).
    """
    s = np.asarray(searches, dtype=float)
    f = np.array([np.inf if x is None else float(x) for x in first_answerable])
    return s, np.where(np.isfinite(f), np.maximum(0.0, s - np.where(np.isfinite(f), f, 0.0)), 0.0)


def choose_mix(runs: dict[int, tuple[Sequence[float], Sequence[float]]], qids: Sequence[str],
               target: float = STUDY_SAFE_PREVALENCE, seed: int = 0) -> MixChoice:
    """The mix whose safe-early-stop prevalence on these (training) questions is nearest ``target``.

    Parameters
    ----------
    runs : dict int -> (eligible, safe)
        Per ``min_searches`` value, each question's eligible and safe state counts in the
        oracle run with it (:func:`safe_eligible`).
    qids : sequence of str
        The question ids, in the order of each list.
    target : float
        Safe eligible states over all eligible states.
    seed : int
        Salt of the id hash that picks the ``low + 1`` questions.
    """
    ms = sorted(runs)
    if not ms or any(len(runs[m][0]) != len(qids) or len(runs[m][1]) != len(qids) for m in ms):
        raise ConfigError("choose_mix needs each run's counts for every question")

    def ratio(e: np.ndarray, s: np.ndarray) -> float:
        return float(s.sum() / e.sum()) if e.sum() > 0 else 0.0

    arr = {m: (np.asarray(runs[m][0], float), np.asarray(runs[m][1], float)) for m in ms}
    prev = {m: ratio(*arr[m]) for m in ms}
    u = np.array([_unit(q, seed) for q in qids])
    best = MixChoice(ms[0], 0.0, target, prev[ms[0]], prev)
    for lo, hi in zip(ms, ms[1:]):
        if hi != lo + 1:
            continue
        # The prevalence is a step function of the fraction: try every breakpoint (a question's hash).
        for f in np.concatenate([[0.0], np.sort(u) + 1e-12]):
            f = float(min(f, 1.0))
            pick = u < f
            e = ratio(np.where(pick, arr[hi][0], arr[lo][0]), np.where(pick, arr[hi][1], arr[lo][1]))
            if abs(e - target) < abs(best.expected - target) - 1e-12:
                best = MixChoice(lo, f, target, e, prev)
    return best


def repeated_queries(trajs: Sequence[Trajectory]) -> int:
    """Searches that repeat an earlier query of the same trajectory (the card's loop check)."""
    n = 0
    for t in trajs:
        seen: set[str] = set()
        for x in t.turns:
            if x.action == "search":
                n += x.content in seen
                seen.add(x.content)
    return n


def sft_example(tokenizer: Any, traj: Trajectory, prompt: str, *, eos_id: int | None) -> dict[str, Any]:
    """Token ids and labels of one trajectory: generated turns in the loss, prompt and observations not.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    traj : Trajectory
    prompt : str
        The templated first message (``HFGenerator.format_prompt(build_prompt(question))``).
    eos_id : int, optional
        Appended (in the loss) after a trajectory that ends with an answer, so the model learns
        to close its turn.

    Returns
    -------
    dict
        ``input_ids``, ``labels`` (-100 out of the loss), ``n_observation`` and ``n_target`` token counts.
    """
    def enc(t: str) -> list[int]:
        return list(tokenizer(t, add_special_tokens=False)["input_ids"]) if t else []

    ids = enc(prompt)
    labels = [-100] * len(ids)
    n_obs = 0
    for t in traj.turns:
        g = enc(t.generated)
        ids += g
        labels += g
        if t.observation:
            o = enc(t.observation)
            ids += o
            labels += [-100] * len(o)
            n_obs += len(o)
    if traj.turns and traj.turns[-1].action == "answer" and eos_id is not None:
        ids.append(int(eos_id))
        labels.append(int(eos_id))
    n_tgt = sum(1 for x in labels if x != -100)
    return {"input_ids": ids, "labels": labels, "n_observation": n_obs, "n_target": n_tgt, "id": traj.id}


def build_training_set(questions: Sequence[Question], retriever: Any, tokenizer: Any, format_prompt: Callable[[str], str],
                       *, eos_id: int | None, max_turns: int = 4, topk: int = 3, max_obs_tokens: int = 500,
                       quote_words: int | None = 0, distinct_queries: bool = False, final_answer_only: bool = False,
                       target: float = STUDY_SAFE_PREVALENCE, seed: int = 0,
                       log: Callable[[str], None] = print) -> tuple[list[dict[str, Any]], MixChoice, dict[str, Any]]:
    """Oracle runs at ``min_searches`` 1..max_turns, the mix, and one SFT example per question.

    Returns
    -------
    (examples, mix, stats)
        ``stats`` holds counts for the card (questions, answered, oracle EM, searches).
    """
    from ragfast.protocol import build_prompt

    qids = [q.id for q in questions]
    runs: dict[int, list[Trajectory]] = {}
    for m in range(1, max_turns + 1):
        runs[m] = oracle_trajectories(questions, retriever, tokenizer, min_searches=m, max_turns=max_turns, topk=topk,
                                      max_obs_tokens=max_obs_tokens, quote_words=quote_words,
                                      distinct_queries=distinct_queries, final_answer_only=final_answer_only)
        log(f"oracle min_searches={m}: {np.mean([t.searches for t in runs[m]]):.3f} searches/q, "
            f"EM {np.mean([t.em for t in runs[m]]):.3f}")
    # The first answerable state: where the min_searches=1 oracle answered a gold it had read.
    first = [t.searches if t.stop_reason == "answer" and t.em > 0 else None for t in runs[1]]
    counts = {m: safe_eligible([t.searches for t in runs[m]], first) for m in runs}
    mix = choose_mix(counts, qids, target, seed)
    chosen = assign_min_searches(qids, mix, seed)
    trajs = [runs[m][i] for i, m in enumerate(chosen)]
    examples = [sft_example(tokenizer, t, format_prompt(build_prompt(q)), eos_id=eos_id)
                for t, q in zip(trajs, questions)]
    elig, safe = safe_eligible([t.searches for t in trajs], first)
    stats = {"questions": len(questions), "searches_per_question": float(np.mean([t.searches for t in trajs])),
             "eligible_states": int(elig.sum()), "safe_eligible_states": int(safe.sum()),
             "safe_prevalence": float(safe.sum() / max(1.0, elig.sum())),
             "answerable_questions": int(sum(f is not None for f in first)),
             "past_first_answerable": int(sum(1 for t, f in zip(trajs, first) if f is not None and t.searches > f)),
             "oracle_em": float(np.mean([t.em for t in trajs])),
             "repeated_queries": repeated_queries(trajs),
             "min_searches": {str(m): int(sum(1 for c in chosen if c == m)) for m in sorted(set(chosen))},
             "tokens": int(sum(len(e["input_ids"]) for e in examples)),
             "target_tokens": int(sum(e["n_target"] for e in examples)),
             "observation_tokens": int(sum(e["n_observation"] for e in examples))}
    return examples, mix, stats

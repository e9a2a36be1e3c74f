"""StepGap: a step-level gap checker for multi-round RAG trajectories.

A trajectory's reasoning is cut into steps; each step gets one of four labels from a five-stage
tree (three LLM stages, two NLI stages), the stage that decided it and, where one exists, the
verbatim evidence quote behind the decision. Each gap label has a typed repair
(:mod:`ragfast.methods.stepgap.repairs`).

Labels and repairs
------------------
=====================  ==================================================  ===========
label                  meaning                                             repair
=====================  ==================================================  ===========
``no_gap``             the step is grounded (or asserts nothing checkable)  none
``CONTRADICTED_CLAIM``  wrong target, unjustified abstention, or the        retract
                       evidence contradicts the claim
``IRRELEVANT_EVIDENCE``  the evidence is about another entity, or nothing   re-search
                       read so far supports the claim
``MISSING_BRIDGE``     a quote is on topic but does not entail the claim   bridge
=====================  ==================================================  ===========

Step segmentation rule (:func:`segment`)
----------------------------------------
Turns are read in order; injected repair turns (``turn.extra["injected"]``) contribute evidence
but no steps (they are the checker's own queries, not the model's reasoning).

1. The think text of a turn is the content of its ``<think>...</think>`` blocks; a turn
   without think tags uses the text before its action tag, with tags removed.
2. The think text is split into sentences at ``.``, ``!`` or ``?`` followed by whitespace and
   an upper-case letter, digit, quote or bracket. Each sentence of at least three words is one
   step, except *intent* sentences ("I need to ...", "I will search ...", "Let me ...",
   "Now I ...", "Next, ..."), which assert nothing checkable and are dropped.
3. A sentence saying the answer cannot be determined (``undeterminable``, ``cannot be
   determined``, ``not enough information``, ...) is an ``abstain`` step; other sentences are
   ``claim`` steps.
4. A search action adds a ``search`` step whose claim is the query; an answer action adds an
   ``answer`` step whose claim is the answer (an ``abstain`` step when the answer itself
   abstains). The answer's NLI hypothesis is "The answer to "<question>" is <answer>.".
5. Evidence: each search turn's observation is parsed into documents (``Doc i(Title: t) text``).
   A step in turn t carries every document observed in turns before t (``evidence``); its
   *local* evidence is the documents of the latest such search, its *earlier* evidence the rest.

The tree (:func:`check`)
------------------------
Every stage runs once, batched over all pending steps of all trajectories.

A. (LLM, claim/search/answer steps) entity/relation alignment with the question: a step about
   the wrong target is ``CONTRADICTED_CLAIM``.
B. (LLM, abstain steps) is the abstention justified by the evidence read? Unjustified (the
   evidence does answer) is ``CONTRADICTED_CLAIM``; justified is ``no_gap``. Without evidence
   an abstention is justified and B is not asked.
C. (LLM, claim/answer steps with local evidence) is the local evidence about the claim's entity,
   and which sentence of it (verbatim) supports the claim? A mismatch is
   ``IRRELEVANT_EVIDENCE``; a quote that is not verbatim in the evidence counts as no quote.
D. (NLI, steps with a quote) quote => claim: entailment >= t_e is ``no_gap``, else
   contradiction >= t_c is ``CONTRADICTED_CLAIM``, else ``MISSING_BRIDGE``. With C switched off
   the premises are the local documents (the best-entailing one counts).
E. (NLI, conclusive steps, i.e. claim/answer steps, without a local quote) earlier evidence
   => claim: the best-entailing earlier document at >= t_e gives ``no_gap``, else
   ``IRRELEVANT_EVIDENCE`` (also when there is no earlier evidence).

Search steps that pass A are ``no_gap``. A stage that is switched off, or whose LLM output
does not parse, passes the step on unchanged (a parse failure is counted per stage); a step
that no stage decides is ``no_gap``, decided by stage ``"-"``.

LLM stage outputs (strict JSON, one object, nothing else; the prompt ends with the object's
opening so the model only continues it):

- A: ``{"aligned": true|false, "entity": "<what the step is about>"}``
- B: ``{"justified": true|false}``
- C: ``{"consistent": true|false, "quote": "<verbatim sentence>" | null}``
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, blame
from ragfast.protocol import parse_observation
from ragfast.types import Trajectory

__all__ = [
    "LABELS", "GAP_LABELS", "NO_GAP", "CC", "IE", "MB", "REPAIRS", "STAGES",
    "Doc", "Step", "StepLabel", "CheckResult",
    "segment", "parse_docs", "check", "as_trajectory", "entity_of", "label_fractions", "norm_ws",
]

NO_GAP = "no_gap"
CC = "CONTRADICTED_CLAIM"
IE = "IRRELEVANT_EVIDENCE"
MB = "MISSING_BRIDGE"
LABELS = (NO_GAP, CC, IE, MB)
GAP_LABELS = (CC, IE, MB)
REPAIRS = {CC: "retract", IE: "re-search", MB: "bridge"}
STAGES = "ABCDE"

_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_TAG = re.compile(r"</?(think|search|answer|information)>")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
_INTENT = re.compile(r"^(?:(?:I|we)\s+(?:need|will|should|must|want|have to|am going to|'ll)\b|I'll\b|let me\b|"
                     r"let's\b|now,?\s+(?:I|let)\b|next,?\b|to answer this\b|first,?\s+I\b)", re.IGNORECASE)
_ABSTAIN = re.compile(r"\b(?:undeterminable|cannot be determined|can ?not determine|can't (?:be )?determine|"
                      r"not enough information|insufficient (?:information|evidence)|impossible to (?:tell|determine)|"
                      r"no information (?:about|on)|unable to determine|(?:is|remains) unknown)\b", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# steps
# ---------------------------------------------------------------------------------------------
@dataclass
class Doc:
    """One retrieved document as the reasoner saw it."""

    title: str
    text: str
    turn: int
    rank: int = 1

    def as_text(self) -> str:
        return f"{self.title}: {self.text}" if self.title else self.text


@dataclass
class Step:
    """One reasoning step s_i of a trajectory, with the evidence read before it.

    Attributes
    ----------
    trajectory_id : str
    question : str
    index : int
        Position among the trajectory's steps (0-based); annotations refer to it.
    turn : int
        Index of the turn the step comes from.
    kind : {"claim", "search", "answer", "abstain"}
    claim : str
        The sentence, the query or the answer.
    evidence : list of Doc
        Documents observed in turns before ``turn`` (e_<=i).
    local_turn : int or None
        Turn of the latest search before the step (its documents are the local evidence).
    """

    trajectory_id: str
    question: str
    index: int
    turn: int
    kind: str
    claim: str
    evidence: list[Doc] = field(default_factory=list)
    local_turn: int | None = None

    @property
    def local(self) -> list[Doc]:
        return [d for d in self.evidence if d.turn == self.local_turn]

    @property
    def earlier(self) -> list[Doc]:
        return [d for d in self.evidence if d.turn != self.local_turn]

    @property
    def hypothesis(self) -> str:
        """The NLI hypothesis: the claim, or a declarative sentence for an answer."""
        if self.kind == "answer":
            q = self.question.strip().rstrip("?")
            return f'The answer to "{q}?" is {self.claim}.'
        return self.claim


def parse_docs(observation: str, turn: int) -> list[Doc]:
    """Documents of a Search-R1 observation (``Doc i(Title: t) text`` lines inside ``<information>``).

    An observation truncated before ``</information>`` still yields its documents (the last one
    cut where the truncation cut it).
    """
    return [Doc(title=d.title, text=d.text, turn=turn, rank=d.rank) for d in parse_observation(observation)]


def _think_text(generated: str) -> str:
    blocks = _THINK.findall(generated or "")
    if blocks:
        return " ".join(b.strip() for b in blocks)
    m = _ACTION.search(generated or "")
    head = (generated or "")[: m.start()] if m else (generated or "")
    return _TAG.sub(" ", head).strip()


def _sentences(text: str) -> list[str]:
    text = re.sub(r"\s+", " ", text).strip()
    return [s.strip() for s in _SENT.split(text) if s.strip()] if text else []


def as_trajectory(t: Trajectory | Mapping[str, Any]) -> Trajectory:
    """A :class:`~ragfast.types.Trajectory` from itself or its dict; :class:`DataError` otherwise."""
    if isinstance(t, Trajectory):
        return t
    if isinstance(t, Mapping):
        try:
            return Trajectory.from_dict(dict(t))
        except TypeError as exc:
            raise DataError(f"not a trajectory record: {exc}") from exc
    raise DataError(f"expected a Trajectory or a trajectory dict, got {type(t).__name__}")


def segment(trajectory: Trajectory | Mapping[str, Any]) -> list[Step]:
    """Cut a trajectory into steps, each with the evidence read before it.

    The rule is the module docstring's "Step segmentation rule".

    Parameters
    ----------
    trajectory : Trajectory or dict
        A trajectory (or its JSONL record) with turns.

    Returns
    -------
    list of Step
    """
    tr = as_trajectory(trajectory)
    steps: list[Step] = []
    evidence: list[Doc] = []
    local_turn: int | None = None

    def add(turn: int, kind: str, claim: str) -> None:
        steps.append(Step(tr.id, tr.question, len(steps), turn, kind, claim, list(evidence), local_turn))

    for ti, turn in enumerate(tr.turns):
        injected = bool(turn.extra.get("injected")) if isinstance(turn.extra, dict) else False
        if not injected:
            for s in _sentences(_think_text(turn.generated)):
                if len(s.split()) < 3 or _INTENT.search(s):
                    continue
                add(ti, "abstain" if _ABSTAIN.search(s) else "claim", s)
            if turn.action == "search" and turn.content:
                add(ti, "search", turn.content.strip())
            elif turn.action == "answer" and turn.content is not None:
                ans = turn.content.strip()
                add(ti, "abstain" if (_ABSTAIN.search(ans) or not ans) else "answer", ans)
        if turn.action == "search":
            docs = parse_docs(turn.observation, ti)
            if docs:
                evidence.extend(docs)
                local_turn = ti
    return steps


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class StepLabel:
    """The checker's verdict on one step."""

    trajectory_id: str
    step: int
    turn: int
    kind: str
    claim: str
    label: str = NO_GAP
    stage: str = "-"
    quote: str | None = None
    reason: str = ""
    entity: str | None = None
    probs: list[float] | None = None  # NLI (entailment, neutral, contradiction) of the deciding pair

    @property
    def repair(self) -> str | None:
        return REPAIRS.get(self.label)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["repair"] = self.repair
        return d


@dataclass
class CheckResult:
    """Labels for every step, plus what the check spent and where its LLM output failed.

    Attributes
    ----------
    steps : list of Step
    labels : list of StepLabel
        One per step, same order.
    stages : str
        Stages that ran (those requested and backed by a model).
    failures : dict
        Stage -> number of LLM outputs that did not parse (those steps were passed on).
    calls : dict
        Stage -> number of batched calls made (one per stage that had work).
    items : dict
        Stage -> prompts or NLI pairs sent.
    slots : dict
        What filled the LLM and NLI slots and whether their outputs mean anything.
    """

    steps: list[Step]
    labels: list[StepLabel]
    stages: str
    failures: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)
    slots: dict[str, Any] = field(default_factory=dict)

    def by_trajectory(self) -> dict[str, list[StepLabel]]:
        out: dict[str, list[StepLabel]] = {}
        for lab in self.labels:
            out.setdefault(lab.trajectory_id, []).append(lab)
        return out

    def label_mix(self) -> dict[str, float]:
        return label_fractions([lab.label for lab in self.labels])

    def summary(self) -> dict[str, Any]:
        return {"steps": len(self.labels), "stages": self.stages, "label_mix": self.label_mix(),
                "deciding_stage": dict(Counter(lab.stage for lab in self.labels)),
                "failures": dict(self.failures), "calls": dict(self.calls), "items": dict(self.items),
                "slots": self.slots}


def label_fractions(labels: Sequence[str]) -> dict[str, float]:
    """The share of each of :data:`LABELS` among ``labels`` (zeros when empty)."""
    n = len(labels)
    c = Counter(labels)
    return {lab: (c[lab] / n if n else 0.0) for lab in LABELS}


# ---------------------------------------------------------------------------------------------
# LLM stages
# ---------------------------------------------------------------------------------------------
_SYSTEM = ("You check one reasoning step of a question-answering agent that searches the web. "
           "Reply with one JSON object only, no other text.")


def _evidence_block(docs: Sequence[Doc], limit_chars: int = 2400) -> str:
    if not docs:
        return "(nothing retrieved yet)"
    text = "\n".join(f"[{i + 1}] {d.as_text()}" for i, d in enumerate(docs))
    return text[:limit_chars]


def _prompt_a(s: Step) -> str:
    what = {"search": "search query", "answer": "final answer", "claim": "claim"}[s.kind]
    return (f"{_SYSTEM}\nTask: decide whether the step is about the entity and relation that the question "
            f"(or the current hop of it) needs. A step about another person, place, work or relation has the "
            f"wrong target.\nSchema: {{\"aligned\": true or false, \"entity\": \"the entity the step is about\"}}\n\n"
            f"QUESTION: {s.question}\nSTEP ({what}): {s.claim}\n\nJSON: ")


def _prompt_b(s: Step) -> str:
    return (f"{_SYSTEM}\nTask: the agent said the answer cannot be determined. Decide whether that is justified: "
            f"it is NOT justified when the evidence below does answer the question.\n"
            f"Schema: {{\"justified\": true or false}}\n\nQUESTION: {s.question}\nSTEP: {s.claim}\n"
            f"EVIDENCE:\n{_evidence_block(s.evidence)}\n\nJSON: ")


def _prompt_c(s: Step) -> str:
    return (f"{_SYSTEM}\nTask: decide whether the evidence is about the same entity as the claim, and copy the one "
            f"sentence of the evidence that supports the claim, word for word (null when none does).\n"
            f"Schema: {{\"consistent\": true or false, \"quote\": \"verbatim sentence\" or null}}\n\n"
            f"QUESTION: {s.question}\nCLAIM: {s.hypothesis}\nEVIDENCE:\n{_evidence_block(s.local)}\n\nJSON: ")


# Each stage's output opens with this key; the prompt ends right before it so a model continues
# the object instead of chatting.
_OPENERS = {"A": '{"aligned":', "B": '{"justified":', "C": '{"consistent":'}
# C's budget holds a verbatim sentence as a JSON quote: in the Qwen2.5 tokenizer, 99.8% of the
# bundled HotpotQA train split's context sentences (25,139) fit in 128 tokens with the rest of
# the object. The 0.5B checker's failures (loops, whole passages) otherwise run to any cap.
_MAX_NEW = {"A": 48, "B": 16, "C": 128}


def _parse_json(stage: str, text: str) -> dict[str, Any] | None:
    """Strict parse of one stage's output; None when it is not exactly the stage's schema."""
    s = (text or "").strip()
    if s.startswith("```"):
        s = re.sub(r"^```(?:json)?\s*|\s*```$", "", s).strip()
    opener = _OPENERS[stage]
    if not s.startswith("{"):
        s = opener + " " + s  # the model continued the opener the prompt ended with
    if s.count("{") > s.count("}"):
        s = s + "}"  # generation stops at the closing brace's stop string
    try:
        obj = json.loads(s, object_pairs_hook=_unique_keys)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    if stage == "A":
        if not isinstance(obj.get("aligned"), bool):
            return None
        ent = obj.get("entity")
        if ent is not None and not isinstance(ent, str):
            return None
    elif stage == "B":
        if not isinstance(obj.get("justified"), bool):
            return None
    elif stage == "C":
        if not isinstance(obj.get("consistent"), bool) or "quote" not in obj:
            return None
        if obj["quote"] is not None and not isinstance(obj["quote"], str):
            return None
    return obj


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A key given twice is not the schema: which of its values counts would otherwise be the last
    # one's, and a completion could not be settled before it ends (:func:`_quote_settled`).
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key")
    return dict(pairs)


# What stage C's completion says before its quote: consistent, then the quote's opening quote mark.
_C_QUOTE = re.compile(r'\s*true\s*,\s*"quote"\s*:\s*"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _string_prefix(raw: str) -> str:
    """The text a JSON string's first characters ``raw`` (after its opening quote) decode to, up to
    its closing quote or a cut escape."""
    out, i = [], 0
    while i < len(raw):
        c = raw[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        e = raw[i + 1]
        if e == "u":
            try:
                code = int(raw[i + 2:i + 6], 16) if i + 6 <= len(raw) else -1
                low = int(raw[i + 8:i + 12], 16) if raw[i + 6:i + 8] == "\\u" and i + 12 <= len(raw) else -1
            except ValueError:
                break
            if code < 0 or (0xD800 <= code < 0xDC00 and i + 12 > len(raw)):
                break  # cut, or a high surrogate whose pair may follow
            if 0xD800 <= code < 0xDC00 and 0xDC00 <= low < 0xE000:  # one character, as json reads the pair
                out.append(chr(0x10000 + (code - 0xD800) * 0x400 + (low - 0xDC00)))
                i += 12
                continue
            out.append(chr(code))
            i += 6
            continue
        out.append(_ESCAPES.get(e, ""))
        i += 2
    return "".join(out)


def _quote_settled(docs: Sequence[Doc]) -> Any:
    """Stage C's ``settled`` test for a step with local documents ``docs``: True once a completion
    reads ``true, "quote": "...`` and what the quote holds so far is in none of them, whitespace and
    case aside. Then whatever follows, the step gets nothing from C: a parsed object has
    consistent true (keys are unique) and a quote that, extending that text, is not verbatim
    either; an unparsed one counts as a failure. Other completions settle only once they are
    :func:`_broken`."""
    texts = [norm_ws(d.title + " " + d.text) for d in docs]
    broken = _broken("C")

    def settled(text: str) -> bool:
        if broken(text):
            return True
        m = _C_QUOTE.match(text)
        if m is None:
            return False
        q = _string_prefix(text[m.end():])
        if "\u03a3" in q:  # str.lower() reads a capital sigma by what follows it: no prefix rule
            return False
        q = norm_ws(q)
        return bool(q) and not any(q in t for t in texts)

    return settled


# The string key each stage writes after its boolean; the head of a completion up to that string.
_STRING_KEY = {"A": "entity", "C": "quote"}
_HEADS = {k: re.compile(r'\s*(?:true|false)\s*,\s*"' + v + r'"\s*:\s*"') for k, v in _STRING_KEY.items()}


def _broken(stage: str) -> Any:
    """A ``settled`` test for stages A and C: True once a completion reads ``true`` or ``false``,
    then the stage's string key, and a string that no text can extend into JSON: a raw control
    character or an unknown escape inside it, or, after its closing quote, anything but
    whitespace, a comma or the closing brace (the 0.5B often copies a title's quote marks
    unescaped). Such a completion is a parse failure however it goes on, so it ends there.
    Completions the test cannot read (another key, a ``\\u`` escape not yet whole) never settle."""
    head = _HEADS[stage]

    def broken(text: str) -> bool:
        m = head.match(text)
        if m is None:
            return False
        i, n = m.end(), len(text)
        while i < n:
            c = text[i]
            if c == '"':
                rest = text[i + 1:].lstrip(" \t\n\r")
                return bool(rest) and rest[0] not in ",}"
            if c < " ":
                return True  # json.loads is strict: no raw control characters in strings
            if c == "\\":
                e = text[i + 1:i + 2]
                if e == "u":
                    if not re.fullmatch(r"[0-9a-fA-F]{4}", text[i + 2:i + 6]):
                        return False  # cut (or odd): left to the parser
                    i += 6
                    continue
                if not e:
                    return False
                if e not in _ESCAPES:
                    return True
                i += 2
                continue
            i += 1
        return False

    return broken


def norm_ws(s: str) -> str:
    """Lower-case text with whitespace runs collapsed (how quotes are matched against evidence)."""
    return re.sub(r"\s+", " ", s).strip().lower()


def _verbatim(quote: str, docs: Sequence[Doc]) -> bool:
    q = norm_ws(quote)
    return bool(q) and any(q in norm_ws(d.title + " " + d.text) for d in docs)


def _run_llm(generator: Any, stage: str, steps: Sequence[Step], build: Any, ledger: CostLedger | None,
             result: CheckResult, max_new: Mapping[str, int], memo: dict) -> list[dict[str, Any] | None]:
    """One batched ``complete`` call for a stage; returns parsed objects (None = failure). Stage A's
    and C's completions may end once they cannot parse (:func:`_broken`), and C's once their quote
    cannot be verbatim (:func:`_quote_settled`)."""
    if not steps:
        return []
    fmt = getattr(generator, "format_prompt", None)
    prompts = [(fmt(p) if fmt else p) + _OPENERS[stage] for p in (build(s) for s in steps)]
    # A think that repeats a sentence gives steps with one prompt (half of the bench's stage A and C
    # prompts, and a third of A's again across a loop's rounds): each distinct prompt is completed
    # once, greedily, booked to its first step's question, and kept in ``memo`` for later calls.
    # Stage C's settled test and quote check read all local documents, the prompt only their start.
    keys = [(p, tuple(d.as_text() for d in s.local) if stage == "C" else ()) for p, s in zip(prompts, steps)]
    first = {k: i for i, k in reversed(list(enumerate(keys))) if k not in memo}
    uniq = sorted(first.values())
    qids = [steps[i].trajectory_id for i in uniq]
    private = CostLedger()
    settled = None
    if stage in _HEADS:
        settled = [(_quote_settled(steps[i].local) if stage == "C" else _broken(stage)) for i in uniq]
    outs: list[str] = []
    if uniq:
        with blame("checker", qids):
            outs = generator.complete([prompts[i] for i in uniq], stop=("}",), max_new_tokens=int(max_new[stage]),
                                      ledger=private, question_ids=qids, settled=settled)
    if len(outs) != len(uniq):
        raise RuntimeError(f"generator returned {len(outs)} outputs for {len(uniq)} stage-{stage} prompts")
    if ledger is not None:
        _move_records(private, ledger, qids)
    if uniq:
        result.calls[stage] = result.calls.get(stage, 0) + 1
    result.items[stage] = result.items.get(stage, 0) + len(prompts)
    memo.update((keys[i], o) for i, o in zip(uniq, outs))
    parsed = [_parse_json(stage, memo[k]) for k in keys]
    result.failures[stage] = result.failures.get(stage, 0) + sum(p is None for p in parsed)
    return parsed


def _move_records(src: CostLedger, dst: CostLedger, qids: Sequence[str]) -> None:
    # The generator books its calls as "reasoner"; the checker's LLM calls go to "judge" so that
    # the reasoner's and the checker's costs stay apart. Stateless completion sessions are named
    # "_complete_<i>" by the base class: map them back to the step's question.
    for r in src.records:
        qid = r.question_id
        m = re.fullmatch(r"_complete_(\d+)", qid or "")
        if m and int(m.group(1)) < len(qids):
            qid = qids[int(m.group(1))]
        dst.add("judge", qid, calls=r.calls, input_tokens=r.input_tokens, cached_tokens=r.cached_tokens,
                output_tokens=r.output_tokens, flops=r.flops, seconds=r.seconds, device_seconds=r.device_seconds)
    n_batches = sum(src.batches.values())
    with dst._lock:
        dst.batches["judge"] += n_batches


# ---------------------------------------------------------------------------------------------
# the tree
# ---------------------------------------------------------------------------------------------
def _nli_max(nli: Any, pairs: list[tuple[int, str, str]], ledger: CostLedger | None,
             qids: Sequence[str]) -> dict[int, np.ndarray]:
    """Score (step, premise, hypothesis) pairs in one call; per step keep the best-entailing pair."""
    if not pairs:
        return {}
    ids = [qids[i] for i, _, _ in pairs]
    with blame("nli", ids):
        probs = np.asarray(nli.score([p for _, p, _ in pairs], [h for _, _, h in pairs], ledger=ledger,
                                     question_ids=ids), dtype=np.float64)
    if probs.shape != (len(pairs), 3):
        raise RuntimeError(f"NLI scorer returned shape {probs.shape} for {len(pairs)} pairs; expected (n, 3)")
    best: dict[int, np.ndarray] = {}
    for (i, _, _), p in zip(pairs, probs):
        if i not in best or p[0] > best[i][0]:
            best[i] = p
    return best


def entity_of(s: Step) -> str | None:
    """The entity a step's claim is about, read from its capitalised words (None when none is new)."""
    # Capitalised word runs of the claim that the question does not already name: the
    # re-search target when stage A gave no entity.
    q = s.question.lower()
    runs = re.findall(r"(?:[A-Z][\w'&.-]*\s?)+", s.claim)
    skip = {"the", "so", "doc", "i", "it", "this", "then", "therefore", "thus", "however", "my", "our"}
    for r in runs:
        r = r.strip().rstrip(".,;:!?'")
        if r and r.lower() not in q and r.split()[0].lower() not in skip:
            return r
    return None


def check(trajectories: Iterable[Trajectory | Mapping[str, Any]], generator: Any = None, nli: Any = None,
          stages: str = STAGES, thresholds: tuple[float, float] = (0.5, 0.5), *, ledger: CostLedger | None = None,
          from_turn: Mapping[str, int] | None = None, max_new_tokens: Mapping[str, int] | None = None,
          memo: dict | None = None) -> CheckResult:
    """Label every step of every trajectory with the five-stage StepGap tree.

    Parameters
    ----------
    trajectories : iterable of Trajectory or dict
    generator : Generator, optional
        Any :class:`ragfast.models.Generator`; stages A-C call its ``complete`` once each, over
        all pending steps. Without one, A-C are skipped.
    nli : NLIScorer-like, optional
        Anything with ``score(premises, hypotheses, ledger=, question_ids=) -> (n, 3)``
        probabilities in (entailment, neutral, contradiction) order. Without one, D-E are
        skipped.
    stages : str
        Which of "ABCDE" to run (ablations drop letters).
    thresholds : (float, float)
        Entailment and contradiction thresholds of stages D and E.
    ledger : CostLedger, optional
        NLI costs go to component "nli", the LLM stages' costs to "judge" (per question).
    from_turn : mapping, optional
        Trajectory id -> first turn whose steps are checked; earlier steps are segmented (their
        documents count as evidence) but left out of the result. Used by the loop to check only
        the newest turn.
    max_new_tokens : mapping, optional
        Per LLM stage ("A", "B", "C") generation budget; defaults 48, 16 and 128 tokens (C
        copies a whole sentence).
    memo : dict, optional
        Completions of stage prompts made by earlier calls with the same generator and budgets
        (a loop's rounds): a prompt found there is not completed again, and this call's
        completions are added to it.

    Returns
    -------
    CheckResult
    """
    stages = stages.upper()
    bad = set(stages) - set(STAGES)
    if bad:
        raise ConfigError(f"unknown StepGap stages {''.join(sorted(bad))!r}; use letters of {STAGES!r}")
    t_e, t_c = (float(x) for x in thresholds)
    if not (0.0 <= t_e <= 1.0 and 0.0 <= t_c <= 1.0):
        raise ConfigError(f"thresholds must be probabilities, got {thresholds}")
    active = "".join(s for s in STAGES if s in stages and ((s in "ABC" and generator is not None)
                                                         or (s in "DE" and nli is not None)))
    memo = {} if memo is None else memo
    budget = dict(_MAX_NEW)
    for k, v in (max_new_tokens or {}).items():
        if k not in _MAX_NEW or int(v) < 1:
            raise ConfigError(f"max_new_tokens: bad entry {k!r}: {v!r} (stages A, B, C; at least 1)")
        budget[k] = int(v)
    trajs = [as_trajectory(t) for t in trajectories]
    dup = [k for k, c in Counter(t.id for t in trajs).items() if c > 1]
    if dup:
        raise DataError(f"duplicate trajectory ids {dup[:3]}: step labels are keyed by (id, step)")
    steps: list[Step] = []
    for tr in trajs:
        start = (from_turn or {}).get(tr.id, 0)
        steps.extend(s for s in segment(tr) if s.turn >= start)
    labels = [StepLabel(s.trajectory_id, s.index, s.turn, s.kind, s.claim) for s in steps]
    slots = {"llm": generator.describe() if generator is not None and hasattr(generator, "describe") else None,
             "nli": nli.describe() if nli is not None and hasattr(nli, "describe") else None}
    res = CheckResult(steps, labels, active, slots=slots)
    qids = [s.trajectory_id for s in steps]
    decided = [False] * len(steps)
    quotes: list[str | None] = [None] * len(steps)

    def decide(i: int, label: str, stage: str, reason: str, quote: str | None = None,
               probs: np.ndarray | None = None) -> None:
        lab = labels[i]
        lab.label, lab.stage, lab.reason, decided[i] = label, stage, reason, True
        if quote is not None:
            lab.quote = quote
        if probs is not None:
            lab.probs = [round(float(x), 6) for x in probs]

    # A: alignment of claims, queries and answers with the question's target.
    if "A" in active:
        idx = [i for i, s in enumerate(steps) if s.kind in ("claim", "search", "answer")]
        for i, obj in zip(idx, _run_llm(generator, "A", [steps[i] for i in idx], _prompt_a, ledger, res, budget, memo)):
            if obj is None:
                continue
            if obj.get("entity"):
                labels[i].entity = obj["entity"].strip() or None
            if obj["aligned"] is False:
                decide(i, CC, "A", "the step targets the wrong entity or relation")
    # B: abstentions. Without evidence there is nothing the abstention could have missed.
    if "B" in active:
        for i, s in enumerate(steps):
            if s.kind == "abstain" and not s.evidence and not decided[i]:
                decide(i, NO_GAP, "B", "abstained before reading any evidence")
        idx = [i for i, s in enumerate(steps) if s.kind == "abstain" and not decided[i]]
        for i, obj in zip(idx, _run_llm(generator, "B", [steps[i] for i in idx], _prompt_b, ledger, res, budget, memo)):
            if obj is None:
                continue
            if obj["justified"]:
                decide(i, NO_GAP, "B", "abstention justified by the evidence read")
            else:
                decide(i, CC, "B", "abstained although the evidence answers the question")
    # Search steps that passed A, and abstentions B could not judge, have nothing more to check.
    for i, s in enumerate(steps):
        if not decided[i] and s.kind in ("search", "abstain"):
            decide(i, NO_GAP, "-", "nothing further to check for this kind of step")
    # C: entity consistency of the local evidence and a verbatim quote.
    if "C" in active:
        idx = [i for i, s in enumerate(steps) if not decided[i] and s.local]
        for i, obj in zip(idx, _run_llm(generator, "C", [steps[i] for i in idx], _prompt_c, ledger, res, budget, memo)):
            if obj is None:
                continue
            if obj["consistent"] is False:
                decide(i, IE, "C", "the local evidence is about another entity")
                continue
            q = obj.get("quote")
            if isinstance(q, str) and q.strip():
                if _verbatim(q, steps[i].local):
                    quotes[i] = q.strip()
                    labels[i].quote = q.strip()
                else:
                    res.failures["C_quote_not_verbatim"] = res.failures.get("C_quote_not_verbatim", 0) + 1
    # D: quote => claim (with C off: local documents => claim).
    if "D" in active:
        pairs: list[tuple[int, str, str]] = []
        for i, s in enumerate(steps):
            if decided[i]:
                continue
            if quotes[i] is not None:
                pairs.append((i, quotes[i], s.hypothesis))
            elif "C" not in active:
                pairs.extend((i, d.as_text(), s.hypothesis) for d in s.local)
        best = _nli_max(nli, pairs, ledger, qids)
        if pairs:
            res.calls["D"] = res.calls.get("D", 0) + 1
            res.items["D"] = res.items.get("D", 0) + len(pairs)
        for i, p in best.items():
            src = "the quote" if quotes[i] is not None else "the best local document"
            if p[0] >= t_e:
                decide(i, NO_GAP, "D", f"{src} entails the claim", probs=p)
            elif p[2] >= t_c:
                decide(i, CC, "D", f"{src} contradicts the claim", probs=p)
            else:
                decide(i, MB, "D", f"{src} is on topic but does not entail the claim", probs=p)
    # E: conclusive steps without a local quote, against the earlier evidence.
    if "E" in active:
        cand = [i for i, s in enumerate(steps) if not decided[i] and quotes[i] is None and s.kind in ("claim", "answer")]
        pairs = [(i, d.as_text(), steps[i].hypothesis) for i in cand for d in steps[i].earlier]
        best = _nli_max(nli, pairs, ledger, qids)
        if pairs:
            res.calls["E"] = res.calls.get("E", 0) + 1
            res.items["E"] = res.items.get("E", 0) + len(pairs)
        for i in cand:
            p = best.get(i)
            if p is not None and p[0] >= t_e:
                decide(i, NO_GAP, "E", "earlier evidence entails the claim", probs=p)
            else:
                decide(i, IE, "E", "no earlier document entails the claim" if steps[i].earlier
                       else "no earlier evidence to support the claim", probs=p)
    for i in range(len(steps)):
        if not decided[i]:
            decide(i, NO_GAP, "-", "no active stage found a gap")
    for lab, s in zip(labels, steps):
        if lab.entity is None:
            lab.entity = entity_of(s)
    return res


"""The scripted evidence oracle: a deterministic reasoner that writes protocol-faithful Search-R1
text from the gold answers and the documents it has retrieved. Its answers are NOT a model's
answers (``meaningful = False``): its EM measures evidence reachability, the ceiling a real
reasoner in the slot is compared with.
"""
from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError
from ragfast.models.base import Generator
from ragfast.models.base import check_new_sessions, check_sessions, cut_at_stop
from ragfast.protocol import observation_blocks
from ragfast.text import whitespace_tokens

__all__ = ["ScriptedGenerator"]


_QUESTION = re.compile(r"Question: (.*)\n", re.DOTALL)
_SENT = re.compile(r"(?<=[.!?])\s+")


@dataclass
class _Doc:
    title: str
    text: str
    search: int  # which search returned it (1-based)
    rank: int  # its Doc number in that observation


@dataclass
class _ScriptSession:
    question: str
    golds: list[str]
    text: str  # the whole session text (prompt + everything generated and appended)
    pending_tokens: int  # whitespace tokens appended since the last generation (fresh input)
    docs: list[_Doc] = field(default_factory=list)
    searches: int = 0
    queried_titles: list[str] = field(default_factory=list)
    held: int = 0  # searches made past a found answer
    final: bool = False
    #: The question id the no-evidence guess is keyed by: a session restarted or probed under
    #: another session id (S2G's answer-only probes) guesses as the question's own session.
    key: str = ""


def _clip_words(s: str, n: int) -> str:
    w = s.split()
    return " ".join(w[:n]) + (" ..." if len(w) > n else "")


class ScriptedGenerator(Generator):
    """A deterministic evidence oracle that writes Search-R1-formatted turns.

    It is a test and demo agent, not a model: it knows the gold answers. Its script:

    - the first search is the question itself;
    - each later search is the question plus the most relevant title it has read and not yet
      searched for (the best-ranked one of the latest observation);
    - each ``<think>`` states one claim citing the document it came from
      (``Doc 2 (Title) says ...``);
    - it answers a gold answer as soon as that answer's normalised string appears in the
      evidence it has read;
    - once its searches are spent (``max_searches``, or the loop marks the final turn with
      :meth:`mark_final`) it answers its best guess: the best-ranked title of the latest search
      that the question does not already name.

    Its EM therefore measures how reachable the evidence is, not how well a model reasons.
    Token counts (for the ledger and observation truncation) are whitespace tokens.

    Parameters
    ----------
    questions : sequence of Question or mapping id -> Question, optional
        Gold answers per session id; more can be given later with :meth:`bind_questions` (the
        Search-R1 loop calls it with each batch). A session without a bound question parses
        its question out of the prompt and can only guess.
    seed : int
        Picks the guess when nothing at all was retrieved (deterministic per question).
    max_searches : int
        Searches after which it answers its best guess even without :meth:`mark_final`.
    min_searches : int
        Searches it makes before it answers a gold answer it has found (default 1: it answers
        at its first answerable state). Above 1 it searches past that state, as RL-trained
        Search-R1 models over-search (``ragfast train-reasoner`` builds its data so).
    quote_words : int, optional
        Words a claim quotes from its document (default: 40 from the answer's sentence, 25
        otherwise). 0 quotes nothing (``Doc 2 (Title) names X.``): the training data of
        ``ragfast train-reasoner``, because SmolLM2-135M trained on the quoting claims copied
        them into loops (0.65 of the turns valid on dev 100-139; unquoted, 0.78 on dev 100-199).
    distinct_queries : bool
        Never search the same query twice (``ragfast train-reasoner``'s data). By default a
        held-back search repeats the answer's title, and a search that brought nothing new is
        followed by the question alone again: on the 615 training questions that repeated 805
        queries and 459 whole turns at ``min_searches`` 3 (``ragfast train-reasoner
        --distinct-queries``; the adapter trained with it looped as much, README). With
        it, each later search is the best-ranked title read and not yet searched (latest
        search first), then the question; a held-back turn cites the latest search's top document; and with no title
        left it answers (a found answer, or its best guess) instead of repeating itself.
    final_answer_only : bool
        Write the turn the loop marks final (:meth:`mark_final`) as ``<answer> X </answer>``
        alone, as :class:`~ragfast.models.searchr1_reasoner.SearchR1Reasoner` opens it with
        ``<answer>`` (``ragfast train-reasoner --final-answer-only``). The bundled adapter, trained
        on think-first final turns, left 26 of 100 held-out questions unanswered and 48 of 100
        closed-book; an adapter trained with this answered no more of them (README).
    """

    name = "scripted evidence oracle"
    meaningful = False
    NOTE = "scripted evidence oracle: EM measures evidence reachability, not reasoning"

    def __init__(self, questions: Sequence[Any] | Mapping[str, Any] | None = None, *, seed: int = 0,
                 max_searches: int = 4, min_searches: int = 1, quote_words: int | None = None,
                 distinct_queries: bool = False, final_answer_only: bool = False):
        if max_searches < 0:
            raise ConfigError(f"max_searches must be >= 0, got {max_searches}")
        if min_searches < 0:
            raise ConfigError(f"min_searches must be >= 0, got {min_searches}")
        self.seed = int(seed)
        self.max_searches = int(max_searches)
        self.min_searches = int(min_searches)
        if quote_words is not None and quote_words < 0:
            raise ConfigError(f"quote_words must be >= 0, got {quote_words}")
        self.quote_words = quote_words
        self.distinct_queries = bool(distinct_queries)
        self.final_answer_only = bool(final_answer_only)
        self._questions: dict[str, Any] = {}
        self._sessions: dict[str, _ScriptSession] = {}
        if questions is not None:
            self.bind_questions(questions)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "meaningful": False, "class": type(self).__name__, "note": self.NOTE,
                "seed": self.seed, "tokens": "whitespace"}

    # -- oracle inputs -----------------------------------------------------------------------
    def bind_questions(self, questions: Sequence[Any] | Mapping[str, Any]) -> None:
        """Give the oracle the gold answers: Questions (keyed by their id) or a mapping id -> Question."""
        items = questions.items() if isinstance(questions, Mapping) else ((q.id, q) for q in questions)
        for qid, q in items:
            if not getattr(q, "golden_answers", None):
                raise ValueError(f"ScriptedGenerator: question {qid!r} has no golden answers")
            self._questions[str(qid)] = q

    def mark_final(self, ids: Sequence[str]) -> None:
        """The next generation of these sessions is the answer-only one: answer, do not search."""
        check_sessions(self._sessions, ids, "ScriptedGenerator.mark_final")
        for i in ids:
            self._sessions[i].final = True

    # -- Generator interface -----------------------------------------------------------------
    def start(self, ids: Sequence[str], prompts: Sequence[str]) -> None:
        check_new_sessions(self._sessions, ids, prompts, "ScriptedGenerator.start")
        for i, p in zip(ids, prompts):
            q = self._questions.get(i)
            if q is not None:
                question, golds = q.question.strip(), list(q.golden_answers)
            else:
                m = _QUESTION.search(p)
                question, golds = (m.group(1).strip() if m else p.strip()), []
            self._sessions[i] = _ScriptSession(question=question, golds=golds, text=p,
                                               pending_tokens=whitespace_tokens(p),
                                               key=str(getattr(q, "id", None) or i))

    def append(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        check_sessions(self._sessions, ids, "ScriptedGenerator.append")
        for i, t in zip(ids, texts):
            s = self._sessions[i]
            s.text += t
            s.pending_tokens += whitespace_tokens(t)
            self._read(s, t)

    def end(self, ids: Sequence[str]) -> None:
        for i in ids:
            self._sessions.pop(i, None)

    def truncate_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        """Observation cap in whitespace tokens (this agent has no tokenizer)."""
        from ragfast.text import truncate_whitespace_tokens

        return [truncate_whitespace_tokens(t, max_tokens) for t in texts]

    def generate(self, ids: Sequence[str], *, stop: Sequence[str], max_new_tokens: int,
                 ledger: CostLedger | None = None) -> list[str]:
        check_sessions(self._sessions, ids, "ScriptedGenerator.generate")
        t0 = time.perf_counter()
        outs, fresh, cached, produced = [], [], [], []
        for i in ids:
            s = self._sessions[i]
            text = self._step(i, s)
            # Honour the same limits a model would: the token budget, then the stop strings.
            words = re.findall(r"\S+\s*", text)
            if len(words) > max_new_tokens:
                text = "".join(words[:max_new_tokens]).rstrip()
            text, _ = cut_at_stop(text, stop)
            fresh.append(s.pending_tokens)
            cached.append(whitespace_tokens(s.text) - s.pending_tokens)
            produced.append(whitespace_tokens(text))
            s.text += text
            s.pending_tokens = 0
            s.final = False
            outs.append(text)
        if ledger is not None:
            ledger.add_batch("reasoner", list(ids), seconds=time.perf_counter() - t0, input_tokens=fresh,
                             cached_tokens=cached, output_tokens=produced)
        return outs

    # -- the script --------------------------------------------------------------------------
    @staticmethod
    def _read(s: _ScriptSession, appended: str) -> None:
        for block in observation_blocks(appended):  # one block per search
            s.searches += 1
            s.docs += [_Doc(title=d.title, text=d.text, search=s.searches, rank=d.rank) for d in block]

    def _find_answer(self, s: _ScriptSession) -> tuple[str, _Doc, str] | None:
        from ragfast.scoring.metrics import normalize_answer

        golds = [(g, normalize_answer(g)) for g in s.golds]
        golds = [(g, n) for g, n in golds if n]
        for d in s.docs:
            nd = f" {normalize_answer(d.title + ' ' + d.text)} "
            for g, ng in golds:
                if f" {ng} " in nd:
                    sent = next((x for x in _SENT.split(d.text) if f" {ng} " in f" {normalize_answer(x)} "),
                                d.text)
                    return g, d, sent
        return None

    def _guess(self, qid: str, s: _ScriptSession) -> tuple[str, _Doc | None]:
        from ragfast.scoring.metrics import normalize_answer

        nq = f" {normalize_answer(s.question)} "
        latest = [d for d in s.docs if d.search == s.searches]
        for d in sorted(latest, key=lambda d: d.rank):
            nt = normalize_answer(d.title)
            if nt and f" {nt} " not in nq:
                return d.title, d
        if s.docs:
            return s.docs[0].title, s.docs[0]
        # Nothing retrieved at all: a question word, picked reproducibly from (seed, question id).
        words = [w for w in re.findall(r"[A-Z][\w'-]+", s.question)] or s.question.split() or ["unknown"]
        return words[zlib.crc32(f"{self.seed}:{s.key or qid}".encode()) % len(words)], None

    def _claim(self, d: _Doc, text: str, words: int, unquoted: str) -> str:
        """``Doc r (Title) says <quote>``, or ``Doc r (Title) <unquoted>`` without quotes (``quote_words=0``)."""
        n = words if self.quote_words is None else min(words, self.quote_words)
        return f"Doc {d.rank} ({d.title}) " + (f"says {_clip_words(text, n)}" if n > 0 else unquoted)

    def _unsearched(self, s: _ScriptSession, first: _Doc | None = None) -> _Doc | None:
        """The next title to search: ``first``, else the latest search's best-ranked, else (with
        ``distinct_queries``) any earlier one, latest search first; ``None`` when all were searched."""
        latest = sorted((d for d in s.docs if d.search == s.searches), key=lambda d: d.rank)
        pool = ([first] if first is not None else []) + latest
        if self.distinct_queries:
            pool += sorted(s.docs, key=lambda d: (-d.search, d.rank))
        return next((d for d in pool if d.title not in s.queried_titles), None)

    def _step(self, qid: str, s: _ScriptSession) -> str:
        found = self._find_answer(s) if s.golds else None
        hold = (found is not None and s.searches < self.min_searches and not s.final
                and s.searches < self.max_searches)
        if hold and self.distinct_queries:
            gold, d, sent = found
            nxt = self._unsearched(s, first=d)
            if nxt is not None:
                s.queried_titles.append(nxt.title)
                top = min((x for x in s.docs if x.search == s.searches), key=lambda x: x.rank, default=None)
                if s.held == 0 or top is None or top is d:
                    claim = self._claim(d, sent, 40, f"names {gold}.")
                else:
                    from ragfast.scoring.metrics import normalize_answer

                    ng = normalize_answer(gold)
                    contains = f" {ng} " in f" {normalize_answer(top.title + ' ' + top.text)} "
                    claim = self._claim(top, top.text, 25, f"also names {gold}." if contains
                                        else "does not change it.")
                s.held += 1
                return (f"<think> {claim} The answer may be {gold}, but I will search once more to make "
                        f"sure. </think>\n<search> {nxt.title} {s.question} </search>")
            hold = False  # every title read was searched: answer now rather than repeat a search
        if hold:
            # Found but held back: one more search, for the question with the answer's title.
            gold, d, sent = found
            s.queried_titles.append(d.title)
            return (f"<think> {self._claim(d, sent, 40, f'names {gold}.')} The answer may be {gold}, "
                    f"but I will search once more to make sure. </think>\n<search> {s.question} {d.title} </search>")
        if s.final and self.final_answer_only:
            return f"<answer> {found[0] if found is not None else self._guess(qid, s)[0]} </answer>"
        if found is not None:
            gold, d, sent = found
            return (f"<think> {self._claim(d, sent, 40, f'names {gold}.')} "
                    f"So the answer is {gold}. </think>\n<answer> {gold} </answer>")
        if not s.docs and s.searches == 0 and not (s.final or s.searches >= self.max_searches):
            return (f"<think> I need to find out: {s.question} I will search for it. </think>\n"
                    f"<search> {s.question} </search>")
        d = None if s.final or s.searches >= self.max_searches else self._unsearched(s)
        if d is None and (s.final or s.searches >= self.max_searches or self.distinct_queries):
            guess, g = self._guess(qid, s)
            cite = (f"{self._claim(g, g.text, 25, 'is the closest.')} " if g is not None
                    else "I found no useful documents. ")
            return f"<think> {cite}My best guess is {guess}. </think>\n<answer> {guess} </answer>"
        if d is not None:
            s.queried_titles.append(d.title)
            # Title first with distinct_queries: a model copying the question then meets the
            # question's earlier continuation, `</search>`. Title last, the adapter copied the
            # question and ran on into its <think> text (82 of 232 held-out turns).
            query = f"{d.title} {s.question}" if self.distinct_queries else f"{s.question} {d.title}"
            claim = self._claim(d, d.text, 25, "does not answer it.")
        else:
            # Nothing new came back: search for the question alone again, as a model might.
            latest = sorted((x for x in s.docs if x.search == s.searches), key=lambda x: x.rank)
            d = latest[0] if latest else None
            query = s.question
            claim = (self._claim(d, d.text, 25, "does not answer it.") if d is not None
                     else "The last search returned nothing.")
        return (f"<think> {claim} The answer is not there yet, so I will search again. </think>\n"
                f"<search> {query} </search>")

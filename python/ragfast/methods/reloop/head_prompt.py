"""RELOOP's prompt for a chat LLM head: a system rule asking for a short span, and the answer cut to one.

A 135M instruction model given the bare pack answers in sentences ("The actor who has acted in
the film "The Town" is Jeremy Renner."). Tried with smollm2 on the evidence packs of the first
24 hotpotqa-dev questions (the packs of one ``run reloop``; token F1 of the head's answer):

- the bare pack as the user message: F1 0.071;
- the short-answer rule at the top of the user message: 0.062;
- three worked examples with short answers as earlier chat turns: 0.000 (the model copied the
  examples' answers, "14 March 1951", into most replies);
- the rule as the system message (kept): 0.127;

against 0.221 for the extractive head on the same questions. :func:`evidence_span` then cuts
what is still a sentence, or a list marker and pack tag copied from the prompt, down to the
evidence span it names.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from ragfast.scoring.metrics import normalize_answer
from ragfast.models.extractive import render_pack
from ragfast.text import NAME_SPAN_PATTERN, STOPWORDS, YEAR_PATTERN, words

__all__ = ["HEAD_SYSTEM", "head_messages", "short_span", "evidence_span"]

HEAD_SYSTEM = "You answer questions with a short phrase copied from the evidence, never a sentence."

# A list marker or pack tag a small model copies from the prompt: "1)", "(1)", "1.", "[1] (text | Title)".
_MARKER = re.compile(r"^\s*(?:\[\d+\]|\(\d+\)|\d+[.)])\s*")
_TAG = re.compile(r"^\((?:text|cell|triple) \| ([^\t]*?)\)\s*(?:\t|$)")


def head_messages(question: str, pack: Sequence[dict[str, Any]], answer_type: str) -> list[dict[str, str]]:
    """Chat messages for one question: the short-answer rule as the system turn, the pack as the user's."""
    return [{"role": "system", "content": HEAD_SYSTEM},
            {"role": "user", "content": render_pack(question, pack, answer_type)}]


def short_span(text: str) -> str:
    """The answer line without the wrappers small models add ("Answer:", quotes, a final full stop)."""
    a = text.strip().splitlines()[0].strip() if text.strip() else ""
    a = _MARKER.sub("", a)
    m = _TAG.match(a)
    if m:  # "(text | GameFan)" copied from the pack: the title is the answer it points at
        a = m.group(1).strip() if not a[m.end():].strip() else a[m.end():].strip()
    for lead in ("answer:", "the answer is", "a:"):
        if a.lower().startswith(lead):
            a = a[len(lead):].strip()
    a = a.strip().strip('"').strip("'").strip()
    if a.endswith(".") and not a.endswith(".."):
        a = a[:-1].rstrip()
    return a


def evidence_span(answer: str, question: str, pack: Sequence[dict[str, Any]], answer_type: str = "span",
                  max_words: int = 5) -> str:
    """Cut a sentence answer down to the evidence span it names that the question does not.

    A short answer (``max_words`` words or fewer, after :func:`short_span`) is kept as it is.
    A longer one keeps "yes"/"no" when it starts with it, else a year for a "year" question,
    else the name-like span (capitalised words, numbers) that occurs in the evidence and adds
    the most words absent from the question; the last of equals wins, since a small model's
    sentence puts the answer after the restated question ("The actor who ... is Jeremy Renner").
    Without such a span the cleaned answer is kept.
    """
    a = short_span(answer)
    if len(a.split()) <= max_words:
        return a
    first = a.split()[0].lower().strip(",.!")
    if first in ("yes", "no"):
        return first
    if answer_type == "year":
        m = YEAR_PATTERN.findall(a)
        if m:
            return m[-1]
    q = set(words(question)) | STOPWORDS
    evidence = f" {normalize_answer(' '.join(str(it.get('title', '')) + ' ' + it['snippet'] for it in pack))} "
    best, best_new = "", 0
    for m in NAME_SPAN_PATTERN.finditer(a):
        span = m.group(0).strip(" .,;:")
        new = sum(w not in q for w in words(span))
        norm = normalize_answer(span)
        if new and norm and f" {norm} " in evidence and new >= best_new:
            best, best_new = span, new
    return best or a

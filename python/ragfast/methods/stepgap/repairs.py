"""StepGap's typed repairs: the search a gap triggers and the text that retracts a contradicted claim.

Used by :mod:`ragfast.methods.stepgap.loop` after :func:`ragfast.methods.stepgap.checker.check` labels a step:
``IRRELEVANT_EVIDENCE`` re-searches the step's entity, ``MISSING_BRIDGE`` searches the missing link, and
``CONTRADICTED_CLAIM`` tells the reasoner to retract.
"""
from __future__ import annotations

from ragfast.methods.stepgap.checker import IE, MB, Step, StepLabel, entity_of, norm_ws
from ragfast.text import SHORT_STOPWORDS, content_words as split_content_words

__all__ = ["content_words", "repair_query", "retraction_text"]


def content_words(text: str) -> list[str]:
    """Lower-case word tokens minus a small stop list (query similarity and bridge terms)."""
    return split_content_words(text, SHORT_STOPWORDS)


def repair_query(step: Step, label: StepLabel) -> str | None:
    """The search a repair runs: the step's entity (re-search) or the missing link (bridge).

    A bridge query joins the title of the quoted document with the claim's content words the
    quote does not contain: what the quote leaves unexplained is what the next hop must find.
    """
    if label.label == IE:
        ent = label.entity or entity_of(step)
        return f"{ent} {step.question}".strip() if ent else step.question
    if label.label == MB:
        quote_words = set(content_words(label.quote or ""))
        missing = [w for w in content_words(step.hypothesis) if w not in quote_words]
        title = next((d.title for d in step.local if label.quote and norm_ws(label.quote) in norm_ws(d.text)), "")
        q = " ".join(dict.fromkeys([title] + missing)).strip()
        return q or step.question
    return None


def retraction_text(step: Step, label: StepLabel) -> str:
    """The text that tells the reasoner one of its claims was contradicted.

    It is plain text, not an ``<information>`` block: it carries no documents, and evidence
    parsers (ours and the reasoner's training format) treat ``<information>`` as retrieval.
    """
    why = f' The evidence says: "{label.quote}".' if label.quote else ""
    return (f"\n\n[check] Your claim \"{step.claim}\" is contradicted or off target ({label.reason}).{why} "
            f"Retract it and reason again from the evidence.\n\n")


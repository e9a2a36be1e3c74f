"""The Search-R1 protocol: prompt, stop strings, action parsing and observation format.

Byte-level facts of PeterGriffinJin/Search-R1 (summarised in PROTOCOLS.md). They sit below the
components and methods because generators, judges, training and the loop all speak them.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

from ragfast.errors import DataError
from ragfast.types import Question

__all__ = ["PROMPT_TEMPLATE", "INVALID_OBSERVATION", "STOP", "build_prompt", "parse_action",
           "format_docs", "format_observation"]

# Byte-for-byte the prompt Search-R1 checkpoints were trained on (PeterGriffinJin/Search-R1,
# scripts/data_process/nq_search.py, make_prefix, template_type "base"), typo "as your want"
# included: a trained checkpoint's behaviour depends on the exact string.
PROMPT_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you "
    "get new information. After reasoning, if you find you lack some knowledge, you can call a search engine "
    "by <search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>. Question: {question}\n"
)

# Byte-for-byte the reference's observation for an unparseable action
# (PeterGriffinJin/Search-R1, search_r1/llm_agent/generation.py, execute_predictions).
INVALID_OBSERVATION = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

#: Generation stops after the first of these (reference: postprocess_predictions cuts there).
STOP = ("</search>", "</answer>")

# The reference's action pattern (generation.py, postprocess_predictions): first match, DOTALL.
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def build_prompt(question: str | Question) -> str:
    """The raw user message of the first turn, before any chat template.

    Parameters
    ----------
    question : str or Question
        The question; it is stripped and gets a trailing "?" when it has none (as in the
        reference's data preparation).

    Raises
    ------
    DataError
        When the question is empty.
    """
    q = question.question if isinstance(question, Question) else question
    if not isinstance(q, str):
        raise DataError(f"build_prompt expects a question string, got {type(q).__name__}")
    q = q.strip()
    if not q:
        raise DataError("build_prompt: empty question")
    if not q.endswith("?"):
        q += "?"
    return PROMPT_TEMPLATE.format(question=q)


def parse_action(text: str) -> tuple[str, str | None]:
    """The action of one generated turn.

    Returns
    -------
    (action, content)
        ``("search", query)`` or ``("answer", answer)`` from the first
        ``<(search|answer)>(.*?)</\\1>`` match (content stripped), else ``("invalid", None)``.
    """
    m = _ACTION.search(text or "")
    if m is None:
        return "invalid", None
    return m.group(1), m.group(2).strip()


def _split_contents(contents: str) -> tuple[str, str]:
    # Reference: title = first line of contents, text = the remaining lines joined by "\n".
    lines = contents.split("\n")
    return lines[0], "\n".join(lines[1:])


def format_docs(docs: Sequence[Any]) -> str:
    """``Doc {i}(Title: {title}) {text}\\n`` per document, i from 1 (reference: _passages2string).

    Parameters
    ----------
    docs : sequence of Hit, dict or str
        Hits (their ``document["contents"]``), corpus rows with ``contents``, or raw contents.
    """
    out = []
    for i, d in enumerate(docs, 1):
        if isinstance(d, str):
            contents = d
        elif isinstance(d, dict):
            contents = d.get("contents", d.get("document", {}).get("contents", ""))
        else:
            contents = d.document.get("contents", "")
        title, text = _split_contents(contents)
        out.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(out)


def format_observation(docs: Sequence[Any]) -> str:
    """The observation appended after a search: ``\\n\\n<information>{docs.strip()}</information>\\n\\n``."""
    return f"\n\n<information>{format_docs(docs).strip()}</information>\n\n"

"""The Search-R1 protocol: prompt, stop strings, action parsing and observation format.

Byte-level facts of PeterGriffinJin/Search-R1 (summarised in PROTOCOLS.md). They sit below the
components and methods because generators, judges, training and the loop all speak them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ragfast.errors import DataError
from ragfast.types import Question

__all__ = ["PROMPT_TEMPLATE", "INVALID_OBSERVATION", "STOP", "build_prompt", "parse_action",
           "format_docs", "format_observation", "ObservedDoc", "observation_blocks", "parse_observation",
           "split_documents"]

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


# -- reading observations back ---------------------------------------------------------------
# The one reader of the format format_docs writes: judges, StepGap's checker and training read
# documents through it. A document starts at a line beginning "Doc {i}(Title: " and runs to
# the next one; the closing </information> is optional (Search-R1 truncates observations to
# 500 tokens, which can cut it).
_DOC_HEAD = re.compile(r"(?:^|\n)\s*Doc (\d+)\(Title: ")
_INFO_BLOCK = re.compile(r"<information>(.*?)(?:</information>|\Z)", re.DOTALL)
_INFO_TAGS = re.compile(r"^\s*<information>|</information>\s*$")
_TITLE_TEXT = re.compile(r"(.*?)\) (.*)", re.DOTALL)


@dataclass(frozen=True)
class ObservedDoc:
    """One document of an observation, as the reasoner saw it.

    Attributes
    ----------
    rank : int
        Its ``Doc`` number (1-based).
    title, text : str
        The title (quotes stripped) and the text.
    raw : str
        Everything after ``Doc {i}(Title: `` (``Title) text``): what the judges embed.
    """

    rank: int
    title: str
    text: str
    raw: str


def _pieces(body: str) -> Iterator[tuple[int | None, str]]:
    """(rank, raw) of each document of one block body; text before the first ``Doc`` has rank None."""
    heads = list(_DOC_HEAD.finditer(body))
    yield None, body[: heads[0].start()] if heads else body
    for i, m in enumerate(heads):
        yield int(m.group(1)), body[m.end(): heads[i + 1].start() if i + 1 < len(heads) else len(body)]


def split_documents(block: str) -> list[str]:
    """The documents of one evidence block as the judges read them: one ``Title) text`` string per
    ``Doc`` of a Search-R1 observation (``<information>...</information>`` optional); text before
    the first ``Doc``, or a block without any, is a document of its own."""
    body = _INFO_TAGS.sub("", block.strip()).strip()
    docs = [raw.strip() for _, raw in _pieces(body) if raw.strip()]
    return docs if docs else ([body] if body else [])


def observation_blocks(observation: str) -> list[list[ObservedDoc]]:
    """The documents of each ``<information>`` block of a turn's observation: one list per block
    (one per search), in order.

    A block truncated before ``</information>`` still yields its documents (the last one cut
    where the truncation cut it); a piece without ``Title) text`` is skipped.
    """
    out: list[list[ObservedDoc]] = []
    for block in _INFO_BLOCK.findall(observation or ""):
        docs = []
        for rank, raw in _pieces(block.strip()):
            m = _TITLE_TEXT.match(raw) if rank is not None else None
            if m is not None:
                docs.append(ObservedDoc(rank, m.group(1).strip().strip('"'), m.group(2).strip(), raw.strip()))
        out.append(docs)
    return out


def parse_observation(observation: str) -> list[ObservedDoc]:
    """The documents of every ``<information>`` block of a turn's observation, in order
    (:func:`observation_blocks`, flattened)."""
    return [d for block in observation_blocks(observation) for d in block]

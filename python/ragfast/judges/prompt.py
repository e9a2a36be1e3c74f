"""The sufficiency judge's text protocol: prompt wording, state coercion, trajectory grouping, verdicts.

What every judge reads and a generating judge writes (S2G protocol, see ``shared/PROTOCOLS.md``):
the system instruction and user message (:data:`SYSTEM_PROMPT`, :func:`user_text`), the coercion
of ``(question, [evidence, ...])`` pairs to states (:func:`as_states`), the grouping of states into
nested-prefix trajectories (:func:`group_states`) and the parsing of a JSON verdict
(:func:`parse_verdict`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ragfast.errors import DataError
from ragfast.types import State

__all__ = [
    "SYSTEM_PROMPT", "NO_CONTEXT", "ANSWER_PREFIX", "GAP_CATEGORIES", "BLOCK_SEP", "Verdict", "as_states",
    "context_blocks", "user_text", "group_states", "parse_verdict",
]

# Our own wording (PROTOCOLS.md asks for a system instruction that requests a JSON verdict).
SYSTEM_PROMPT = (
    "You decide whether retrieved evidence is enough to answer a question. Read the QUESTION "
    "and the CONTEXT (search results collected so far). Reply with one JSON object and nothing "
    'else: {"sufficient": true or false, "gap_items": [...]}. Use "sufficient": true only when '
    "the CONTEXT alone supports a complete, specific answer; then gap_items must be an empty "
    'list. Otherwise use "sufficient": false and list what is missing, each gap item as '
    '{"category": one of "bridge entity", "attribute", "relation", "evidence span", "other", '
    '"target": the entity the missing fact is about, "slot": the property or relation that is '
    'missing, "description": a short phrase saying what to search for next}.'
)
#: Context text of a state that has no evidence yet.
NO_CONTEXT = "(no documents retrieved)"
#: The assistant turn is forced to start with this; the STOP score reads the next token.
ANSWER_PREFIX = '{"sufficient":'
GAP_CATEGORIES = ("bridge entity", "attribute", "relation", "evidence span", "other")
#: Evidence blocks are joined with one blank line in the judge's context.
BLOCK_SEP = "\n\n"


# ---------------------------------------------------------------------------------------------
# states, prompt text, trajectory grouping
# ---------------------------------------------------------------------------------------------
def as_states(states: Iterable[State | tuple[str, list[str]]]) -> list[State]:
    """Coerce states or ``(question, [evidence, ...])`` pairs to :class:`State`, checking types.

    Raises
    ------
    DataError
        When an item is neither, or its question/evidence are not strings.
    """
    if isinstance(states, (State, str)) or (isinstance(states, tuple) and len(states) == 2
                                            and isinstance(states[0], str)):
        raise DataError("expected a list of states, got a single state")
    out = []
    for i, s in enumerate(states):
        try:
            st = State.coerce(s)
        except TypeError as exc:
            raise DataError(f"state {i}: {exc}") from None
        if not isinstance(st.question, str):
            raise DataError(f"state {i}: question must be a str, got {type(st.question).__name__}")
        if isinstance(st.evidence, str) or not all(isinstance(e, str) for e in st.evidence):
            raise DataError(f"state {i}: evidence must be a list of strings")
        out.append(st)
    return out


def context_blocks(state: State) -> list[str]:
    """The state's evidence blocks, each stripped of surrounding whitespace.

    Search-R1 observations arrive as ``"\\n\\n<information>...</information>\\n\\n"``; the
    judge's context joins the ``<information>`` blocks themselves with one blank line.
    """
    return [e.strip() for e in state.evidence]


def user_text(state: State) -> str:
    """The judge's user message: ``QUESTION:\\n{q}\\n\\nCONTEXT:\\n{context}`` (PROTOCOLS.md)."""
    blocks = context_blocks(state)
    ctx = BLOCK_SEP.join(blocks) if blocks else NO_CONTEXT
    return f"QUESTION:\n{state.question}\n\nCONTEXT:\n{ctx}"


def group_states(states: Sequence[State]) -> list[list[int]]:
    """Group states into trajectories whose evidence lists are nested prefixes.

    States with a ``trajectory_id`` are grouped by (question, id); states without one by
    question. Inside a group, each state joins the first chain whose longest member has its
    evidence as a prefix (longest states placed first), so every chain is a set of prefixes of
    one root state and can be scored in one packed pass.

    Returns
    -------
    list of list of int
        Indices into ``states``; each chain is ordered by evidence length.
    """
    buckets: dict[tuple, list[int]] = {}
    blocks = [context_blocks(s) for s in states]
    for i, s in enumerate(states):
        key = ("t", s.question, s.trajectory_id) if s.trajectory_id is not None else ("q", s.question)
        buckets.setdefault(key, []).append(i)
    chains: list[list[int]] = []
    for idxs in buckets.values():
        order = sorted(idxs, key=lambda i: -len(blocks[i]))
        mine: list[list[int]] = []
        for i in order:
            b = blocks[i]
            for ch in mine:
                root = blocks[ch[0]]
                if root[:len(b)] == b:
                    ch.append(i)
                    break
            else:
                mine.append([i])
        chains.extend(sorted(ch, key=lambda i: (len(blocks[i]), i)) for ch in mine)
    return chains


# ---------------------------------------------------------------------------------------------
# verdict parsing
# ---------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """A generated judge verdict. ``parse`` is "strict", "lenient" or "failed" (failed = CONTINUE)."""

    sufficient: bool
    gap_items: list[dict[str, str]] = field(default_factory=list)
    parse: str = "failed"
    raw: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"sufficient": self.sufficient, "gap_items": self.gap_items, "parse": self.parse, "raw": self.raw,
                "error": self.error}


def _first_object(text: str) -> str | None:
    """The first balanced ``{...}`` in text (string-aware); closes what is left open at the end."""
    start = text.find("{")
    if start < 0:
        return None
    stack, in_str, esc = [], False, False
    for j in range(start, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack[-1] != c:
                return text[start:j]  # mismatched closer: cut here and let the repair close it
            stack.pop()
            if not stack:
                return text[start:j + 1]
    # Ran out of text (generation budget): close the open string and brackets.
    tail = text[start:]
    if in_str:
        tail += '"'
    return tail.rstrip().rstrip(",") + "".join(reversed(stack))


def _repair(s: str) -> str:
    s = re.sub(r",\s*([}\]])", r"\1", s)  # trailing commas
    s = re.sub(r"\bTrue\b", "true", s)
    s = re.sub(r"\bFalse\b", "false", s)
    s = re.sub(r"\bNone\b", "null", s)
    if '"' not in s and "'" in s:
        s = s.replace("'", '"')
    return s


def _check_schema(obj: Any, strict: bool) -> tuple[bool, list[dict[str, str]]]:
    if not isinstance(obj, dict):
        raise ValueError("verdict is not a JSON object")
    suff = obj.get("sufficient")
    if not strict and isinstance(suff, str) and suff.strip().lower() in ("true", "false"):
        suff = suff.strip().lower() == "true"
    if not isinstance(suff, bool):
        raise ValueError(f"'sufficient' must be true or false, got {suff!r}")
    if strict and list(obj) != ["sufficient", "gap_items"]:
        raise ValueError(f"keys must be exactly sufficient, gap_items (in that order); got {list(obj)}")
    items = obj.get("gap_items", None if strict else [])
    if items is None and not strict:
        items = []
    if not isinstance(items, list):
        raise ValueError("'gap_items' must be a list")
    out = []
    for it in items:
        if not isinstance(it, dict):
            raise ValueError("each gap item must be an object")
        if strict and set(it) != {"category", "target", "slot", "description"}:
            raise ValueError(f"gap item keys must be category, target, slot, description; got {sorted(it)}")
        row = {k: it.get(k, "") for k in ("category", "target", "slot", "description")}
        if any(not isinstance(v, str) for v in row.values()):
            raise ValueError("gap item fields must be strings")
        cat = row["category"].strip().lower()
        if cat not in GAP_CATEGORIES:
            if strict:
                raise ValueError(f"unknown gap category {row['category']!r}")
            cat = "other"
        row["category"] = cat
        out.append(row)
    # The schema ties the two fields together; a contradiction is not a usable verdict.
    if suff and out:
        raise ValueError("sufficient=true with a non-empty gap_items list")
    if not suff and not out:
        raise ValueError("sufficient=false with an empty gap_items list")
    return suff, out


def parse_verdict(text: str) -> Verdict:
    """Parse a judge's JSON verdict, strictly first, then with a lenient fallback.

    Strict: the whole text (stripped) is exactly one JSON object with keys ``sufficient`` then
    ``gap_items``, known categories and the consistency rule (true ⇔ empty list). Lenient: the
    first balanced ``{...}`` (closed if generation was cut off), with trailing commas, Python
    literals and single quotes repaired, missing ``gap_items`` read as empty, unknown
    categories mapped to "other"; the consistency rule still holds. Anything else is a parse
    failure, which means CONTINUE (``sufficient=False``).

    Parameters
    ----------
    text : str
        The full verdict text, including the forced ``{"sufficient":`` prefix.

    Returns
    -------
    Verdict
    """
    try:
        suff, items = _check_schema(json.loads(text.strip()), strict=True)
        return Verdict(suff, items, "strict", text)
    except (ValueError, json.JSONDecodeError) as exc:
        strict_err = str(exc)
    cand = _first_object(text)
    if cand is None:
        return Verdict(False, [], "failed", text, f"no JSON object ({strict_err})")
    try:
        suff, items = _check_schema(json.loads(_repair(cand)), strict=False)
        return Verdict(suff, items, "lenient", text)
    except (ValueError, json.JSONDecodeError) as exc:
        return Verdict(False, [], "failed", text, str(exc))

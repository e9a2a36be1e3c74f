"""Text helpers shared across layers: whitespace token counts and cuts."""
from __future__ import annotations

import re

__all__ = ["truncate_whitespace_tokens"]


def truncate_whitespace_tokens(text: str, max_tokens: int) -> str:
    """Cut ``text`` after its first ``max_tokens`` whitespace-separated tokens.

    The stand-in tokenizer for generators without one (the scripted agent): the original
    spacing is kept up to the cut.
    """
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    if max_tokens == 0:
        return ""
    n = 0
    for m in re.finditer(r"\S+", text):
        n += 1
        if n == max_tokens:
            return text[: m.end()]
    return text

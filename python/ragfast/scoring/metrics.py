"""Answer and retrieval metrics.

Answer normalisation, exact match and sub-exact match follow the Search-R1 definitions
(see PROTOCOLS.md): lowercase, drop ASCII punctuation, articles a/an/the (whole words) become a
space, whitespace collapses. Token F1 is HotpotQA's official score on the same normalised text,
with its rule that yes / no / noanswer only score when they match exactly.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from typing import Callable, Iterable, Sequence

__all__ = [
    "normalize_answer",
    "exact_match",
    "sub_exact_match",
    "f1",
    "extract_answer",
    "normalize_title",
    "sufficient",
    "recall_at_k",
]

# string.punctuation is exactly the ASCII set Search-R1 drops; non-ASCII marks (e.g. “ ” – é)
# are kept, as in the reference.
_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPEN = "<answer>"
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(s: str) -> str:
    """Normalise an answer string the Search-R1 way.

    Parameters
    ----------
    s : str
        Raw answer text.

    Returns
    -------
    str
        Lowercased text without ASCII punctuation, with the whole-word articles a/an/the
        replaced by a space and runs of whitespace collapsed to single spaces (stripped).
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects a str, got {type(s).__name__}")
    s = s.lower().translate(_PUNCT_TABLE)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _golds(golds: str | Sequence[str]) -> list[str]:
    if isinstance(golds, str):
        return [golds]
    out = list(golds)
    if not out:
        raise ValueError("empty gold answer list: a metric needs at least one gold answer")
    for g in out:
        if not isinstance(g, str):
            raise TypeError(f"gold answers must be strings, got {type(g).__name__}: {g!r}")
    return out


def _best(pred: str | None, golds: str | Sequence[str], score: Callable[[str, str], float]) -> float:
    """``score(normalised pred, normalised gold)`` maximised over the gold answers; 0 for no prediction."""
    gl = _golds(golds)
    if pred is None:
        return 0.0
    p = normalize_answer(pred)
    return max(score(p, normalize_answer(g)) for g in gl)


def exact_match(pred: str | None, golds: str | Sequence[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold answer, else 0.0.

    Parameters
    ----------
    pred : str or None
        The predicted answer; None (no answer extracted) scores 0.
    golds : str or sequence of str
        One gold answer or a non-empty list of them.

    Raises
    ------
    ValueError
        If ``golds`` is an empty list.
    """
    return _best(pred, golds, lambda p, g: float(p == g))


def sub_exact_match(pred: str | None, golds: str | Sequence[str]) -> float:
    """1.0 when some normalised gold answer is a substring of the normalised prediction.

    Parameters
    ----------
    pred, golds
        As for :func:`exact_match`.
    """
    return _best(pred, golds, lambda p, g: float(g in p))


def _f1_one(p: str, g: str) -> float:
    if (p in _SPECIAL or g in _SPECIAL) and p != g:
        return 0.0
    pt, gt = p.split(), g.split()
    same = sum((Counter(pt) & Counter(gt)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pt), same / len(gt)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str | None, golds: str | Sequence[str]) -> float:
    """HotpotQA token F1 on normalised text, maximised over the gold answers.

    When either side normalises to ``yes``, ``no`` or ``noanswer`` and the two differ, the
    score is 0 (HotpotQA's official rule).

    Parameters
    ----------
    pred, golds
        As for :func:`exact_match`.
    """
    return _best(pred, golds, _f1_one)


def extract_answer(text: str | None) -> str | None:
    """Content of the last ``<answer>...</answer>`` block, stripped; None when there is none.

    Apply it to the model's response only: the Search-R1 prompt itself contains an example
    ``<answer> Beijing </answer>``. A block whose content holds a further ``<answer>`` (a nested
    or doubled opening tag) yields the text after the innermost opening tag; an opening tag
    without its closing tag is not an answer.

    Parameters
    ----------
    text : str or None
        Generated text.

    Returns
    -------
    str or None
    """
    if not text:
        return None
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return None
    content = matches[-1].group(1)
    cut = content.rfind(_OPEN)
    if cut >= 0:
        content = content[cut + len(_OPEN):]
    return content.strip()


def normalize_title(t: str) -> str:
    """A passage title for comparison: surrounding whitespace and quotes stripped.

    wiki-18 corpus rows keep the title's quotes (``"Title"``); HotpotQA supporting facts do not.
    """
    return t.strip().strip('"').strip()


def _support(supporting_titles: Iterable[str]) -> list[str]:
    sup = list(dict.fromkeys(normalize_title(t) for t in supporting_titles))
    if not sup:
        raise ValueError("no supporting titles: sufficiency and recall are undefined for this question")
    return sup


def sufficient(retrieved_titles: Iterable[str], supporting_titles: Iterable[str]) -> bool:
    """Gold sufficiency of a retrieval state: every supporting title has been retrieved.

    Parameters
    ----------
    retrieved_titles : iterable of str
        Titles of every passage retrieved so far (any order, repeats allowed, quotes allowed).
    supporting_titles : iterable of str
        The question's supporting titles (must not be empty).

    Raises
    ------
    ValueError
        If there are no supporting titles.
    """
    sup = _support(supporting_titles)
    got = {normalize_title(t) for t in retrieved_titles}
    return all(t in got for t in sup)


def recall_at_k(retrieved_titles: Sequence[str], supporting_titles: Iterable[str], k: int | None = None) -> float:
    """Fraction of the (distinct) supporting titles found among the first ``k`` retrieved.

    Parameters
    ----------
    retrieved_titles : sequence of str
        Retrieved passage titles in rank order.
    supporting_titles : iterable of str
        The question's supporting titles (must not be empty).
    k : int, optional
        Cut-off (>= 0); None means every retrieved title.

    Raises
    ------
    ValueError
        If there are no supporting titles or ``k`` is negative.
    """
    sup = _support(supporting_titles)
    if k is not None and k < 0:
        raise ValueError(f"recall_at_k: k must be >= 0, got {k}")
    ranked = list(retrieved_titles)
    if k is not None:
        ranked = ranked[:k]
    got = {normalize_title(t) for t in ranked}
    return sum(1 for t in sup if t in got) / len(sup)

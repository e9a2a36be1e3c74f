"""The judges' training states from dense-retrieval trajectories, shared by the head and document trainers.

:func:`dense_turns` runs, for every question at once, an empty state then ``turns`` turns of
top-``k`` inner-product retrieval over a passage matrix (turn 1 queries the question, later
turns the question plus the title of the previous turn's best hit, a crude bridge query as a
multi-hop reasoner would issue), each turn one Search-R1 observation, and labels each state 1
when every supporting title has been retrieved (:func:`ragfast.scoring.metrics.sufficient`).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ragfast.protocol import format_docs, format_observation, split_documents
from ragfast.types import Passage, State

__all__ = ["dense_turns", "document_text"]


def document_text(p: Passage) -> str:
    """A passage as the judge reads it inside a Search-R1 observation (``"Title") text``)."""
    return split_documents("<information>" + format_docs([p.to_row()]).strip() + "</information>")[0]


def dense_turns(questions: Sequence[Any], passages: Sequence[Passage], P: np.ndarray,
                encode_queries: Callable[[list[str]], np.ndarray], *, k: int = 3,
                turns: int = 4) -> list[list[tuple[State, int]]]:
    """Per question, its states 0..``turns`` with their sufficiency labels.

    Parameters
    ----------
    questions : sequence of Question
        With ``supporting_titles`` (a question without any is never sufficient).
    passages : sequence of Passage
        The corpus, row ``i`` of ``P``.
    P : numpy.ndarray
        ``[len(passages), dim]`` passage vectors.
    encode_queries : callable
        Texts to ``[n, dim]`` query vectors; each turn's queries go in one call.
    k, turns : int
        Passages per turn; turns per question.
    """
    from ragfast.scoring.metrics import normalize_title, sufficient

    per = [[(State(q.question, [], q.id, 0), 0)] for q in questions]
    seen: list[set[int]] = [set() for _ in questions]
    titles: list[list[str]] = [[] for _ in questions]
    ev: list[list[str]] = [[] for _ in questions]
    best = [""] * len(questions)
    for t in range(turns):
        texts = [q.question if t == 0 else f"{q.question} {normalize_title(best[i])}" for i, q in enumerate(questions)]
        sims = encode_queries(texts) @ P.T
        for i, q in enumerate(questions):
            s = sims[i]
            s[list(seen[i])] = -np.inf
            hits = [int(j) for j in np.argsort(-s, kind="stable")[:k]]
            seen[i].update(hits)
            best[i] = passages[hits[0]].title
            titles[i] += [passages[j].title for j in hits]
            ev[i] = ev[i] + [format_observation([passages[j].to_row() for j in hits])]
            per[i].append((State(q.question, list(ev[i]), q.id, t + 1),
                           int(sufficient(titles[i], q.supporting_titles))))
    return per

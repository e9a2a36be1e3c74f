"""The judge interface, and the document-level judge every trained text judge builds on.

:class:`Judge` scores retrieval states ("stop now, the evidence is sufficient"). Two of the
package's judges (:class:`ragfast.judges.docset.DocSetJudge`, the bundled default, and
:class:`ragfast.judges.cross.CrossEncoderJudge`) score each document of a state and then the
state from its sorted document logits: that shared part is :class:`DocumentStateJudge` and
:func:`state_features`, here so the default judge does not depend on the cross-encoder module.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError
from ragfast.protocol import split_documents
from ragfast.types import State

__all__ = ["Judge", "DocumentStateJudge", "STATE_FEATURES", "MISSING_LOGIT", "state_features"]

#: Names of the state features, in order (the state head's inputs).
STATE_FEATURES = ("top1", "top2", "top3", "logp_top2_needed", "expected_needed", "log1p_docs", "empty")
#: Logit that stands in for a missing document (a state with fewer than three documents).
MISSING_LOGIT = -8.0


class Judge(ABC):
    """Scores retrieval states: higher means "stop now, the evidence is sufficient"."""

    name: str = "judge"
    meaningful: bool = True

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "meaningful": self.meaningful, "class": type(self).__name__}

    @abstractmethod
    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *,
                    ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """One STOP score per state (float64; NaN where a state cannot be scored)."""


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def state_features(doc_logits: Sequence[float]) -> np.ndarray:
    """The state head's inputs from the document logits of one state (:data:`STATE_FEATURES`).

    Parameters
    ----------
    doc_logits : sequence of float
        One cross-encoder logit per (distinct) document of the state; empty for no evidence.

    Returns
    -------
    numpy.ndarray
        float64 ``[len(STATE_FEATURES)]``.
    """
    z = np.sort(np.asarray(doc_logits, dtype=np.float64))[::-1]
    top = np.full(3, MISSING_LOGIT)
    top[:min(3, z.size)] = z[:3]
    ls = _log_sigmoid(top)
    return np.array([top[0], top[1], top[2], ls[0] + ls[1], float(np.sum(1.0 / (1.0 + np.exp(-z)))),
                     float(np.log1p(z.size)), float(z.size == 0)])


class DocumentStateJudge(Judge):
    """A judge whose STOP score is a state head over per-document logits.

    Subclasses provide ``doc_logits(pairs, ledger=, question_ids=)`` (one logit per (question,
    document) pair) and the state head ``state_w`` / ``state_b`` over :meth:`state_inputs`
    (:data:`STATE_FEATURES` unless a subclass reads more of the state).
    """

    state_w: np.ndarray
    state_b: float

    @abstractmethod
    def doc_logits(self, pairs: Sequence[tuple[str, str]], *, ledger: CostLedger | None = None,
                   question_ids: Sequence[str] | None = None) -> np.ndarray:
        """One logit per (question, document) pair, higher = more likely a needed document."""

    def state_inputs(self, question: str, docs: Sequence[str], doc_logits: Sequence[float]) -> np.ndarray:
        """The state head's inputs for one state: :func:`state_features` of its document logits.

        Parameters
        ----------
        question : str
        docs : sequence of str
            The state's distinct documents (as :func:`split_documents` gives them).
        doc_logits : sequence of float
            One logit per document, in ``docs`` order.

        Returns
        -------
        numpy.ndarray
            float64, one value per weight of the state head.
        """
        return state_features(doc_logits)

    # -- STOP scores -------------------------------------------------------------------------
    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """The state head's logit per state (float64); document scoring goes to the ledger as ``judge``."""
        sts = [State.coerce(s) for s in states]
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        if not sts:
            return np.zeros(0, dtype=np.float64)
        docs = []
        for i, s in enumerate(sts):
            if not isinstance(s.question, str) or isinstance(s.evidence, str) \
                    or not all(isinstance(e, str) for e in s.evidence):
                raise DataError(f"state {i}: question must be a str and evidence a list of strings")
            docs.append(list(dict.fromkeys(d for b in s.evidence for d in split_documents(b))))
        pairs = [(s.question, d) for s, ds in zip(sts, docs) for d in ds]
        pq = ([question_ids[i] for i, ds in enumerate(docs) for _ in ds] if question_ids is not None else None)
        z = self.doc_logits(pairs, ledger=ledger, question_ids=pq)
        rows, off = [], 0
        for s, ds in zip(sts, docs):
            rows.append(self.state_inputs(s.question, ds, z[off:off + len(ds)]))
            off += len(ds)
        return np.vstack(rows) @ self.state_w + self.state_b

"""The bundled default judge: per-document "needed?" logits on MiniLM, then a state head.

:class:`DocSetJudge` scores a retrieval state in two steps, like
:class:`ragfast.models.cross_judge.CrossEncoderJudge`, but reads each document with the bundled
all-MiniLM-L6-v2 as a bi-encoder (question and document embedded apart, each once):

1. document logit = a logistic head over ``[q*d, |q-d|, cos(q, d), title named in the question,
   share of the question's content words in the document]`` (trained on HotpotQA supporting
   paragraphs: "this document is one the answer needs");
2. STOP logit = the state head over the state's sorted document logits
   (:func:`ragfast.models.cross_judge.state_features`).

Unlike the older :class:`ragfast.models.judge.EncoderJudge` (one head over the MEAN document
vector), each document keeps its own score, so a state with both needed documents stands out
from one with many near misses. Question and document vectors are cached (each text is
embedded once), so the states of one trajectory share them; a cached text is still charged
what embedding it costs (counted as ``reused``), so a question's recorded cost does not depend
on what the judge scored before. Trained by
:func:`ragfast.methods.s2g.judge_train.train_docset_judge` (``ragfast train-judge --kind docset``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.cost import CostLedger
from ragfast.errors import ModelError
from ragfast.models.cross_judge import STATE_FEATURES, DocumentStateJudge
from ragfast.text import content_words

__all__ = ["DOCSET_FORMAT", "DocSetJudge", "default_docset_judge_path", "doc_title", "DocFeatures"]

DOCSET_FORMAT = "ragfast-docset-judge-v1"


def default_docset_judge_path() -> Path:
    """The bundled judge (``ragfast/models/weights/docset_judge.safetensors``)."""
    return Path(__file__).resolve().parent / "weights" / "docset_judge.safetensors"


def doc_title(doc: str) -> str:
    """The title of a document string ``Title) text`` / ``"Title") text`` (quotes and a trailing
    parenthetical like "(film)" removed, lower-cased); empty when there is none."""
    m = re.match(r'^\s*"?(.*?)"?\)\s', doc)
    if not m:
        return ""
    t = re.sub(r"\s*\([^)]*\)\s*$", "", m.group(1)).strip().lower()
    return t if len(t) > 2 else ""


def _words(text: str) -> set[str]:
    return set(content_words(text, min_len=3))


class DocFeatures:
    """Per (question, document) features on a frozen sentence encoder, with embedding caches.

    The caches are LRU and capped in bytes (:class:`ragfast.retrieval.encoder.EmbeddingCache`):
    a judge behind a server sees an unbounded stream of distinct texts. A text found in a cache
    is charged what embedding it costs, counted as ``reused``, so a caller's recorded cost does
    not depend on what this judge scored before.
    """

    def __init__(self, encoder: Any, max_bytes: int | None = None):
        from ragfast.retrieval.encoder import EmbeddingCache

        self.encoder = encoder
        self.dim = int(encoder.dim)
        self._q = EmbeddingCache(encoder, "query", max_bytes)
        self._d = EmbeddingCache(encoder, "passage", max_bytes)

    @property
    def n_features(self) -> int:
        return 2 * self.dim + 3

    def document_vectors(self, texts: Sequence[str]) -> np.ndarray:
        """Vectors of document texts ``[n, dim]``, embedded into the cache where new."""
        got = self._d.embed(list(texts)).vectors
        return np.stack([got[t] for t in texts]) if len(texts) else np.zeros((0, self.dim), np.float32)

    def __call__(self, pairs: Sequence[tuple[str, str]], *, ledger: CostLedger | None = None,
                 question_ids: Sequence[Any] | None = None) -> np.ndarray:
        """Features ``[len(pairs), n_features]`` (float32); new texts are embedded (cost to ``ledger``)."""
        from ragfast.retrieval.encoder import record_embedded

        qids = list(question_ids) if question_ids is not None else [None] * len(pairs)
        qe = self._q.embed([q for q, _ in pairs], qids)
        de = self._d.embed([d for _, d in pairs], qids)
        record_embedded(ledger, "judge", [qe, de])
        qvec, dvec = qe.vectors, de.vectors
        X = np.zeros((len(pairs), self.n_features), dtype=np.float32)
        D = self.dim
        for i, (q, d) in enumerate(pairs):
            qv, dv = qvec[q], dvec[d]
            X[i, :D] = qv * dv
            X[i, D:2 * D] = np.abs(qv - dv)
            t = doc_title(d)
            qw = _words(q)
            X[i, 2 * D:] = [float(qv @ dv), float(bool(t) and t in q.lower()),
                            len(qw & _words(d)) / len(qw) if qw else 0.0]
        return X


class DocSetJudge(DocumentStateJudge):
    """Per-document logits (bi-encoder features + logistic head) and a state head; STOP = its logit.

    Parameters
    ----------
    path : str or Path, optional
        ``docset_judge.safetensors`` (with ``docset_judge.json`` beside it) or a directory holding
        them; default: the bundled judge (:func:`default_docset_judge_path`).
    device : str
        Encoder device.
    encoder : ragfast.retrieval.encoder.Encoder, optional
        Reuse an already loaded encoder (must match the card's encoder).
    """

    def __init__(self, path: str | Path | None = None, device: str = "cpu", encoder: Any = None):
        from safetensors.numpy import load_file

        p = default_docset_judge_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            p = p / "docset_judge.safetensors"
        card_path = p.with_suffix(".json")
        if not p.exists() or not card_path.exists():
            raise ModelError(f"doc-set judge not found: need {p} and {card_path} "
                             "(train one with `ragfast train-judge --kind docset`)")
        self.card = json.loads(card_path.read_text())
        if self.card.get("format") != DOCSET_FORMAT:
            raise ModelError(f"{card_path} is not a {DOCSET_FORMAT} card (format {self.card.get('format')!r})")
        if list(self.card.get("state_features", [])) != list(STATE_FEATURES):
            raise ModelError(f"{card_path}: state features differ from this ragfast's {list(STATE_FEATURES)}")
        t = load_file(str(p))
        if encoder is None:
            from ragfast.retrieval.encoder import Encoder

            encoder = Encoder(self.card.get("encoder", "minilm"), device=device)
        self.encoder = encoder
        self.features = DocFeatures(encoder)
        self.doc_w = t["doc_head.weight"].astype(np.float64).reshape(-1)
        self.doc_b = float(t["doc_head.bias"].reshape(-1)[0])
        self.state_w = t["state_head.weight"].astype(np.float64).reshape(-1)
        self.state_b = float(t["state_head.bias"].reshape(-1)[0])
        if self.doc_w.size != self.features.n_features or self.state_w.size != len(STATE_FEATURES):
            raise ModelError(f"{p}: head sizes {self.doc_w.size}/{self.state_w.size} do not match the encoder's "
                             f"{self.features.n_features} features / {len(STATE_FEATURES)} state features")
        self.path = p
        self.name = f"docset-judge:{p.name} on {self.card.get('encoder', 'minilm')}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Weights path, encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "per-document logits on MiniLM + state head, trained on supporting-fact sufficiency; see metrics",
                "path": str(self.path), "encoder": self.card.get("encoder", "minilm"),
                "trained_on": self.card.get("data"), "metrics": self.card.get("metrics")}

    def doc_logits(self, pairs: Sequence[tuple[str, str]], *, ledger: CostLedger | None = None,
                   question_ids: Sequence[Any] | None = None) -> np.ndarray:
        """Document logit per (question, document) pair."""
        if not pairs:
            return np.zeros(0)
        return self.features(pairs, ledger=ledger, question_ids=question_ids).astype(np.float64) @ self.doc_w + self.doc_b

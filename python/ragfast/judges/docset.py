"""The bundled default judge: per-document "needed?" logits on MiniLM, then a state head.

:class:`DocSetJudge` scores a retrieval state in two steps, like
:class:`ragfast.judges.cross.CrossEncoderJudge`, but reads each document with the bundled
all-MiniLM-L6-v2 as a bi-encoder (question and document embedded apart, each once):

1. document logit = a logistic head over ``[q*d, |q-d|, cos(q, d), title named in the question,
   share of the question's content words in the document]`` (trained on HotpotQA supporting
   paragraphs: "this document is one the answer needs");
2. STOP logit = the state head over the state's sorted document logits
   (:func:`ragfast.judges.cross.state_features`) AND set features of the state as a whole
   (:func:`set_features`: how much of the question the union of its documents covers, whether
   one document names another's title (a bridge), whether both sides of an "X or Y" question
   are there, how many documents have a positive logit).

The document logits alone cannot tell a state holding both documents a two-hop question needs
from one holding the first hop and look-alikes of the second: each document is scored apart.
The set features read the documents together, cheaply and deterministically (string matching,
no model).

Unlike the older :class:`ragfast.judges.head.EncoderJudge` (one head over the MEAN document
vector), each document keeps its own score, so a state with both needed documents stands out
from one with many near misses. Question and document vectors are cached (each text is
embedded once), so the states of one trajectory share them; a cached text is still charged
what embedding it costs (``reused`` counts a text its question read before), so a question's recorded cost does not depend
on what the judge scored before. Trained by
:func:`ragfast.judges.train.documents.train_docset_judge` (``ragfast train-judge --kind docset``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ModelError
from ragfast.judges.base import STATE_FEATURES, DocumentStateJudge, state_features
from ragfast.text import content_words

__all__ = ["DOCSET_FORMAT", "DocSetJudge", "default_docset_judge_path", "doc_title", "doc_body", "DocFeatures",
           "SET_FEATURES", "DOCSET_STATE_FEATURES", "set_features", "question_entities", "comparison_sides"]

#: ``format`` field of the card; v2 added the set features to the state head.
DOCSET_FORMAT = "ragfast-docset-judge-v2"
#: Names of the set features (:func:`set_features`), in order.
SET_FEATURES = ("union_coverage", "entity_title_match", "bridge_link", "bridge_from_question", "bridge_from_top",
                "linked_pair", "comparison_both", "comparison_question", "docs_logit_gt0", "docs_logit_gt_m1")
#: The doc-set judge's state head inputs: the document-logit features, then the set features.
DOCSET_STATE_FEATURES = tuple(STATE_FEATURES) + SET_FEATURES

# A capitalised span: capitalised words (or numbers), possibly joined by a few lower-case
# particles ("Lord of the Rings", "University of California")
_CAPS = re.compile(r"(?:[A-Z0-9][\w'’.\-&]*)(?:\s+(?:(?:of|the|and|de|la|in|for|on|a)\s+)*[A-Z0-9][\w'’.\-&]*)*")
_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”|`([^\']+)\'')
# the question's first word is capitalised because it starts the sentence, not because it is a name
_LEADING = frozenset({"which", "what", "who", "when", "where", "how", "is", "are", "was", "were", "the", "in",
                      "did", "do", "does", "name"})
# "..., X or Y?" at the end of a question: HotpotQA's comparison questions
_COMPARISON = re.compile(r",?\s*([^,?]+?)\s+or\s+([^,?]+?)\s*\??$")


def default_docset_judge_path() -> Path:
    """The bundled judge (``ragfast/judges/weights/docset_judge.safetensors``)."""
    return Path(__file__).resolve().parent / "weights" / "docset_judge.safetensors"


def doc_title(doc: str) -> str:
    """The title of a document string ``Title) text`` / ``"Title") text`` (quotes and a trailing
    parenthetical like "(film)" removed, lower-cased); empty when there is none."""
    m = re.match(r'^\s*"?(.*?)"?\)\s', doc)
    if not m:
        return ""
    t = re.sub(r"\s*\([^)]*\)\s*$", "", m.group(1)).strip().lower()
    return t if len(t) > 2 else ""


def doc_body(doc: str) -> str:
    """A document string's text after its ``Title)`` prefix (the whole string when there is none)."""
    i = doc.find(") ")
    return doc[i + 2:] if i >= 0 else doc


def question_entities(question: str) -> list[str]:
    """Lower-cased quoted titles and capitalised spans of a question (its named entities, roughly).

    A sentence-initial question word ("Which", "What", ...) is dropped from the span it starts;
    spans of two characters or fewer are dropped. Order of first appearance, no repeats.
    """
    out = [next(g for g in m.groups() if g) for m in _QUOTED.finditer(question)]
    for m in _CAPS.finditer(question):
        span = m.group(0)
        if m.start() == 0:
            parts = span.split()
            if parts[0].lower() in _LEADING:
                span = " ".join(parts[1:])
        if len(span) > 2:
            out.append(span)
    return list(dict.fromkeys(x.lower() for x in out))


def comparison_sides(question: str) -> tuple[str, str] | None:
    """The two sides ``(x, y)`` (lower-cased) of a question ending in "X or Y?"; None otherwise."""
    m = _COMPARISON.search(question)
    if not m:
        return None
    return m.group(1).lower().strip(' "'), m.group(2).lower().strip(' "')


def _title_match(span: str, titles: Sequence[str]) -> bool:
    # either way round: "tinted windows" names the title "tinted windows (band)" after doc_title
    # strips the parenthetical, and a span may be longer than the title it holds
    return any(t and (span == t or span in t or t in span) for t in titles)


def set_features(question: str, docs: Sequence[str], doc_logits: Sequence[float]) -> np.ndarray:
    """Features of a state's documents taken together (:data:`SET_FEATURES`).

    Parameters
    ----------
    question : str
    docs : sequence of str
        The state's distinct documents, ``Title) text`` strings as
        :func:`ragfast.protocol.split_documents` gives them.
    doc_logits : sequence of float
        The judge's document logit per document.

    Returns
    -------
    numpy.ndarray
        float64 ``[len(SET_FEATURES)]``:

        - ``union_coverage``: share of the question's content words found in some document;
        - ``entity_title_match``: share of :func:`question_entities` matched by a document title;
        - ``bridge_link``: 1 when a document's title appears in another document's text;
        - ``bridge_from_question``: 1 when a document whose title the question names names another
          document's title in its text (the first hop of a bridge question leads to the second);
        - ``bridge_from_top``: 1 when the highest-logit document names another document's title;
        - ``linked_pair``: 1 when two documents are linked (either names the other's title) or both
          are named by the question;
        - ``comparison_both``: 1 when both sides of an "X or Y?" question match document titles;
        - ``comparison_question``: 1 when the question is an "X or Y?" question;
        - ``docs_logit_gt0``, ``docs_logit_gt_m1``: documents whose logit is above 0 / above -1.
    """
    z = np.asarray(doc_logits, dtype=np.float64)
    if z.size != len(docs):
        raise ValueError(f"{z.size} document logits for {len(docs)} documents")
    ql = question.lower()
    qw = _words(question)
    titles = [doc_title(d) for d in docs]
    bodies = [doc_body(d).lower() for d in docs]
    union = set().union(*(_words(d) for d in docs)) if docs else set()
    coverage = len(qw & union) / len(qw) if qw else 0.0
    ents = question_entities(question)
    ent_match = float(np.mean([_title_match(e, titles) for e in ents])) if ents else 0.0
    in_q = [bool(t) and t in ql for t in titles]
    n = len(docs)
    link = np.array([[i != j and bool(titles[j]) and titles[j] in bodies[i] for j in range(n)] for i in range(n)],
                    dtype=bool).reshape(n, n)
    bridge_q = any(in_q[i] and link[i].any() for i in range(n))
    bridge_top = n > 0 and bool(link[int(np.argmax(z))].any())
    linked = any(link[i, j] or link[j, i] or (in_q[i] and in_q[j]) for i in range(n) for j in range(i + 1, n))
    sides = comparison_sides(question)
    both = sides is not None and _title_match(sides[0], titles) and _title_match(sides[1], titles)
    return np.array([coverage, ent_match, float(link.any()), float(bridge_q), float(bridge_top), float(linked),
                     float(both), float(sides is not None), float(np.sum(z > 0)), float(np.sum(z > -1))])


def _words(text: str) -> set[str]:
    return set(content_words(text, min_len=3))


class DocFeatures:
    """Per (question, document) features on a frozen sentence encoder, with embedding caches.

    The caches are LRU and capped in bytes (:class:`ragfast.encoders.encoder.EmbeddingCache`):
    a judge behind a server sees an unbounded stream of distinct texts. A text found in a cache
    is charged what embedding it costs (``reused`` counts only a text the same question read
    before on the same ledger), so a caller's recorded cost does not depend on what this judge
    scored before.
    """

    def __init__(self, encoder: Any, max_bytes: int | None = None):
        from ragfast.encoders.encoder import EmbeddingCache

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
        from ragfast.encoders.encoder import record_embedded

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

    The state head reads :data:`DOCSET_STATE_FEATURES`: the sorted document logits'
    features and the :func:`set_features` of the state's documents.

    Parameters
    ----------
    path : str or Path, optional
        ``docset_judge.safetensors`` (with ``docset_judge.json`` beside it) or a directory holding
        them; default: the bundled judge (:func:`default_docset_judge_path`).
    device : str
        Encoder device.
    encoder : ragfast.encoders.encoder.Encoder, optional
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
        if self.card.get("format") == "ragfast-docset-judge-v1":
            raise ModelError(f"{card_path} is a ragfast-docset-judge-v1 judge, whose state head lacks the set "
                             f"features this ragfast reads ({DOCSET_FORMAT}); retrain it with "
                             "`ragfast train-judge --kind docset`")
        if self.card.get("format") != DOCSET_FORMAT:
            raise ModelError(f"{card_path} is not a {DOCSET_FORMAT} card (format {self.card.get('format')!r})")
        if list(self.card.get("state_features", [])) != list(DOCSET_STATE_FEATURES):
            raise ModelError(f"{card_path}: state features differ from this ragfast's {list(DOCSET_STATE_FEATURES)}")
        t = load_file(str(p))
        if encoder is None:
            from ragfast.encoders.encoder import Encoder

            encoder = Encoder(self.card.get("encoder", "minilm"), device=device)
        self.encoder = encoder
        self.features = DocFeatures(encoder)
        self.doc_w = t["doc_head.weight"].astype(np.float64).reshape(-1)
        self.doc_b = float(t["doc_head.bias"].reshape(-1)[0])
        self.state_w = t["state_head.weight"].astype(np.float64).reshape(-1)
        self.state_b = float(t["state_head.bias"].reshape(-1)[0])
        if self.doc_w.size != self.features.n_features or self.state_w.size != len(DOCSET_STATE_FEATURES):
            raise ModelError(f"{p}: head sizes {self.doc_w.size}/{self.state_w.size} do not match the encoder's "
                             f"{self.features.n_features} features / {len(DOCSET_STATE_FEATURES)} state features")
        self.path = p
        self.name = f"docset-judge:{p.name} on {self.card.get('encoder', 'minilm')}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Weights path, encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "per-document logits on MiniLM + a state head over them and set features of the state's "
                       "documents, trained on supporting-fact sufficiency; see metrics",
                "path": str(self.path), "encoder": self.card.get("encoder", "minilm"),
                "trained_on": self.card.get("data"), "metrics": self.card.get("metrics")}

    def doc_logits(self, pairs: Sequence[tuple[str, str]], *, ledger: CostLedger | None = None,
                   question_ids: Sequence[Any] | None = None) -> np.ndarray:
        """Document logit per (question, document) pair."""
        if not pairs:
            return np.zeros(0)
        return self.features(pairs, ledger=ledger, question_ids=question_ids).astype(np.float64) @ self.doc_w + self.doc_b

    def state_inputs(self, question: str, docs: Sequence[str], doc_logits: Sequence[float]) -> np.ndarray:
        """The state head's inputs (:data:`DOCSET_STATE_FEATURES`): document-logit and set features."""
        return np.concatenate([state_features(doc_logits), set_features(question, docs, doc_logits)])

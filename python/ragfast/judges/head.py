"""The frozen-feature head judge (``--judge head``): a logistic head over sentence-encoder features.

:class:`EncoderJudge` reads a state with a frozen sentence encoder (the bundled all-MiniLM-L6-v2)
and scores it with a small logistic head over question/evidence features (:class:`FeatureMaker`);
trained by :func:`ragfast.judges.train.head.train_encoder_judge` (``ragfast train-judge --kind head``)
on states labelled by supporting facts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import DataError, ModelError
from ragfast.judges.base import Judge
from ragfast.judges.prompt import as_states, context_blocks
from ragfast.protocol import split_documents
from ragfast.text import content_words
from ragfast.types import State

__all__ = ["EncoderJudge", "FeatureMaker", "FEATURE_VERSION", "default_encoder_judge_path"]

# ---------------------------------------------------------------------------------------------
# EncoderJudge
# ---------------------------------------------------------------------------------------------
#: Bumped when the feature layout changes; a head trained on another layout will not load.
FEATURE_VERSION = 1
_N_SCALARS = 7


def default_encoder_judge_path() -> Path:
    """The bundled EncoderJudge head (``ragfast/judges/weights/encoder_judge.safetensors``)."""
    return Path(__file__).resolve().parent / "weights" / "encoder_judge.safetensors"


def _content_words(text: str) -> set[str]:
    return set(content_words(text, min_len=3))


class FeatureMaker:
    """Question/evidence features on a frozen sentence encoder, with an embedding cache.

    Per state: the question vector q, the mean c of its document vectors, q*c, |q-c|, then
    seven scalars: the three highest and the mean question-document cosines, log(1 + #docs),
    an empty-state flag, and the fraction of the question's content words found in the
    evidence text. Documents are embedded one by one (the encoder reads 256 tokens), and each
    distinct text only once: the states of a trajectory share their documents.
    """

    def __init__(self, encoder: Any, cache_bytes: int | None = None):
        from ragfast.encoders.encoder import EmbeddingCache

        self.encoder = encoder
        self.dim = int(encoder.dim)
        # Least recently used first out once over the byte cap; a hit is charged as a miss.
        self._q = EmbeddingCache(encoder, "query", cache_bytes)
        self._d = EmbeddingCache(encoder, "passage", cache_bytes)

    @property
    def n_features(self) -> int:
        return 4 * self.dim + _N_SCALARS

    def embed_documents(self, texts: Sequence[str]) -> None:
        """Embed document texts into the cache (as the judge reads them)."""
        self._d.embed(list(texts))

    def doc_vector(self, text: str) -> np.ndarray:
        v = self._d.get(text)
        return v if v is not None else self._d.embed([text]).vectors[text]

    def __call__(self, states: Sequence[State], question_ids: Sequence[Any] | None = None,
                 ledger: CostLedger | None = None) -> np.ndarray:
        """Features ``[len(states), n_features]``; the embeddings are charged to ``ledger`` as ``judge``."""
        from ragfast.encoders.encoder import record_embedded

        qids = list(question_ids) if question_ids is not None else [None] * len(states)
        docs = [[d for b in context_blocks(s) for d in split_documents(b)] for s in states]
        qe = self._q.embed([s.question for s in states], qids)
        flat = [(d, qid) for ds, qid in zip(docs, qids) for d in ds]
        de = self._d.embed([d for d, _ in flat], [q for _, q in flat])
        record_embedded(ledger, "judge", [qe, de])
        qv, dv = qe.vectors, de.vectors
        X = np.zeros((len(states), self.n_features), dtype=np.float32)
        D = self.dim
        for i, (s, ds) in enumerate(zip(states, docs)):
            q = qv[s.question]
            if ds:
                E = np.stack([dv[d] for d in ds])
                c = E.mean(0)
                sims = np.sort(E @ q)[::-1]
            else:
                c = np.zeros(D, dtype=np.float32)
                sims = np.zeros(0, dtype=np.float32)
            top = np.zeros(3, dtype=np.float32)
            top[:min(3, len(sims))] = sims[:3]
            qw = _content_words(s.question)
            ev = _content_words(" ".join(ds)) if ds else set()
            overlap = len(qw & ev) / len(qw) if qw else 0.0
            X[i, :D] = q
            X[i, D:2 * D] = c
            X[i, 2 * D:3 * D] = q * c
            X[i, 3 * D:4 * D] = np.abs(q - c)
            X[i, 4 * D:] = [top[0], top[1], top[2], float(sims.mean()) if len(sims) else 0.0,
                            math.log1p(len(ds)), float(not ds), overlap]
        return X


class EncoderJudge(Judge):
    """A frozen sentence encoder with a logistic head; STOP score = the head's logit.

    Parameters
    ----------
    path : str or Path, optional
        A head file (``*.safetensors`` with its ``.json`` card beside it) or a directory holding
        ``encoder_judge.safetensors``; default: the bundled head (:func:`default_encoder_judge_path`),
        trained by ``ragfast train-judge`` on the bundled HotpotQA train sample.
    device : str
        Encoder device.
    encoder : ragfast.encoders.encoder.Encoder, optional
        Reuse an already loaded encoder (must match the card's encoder).

    Notes
    -----
    ``describe()`` carries the card's validation metrics: the bundled head is trained on real
    sufficiency labels but on 240 questions only, so its scores are a weak, honest signal.
    """

    def __init__(self, path: str | Path | None = None, device: str = "cpu", encoder: Any = None):
        from safetensors.numpy import load_file

        p = default_encoder_judge_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            p = p / "encoder_judge.safetensors"
        card_path = p.with_suffix(".json")
        if not p.exists() or not card_path.exists():
            raise ModelError(f"EncoderJudge head not found: need {p} and {card_path} "
                             "(train one with `ragfast train-judge`)")
        self.card = json.loads(card_path.read_text())
        if self.card.get("format") != "ragfast-encoder-judge" or self.card.get("feature_version") != FEATURE_VERSION:
            raise ModelError(f"{card_path} is not a ragfast encoder-judge card of feature version {FEATURE_VERSION}")
        t = load_file(str(p))
        self.weight = t["weight"].astype(np.float64).reshape(-1)
        self.bias = float(t["bias"].reshape(-1)[0])
        if encoder is None:
            from ragfast.encoders.encoder import Encoder

            encoder = Encoder(self.card["encoder"], device=device)
        self.encoder = encoder
        self.features = FeatureMaker(encoder)
        if self.features.n_features != self.weight.size:
            raise ModelError(f"{p}: head has {self.weight.size} weights but the encoder gives "
                             f"{self.features.n_features} features")
        self.path = p
        self.name = f"encoder-judge:{p.name} on {self.card['encoder']}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Head path, encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "logistic head trained on supporting-fact sufficiency labels; see metrics",
                "path": str(self.path), "encoder": self.card["encoder"], "trained_on": self.card.get("data"),
                "metrics": self.card.get("metrics")}

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """The head's logit per state (float64). Encoder compute goes to the ledger as ``judge``."""
        sts = as_states(states)
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        if not sts:
            return np.zeros(0, dtype=np.float64)
        X = self.features(sts, question_ids, ledger)
        return X.astype(np.float64) @ self.weight + self.bias

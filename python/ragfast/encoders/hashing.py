"""A model-free lexical encoder (hashed bag of words) and the encoder factory RELOOP's CLI uses."""
from __future__ import annotations

import time
import zlib
from typing import Any, Sequence

import numpy as np

from ragfast.accounting.ledger import CostLedger
from ragfast.text import EXTENDED_STOPWORDS, content_words

__all__ = ["HashingEncoder", "default_encoder"]


class HashingEncoder:
    """Lexical bag-of-words encoder: hashed unigrams and bigrams, L2-normalised (NOT a neural model).

    A deterministic, model-free stand-in for :class:`ragfast.retrieval.Encoder` with the same
    ``encode_queries`` / ``encode_passages`` methods: tests and the quick benchmark use it so
    they do not depend on model weights; real runs use the MiniLM encoder.
    """

    name = "hashing bag-of-words (lexical, not a neural encoder)"
    meaningful = True

    def __init__(self, dim: int = 512):
        self.dim = int(dim)

    def describe(self) -> dict[str, Any]:
        """The slot entry a run manifest records."""
        return {"name": self.name, "dim": self.dim, "class": type(self).__name__, "meaningful": True}

    def _encode(self, texts: Sequence[str], ledger: CostLedger | None, question_ids: Sequence[str] | None):
        import torch

        t0 = time.perf_counter()
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        toks = []
        for i, t in enumerate(texts):
            w = content_words(t, EXTENDED_STOPWORDS, min_len=2)
            toks.append(len(w))
            for g in w + [a + " " + b for a, b in zip(w, w[1:])]:
                out[i, zlib.crc32(g.encode()) % self.dim] += 1.0
        n = np.linalg.norm(out, axis=1, keepdims=True)
        out /= np.where(n > 0, n, 1.0)
        if ledger is not None and len(texts):
            ledger.add_batch("encoder", list(question_ids) if question_ids is not None else [None] * len(texts),
                             seconds=time.perf_counter() - t0, input_tokens=toks)
        return torch.from_numpy(out)

    def encode_queries(self, texts: Sequence[str], *, ledger: CostLedger | None = None,
                       question_ids: Sequence[str] | None = None, **_: Any):
        """Query vectors, float32 ``[len(texts), dim]``, L2-normalised (a torch tensor)."""
        return self._encode(texts, ledger, question_ids)

    def encode_passages(self, texts: Sequence[str], *, ledger: CostLedger | None = None,
                        question_ids: Sequence[str] | None = None, **_: Any):
        """Passage vectors; the same map as :meth:`encode_queries` (no query/passage prefixes)."""
        return self._encode(texts, ledger, question_ids)


def default_encoder(name: str = "minilm") -> Any:
    """``"minilm"`` (the bundled all-MiniLM-L6-v2 through :class:`ragfast.retrieval.Encoder`) or ``"hashing"``."""
    if name == "hashing":
        return HashingEncoder()
    from ragfast.encoders.encoder import Encoder

    return Encoder(name)

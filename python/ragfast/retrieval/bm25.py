"""BM25 over a corpus with bm25s (sparse, precomputed scores, memory-mappable on load).

SIM-RAG retrieves with BM25 (top-2); Search-R1 and FlashRAG offer it as the sparse baseline.
The defaults k1=0.9, b=0.4 are Pyserini's, which those baselines run. English stop words are
dropped; an English stemmer is used when PyStemmer is installed (``pip install PyStemmer``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.checks import check_exclude, check_positive_k, check_question_ids, check_texts
from ragfast.errors import ConfigError, DataError
from ragfast.retrieval.base import Hit, Retriever
from ragfast.retrieval.index_meta import read_index_meta

__all__ = ["BM25", "BM25Retriever"]

_FORMAT = "ragfast-bm25/1"


def _stemmer(use: bool | None):
    if use is False:
        return None
    try:
        import Stemmer
    except ImportError:
        if use:
            raise ConfigError("stemming needs PyStemmer (pip install PyStemmer)") from None
        return None
    return Stemmer.Stemmer("english").stemWords


def _texts_of(corpus: Any) -> list[str]:
    if hasattr(corpus, "iter_batches"):
        out: list[str] = []
        for batch in corpus.iter_batches(65536):
            out.extend(batch)
        return out
    texts = list(corpus)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise DataError(f"BM25 corpus item {i} is {type(t).__name__}, expected str")
    return texts


class BM25:
    """A BM25 index over passages; row ids are positions in the indexed order.

    Build with :meth:`build`, persist with :meth:`save` / :meth:`load`.

    Parameters
    ----------
    retriever : bm25s.BM25
    tokenizer : bm25s.tokenization.Tokenizer
    stem : bool
        Whether the tokenizer stems (recorded so that :meth:`load` rebuilds the same one).
    """

    def __init__(self, retriever: Any, tokenizer: Any, n: int, *, stem: bool = False, k1: float = 0.9,
                 b: float = 0.4, method: str = "lucene"):
        self.retriever, self.tokenizer, self.ntotal = retriever, tokenizer, int(n)
        self.stem, self.k1, self.b, self.method = stem, k1, b, method

    @classmethod
    def build(cls, corpus: Any, *, k1: float = 0.9, b: float = 0.4, method: str = "lucene",
              stem: bool | None = None, progress: bool = False) -> "BM25":
        """Index a :class:`ragfast.data.Corpus` (its ``contents``) or a list of strings.

        Parameters
        ----------
        corpus : Corpus or sequence of str
        k1, b : float
            BM25 saturation and length normalisation.
        method : str
            bm25s scoring variant: ``lucene``, ``robertson``, ``atire``, ``bm25l``, ``bm25+``.
        stem : bool, optional
            Stem with PyStemmer; default: when it is installed.
        progress : bool
            bm25s's own progress bars.
        """
        import bm25s
        from bm25s.tokenization import Tokenizer

        texts = _texts_of(corpus)
        if not texts:
            raise DataError("cannot build BM25 over an empty corpus")
        if k1 < 0 or not 0 <= b <= 1:
            raise ConfigError(f"BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={k1}, b={b}")
        stemmer = _stemmer(stem)
        tok = Tokenizer(stopwords="en", stemmer=stemmer)
        tokens = tok.tokenize(texts, return_as="tuple", show_progress=progress)
        try:
            ret = bm25s.BM25(k1=k1, b=b, method=method)
        except (ValueError, KeyError) as exc:
            raise ConfigError(f"unknown BM25 method {method!r}: {exc}") from exc
        ret.index(tokens, show_progress=progress)
        return cls(ret, tok, len(texts), stem=stemmer is not None, k1=k1, b=b, method=method)

    def __len__(self) -> int:
        return self.ntotal

    def describe(self) -> dict[str, Any]:
        return {"backend": "bm25s", "k1": self.k1, "b": self.b, "method": self.method, "stem": self.stem,
                "ntotal": self.ntotal}

    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[int]] | None = None,
               ledger=None, question_ids: Sequence[str] | None = None):
        """Top-k rows per query by BM25 score.

        Rows that share no term with the query score 0 and are not returned (their slots hold
        id -1, score -inf), as a Lucene-style engine returns only matching documents.

        Parameters
        ----------
        queries : sequence of str
        k : int
            ``k >= 1``; more than the corpus size is clipped to it.
        exclude : list of lists of int, optional
            Row ids each query must skip (met by over-fetching, then filtering).

        Returns
        -------
        (scores, ids) : (np.ndarray, np.ndarray)
            float32 ``[B, k]`` best first, int64 ``[B, k]``.
        """
        queries = check_texts(queries, "BM25.search expects a list of query strings", item="query")
        k = check_positive_k(k)
        check_exclude(exclude, len(queries), as_int=False)
        bsz = len(queries)
        out_s = np.full((bsz, k), -np.inf, dtype=np.float32)
        out_i = np.full((bsz, k), -1, dtype=np.int64)
        if bsz == 0:
            return out_s, out_i
        t0 = time.perf_counter()
        extra = max((len(e) for e in exclude), default=0) if exclude else 0
        kk = min(self.ntotal, k + extra)
        toks = self.tokenizer.tokenize(queries, update_vocab=False, return_as="string", show_progress=False)
        docs, scores = self.retriever.retrieve(toks, k=kk, show_progress=False, n_threads=0)
        for r in range(bsz):
            keep = scores[r] > 0
            if exclude is not None and len(exclude[r]):
                keep &= ~np.isin(docs[r], np.asarray(list(exclude[r]), dtype=np.int64))
            sel = np.flatnonzero(keep)[:k]
            out_s[r, :len(sel)] = scores[r, sel]
            out_i[r, :len(sel)] = docs[r, sel]
        if ledger is not None:
            ledger.add_batch("search", check_question_ids(question_ids, bsz), seconds=time.perf_counter() - t0,
                             bytes_scanned=[self._bytes_for(t) for t in toks])
        return out_s, out_i

    def _bytes_for(self, tokens: Sequence[str]) -> int:
        """Bytes of the posting lists a query reads (score + row id per posting)."""
        vocab = self.retriever.vocab_dict
        indptr = self.retriever.scores["indptr"]
        per = self.retriever.scores["data"].itemsize + self.retriever.scores["indices"].itemsize
        total = 0
        for t in set(tokens):
            j = vocab.get(t)
            if j is not None and j + 1 < len(indptr):
                total += int(indptr[j + 1] - indptr[j]) * per
        return total

    def save(self, path: str | os.PathLike) -> Path:
        """Write the index (bm25s's sparse matrices), the tokenizer vocabulary and ``meta.json``."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.retriever.save(str(out), show_progress=False)
        self.tokenizer.save_vocab(str(out))
        meta = {"format": _FORMAT, "n": self.ntotal, "stem": self.stem, "k1": self.k1, "b": self.b,
                "method": self.method}
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, *, mmap: bool = True) -> "BM25":
        """Load a saved index; ``mmap`` maps the score matrices instead of reading them."""
        import bm25s
        from bm25s.tokenization import Tokenizer

        p = Path(path)
        meta = read_index_meta(p, _FORMAT, "BM25 index")
        ret = bm25s.BM25.load(str(p), mmap=mmap, show_progress=False, verbosity=0)
        tok = Tokenizer(stopwords="en", stemmer=_stemmer(True) if meta["stem"] else None)
        tok.load_vocab(str(p))
        return cls(ret, tok, meta["n"], stem=meta["stem"], k1=meta["k1"], b=meta["b"], method=meta["method"])


class BM25Retriever(Retriever):
    """BM25 + corpus as a :class:`~ragfast.retrieval.base.Retriever` (scores are BM25 scores)."""

    name = "bm25"

    def __init__(self, index: BM25, corpus: Any):
        if len(index) != len(corpus):
            raise DataError(f"BM25 index has {len(index)} rows but the corpus has {len(corpus)} passages")
        self.index, self.corpus = index, corpus

    @classmethod
    def build(cls, corpus: Any, **kw: Any) -> "BM25Retriever":
        """Index a corpus (a :class:`ragfast.data.Corpus`, a path or a sample name) with :meth:`BM25.build`."""
        if isinstance(corpus, (str, os.PathLike)):
            from ragfast.data import load_corpus

            corpus = load_corpus(corpus)
        return cls(BM25.build(corpus, **kw), corpus)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "class": type(self).__name__, "index": self.index.describe(),
                "passages": len(self.corpus)}

    def search(self, queries: Sequence[str], k: int, *, exclude: Sequence[Sequence[str]] | None = None,
               ledger=None, question_ids: Sequence[str] | None = None) -> list[list[Hit]]:
        """Up to ``k`` hits per query, best first; ``exclude`` holds corpus ids per query."""
        queries = list(queries)
        if not queries:
            return []
        ex = None
        if exclude is not None:
            check_exclude(exclude, len(queries), as_int=False)
            ex = []
            for e in exclude:
                rows = []
                for i in e:
                    try:
                        rows.append(self.corpus.index_of(str(i)))
                    except KeyError:
                        continue  # not in this corpus: can never be returned
                ex.append(rows)
        scores, ids = self.index.search(queries, k, exclude=ex, ledger=ledger, question_ids=question_ids)
        out = []
        for srow, irow in zip(scores.tolist(), ids.tolist()):
            hits = []
            for s, i in zip(srow, irow):
                if i >= 0:
                    row = self.corpus.row(i)
                    hits.append(Hit(id=row["id"], score=float(s), document=row))
            out.append(hits)
        return out

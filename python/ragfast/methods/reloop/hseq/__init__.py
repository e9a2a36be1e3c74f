"""HSEQ: one reversible hierarchical sequence of segments over text, tables and knowledge graphs.

RELOOP's workspace (:mod:`ragfast.methods.reloop`). :mod:`~ragfast.methods.reloop.hseq.core`
holds the records (:class:`Segment`, :class:`HSeq`, :class:`KGraph`), and
:mod:`~ragfast.methods.reloop.hseq.build` the builders and their exact reversal.
"""
from __future__ import annotations

from ragfast.methods.reloop.hseq.build import from_tatqa, from_text, from_triples, split_sentences, to_source
from ragfast.methods.reloop.hseq.core import LEVELS, METAQA_RELATIONS, HSeq, KGraph, Segment, gather_csr

__all__ = ["LEVELS", "METAQA_RELATIONS", "Segment", "HSeq", "KGraph", "from_text", "from_tatqa", "from_triples",
           "to_source", "split_sentences", "gather_csr"]

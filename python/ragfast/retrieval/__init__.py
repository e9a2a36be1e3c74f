"""Retrieval: encoders, dense and BM25 indexes, the Search-R1-compatible server and client."""
from __future__ import annotations

from ragfast.retrieval.base import Hit, Retriever

__all__ = ["Hit", "Retriever"]

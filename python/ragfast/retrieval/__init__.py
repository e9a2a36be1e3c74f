"""Retrieval: encoders, dense (local, sharded, Ray-sharded) and BM25 indexes, the exact top-k merge,
the Search-R1-compatible server and client.

Only the interface is imported eagerly; the heavy classes (torch, transformers, faiss, bm25s)
load on first use, so ``import ragfast.retrieval`` stays cheap for the HTTP client and the CLI.
"""
from __future__ import annotations

import importlib
from typing import Any

from ragfast.retrieval.base import Hit, Retriever

_LAZY = {
    "Encoder": "ragfast.encoders.encoder",
    "encode_corpus": "ragfast.encoders.encoder",
    "load_embeddings": "ragfast.encoders.encoder",
    "DenseIndex": "ragfast.retrieval.dense",
    "ShardedIndex": "ragfast.retrieval.dense",
    "DenseRetriever": "ragfast.retrieval.dense",
    "build_default_retriever": "ragfast.retrieval.dense",
    "BM25": "ragfast.retrieval.bm25",
    "BM25Retriever": "ragfast.retrieval.bm25",
    "create_app": "ragfast.retrieval.server",
    "RemoteRetriever": "ragfast.retrieval.remote",
    "RayShardedIndex": "ragfast.retrieval.ray_index",
    "merge_topk": "ragfast.retrieval.merge",
}

__all__ = ["Hit", "Retriever", *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ragfast.retrieval' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value

"""ragfast: fast, batched, cost-measured multi-round retrieval-augmented generation.

Runs Search-R1, S2G-style stopping, StepGap and RELOOP on the same questions, with compiled
kernels for the hot paths (C++ through pybind11 on the CPU, Triton on the GPU) and a cost
ledger that measures reasoner, retrieval, judge and NLI compute side by side.

The public API is importable from here (``ragfast.topk_ip``, ``ragfast.DenseIndex``,
``ragfast.SearchR1Loop`` ...), as faiss and FlashInfer export theirs. Every name is imported on
first use (PEP 562), so ``import ragfast`` stays fast and loads neither torch nor transformers;
``dir(ragfast)`` and ``ragfast.__all__`` list them all.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (same name there unless given as "module:attr")
_LAZY: dict[str, str] = {
    # ops and their backends
    "topk_ip": "ragfast.ops.topk_ip",
    "topk_ip_ref": "ragfast.ops.topk_ip",
    "quantize": "ragfast.ops.topk_ip",
    "QuantizedCorpus": "ragfast.ops.topk_ip",
    "retrieve_step": "ragfast.ops.topk_ip",
    "RetrieveStep": "ragfast.ops.topk_ip",
    "prefix_attention": "ragfast.ops.prefix_attention",
    "bootstrap_means": "ragfast.ops.policy",
    "backends": "ragfast.ops.registry",
    "BackendError": "ragfast.ops.registry",
    # records
    "Question": "ragfast.types",
    "Passage": "ragfast.types",
    "Turn": "ragfast.types",
    "Trajectory": "ragfast.types",
    "CostLedger": "ragfast.accounting.ledger",
    "CostRecord": "ragfast.accounting.ledger",
    "RagfastError": "ragfast.errors",
    "ConfigError": "ragfast.errors",
    "DataError": "ragfast.errors",
    "ModelError": "ragfast.errors",
    "exact_match": "ragfast.scoring.metrics",
    "f1": "ragfast.scoring.metrics",
    # data
    "load_qa": "ragfast.data",
    "load_corpus": "ragfast.data",
    "sample": "ragfast.data",
    "Corpus": "ragfast.data",
    "HSeq": "ragfast.methods.reloop.hseq",
    # retrieval
    "Hit": "ragfast.retrieval.base",
    "Retriever": "ragfast.retrieval.base",
    "Encoder": "ragfast.encoders.encoder",
    "DenseIndex": "ragfast.retrieval.dense",
    "ShardedIndex": "ragfast.retrieval.dense",
    "DenseRetriever": "ragfast.retrieval.dense",
    "build_default_retriever": "ragfast.retrieval.dense",
    "RayShardedIndex": "ragfast.retrieval.ray_index",
    "merge_topk": "ragfast.retrieval.merge",
    "BM25": "ragfast.retrieval.bm25",
    "BM25Retriever": "ragfast.retrieval.bm25",
    "RemoteRetriever": "ragfast.retrieval.remote",
    # models
    "Generator": "ragfast.models.base",
    "Judge": "ragfast.judges.base",
    "ScriptedGenerator": "ragfast.models.scripted",
    "HFGenerator": "ragfast.models.generator",
    "OpenAIGenerator": "ragfast.models.openai_generator",
    # methods
    "SearchR1Config": "ragfast.methods.searchr1.loop",
    "SearchR1Loop": "ragfast.methods.searchr1.loop",
    "run_searchr1": "ragfast.methods.searchr1.loop",
    "run_s2g": "ragfast.methods.s2g.loop",
    "StepGapConfig": "ragfast.methods.stepgap.loop",
    "run_stepgap": "ragfast.methods.stepgap.loop",
    "ReloopConfig": "ragfast.methods.reloop.config",
    "run_reloop": "ragfast.methods.reloop.loop:run_questions",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'ragfast' has no attribute {name!r}")
    module, _, attr = target.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Model slots: generators (reasoners), judges, NLI scorers, tiny test models, ONNX export."""
from __future__ import annotations

from ragfast.models.base import Generator, Judge
from ragfast.models.tiny import make_tiny, tiny_path  # torch/transformers load on first call

__all__ = ["Generator", "Judge", "make_tiny", "tiny_path"]

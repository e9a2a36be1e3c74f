"""Model slots: generators (reasoners), judges, NLI scorers, tiny test models, ONNX export."""
from __future__ import annotations

from ragfast.models.base import Generator, Judge

__all__ = ["Generator", "Judge"]

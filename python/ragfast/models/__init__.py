"""Model slots: generators (reasoners), NLI scorers, tiny test models, LoRA fine-tuning.

The judges live in :mod:`ragfast.judges`.
"""
from __future__ import annotations

from ragfast.models.base import Generator
from ragfast.models.tiny import make_tiny, tiny_path  # torch/transformers load on first call

__all__ = ["Generator", "make_tiny", "tiny_path"]
from ragfast.models.generator import HFGenerator  # noqa: E402 (torch loads in HFGenerator())
from ragfast.models.openai_generator import OpenAIGenerator  # noqa: E402
from ragfast.models.scripted import ScriptedGenerator  # noqa: E402
__all__ += ["HFGenerator", "OpenAIGenerator", "ScriptedGenerator"]


def __getattr__(name: str):
    # NLIScorer and the exporter pull in transformers/onnxruntime: import them on first use.
    if name == "NLIScorer":
        from ragfast.models.nli import NLIScorer

        return NLIScorer
    if name == "export_onnx":
        from ragfast.encoders.export import export_onnx

        return export_onnx
    raise AttributeError(f"module 'ragfast.models' has no attribute {name!r}")

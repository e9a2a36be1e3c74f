"""Model slots: generators (reasoners), judges, NLI scorers, tiny test models, ONNX export."""
from __future__ import annotations

from ragfast.models.base import Generator, Judge
from ragfast.models.tiny import make_tiny, tiny_path  # torch/transformers load on first call

__all__ = ["Generator", "Judge", "make_tiny", "tiny_path"]
from ragfast.models.generator import HFGenerator  # noqa: E402 (torch loads in HFGenerator())
from ragfast.models.openai_generator import OpenAIGenerator  # noqa: E402
from ragfast.models.scripted import ScriptedGenerator  # noqa: E402
__all__ += ["HFGenerator", "OpenAIGenerator", "ScriptedGenerator"]
from ragfast.models.causal_judge import CausalJudge  # noqa: E402
from ragfast.models.judge import EncoderJudge  # noqa: E402 (torch loads when a judge is built)
__all__ += ["CausalJudge", "EncoderJudge"]


def __getattr__(name: str):
    # NLIScorer and the exporter pull in transformers/onnxruntime: import them on first use.
    if name == "NLIScorer":
        from ragfast.models.nli import NLIScorer

        return NLIScorer
    if name == "export_onnx":
        from ragfast.encoders.export import export_onnx

        return export_onnx
    raise AttributeError(f"module 'ragfast.models' has no attribute {name!r}")

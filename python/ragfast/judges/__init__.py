"""Stopping judges, by role: score a retrieval state "stop now, the evidence is sufficient".

- :mod:`~ragfast.judges.base`: the :class:`Judge` interface and the document-level judge the
  trained text judges build on;
- :mod:`~ragfast.judges.docset`: the bundled default (``encoder``), per-document MiniLM logits
  plus set features and a state head;
- :mod:`~ragfast.judges.head`: the frozen-feature logistic head (``head``);
- :mod:`~ragfast.judges.cross`: a LoRA cross-encoder (no weights ship);
- :mod:`~ragfast.judges.causal`: a causal LM reading the S2G prompt (:mod:`~ragfast.judges.prompt`);
- :mod:`~ragfast.judges.remote`: a ``ragfast serve-judge`` server (:mod:`~ragfast.judges.server`);
- :mod:`~ragfast.judges.train`: the trainers of all of them.

:func:`load` is the one factory that turns a judge spec into a judge; every command reaches it
(through :func:`ragfast.runner.slots.judge` where RELOOP's ``heuristic`` and ``none`` apply).
Nothing heavy is imported here: torch and transformers load when a judge is built.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ragfast.errors import ConfigError

__all__ = ["load", "SPECS"]

#: What a judge spec may be (the error of :func:`load` and the CLI help say the same).
SPECS = ("'encoder' (the bundled doc-set judge), 'head' (the bundled frozen-feature head), 'tiny' (a "
         "random-weight causal LM), a catalogue model, a serve-judge URL, a docset_judge/cross_judge .safetensors "
         "(or a directory with one), an encoder-judge head (.safetensors or a directory with "
         "encoder_judge.safetensors), or a causal-LM directory with config.json")


def _bundled(name: str, device: str, shared_encoder: Any, encoder_device: str | None) -> Any:
    """``encoder`` or ``head``, on the retrieval encoder when it is the same model on the same device."""
    from ragfast.judges.docset import DocSetJudge, default_docset_judge_path
    from ragfast.judges.head import EncoderJudge, default_encoder_judge_path

    if name == "encoder":
        cls, card = DocSetJudge, default_docset_judge_path().with_suffix(".json")
    else:
        hp = default_encoder_judge_path()
        cls, card = EncoderJudge, hp / "encoder_judge.json" if hp.is_dir() else hp.with_suffix(".json")
    wanted = json.loads(card.read_text(encoding="utf-8")).get("encoder", "minilm") if card.exists() else None
    same_device = (encoder_device or device) == device
    if (shared_encoder is not None and wanted is not None and getattr(shared_encoder, "name", None) == wanted
            and same_device):
        return cls(encoder=shared_encoder)
    return cls(device=device)


def load(spec: str, device: str = "cpu", *, shared_encoder: Any = None, encoder_device: str | None = None,
         check: bool = True, dtype: str | None = None) -> Any:
    """The judge a spec names.

    Parameters
    ----------
    spec : str
        ``encoder``: the bundled default judge (:class:`~ragfast.judges.docset.DocSetJudge`);
        ``head``: the bundled frozen-feature :class:`~ragfast.judges.head.EncoderJudge`;
        ``tiny``: a random-weight causal LM judge (compute path only); a catalogue model (e.g.
        ``smollm2``: the zero-shot :class:`~ragfast.judges.causal.CausalJudge`); an
        ``http(s)://`` URL of ``ragfast serve-judge`` (:class:`~ragfast.judges.remote.RemoteJudge`);
        or a path: a doc-set or cross-encoder judge (``docset_judge.safetensors`` /
        ``cross_judge.safetensors`` or a directory holding one), an encoder-judge head
        (``.safetensors`` or a directory with ``encoder_judge.safetensors``), or a causal-LM
        directory.
    device : str
        Where the judge's model runs.
    shared_encoder : optional
        The retrieval encoder: a bundled judge whose encoder is the same model on the same
        device reuses it (loaded once, on its faster backend).
    encoder_device : str, optional
        The retrieval encoder's device (default ``device``).
    check : bool
        For a URL: connect once now, so an unreachable server is one error line up front.
    dtype : {"fp32", "bf16", "fp16"}, optional
        Weights and compute of a causal-LM judge (default: fp32 on the CPU, bf16 on CUDA); the
        other judges ignore it.

    Raises
    ------
    ragfast.errors.ConfigError
        When the spec names nothing loadable.
    """
    from ragfast.infra.http import is_url

    if spec in ("encoder", "head"):
        return _bundled(spec, device, shared_encoder, encoder_device)
    if is_url(spec):
        from ragfast.judges.remote import RemoteJudge

        if check:
            from ragfast.retrieval.remote import check_reachable

            check_reachable(spec, "judge server")
        return RemoteJudge(spec)
    from ragfast.judges.causal import CausalJudge
    from ragfast.models.hub import is_hub_id, local_model
    from ragfast.models.catalogue import is_catalogued

    if spec == "tiny":
        from ragfast.models.tiny import tiny_path

        return CausalJudge(tiny_path("qwen2"), device=device, dtype=dtype)
    if is_catalogued(spec) or is_hub_id(spec):  # e.g. smollm2: the structured zero-shot causal judge
        return CausalJudge(local_model(spec, "judge"), device=device, dtype=dtype)
    from ragfast.judges.cross import CrossEncoderJudge
    from ragfast.judges.docset import DocSetJudge
    from ragfast.judges.head import EncoderJudge

    p = Path(spec).expanduser()
    for name, cls in (("docset_judge.safetensors", DocSetJudge), ("cross_judge.safetensors", CrossEncoderJudge)):
        if p.name == name or (p.is_dir() and (p / name).exists()):
            return cls(p, device=device)
    if p.suffix == ".safetensors" or (p.is_dir() and (p / "encoder_judge.safetensors").exists()):
        return EncoderJudge(p, device=device)
    if p.is_dir() and (p / "config.json").exists():
        return CausalJudge(p, device=device, dtype=dtype)
    raise ConfigError(f"--judge {spec!r}: expected {SPECS}")

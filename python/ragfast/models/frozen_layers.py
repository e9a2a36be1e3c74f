"""Replay a decoder's frozen lower layers from cached hidden states (LoRA on the top layers).

When LoRA adapts only the last ``top`` decoder layers, everything below them is frozen and
deterministic (no dropout in these architectures), so each example's hidden state entering
the first adapted layer is the same in every epoch. :func:`frozen_inputs` computes it once,
without autograd; :func:`replay_from` then runs the decoder from that layer on: the token
embedding hands back the cached states and the layer list holds the top layers only. The
loss functions call the decoder as usual and see the same numbers: the frozen layers' work
is paid once instead of once per epoch.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["supports_replay", "frozen_inputs", "cache_frozen_inputs", "replay_from"]

# Decoders whose forward is embed -> layers -> norm, with no scaling of the embeddings in
# between (Gemma's is applied after the embedding lookup, so it would be applied twice).
_REPLAYABLE = ("llama", "qwen2", "qwen3")


class _Stop(Exception):
    """Raised by the capture hook once the wanted layer's input is in hand."""


def supports_replay(model: Any, first: int) -> bool:
    """Whether ``model``'s decoder can run from layer ``first`` on cached hidden states.

    The architecture must be one whose layers are called in order on the embeddings, and every
    layer must use the same attention mask type (the decoder indexes the layer types by the
    position in its list, which the replay shortens).
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in _REPLAYABLE:
        return False
    n = int(getattr(cfg, "num_hidden_layers", 0))
    types = getattr(cfg, "layer_types", None) or []
    return 0 < first < n and len(set(types)) <= 1


def frozen_inputs(decoder: Any, first: int, examples: Sequence[Sequence[int]], *, device: str = "cpu",
                  context: Callable[[], Any] = contextlib.nullcontext,
                  on_progress: Callable[[int], None] | None = None) -> list[Any]:
    """Each example's hidden state entering decoder layer ``first`` (shape ``[len, hidden]``).

    Examples run one at a time (no padding), under ``torch.no_grad`` and ``context`` (the
    training's autocast, so the states are what training would compute).
    """
    got: list[Any] = []

    def grab(module: Any, args: tuple, kwargs: dict) -> None:
        got.append((args[0] if args else kwargs["hidden_states"]).detach()[0].clone())
        raise _Stop

    hook = decoder.layers[first].register_forward_pre_hook(grab, with_kwargs=True)
    was_training = decoder.training
    decoder.eval()
    try:
        with torch.no_grad(), context():
            for i, ids in enumerate(examples):
                try:
                    decoder(input_ids=torch.tensor([list(ids)], device=device), use_cache=False)
                except _Stop:
                    pass
                if on_progress is not None:
                    on_progress(i + 1)
    finally:
        hook.remove()
        decoder.train(was_training)
    return got


def cache_frozen_inputs(decoder: Any, first: int, examples: Sequence[Sequence[int]], *, budget_bytes: int,
                        device: str = "cpu", context: Callable[[], Any] = contextlib.nullcontext,
                        log: Callable[[str], None] = print) -> list[Any]:
    """:func:`frozen_inputs` of every example if they fit ``budget_bytes``, else ``[]``.

    The size is the examples' tokens times the hidden width in the decoder's parameter dtype
    (the residual stream's: bf16 weights keep bf16 states, fp32 weights under autocast fp32).
    Progress goes to ``log`` every tenth of the examples.
    """
    width = int(decoder.config.hidden_size) * (2 if next(decoder.parameters()).dtype == torch.bfloat16 else 4)
    need = sum(len(e) for e in examples) * width
    if need > budget_bytes:
        log(f"frozen layers run in every step: caching them would take {need / 2**30:.1f} GiB "
            f"(budget {budget_bytes / 2**30:.1f} GiB)")
        return []
    t0 = time.perf_counter()
    log(f"running the {first} frozen layers once on {len(examples)} examples ({need / 2**30:.2f} GiB kept)")
    every = max(1, len(examples) // 10)
    got = frozen_inputs(decoder, first, examples, device=device, context=context,
                        on_progress=lambda i: i % every == 0 and log(f"  frozen layers: {i}/{len(examples)}"))
    log(f"frozen layers done in {time.perf_counter() - t0:.0f} s")
    return got


class _Replay(torch.nn.Module):
    """Stands in for the token embedding: returns the hidden states set for this call."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: Any = None

    def forward(self, ids: Any) -> Any:
        if self.hidden is None or tuple(self.hidden.shape[:2]) != tuple(ids.shape):
            raise RuntimeError("replayed hidden states do not match the input ids")
        return self.hidden


@contextlib.contextmanager
def replay_from(decoder: Any, first: int) -> Iterator[_Replay]:
    """Within the block, ``decoder`` starts at layer ``first`` on ``replay.hidden``.

    Set ``replay.hidden`` (``[batch, length, hidden]``, the input ids' shape) before each call.
    The modules are swapped in place (same keys, same order) and put back on exit.
    """
    mods = decoder._modules
    layers, embed = mods["layers"], mods["embed_tokens"]
    replay = _Replay()
    mods["layers"] = torch.nn.ModuleList(list(layers)[first:])
    mods["embed_tokens"] = replay
    try:
        yield replay
    finally:
        mods["layers"], mods["embed_tokens"] = layers, embed

"""Replay a decoder's frozen lower layers from cached hidden states (LoRA on the top layers).

When LoRA adapts only the last ``top`` decoder layers, everything below them is frozen and
deterministic (no dropout in these architectures), so each example's hidden state entering
the first adapted layer is the same in every epoch. :func:`frozen_inputs` computes it once,
without autograd; :func:`replay_from` then runs the decoder from that layer on: the token
embedding hands back the cached states and the layer list holds the top layers only. The
loss functions call the decoder as usual and see the same numbers: the frozen layers' work
is paid once instead of once per epoch.

That one pass is a prefill of every example, so it runs on the generator's CPU kernels
(fused RMSNorm and SiLU gate, the prefill attention kernel) where they fit: no gradient is
wanted there. The states then differ from torch's ops by rounding only (bf16: within its
precision), and training steps run on torch's ops as before, for autograd.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["supports_replay", "prefix_order", "tokens_run", "frozen_inputs", "cache_frozen_inputs", "replay_from"]

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


@contextlib.contextmanager
def _on_kernels(decoder: Any, first: int) -> Iterator[None]:
    """Within the block the layers below ``first`` run ragfast's fused norms and MLPs and the
    decoder's attention runs the kernel interface; both are put back as they were on exit."""
    from ragfast.models.attention import decode_attention_on, set_decode_attention
    from ragfast.models.fused_layers import fused_layers_on, set_fused_layers

    lower = torch.nn.ModuleList(list(decoder.layers)[:first])
    had_attention, had_fused = decoder.config._attn_implementation, fused_layers_on(lower) > 0
    # Any implementation computes plain causal attention in this pass (a judge's prefix-packed one
    # too: it is SDPA without its mask keyword), so the kernel interface may stand in for it.
    if not decode_attention_on(decoder) and decoder.device.type == "cpu":
        decoder.set_attn_implementation("sdpa")
    set_fused_layers(lower, True)
    set_decode_attention(decoder, True)
    try:
        yield
    finally:
        if decoder.config._attn_implementation != had_attention:
            decoder.set_attn_implementation(had_attention)
        set_fused_layers(lower, had_fused)


def prefix_order(examples: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The examples' indices in the lexicographic order of their ids, and for each the number of
    leading ids it shares with the one before it in that order (0 for the first).

    In that order each example continues the longest prefix it shares with any example before it,
    so a pass that keeps the previous example's cache computes every distinct prefix once.
    """
    order = sorted(range(len(examples)), key=lambda i: list(examples[i]))
    shared = [0] * len(order)
    for j in range(1, len(order)):
        a, b = examples[order[j - 1]], examples[order[j]]
        n, k = min(len(a), len(b)), 0
        while k < n and a[k] == b[k]:
            k += 1
        shared[j] = k
    return order, shared


def tokens_run(examples: Sequence[Sequence[int]]) -> int:
    """Tokens :func:`frozen_inputs` computes for ``examples``: each one's ids after those it shares
    with the one before it in :func:`prefix_order` (none for a repeat)."""
    order, shared = prefix_order(examples)
    return sum(max(0, len(examples[i]) - p) for i, p in zip(order, shared))


def frozen_inputs(decoder: Any, first: int, examples: Sequence[Sequence[int]], *, device: str = "cpu",
                  context: Callable[[], Any] = contextlib.nullcontext,
                  on_progress: Callable[[int], None] | None = None, kernels: bool = True) -> list[Any]:
    """Each example's hidden state entering decoder layer ``first`` (shape ``[len, hidden]``).

    Examples run one at a time (no padding), under ``torch.no_grad`` and ``context`` (the
    training's autocast, so the states are what training would compute, up to rounding), in
    :func:`prefix_order`: an example that shares leading ids with the one before it runs only
    the rest, on that one's key/value cache of the frozen layers (a judge's states of one question
    share the system prompt, the question and the documents; only their ends differ). With
    ``kernels`` the pass runs on ragfast's CPU kernels where a call fits
    (:mod:`ragfast.models.fused_layers`, :mod:`ragfast.models.attention`); without, on the
    model's own modules.
    """
    from transformers import DynamicCache

    got: list[Any] = [None] * len(examples)
    grabbed: list[Any] = []

    def grab(module: Any, args: tuple, kwargs: dict) -> None:
        grabbed.append((args[0] if args else kwargs["hidden_states"]).detach()[0].clone())
        raise _Stop

    order, shared = prefix_order(examples)
    hook = decoder.layers[first].register_forward_pre_hook(grab, with_kwargs=True)
    was_training = decoder.training
    decoder.eval()
    cache, prev = None, None
    try:
        with torch.no_grad(), context(), _on_kernels(decoder, first) if kernels else contextlib.nullcontext():
            for done, (i, p) in enumerate(zip(order, shared), 1):
                ids = list(examples[i])
                if p >= len(ids):  # the same ids as the example before (a prefix sorts first)
                    got[i] = prev.clone()
                else:
                    if p == 0:
                        cache = DynamicCache(config=decoder.config)
                    elif cache.get_seq_length() > p:
                        cache.crop(p - cache.get_seq_length())  # a negative count: drop that many
                    grabbed.clear()
                    try:
                        decoder(input_ids=torch.tensor([ids[p:]], device=device), cache=cache,
                                use_cache=True)
                    except _Stop:
                        pass
                    got[i] = torch.cat([prev[:p], grabbed[0]]) if p else grabbed[0]
                prev = got[i]
                if on_progress is not None:
                    on_progress(done)
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
    log(f"running the {first} frozen layers once on {len(examples)} examples: {tokens_run(examples):,} of their "
        f"{sum(len(e) for e in examples):,} tokens, shared prefixes once ({need / 2**30:.2f} GiB kept)")
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

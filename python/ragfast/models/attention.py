"""The decode- and prefill-attention kernels inside a transformers model.

transformers calls a model's attention through its ``AttentionInterface`` by name. This module
registers ``ragfast_decode``: a pass of one query token per row on the CPU (a decode step) of at
least :data:`MIN_TASKS` rows x key/value heads (any size in bf16 without a padding mask), at an
ISA level where the kernel wins (:data:`FAST_LEVELS`), runs
:func:`ragfast.ops.decode_attention.decode_attention` with the model's padding mask; a bf16 pass
of several query tokens per row (a prefill) under the causal padding mask, at a level of
:data:`PREFILL_LEVELS`, runs :func:`ragfast.ops.prefill_attention.prefill_attention`, and so does a
bf16 decode step at :data:`DECODE_ON_PREFILL_LEVELS`, where that kernel is the faster; every other
pass (a small padded batch, a GPU, a mask of another form) runs transformers' own SDPA
function, which is what the model ran before. :func:`set_decode_attention` switches a loaded
model between the two.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ATTN_IMPL", "set_decode_attention", "decode_attention_on"]

#: The name registered with transformers' AttentionInterface.
ATTN_IMPL = "ragfast_decode"
_REGISTERED = False
#: Rows x key/value heads below which a decode step stays on SDPA, unless it is bf16 with no mask.
#: The kernel runs one task per (row, key/value head), so a batch of one (two tasks) has no parallel
#: work to split: with a padding mask it ran there at 0.73-1.06x SDPA, and at 1.29-2.04x from 16
#: rows (bench/bench_decode_attention.py, Qwen2.5's 0.5B and 1.5B shapes, bf16 and fp32, 256 and
#: 1,024 cached tokens, two threads, AMD EPYC Zen 4). Without a mask (one session, nothing padded)
#: SDPA's bf16 path is slow: the kernel ran at 6.5-7.7x it there at one row (fp32: 0.94-1.14x).
MIN_TASKS = 8
#: ISA levels whose task kernel beats SDPA. Below them the portable task (scalar exponentials) ran
#: at 0.28-0.43x SDPA (forced to avx2 with torch restricted alike, same CPU), so SDPA stays. The
#: avx512* levels were measured on Zen 4. On an AMX machine (an Emerald Rapids Xeon, 2 vCPUs) the
#: AVX-512 task ran at 0.60-1.11x SDPA; the amx level's task (scores as AMX-BF16 tile products,
#: keys and values prefetched) ran at 1.62-1.70x SDPA at 64 rows, bf16, 256 and 1,024 cached
#: tokens, both Qwen2.5 shapes (bench/bench_decode_attention.py, two threads, 2026-12-06), and at
#: 1.41-1.96x from 16 rows once the values' sums stayed in registers (1.18-1.63x for the old
#: kernel in the same session).
FAST_LEVELS = ("avx512", "avx512vnni", "avx512bf16", "amx")
#: Levels among them where only bf16 wins: at amx fp32 runs the AVX-512 task, 0.78-1.10x SDPA there
#: (same bench and machine), so fp32 stays on SDPA.
BF16_ONLY_LEVELS = ("amx",)
#: Levels where the prefill kernel runs bf16 passes (head dims a multiple of 32 up to 128): its
#: amx task (scores and values as AMX-BF16 tile products) ran at 1.70-2.49x SDPA with the same
#: causal padding mask (bench/bench_prefill_attention.py, both Qwen2.5 shapes, two threads, an
#: Emerald Rapids Xeon, 2026-12-07), its avx512bf16 task (AVX512-BF16 dot products) at 2.82-4.41x
#: (same bench, an AMD EPYC Zen 4, 2026-12-07). Below, its portable task is scalar and SDPA stays.
PREFILL_LEVELS = ("avx512bf16", "amx")
#: Levels where a bf16 decode step (one query a row) runs the prefill kernel too: its avx512bf16 task
#: packs the G query heads that read one key/value head into the lanes of one block, and ran at
#: 1.03-2.1x the decode kernel (0.048 against 0.100 ms a layer at 1 row, 0.55 against 0.74 at 16, 3.1
#: against 3.2 at 64; Qwen2.5-0.5B's 14 / 2 heads, 1,204 cached tokens, two threads, AMD EPYC Zen 4,
#: 2026-12-07). The amx task keeps one head's queries per block, so the decode kernel stays there.
DECODE_ON_PREFILL_LEVELS = ("avx512bf16",)


def _fits(query: Any, key: Any, value: Any, mask: Any, dropout: float, kwargs: dict) -> bool:
    """Whether a call is a decode step on the CPU that the kernel computes as SDPA would, and faster."""
    import torch

    from ragfast.ops.registry import cpp_module

    if query.shape[2] != 1 or query.device.type != "cpu" or dropout:
        return False
    few = query.shape[0] * key.shape[1] < MIN_TASKS
    if few and not (mask is None and query.dtype == torch.bfloat16):
        return False
    level = cpp_module().isa_current()
    if level not in FAST_LEVELS or (level in BF16_ONLY_LEVELS and query.dtype != torch.bfloat16):
        return False
    if query.dtype not in (torch.float32, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks")):
        return False  # attention variants the kernel does not compute
    if mask is None:
        return True
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
            and mask.shape[3] == key.shape[2])


def _fits_prefill(module: Any, query: Any, key: Any, value: Any, mask: Any, dropout: float, kwargs: dict) -> bool:
    """Whether a call is a causal bf16 pass of query tokens on the CPU that the prefill kernel
    computes as SDPA would (queries after the cache, the padding mask's keys): several a row, or
    one (a decode step) at :data:`DECODE_ON_PREFILL_LEVELS`."""
    import torch

    from ragfast.ops.registry import cpp_module

    L, T, D = query.shape[2], key.shape[2], query.shape[3]
    level = cpp_module().isa_current()
    if L < 1 or query.device.type != "cpu" or dropout or level not in PREFILL_LEVELS:
        return False
    if L == 1 and level not in DECODE_ON_PREFILL_LEVELS:
        return False
    if any(t.dtype != torch.bfloat16 for t in (query, key, value)) or D % 32 or D > 128:
        return False
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks")):
        return False
    # A causal layer without a sliding window gets transformers' causal padding mask, aligned to
    # the end of the cache; without a mask SDPA aligns a causal pass to the start, the same only
    # when nothing is cached.
    if not getattr(module, "is_causal", False) or getattr(module, "sliding_window", None) is not None:
        return False
    if mask is None:  # one query sees every key either way
        return L == T or L == 1
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == L
            and mask.shape[3] == T)


def _register() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from ragfast.ops.decode_attention import decode_attention
    from ragfast.ops.prefill_attention import prefill_attention

    def ragfast_decode(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if _fits_prefill(module, query, key, value, attention_mask, dropout, kwargs):
            pad = None
            if attention_mask is not None:  # the last query sees every key that is not padding
                pad = attention_mask[:, 0, -1, :].expand(query.shape[0], key.shape[2])
            out = prefill_attention(query, key, value, pad, scaling)  # [B, H, L, D]
            return out.transpose(1, 2), None  # [B, L, H, D]
        if not _fits(query, key, value, attention_mask, dropout, kwargs):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, 0, 0, :].expand(query.shape[0], key.shape[2])
        out = decode_attention(query, key, value, mask, scaling)  # [B, H, 1, D]
        return out.transpose(1, 2), None  # [B, 1, H, D], as the layer's output projection reads it

    AttentionInterface.register(ATTN_IMPL, ragfast_decode)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)
    _REGISTERED = True


def decode_attention_on(model: Any) -> bool:
    """Whether ``model`` runs its decode steps' attention on the kernel."""
    return getattr(model.config, "_attn_implementation", None) == ATTN_IMPL


def set_decode_attention(model: Any, on: bool = True) -> bool:
    """Run ``model``'s decode-step attention on ragfast's kernel (``on``) or on SDPA; returns whether it does.

    Only a model that runs SDPA (or already the kernel) on the CPU is switched, and only where the
    compiled extension is built: other attention implementations (eager, flash) are left as
    they are, and so are models on a GPU.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded model.
    on : bool
        ``True``: the kernel; ``False``: transformers' SDPA.
    """
    from ragfast.ops.registry import cpp_module

    current = getattr(model.config, "_attn_implementation", None)
    if current not in ("sdpa", ATTN_IMPL):
        return False
    want = ATTN_IMPL if on and cpp_module() is not None and model.device.type == "cpu" else "sdpa"
    if want == ATTN_IMPL:
        _register()
    if want != current:
        model.set_attn_implementation(want)
    return decode_attention_on(model)

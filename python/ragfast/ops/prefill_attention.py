"""Prefill attention: ``L`` new query tokens per sequence against the cached keys and their own.

A prefill pass over a KV cache appends ``L`` tokens to each sequence's ``T - L`` cached ones;
query ``i`` sits at key position ``T - L + i`` and sees the keys up to it that its padding mask
allows (causal, aligned to the end of the cache: what transformers builds for these passes).
torch's CPU SDPA takes it with an explicit mask, which its flash kernel computes block by block
in full: 1.9 s of a 4.2-4.8 s prefill of 9 rows x 450 new tokens after 1,000 cached ones of
Qwen2.5-Coder-0.5B (bf16, two threads, an Emerald Rapids Xeon); ``bench/bench_prefill_attention.py``
measures both in one run.

Semantics: ``out[b, h, i] = softmax(scale * q[b, h, i] · k[b, h // G, t]ᵀ over keys t <= T - L + i
with mask[b, t]) · v[b, h // G]`` with fp32 sums, in ``q``'s dtype; a query with no visible key
is 0 (SDPA gives NaN there).

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (torch in fp32: the oracle)
and ``cpp`` (``ragfast._C.prefill_attention``: one task per (sequence, key/value head); for bf16
with head dims a multiple of 32 up to 128, AMX-BF16 tile products for the scores and the values at
the amx level, AVX512-BF16 dot products (``vdpbf16ps``, 16 rows of (query, head) in the lanes,
the heads sharing a key/value head side by side) at the avx512bf16 level, the exponentials rounded
to bf16 between them; otherwise a portable task).
:func:`prefill_attention` checks and dispatches.
"""
from __future__ import annotations

import math
from typing import Any

from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["check_inputs", "prefill_attention", "prefill_attention_ref"]


def check_inputs(q: Any, k: Any, v: Any, mask: Any = None) -> None:
    """Raise ``ValueError`` naming the problem when the inputs do not fit together.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, L, D]``, fp32 or bf16, on the CPU.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]`` each, ``q``'s dtype, ``H % Hkv == 0``, ``T >= L``.
    mask : torch.Tensor, optional
        ``[B, T]`` bool (True: visible).
    """
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.device.type != "cpu":
            raise ValueError(f"prefill_attention: {name} must be a 4-D CPU tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"prefill_attention: q, k, v must all be fp32 or all bf16, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    B, H, L, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"prefill_attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q "
                         f"{tuple(q.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"prefill_attention: {H} query heads are not a multiple of {k.shape[1]} key/value heads")
    if L < 1 or k.shape[2] < L:
        raise ValueError(f"prefill_attention: {L} queries need at least as many keys, got {k.shape[2]}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or tuple(mask.shape) != (B, k.shape[2])):
        raise ValueError(f"prefill_attention: mask must be a bool tensor [{B}, {k.shape[2]}], got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")


def visible(L: int, T: int, mask: Any = None) -> Any:
    """The ``[B or 1, L, T]`` bool matrix of which keys each query sees (see the module)."""
    import torch

    causal = torch.arange(T)[None, :] <= (T - L + torch.arange(L))[:, None]
    return causal[None] if mask is None else causal[None] & mask[:, None, :]


def prefill_attention_ref(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None) -> Any:
    """Reference: the softmax attention in fp32, ``[B, H, L, D]`` in ``q``'s dtype (see the module)."""
    import torch

    check_inputs(q, k, v, mask)
    B, H, L, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, L, T]
    s = s.masked_fill(~visible(L, k.shape[2], mask)[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no visible key: 0
    return (p @ vf).to(q.dtype)


def prefill_attention_cpp(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None, *,
                          check: bool = True, out: Any = None) -> Any:
    """The compiled kernel; ``out``, if given, is the contiguous ``[B, L, H, D]`` tensor written."""
    import torch

    if check:
        check_inputs(q, k, v, mask)
    B, H, L, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    # The kernel wants the head dimension contiguous; anything else is copied once.
    q, k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))
    if mask is not None and mask.stride(1) != 1:
        mask = mask.contiguous()
    if out is None:
        out = torch.empty((B, L, H, D), dtype=q.dtype)  # what the layer's output projection reads
    elif out.dtype != q.dtype or tuple(out.shape) != (B, L, H, D) or not out.is_contiguous():
        raise ValueError(f"prefill_attention: out must be a contiguous {q.dtype} tensor {(B, L, H, D)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cpp_module().prefill_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if mask is None else mask.data_ptr(), out.data_ptr(),
        q.dtype == torch.bfloat16, B, H, Hkv, L, T, D, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), 0 if mask is None else mask.stride(0),
        L * H * D, D, H * D, scale, torch.get_num_threads())
    return out.transpose(1, 2)


def prefill_attention(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None, *,
                      backend: str | None = None) -> Any:
    """Causal attention of ``L`` new query tokens per row over the cache and themselves (see the module).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, L, D]``, fp32 or bf16, CPU; any strides.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]`` with ``T >= L`` (the last ``L`` keys are the queries' own), ``q``'s
        dtype; ``H`` a multiple of ``Hkv``; any strides.
    mask : torch.Tensor, optional
        ``[B, T]`` bool, True where a key is not padding (default: none is).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        ``[B, H, L, D]`` in ``q``'s dtype (the cpp backend's is a view of a ``[B, L, H, D]`` tensor).

    Raises
    ------
    ValueError
        The inputs do not fit together (:func:`check_inputs`).
    """
    _, fn = resolve("prefill_attention", backend, "cpu")
    return fn(q, k, v, mask, scale)


register("prefill_attention", "ref", prefill_attention_ref)
register("prefill_attention", "cpp", prefill_attention_cpp)

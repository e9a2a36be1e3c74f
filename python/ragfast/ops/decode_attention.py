"""Decode attention: one query token per sequence against its cached keys and values.

A batched decode step feeds each sequence one token, so each layer's attention is, per sequence
and key/value head, a ``[G, D] x [D, T]`` product, a softmax over the ``T`` cached keys and a
``[G, T] x [T, D]`` product (``G`` query heads share a key/value head: grouped-query attention).
torch's CPU SDPA took 1.3 ms a layer there for 64 rows of Qwen2.5-Coder-0.5B (about 230 cached
tokens, bf16, two threads, AMD EPYC Zen 4), about six times what reading the cache takes;
``bench/bench_decode_attention.py`` measures both in one run.

Semantics: ``out[b, h] = softmax(scale * q[b, h] · k[b, h // G]ᵀ, over keys t with mask[b, t]) ·
v[b, h // G]`` with fp32 sums, returned in ``q``'s dtype; a row with no visible key is 0 (SDPA
gives NaN there; a decode step always sees at least its own token).

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (torch in fp32: the oracle)
and ``cpp`` (``ragfast._C.decode_attention``: one task per (sequence, key/value head), one task
kernel per ISA level, threads over the tasks). :func:`decode_attention` checks and dispatches.
"""
from __future__ import annotations

import math
from typing import Any

from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["check_inputs", "decode_attention", "decode_attention_ref"]


def check_inputs(q: Any, k: Any, v: Any, mask: Any = None) -> None:
    """Raise ``ValueError`` naming the problem when the inputs do not fit together.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, 1, D]``, fp32 or bf16, on the CPU.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]`` each, ``q``'s dtype, ``H % Hkv == 0``.
    mask : torch.Tensor, optional
        ``[B, T]`` bool (True: visible).
    """
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.device.type != "cpu":
            raise ValueError(f"decode_attention: {name} must be a 4-D CPU tensor, got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"decode_attention: q, k, v must all be fp32 or all bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, Lq, D = q.shape
    if Lq != 1:
        raise ValueError(f"decode_attention: one query token per row, got {Lq}")
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"decode_attention: k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if k.shape[1] < 1 or H % k.shape[1]:
        raise ValueError(f"decode_attention: {H} query heads are not a multiple of {k.shape[1]} key/value heads")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or tuple(mask.shape) != (B, k.shape[2])):
        raise ValueError(f"decode_attention: mask must be a bool tensor [{B}, {k.shape[2]}], got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")


def decode_attention_ref(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None) -> Any:
    """Reference: the softmax attention in fp32, ``[B, H, 1, D]`` in ``q``'s dtype (see the module)."""
    import torch

    check_inputs(q, k, v, mask)
    B, H, _, D = q.shape
    G = H // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    kf = k.float().repeat_interleave(G, dim=1)
    vf = v.float().repeat_interleave(G, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, H, 1, T]
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: 0
    return (p @ vf).to(q.dtype)


def decode_attention_cpp(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None, *,
                         check: bool = True, out: Any = None) -> Any:
    """The compiled kernel; ``out``, if given, is the contiguous ``[B, 1, H, D]`` tensor written."""
    import torch

    if check:
        check_inputs(q, k, v, mask)
    B, H, _, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    # The kernel wants the head dimension contiguous; anything else is copied once.
    q, k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (q, k, v))
    if mask is not None and mask.stride(1) != 1:
        mask = mask.contiguous()
    if out is None:
        out = torch.empty((B, 1, H, D), dtype=q.dtype)  # what the layer's output projection reads
    elif out.dtype != q.dtype or tuple(out.shape) != (B, 1, H, D) or not out.is_contiguous():
        raise ValueError(f"decode_attention: out must be a contiguous {q.dtype} tensor {(B, 1, H, D)}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    cpp_module().decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), 0 if mask is None else mask.data_ptr(), out.data_ptr(),
        q.dtype == torch.bfloat16, B, H, Hkv, T, D, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), 0 if mask is None else mask.stride(0), H * D, D, scale,
        torch.get_num_threads())
    return out.transpose(1, 2)


def decode_attention(q: Any, k: Any, v: Any, mask: Any = None, scale: float | None = None, *,
                     backend: str | None = None) -> Any:
    """Attention of one query token per row over its cached keys/values (see the module).

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, 1, D]``, fp32 or bf16, CPU; any strides.
    k, v : torch.Tensor
        ``[B, Hkv, T, D]``, ``q``'s dtype; ``H`` a multiple of ``Hkv``; any strides.
    mask : torch.Tensor, optional
        ``[B, T]`` bool, True where a key is visible (default: all are).
    scale : float, optional
        Default ``1 / sqrt(D)``.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        ``[B, H, 1, D]`` in ``q``'s dtype (the cpp backend's is a view of a ``[B, 1, H, D]`` tensor).

    Raises
    ------
    ValueError
        The inputs do not fit together (:func:`check_inputs`).
    """
    _, fn = resolve("decode_attention", backend, "cpu")
    return fn(q, k, v, mask, scale)


register("decode_attention", "ref", decode_attention_ref)
register("decode_attention", "cpp", decode_attention_cpp)

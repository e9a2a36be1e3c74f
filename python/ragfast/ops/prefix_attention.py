"""Attention under a "prefix limit + own segment" mask: the judge's prefix-shared scoring.

The states of one trajectory are nested prefixes. The judge packs one trajectory as
``[question, evidence 1 .. evidence T, suffix 1 .. suffix T]`` (after a KV-cached system prompt)
and lets each state's short suffix see only the tokens up to the end of its own evidence, plus
itself causally. Written per query row instead of as a dense matrix, with queries being the last
``Lq`` of ``Lk`` keys (query ``i`` at absolute key index ``a = Lk - Lq + i``), key ``j`` is
visible to query ``i`` when

    ``j < prefix_hi[b, i]``  or  ``seg_lo[b, i] <= j <= a``.

A plain causal row is ``prefix_hi = 0, seg_lo = 0``. Every query must see at least itself
(``seg_lo <= a``).

Implementations, one signature: :func:`prefix_attention_ref` (dense boolean mask + SDPA in
fp32: the oracle and CPU fallback), :func:`prefix_attention_flex` (FlexAttention block mask,
which skips fully masked blocks; compiled on CUDA, eager on the CPU), and the Triton kernel
``ragfast.kernels.prefix_attention`` (flash-attention style, walks only the two key ranges a
query block can see). :func:`prefix_attention` validates and dispatches through the backend
registry (``ref`` / ``triton``).
"""
from __future__ import annotations

import warnings
from typing import Any

from ragfast.ops.registry import register, resolve

__all__ = ["prefix_attention", "prefix_attention_ref", "prefix_attention_flex", "flex_block_mask", "dense_mask",
           "check_inputs"]


def check_inputs(q: Any, k: Any, v: Any, prefix_hi: Any, seg_lo: Any) -> None:
    """Raise ``ValueError`` naming the problem when the inputs do not fit together.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, Lq, D]`` float32 / float16 / bfloat16.
    k, v : torch.Tensor
        ``[B, Hkv, Lk, D]`` with ``H % Hkv == 0``, ``Lk >= Lq``, same dtype and device as ``q``.
    prefix_hi, seg_lo : torch.Tensor
        Integer ``[B, Lq]``; ``0 <= seg_lo[b, i] <= Lk - Lq + i`` and ``0 <= prefix_hi <= Lk``.
    """
    import torch

    for name, t in (("q", q), ("k", k), ("v", v), ("prefix_hi", prefix_hi), ("seg_lo", seg_lo)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"prefix_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"prefix_attention: q, k, v must be 4-D [B, H, L, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"prefix_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"prefix_attention: k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head dim")
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"prefix_attention: {H} query heads are not a multiple of {Hkv} key/value heads")
    if Lk < Lq:
        raise ValueError(f"prefix_attention: {Lk} keys but {Lq} queries; queries must be the last Lq keys")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"prefix_attention: q, k, v must share one float dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("prefix_attention: q, k, v must be on one device")
    for name, t in (("prefix_hi", prefix_hi), ("seg_lo", seg_lo)):
        if t.shape != (B, Lq):
            raise ValueError(f"prefix_attention: {name} must be [B, Lq] = [{B}, {Lq}], got {tuple(t.shape)}")
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"prefix_attention: {name} must be an integer tensor, got {t.dtype}")
    if B and Lq:
        a = torch.arange(Lq, device=seg_lo.device) + (Lk - Lq)
        if bool((seg_lo < 0).any()) or bool((seg_lo > a).any()):
            raise ValueError("prefix_attention: every query must see itself (need 0 <= seg_lo[b, i] <= Lk - Lq + i)")
        if bool((prefix_hi < 0).any()) or bool((prefix_hi > Lk).any()):
            raise ValueError(f"prefix_attention: prefix_hi must lie in [0, Lk={Lk}]")


def dense_mask(prefix_hi: Any, seg_lo: Any, lk: int) -> Any:
    """The boolean mask ``[B, 1, Lq, Lk]`` (True = visible) that the row description stands for."""
    import torch

    B, Lq = prefix_hi.shape
    j = torch.arange(lk, device=prefix_hi.device)
    a = torch.arange(Lq, device=prefix_hi.device) + (lk - Lq)
    vis = (j[None, None, :] < prefix_hi[:, :, None]) | (
        (j[None, None, :] >= seg_lo[:, :, None]) & (j[None, None, :] <= a[None, :, None]))
    return vis[:, None]


def prefix_attention_ref(q: Any, k: Any, v: Any, prefix_hi: Any, seg_lo: Any, scale: float | None = None, *,
                         mask: Any = None) -> Any:
    """Reference: dense boolean mask and ``scaled_dot_product_attention`` computed in fp32.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, Lq, D]``.
    k, v : torch.Tensor
        ``[B, Hkv, Lk, D]`` (grouped-query attention when ``Hkv < H``).
    prefix_hi, seg_lo : torch.Tensor
        Integer ``[B, Lq]`` row description of the mask (see the module docstring).
    scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    mask : torch.Tensor, optional
        The :func:`dense_mask` of the description, when the caller already built it (a model
        reuses one mask for all its layers).

    Returns
    -------
    torch.Tensor
        ``[B, H, Lq, D]`` in ``q``'s dtype.
    """
    import torch.nn.functional as F

    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else float(scale)
    if mask is None:
        mask = dense_mask(prefix_hi, seg_lo, Lk)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                         enable_gqa=Hkv != H)
    return out.to(q.dtype)


_FLEX_COMPILED = None


def flex_block_mask(prefix_hi: Any, seg_lo: Any, lk: int) -> Any:
    """The FlexAttention ``BlockMask`` of a row description (build once, reuse for every layer)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    B, Lq = prefix_hi.shape
    off = lk - Lq
    hi = prefix_hi.to(torch.int64)
    lo = seg_lo.to(torch.int64)

    def mask_mod(b, h, qi, kj):
        return (kj < hi[b, qi]) | ((kj >= lo[b, qi]) & (kj <= qi + off))

    return create_block_mask(mask_mod, B, None, Lq, lk, device=prefix_hi.device)


def prefix_attention_flex(q: Any, k: Any, v: Any, prefix_hi: Any, seg_lo: Any, scale: float | None = None, *,
                          block_mask: Any = None) -> Any:
    """FlexAttention with a block mask built from the row description.

    Fully masked key blocks are skipped (the later states' evidence for an early suffix). On
    CUDA ``flex_attention`` is compiled once; on the CPU it runs eagerly (correct, not fast).

    Parameters and returns as :func:`prefix_attention_ref`; ``block_mask`` (from
    :func:`flex_block_mask`) skips rebuilding the mask.

    Raises
    ------
    RuntimeError
        When this torch has no ``torch.nn.attention.flex_attention``.
    """
    global _FLEX_COMPILED
    import torch

    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as exc:  # torch < 2.5
        raise RuntimeError(f"FlexAttention needs torch >= 2.5; this is torch {torch.__version__}") from exc
    H, D = q.shape[1], q.shape[3]
    scale = D ** -0.5 if scale is None else float(scale)
    if block_mask is None:
        block_mask = flex_block_mask(prefix_hi, seg_lo, k.shape[2])
    fn = flex_attention
    if q.is_cuda:
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(flex_attention, dynamic=True)
        fn = _FLEX_COMPILED
    with warnings.catch_warnings():
        # Eager flex attention on the CPU warns that it is unfused; that is known and intended here.
        warnings.simplefilter("ignore")
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != H)


def _prefix_attention_triton(q: Any, k: Any, v: Any, prefix_hi: Any, seg_lo: Any, scale: float | None = None) -> Any:
    import torch
    from ragfast.kernels.prefix_attention import prefix_attention as _kernel

    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else float(scale)
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        raise ValueError("prefix_attention: the Triton interpreter supports fp32/fp16 only, got bfloat16")
    return _kernel(q, k, v, prefix_hi.to(torch.int32), seg_lo.to(torch.int32), scale)


register("prefix_attention", "ref", prefix_attention_ref)
register("prefix_attention", "triton", _prefix_attention_triton)


def prefix_attention(q: Any, k: Any, v: Any, prefix_hi: Any, seg_lo: Any, scale: float | None = None, *,
                     backend: str | None = None, check: bool = True) -> Any:
    """Attention where each query sees a key prefix plus its own causal segment.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, H, Lq, D]``, any strides.
    k, v : torch.Tensor
        ``[B, Hkv, Lk, D]``; the queries are the last ``Lq`` key positions.
    prefix_hi : torch.Tensor
        Integer ``[B, Lq]``: keys ``j < prefix_hi`` are visible.
    seg_lo : torch.Tensor
        Integer ``[B, Lq]``: keys ``seg_lo <= j <= own position`` are visible.
    scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``.
    backend : {"ref", "triton", "flex"}, optional
        ``flex`` calls :func:`prefix_attention_flex`; otherwise the registry picks
        (``RAGFAST_BACKEND``, then triton on CUDA, else ref).
    check : bool
        Validate shapes, dtypes and the mask description first (one host sync).

    Returns
    -------
    torch.Tensor
        ``[B, H, Lq, D]`` in ``q``'s dtype.

    Raises
    ------
    ValueError
        On mismatched shapes or dtypes, or a query that would see nothing.
    """
    if check:
        check_inputs(q, k, v, prefix_hi, seg_lo)
    if backend == "flex":
        return prefix_attention_flex(q, k, v, prefix_hi, seg_lo, scale)
    _, fn = resolve("prefix_attention", backend, str(q.device))
    return fn(q, k, v, prefix_hi, seg_lo, scale)

"""argmax: the index of each row's largest value, as greedy decoding picks its next token.

A decode step over a batch ends in one argmax over its ``[rows, vocabulary]`` logits. torch's
argmax over bf16 logits is not vectorised: at 64 rows of Qwen2.5's 151,936-token vocabulary it
took 17 ms of a 285 ms step (two threads, AMD EPYC Zen 4; bench/bench_argmax.py measures both in
one run). Semantics are torch's: the first of equal values wins, and a NaN counts as the largest
value (a row holding one answers its first NaN).

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (``torch.argmax`` on fp32
values: the oracle) and ``cpp`` (``ragfast._C.argmax``, one row kernel per ISA level, threads over
the rows). :func:`argmax` checks and dispatches.
"""
from __future__ import annotations

from typing import Any

from ragfast.ops.layout import as_rows
from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["argmax", "argmax_ref"]


def _check(x: Any) -> None:
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"argmax: x must be a fp32 or bf16 CPU tensor [..., N] with N >= 1, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


def argmax_ref(x: Any) -> Any:
    """Reference: ``torch.argmax(x.float(), dim=-1)`` (int64, ``x``'s leading shape)."""
    _check(x)
    return x.float().argmax(dim=-1)


def argmax_cpp(x: Any, threads: int | None = None) -> Any:
    import torch

    _check(x)
    lead, N = x.shape[:-1], x.shape[-1]
    x2, ldx = as_rows(x)
    M = x2.shape[0]
    out = torch.empty(M, dtype=torch.long)
    cpp_module().argmax(x2.data_ptr(), x.dtype == torch.bfloat16, M, N, ldx, out.data_ptr(),
                        torch.get_num_threads() if threads is None else threads)
    return out.view(lead)


def argmax(x: Any, *, backend: str | None = None) -> Any:
    """The first index of the largest value along the last dimension, as ``torch.argmax(x, -1)``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., N]``, fp32 or bf16, on the CPU, ``N >= 1``; any strides.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        int64, ``x``'s leading shape.

    Raises
    ------
    ValueError
        ``x`` is not a non-empty fp32 or bf16 CPU tensor.
    """
    _, fn = resolve("argmax", backend, "cpu")
    return fn(x)


register("argmax", "ref", argmax_ref)
register("argmax", "cpp", argmax_cpp)

"""silu_mul: ``silu(gate) * up``, the gated activation of a SwiGLU MLP (Llama, Qwen2).

Between a SwiGLU MLP's matmuls transformers computes ``act_fn(gate_proj(x)) * up_proj(x)``: torch
writes the activation into one new tensor and the product into another, two passes over
``[tokens, intermediate]`` values (18.7 MB each in bf16 for 1,920 tokens of Qwen2.5-0.5B). ``cpp``
(``ragfast._C.silu_mul``: a portable loop and an AVX-512 kernel with a vector exponential,
threads over the rows) reads both inputs once and writes once, rounding where torch rounds.

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (``F.silu(gate) * up``, the
oracle) and ``cpp``; they agree within a few fp32 units in the last place (the exponential), which
in bf16 is a bf16 step or two where a rounding falls the other way. :func:`silu_mul` checks and
dispatches.
"""
from __future__ import annotations

from typing import Any

from ragfast.ops.layout import as_rows
from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["silu_mul", "silu_mul_ref"]


def _check(gate: Any, up: Any) -> None:
    import torch

    if gate.dtype not in (torch.float32, torch.bfloat16) or gate.device.type != "cpu" or gate.dim() < 1 \
            or gate.shape[-1] < 1:
        raise ValueError(f"silu_mul: gate must be a fp32 or bf16 CPU tensor [..., N] with N >= 1, got {gate.dtype} "
                         f"{tuple(gate.shape)} on {gate.device}")
    if up.dtype != gate.dtype or up.shape != gate.shape or up.device.type != "cpu":
        raise ValueError(f"silu_mul: up must be a CPU {gate.dtype} tensor {tuple(gate.shape)} like gate, got "
                         f"{up.dtype} {tuple(up.shape)} on {up.device}")


def silu_mul_ref(gate: Any, up: Any) -> Any:
    """Reference: ``torch.nn.functional.silu(gate) * up`` in the inputs' dtype."""
    import torch

    _check(gate, up)
    return torch.nn.functional.silu(gate) * up


def silu_mul_cpp(gate: Any, up: Any, threads: int | None = None, out: Any = None) -> Any:
    """``out``: a contiguous ``[rows, N]`` tensor to write (the tests poison it first)."""
    import torch

    _check(gate, up)
    N = gate.shape[-1]
    (g, ldg), (u, ldu) = as_rows(gate), as_rows(up)
    M = g.shape[0]
    out = torch.empty((M, N), dtype=gate.dtype) if out is None else out
    cpp_module().silu_mul(g.data_ptr(), ldg, u.data_ptr(), ldu, out.data_ptr(), M, N, gate.dtype == torch.bfloat16,
                          torch.get_num_threads() if threads is None else threads)
    return out.view(gate.shape)


def silu_mul(gate: Any, up: Any, *, backend: str | None = None) -> Any:
    """``silu(gate) * up`` elementwise, rounded as torch rounds in the inputs' dtype.

    Parameters
    ----------
    gate, up : torch.Tensor
        The same shape ``[..., N]`` and dtype (fp32 or bf16), on the CPU; any strides.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        ``gate``'s shape and dtype, contiguous.

    Raises
    ------
    ValueError
        The inputs are not of that form.
    """
    _, fn = resolve("silu_mul", backend, "cpu")
    return fn(gate, up)


register("silu_mul", "ref", silu_mul_ref)
register("silu_mul", "cpp", silu_mul_cpp)

"""rms_norm: each row over its root mean square, times a weight, as transformers' RMSNorm.

The RMSNorm of Llama- and Qwen2-style models (``LlamaRMSNorm``, ``Qwen2RMSNorm``) computes in fp32
and rounds twice to the input's dtype: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``. torch runs it
as six ops over fp32 intermediates; a prefill pass of 1,920 tokens of Qwen2.5-0.5B spent 2.4 ms in
each of its 49 norms in bf16 (Intel Xeon, two threads). ``cpp`` does it in one pass per row
(``ragfast._C.rms_norm``: a portable loop and an AVX-512 kernel, threads over the rows).

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (the module's torch code, the
oracle) and ``cpp``. Results agree with ``ref`` up to the order of the sum of squares: fp32
within a few units in the last place, bf16 within two bf16 steps. :func:`rms_norm` checks and
dispatches; :mod:`ragfast.models.fused_layers` puts it inside a loaded model.
"""
from __future__ import annotations

from typing import Any

from ragfast.ops.layout import as_rows
from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["rms_norm", "rms_norm_ref"]


def _check(x: Any, weight: Any) -> None:
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"rms_norm: x must be a fp32 or bf16 CPU tensor [..., N] with N >= 1, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if weight.dtype != x.dtype or tuple(weight.shape) != (x.shape[-1],) or weight.device.type != "cpu":
        raise ValueError(f"rms_norm: weight must be a CPU {x.dtype} tensor [{x.shape[-1]}], got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")


def rms_norm_ref(x: Any, weight: Any, eps: float) -> Any:
    """Reference: transformers' RMSNorm forward (fp32 inside, rounded to ``x``'s dtype twice)."""
    import torch

    _check(x, weight)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_cpp(x: Any, weight: Any, eps: float, threads: int | None = None, out: Any = None) -> Any:
    """``out``: a contiguous ``[rows, N]`` tensor to write (the tests poison it first)."""
    import torch

    _check(x, weight)
    lead, N = x.shape[:-1], x.shape[-1]
    x2, ldx = as_rows(x)
    w = weight.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype) if out is None else out
    cpp_module().rms_norm(x2.data_ptr(), ldx, w.data_ptr(), out.data_ptr(), M, N, float(eps), x.dtype == torch.bfloat16,
                          torch.get_num_threads() if threads is None else threads)
    return out.view(*lead, N)


def rms_norm(x: Any, weight: Any, eps: float, *, backend: str | None = None) -> Any:
    """``weight * x / sqrt(mean(x^2) + eps)`` per row, as transformers' Llama / Qwen2 RMSNorm.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., N]``, fp32 or bf16, on the CPU, ``N >= 1``; any strides.
    weight : torch.Tensor
        ``[N]``, ``x``'s dtype.
    eps : float
        Added to the mean square.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        ``x``'s shape and dtype, contiguous.

    Raises
    ------
    ValueError
        ``x`` or ``weight`` is not of that form.
    """
    _, fn = resolve("rms_norm", backend, "cpu")
    return fn(x, weight, eps)


register("rms_norm", "ref", rms_norm_ref)
register("rms_norm", "cpp", rms_norm_cpp)

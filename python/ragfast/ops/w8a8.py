"""The elementwise ends of an int8 x int8 linear layer: rows to int8 codes, int32 sums back to floats.

``--weights w8a8`` (:mod:`ragfast.models.weight_quant`) multiplies int8 activations by int8
weights with torch's ``_int_mm``. Around that product are two elementwise passes:

* :func:`quantize_rows`: each row of ``x`` to int8 codes with one symmetric scale,
  ``scale = max|x| / 127`` (1 for a zero row), ``code = round(x / scale)`` (ties to even);
* :func:`dequantize_sums`: ``y[m, n] = float(acc[m, n]) * xs[m] * ws[n] (+ bias[n])`` in fp32,
  returned as fp32 or bf16.

As torch expressions they were ten ops and four dtype copies, about 50 ms of a 235 ms batch-64
decode step of Qwen2.5-Coder-0.5B in torch's profiler (two threads, AMD EPYC Zen 4);
bench/bench_decode_weights.py measures the w8a8 generator against bf16 in one run. Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (those torch
expressions: the oracle) and ``cpp`` (``ragfast._C.w8a8_quantize`` / ``w8a8_dequantize``: one
pass each, the same arithmetic in the same order, so the same bits; threads over the rows).
"""
from __future__ import annotations

from typing import Any

from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["dequantize_sums", "dequantize_sums_ref", "quantize_rows", "quantize_rows_ref"]


def _check_x(x: Any) -> None:
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"w8a8: x must be a 2-D fp32 or bf16 CPU tensor [rows, K >= 1], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


def _check_sums(acc: Any, xs: Any, ws: Any, bias: Any, dtype: Any) -> None:
    import torch

    if acc.dtype != torch.int32 or acc.dim() != 2 or acc.device.type != "cpu" or acc.shape[1] < 1:
        raise ValueError(f"w8a8: sums must be a 2-D int32 CPU tensor [rows, N >= 1], got {acc.dtype} {tuple(acc.shape)}")
    M, N = acc.shape
    for name, t, n in (("row scales", xs, M), ("column scales", ws, N), ("bias", bias, N)):
        if t is not None and (t.dtype != torch.float32 or t.numel() != n or t.device.type != "cpu"):
            raise ValueError(f"w8a8: {name} must be {n} fp32 CPU values, got {t.dtype} {tuple(t.shape)}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"w8a8: the output dtype must be fp32 or bf16, got {dtype}")


def quantize_rows_ref(x: Any) -> tuple[Any, Any]:
    """Reference: symmetric per-row int8 codes ``[rows, K]`` and fp32 scales ``[rows]`` of a 2-D ``x``."""
    import torch

    w = x.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.contiguous(), scales


def _out(out: Any, acc: Any, dtype: Any) -> Any:
    import torch

    dtype = torch.float32 if dtype is None and out is None else (out.dtype if dtype is None else dtype)
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(acc.shape) or out.device.type != "cpu"
                            or out.stride(1) != 1):
        raise ValueError(f"w8a8: out must be a {dtype} CPU tensor {tuple(acc.shape)} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return dtype


def dequantize_sums_ref(acc: Any, xs: Any, ws: Any, bias: Any = None, dtype: Any = None, out: Any = None) -> Any:
    """Reference: ``acc * xs[:, None] * ws[None, :] (+ bias)`` in fp32, as ``dtype`` (default fp32)."""
    dtype = _out(out, acc, dtype)
    _check_sums(acc, xs, ws, bias, dtype)
    y = acc.float().mul_(xs.reshape(-1, 1)).mul_(ws.reshape(1, -1))
    if bias is not None:
        y.add_(bias.reshape(1, -1))
    return y.to(dtype) if out is None else out.copy_(y)


def quantize_rows_cpp(x: Any) -> tuple[Any, Any]:
    import torch

    _check_x(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, K = x.shape
    codes = torch.empty((M, K), dtype=torch.int8)
    scales = torch.empty(M, dtype=torch.float32)
    cpp_module().w8a8_quantize(x.data_ptr(), x.dtype == torch.bfloat16, M, K, x.stride(0) if M > 1 else K,
                               codes.data_ptr(), scales.data_ptr(), torch.get_num_threads())
    return codes, scales


def dequantize_sums_cpp(acc: Any, xs: Any, ws: Any, bias: Any = None, dtype: Any = None, out: Any = None) -> Any:
    import torch

    dtype = _out(out, acc, dtype)
    _check_sums(acc, xs, ws, bias, dtype)
    acc = acc.contiguous()
    xs, ws = xs.contiguous(), ws.contiguous()
    bias = None if bias is None else bias.contiguous()
    M, N = acc.shape
    y = torch.empty((M, N), dtype=dtype) if out is None else out
    cpp_module().w8a8_dequantize(acc.data_ptr(), M, N, xs.data_ptr(), ws.data_ptr(),
                                 0 if bias is None else bias.data_ptr(), y.data_ptr(), dtype == torch.bfloat16,
                                 y.stride(0) if M > 1 else N, torch.get_num_threads())
    return y


def quantize_rows(x: Any, *, backend: str | None = None) -> tuple[Any, Any]:
    """Symmetric per-row int8 codes of ``x`` and their scales (see the module).

    Parameters
    ----------
    x : torch.Tensor
        ``[rows, K]`` fp32 or bf16 on the CPU; any strides.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    (codes, scales)
        int8 ``[rows, K]`` in [-127, 127], contiguous; fp32 ``[rows]``; ``x ≈ codes * scales[:, None]``.
    """
    _, fn = resolve("w8a8_quantize", backend, "cpu")
    return fn(x)


def dequantize_sums(acc: Any, xs: Any, ws: Any, bias: Any = None, dtype: Any = None, out: Any = None, *,
                    backend: str | None = None) -> Any:
    """Int32 sums of int8 products back to floats: ``acc * xs[:, None] * ws (+ bias)`` (see the module).

    Parameters
    ----------
    acc : torch.Tensor
        int32 ``[rows, N]`` on the CPU (``torch._int_mm``'s output).
    xs, ws : torch.Tensor
        fp32 ``[rows]`` and ``[N]``: the rows' and the columns' scales.
    bias : torch.Tensor, optional
        fp32 ``[N]``.
    dtype : torch.dtype, optional
        fp32 or bf16 (rounded to nearest even); default ``out``'s, else fp32.
    out : torch.Tensor, optional
        ``[rows, N]`` of ``dtype`` with contiguous rows (a column slice of a wider tensor, say),
        written and returned.
    backend : str, optional
        ``"cpp"`` or ``"ref"``.
    """
    _, fn = resolve("w8a8_dequantize", backend, "cpu")
    return fn(acc, xs, ws, bias, dtype, out)


def _quantize_rows_checked_ref(x: Any) -> tuple[Any, Any]:
    _check_x(x)  # the op's inputs; quantize_rows_ref also takes any float weight (quantize_int8)
    return quantize_rows_ref(x)


register("w8a8_quantize", "ref", _quantize_rows_checked_ref)
register("w8a8_quantize", "cpp", quantize_rows_cpp)
register("w8a8_dequantize", "ref", dequantize_sums_ref)
register("w8a8_dequantize", "cpp", dequantize_sums_cpp)

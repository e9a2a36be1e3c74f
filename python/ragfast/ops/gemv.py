"""gemv: a few rows of activations times a weight matrix, at the memory's bandwidth.

``y[M, N] = x[M, K] · w[N, K]ᵀ (· scales[N]) (+ bias[N])`` for small ``M`` (a decode step's
rows). The weights are fp32, bf16 or int8 codes with one scale per output row; ``x`` and ``y``
are fp32 or bf16; sums are fp32 and ``y`` is rounded to ``x``'s dtype. At a few rows the op reads
every weight once and does two flops per weight, so it is bound by the weight bytes: torch's
oneDNN matmul read bf16 weights at 16.5 GB/s of the 31 GB/s a 2-core Zen 4 EPYC streams
(bench/bench_gemv.py measures both, and the read rate, in one run).

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (torch, fp32 arithmetic:
the oracle) and ``cpp`` (``ragfast._C.gemv``, one kernel per ISA level, threads over the output
rows). :func:`gemv` checks and dispatches; :class:`GemvWeight` holds a layer's weight prepared
once, for the per-token calls of a linear layer (:mod:`ragfast.models.weight_quant`).
"""
from __future__ import annotations

from typing import Any

from ragfast.ops.layout import as_rows
from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["GemvWeight", "default_rows", "gemv", "gemv_ref", "weight_kind"]

def default_rows(weight_dtype: Any) -> int:
    """Rows up to which a linear layer with ``weight_dtype`` weights runs gemv by default at the ISA
    level in use (0: never): this machine's measured rows (:mod:`ragfast.ops.gemv_rows`).

    bf16 weights take gemv only at levels with a bf16 dot product (avx512bf16, amx): where the
    kernel must widen them (avx2, avx512, avx512vnni) it lost to torch's oneDNN matmul at 1-2
    rows (0.85-0.98x on a Zen 4 EPYC forced to those levels, torch and oneDNN restricted alike).
    """
    import torch

    from ragfast.ops.gemv_rows import machine_rows

    c = cpp_module()
    if c is None:
        return 0
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}.get(weight_dtype)
    if name is None:
        return 0
    level = c.isa_current()
    if name == "bf16" and level not in ("avx512bf16", "amx"):
        return 0
    return machine_rows(level, calibrate_with=_calibrate_rows)[name]


def _calibrate_rows() -> dict[str, int]:
    from ragfast.ops.gemv_rows import calibrate_rows

    return calibrate_rows(GemvWeight)


def weight_kind(dtype: Any) -> int | None:
    """The kernel's code for a weight dtype (0 fp32, 1 bf16, 2 int8), None where it has none."""
    import torch

    return {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}.get(dtype)


def gemv_ref(x: Any, weight: Any, scales: Any = None, bias: Any = None) -> Any:
    """Reference: ``x @ (weight * scales[:, None])ᵀ + bias`` in fp32, returned in ``x``'s dtype.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` activations, fp32 or bf16.
    weight : torch.Tensor
        ``[N, K]``: fp32, bf16, or int8 codes (then ``scales`` is required).
    scales, bias : torch.Tensor, optional
        ``[N]`` each.
    """
    w = weight.float()
    if scales is not None:
        w = w * scales.float()[:, None]
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


class GemvWeight:
    """A weight matrix made ready for :meth:`__call__`: its kind, fp32 scales and bias, checked once.

    Parameters
    ----------
    weight : torch.Tensor
        ``[N, K]`` fp32, bf16 or int8 on the CPU. Held, not copied, when its rows are contiguous
        (``stride(1) == 1``; else copied once), so the caller's later in-place changes are seen.
    scales : torch.Tensor, optional
        ``[N]``, required for int8 codes.
    bias : torch.Tensor, optional
        ``[N]``.
    """

    def __init__(self, weight: Any, scales: Any = None, bias: Any = None):
        import torch

        kind = weight_kind(weight.dtype)
        if weight.dim() != 2 or kind is None or weight.device.type != "cpu":
            raise ValueError(f"gemv: weight must be a 2-D fp32, bf16 or int8 CPU tensor, got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        N, K = weight.shape
        if (scales is None) == (kind == 2):
            raise ValueError("gemv: scales are given with int8 weights, and only with them")

        def vec(t: Any, what: str) -> Any:
            if t is None:
                return None
            if t.numel() != N:
                raise ValueError(f"gemv: {what} has {t.numel()} values for {N} output rows")
            return t.detach().reshape(N).to(torch.float32).contiguous()

        self.weight, self.kind, self.N, self.K = weight, kind, N, K
        self.scales, self.bias = vec(scales, "scales"), vec(bias, "bias")

    def check_x(self, x: Any) -> None:
        """Raise ValueError unless ``x`` is a fp32 or bf16 CPU tensor ``[..., K]``."""
        import torch

        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.shape[-1] != self.K:
            raise ValueError(f"gemv: x must be a fp32 or bf16 CPU tensor [..., {self.K}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")

    def __call__(self, x: Any, out: Any = None, threads: int | None = None) -> Any:
        """``x [..., K]`` (fp32 or bf16) times the weight: ``[..., N]`` in ``x``'s dtype.

        ``out`` (``[..., N]``, ``x``'s dtype, rows contiguous) receives the result when given.
        """
        import torch

        self.check_x(x)
        lead = x.shape[:-1]
        x2, ldx = as_rows(x)
        M = x2.shape[0]
        if out is None:
            y = torch.empty((M, self.N), dtype=x.dtype)
        else:
            if out.dtype != x.dtype or tuple(out.shape) != (*lead, self.N) or out.device.type != "cpu":
                raise ValueError(f"gemv: out must be {x.dtype} {(*lead, self.N)} on the CPU, got {out.dtype} "
                                 f"{tuple(out.shape)}")
            y = out.view(M, self.N)  # raises when the rows cannot be one strided block
            if y.stride(1) != 1:
                raise ValueError("gemv: out's rows must be contiguous")
        c = cpp_module()
        c.gemv(x2.data_ptr(), x.dtype == torch.bfloat16, M, self.K, ldx,
               self.weight.data_ptr(), self.kind, self.N, self.weight.stride(0),
               0 if self.scales is None else self.scales.data_ptr(), 0 if self.bias is None else self.bias.data_ptr(),
               y.data_ptr(), y.stride(0) if M > 1 else self.N, torch.get_num_threads() if threads is None else threads)
        return out if out is not None else y.view(*lead, self.N)


def gemv_cpp(x: Any, weight: Any, scales: Any = None, bias: Any = None) -> Any:
    return GemvWeight(weight, scales, bias)(x)


def _checked_ref(x: Any, weight: Any, scales: Any = None, bias: Any = None) -> Any:
    g = GemvWeight(weight, scales, bias)  # the same checks as the compiled path
    g.check_x(x)
    return gemv_ref(x, weight, scales, bias)


register("gemv", "ref", _checked_ref)
register("gemv", "cpp", gemv_cpp)


def gemv(x: Any, weight: Any, scales: Any = None, bias: Any = None, *, backend: str | None = None) -> Any:
    """``x @ (weight · scales)ᵀ + bias`` for a few rows of ``x``, in ``x``'s dtype.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]``, fp32 or bf16, on the CPU.
    weight : torch.Tensor
        ``[N, K]`` fp32, bf16, or int8 codes.
    scales : torch.Tensor, optional
        ``[N]`` per-output-row scales of int8 codes (required for them, refused otherwise).
    bias : torch.Tensor, optional
        ``[N]``.
    backend : str, optional
        ``"cpp"`` or ``"ref"`` (default: :func:`ragfast.ops.registry.resolve`'s choice).

    Returns
    -------
    torch.Tensor
        ``[..., N]`` in ``x``'s dtype.
    """
    _, fn = resolve("gemv", backend, "cpu")
    return fn(x, weight, scales, bias)

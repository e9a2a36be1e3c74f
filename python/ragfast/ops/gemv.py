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

__all__ = ["GemvWeight", "default_rows", "gemv", "gemv_packed", "gemv_packed_ref", "gemv_ref", "weight_kind"]

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


def _check_packed(x: Any, packed: Any, scales: Any, bias: Any, silu: bool) -> None:
    import torch

    n, k = packed.n, packed.k
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"gemv_packed: x must be a bf16 CPU tensor [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n,) or not scales.is_contiguous():
        raise ValueError(f"gemv_packed: scales must be contiguous fp32 [{n}], got {scales.dtype} {tuple(scales.shape)}")
    if bias is not None and (silu or bias.dtype != torch.float32 or tuple(bias.shape) != (n,)
                             or not bias.is_contiguous()):
        raise ValueError("gemv_packed: bias must be contiguous fp32 [N], and a SiLU pair has none")
    if silu and n % 128:
        raise ValueError(f"gemv_packed: a SiLU pair interleaves 64 gate and 64 up rows, got N = {n}")


def gemv_packed_ref(x: Any, packed: Any, scales: Any, bias: Any = None, *, silu: bool = False) -> Any:
    """Reference of :func:`gemv_packed`: :func:`gemv_ref` on the packed codes' ``[N, K]`` rows; with
    ``silu``, the gate's and the up projection's outputs (rows interleaved by 64) through
    :func:`ragfast.ops.silu_mul.silu_mul_ref`."""
    from ragfast.ops.silu_mul import silu_mul_ref

    _check_packed(x, packed, scales, bias, silu)
    y = gemv_ref(x, packed.codes(), scales, bias)
    if not silu:
        return y
    strips = y.reshape(*y.shape[:-1], packed.n // 128, 2, 64)
    return silu_mul_ref(strips[..., 0, :], strips[..., 1, :]).reshape(*y.shape[:-1], packed.n // 2)


def gemv_packed(x: Any, packed: Any, scales: Any, bias: Any = None, *, silu: bool = False, out: Any = None,
                threads: int | None = None) -> Any:
    """gemv on int8 codes in w8a8's packed layout (:func:`ragfast.ops.w8a8.pack_codes`), bf16 in and out.

    At one to a few rows the packed layout streams each column group's codes front to back with
    every lane an output row's sum: on a 2-core Zen 4 EPYC it read them at a plain read loop's
    rate where :class:`GemvWeight` on the row-major codes ran at 0.6-0.7x of it. Sums are the
    row-major gemv's (int32, exact) combined in another order; ``silu`` takes a SiLU MLP's gate and
    up projections packed as one (:func:`ragfast.ops.w8a8.pack_gate_up`) and returns
    ``silu(gate) * up`` as :func:`ragfast.ops.silu_mul.silu_mul` computes it from their bf16 outputs.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., K]`` bf16 on the CPU.
    packed : ragfast.ops.w8a8.PackedCodes
        The codes ``[N, K]``, K a multiple of 64 (N of 128 with ``silu``).
    scales : torch.Tensor
        ``[N]`` fp32 per-row scales (interleaved like the codes with ``silu``).
    bias : torch.Tensor, optional
        ``[N]`` fp32 (not with ``silu``).
    silu : bool
        The codes are a gate/up pair: return ``[..., N / 2]``.
    out : torch.Tensor, optional
        A contiguous bf16 ``[rows, N or N / 2]`` to write (the tests poison it first).

    Returns
    -------
    torch.Tensor or None
        ``[..., N]`` (``[..., N / 2]`` with ``silu``) in bf16; None where the compiled kernel does
        not run here (no VNNI, no build) or ``x`` holds NaN or infinity: the caller runs gemv on
        the row-major codes, which carries them as the reference does.
    """
    import torch

    c = cpp_module()
    if c is None:
        return None
    _check_packed(x, packed, scales, bias, silu)
    x2, ldx = as_rows(x)
    M, width = x2.shape[0], packed.n // 2 if silu else packed.n
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (M, width) or not out.is_contiguous()):
        raise ValueError(f"gemv_packed: out must be a contiguous bf16 [{M}, {width}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    y = torch.empty((M, width), dtype=torch.bfloat16) if out is None else out
    ok = c.gemv_packed(x2.data_ptr(), M, packed.k, ldx, packed.data.data_ptr(), packed.n, scales.data_ptr(),
                       0 if bias is None else bias.data_ptr(), y.data_ptr(), width, silu,
                       torch.get_num_threads() if threads is None else threads)
    return y.view(*x.shape[:-1], width) if ok else None


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

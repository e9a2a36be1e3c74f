"""The elementwise ends of an int8 x int8 linear layer: rows to int8 codes, int32 sums back to floats.

``--weights w8a8`` (:mod:`ragfast.models.weight_quant`) multiplies int8 activations by int8
weights with torch's ``_int_mm``. Around that product are two elementwise passes:

* :func:`quantize_rows`: each row of ``x`` to int8 codes with one symmetric scale,
  ``scale = max|x| / 127`` (1 for a zero row), ``code = round(x / scale)`` (ties to even);
* :func:`dequantize_sums`: ``y[m, n] = float(acc[m, n]) * xs[m] * ws[n] (+ bias[n])`` in fp32,
  returned as fp32 or bf16.

As torch expressions they were ten ops and four dtype copies, about 50 ms of a 235 ms batch-64
decode step of Qwen2.5-Coder-0.5B in torch's profiler (two threads, AMD EPYC Zen 4);
bench/bench_decode_weights.py measures the w8a8 generator against bf16 in one run.

* :func:`matmul`: the whole product, ``dequantize_sums(xq @ codes.T, ...)``, with the weight's
  codes packed once by :func:`pack_codes` into the tile layout AMX-INT8 reads, which is also the
  layout AVX-512 VNNI's ``vpdpbusd`` reads a zmm at a time (``_int_mm`` hands oneDNN the
  row-major codes and it re-blocks them on every call), each block of int32 sums turned into
  floats while still in cache: AMX tiles at the amx ISA level, VNNI at the other levels of
  :data:`MATMUL_LEVELS`. The same bits as ``_int_mm`` followed by
  :func:`dequantize_sums` (int32 sums are exact). :func:`matmul_available` says whether it runs.
* :func:`gate_up`: a SiLU MLP's gate and up projections as one product on the same codes, their
  codes interleaved by 64 output columns (:func:`pack_gate_up`), each strip's two halves turned
  into ``silu(gate) * up`` while in cache: the same bits as the two products followed by
  ``ragfast.ops.silu_mul``'s kernel, with one pass over the input's codes, one call and no
  ``[rows, 2 x width]`` intermediate.

Implementations registered with :mod:`ragfast.ops.registry`: ``ref`` (those torch expressions,
and for :func:`matmul` an exact integer ``torch.mm``: the oracle) and ``cpp``
(``ragfast._C.w8a8_quantize`` / ``w8a8_dequantize``: one pass each, the same arithmetic in the
same order, so the same bits, threads over the rows; ``ragfast._C.w8a8_matmul``: AMX-INT8 tiles or
VNNI, threads over the output columns; ``silu=True`` for :func:`gate_up`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragfast.ops.registry import cpp_module, register, resolve

__all__ = ["GATE_UP_COLUMNS", "MATMUL_LEVELS", "PackedCodes", "dequantize_sums", "dequantize_sums_ref", "gate_up", "gate_up_ref",
           "interleave_gate_up", "matmul", "matmul_available", "matmul_engine", "matmul_ref", "pack_codes", "pack_gate_up",
           "quantize_rows", "quantize_rows_ref"]


def _check_x(x: Any) -> None:
    import torch

    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"w8a8: x must be a 2-D fp32 or bf16 CPU tensor [rows, K >= 1], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")


def _check_sums(acc: Any, xs: Any, ws: Any, bias: Any, dtype: Any) -> None:
    import torch

    if acc.dtype != torch.int32 or acc.dim() != 2 or acc.device.type != "cpu" or acc.shape[1] < 1:
        raise ValueError(f"w8a8: sums must be a 2-D int32 CPU tensor [rows, N >= 1], got {acc.dtype} {tuple(acc.shape)}")
    _check_scales(acc.shape[0], acc.shape[1], xs, ws, bias, dtype)


def _check_scales(M: int, N: int, xs: Any, ws: Any, bias: Any, dtype: Any) -> None:
    import torch

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


def _out(out: Any, shape: Any, dtype: Any) -> Any:
    import torch

    dtype = torch.float32 if dtype is None and out is None else (out.dtype if dtype is None else dtype)
    if out is not None and (out.dtype != dtype or tuple(out.shape) != tuple(shape) or out.device.type != "cpu"
                            or out.stride(1) != 1):
        raise ValueError(f"w8a8: out must be a {dtype} CPU tensor {tuple(shape)} with contiguous rows, got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    return dtype


def dequantize_sums_ref(acc: Any, xs: Any, ws: Any, bias: Any = None, dtype: Any = None, out: Any = None) -> Any:
    """Reference: ``acc * xs[:, None] * ws[None, :] (+ bias)`` in fp32, as ``dtype`` (default fp32)."""
    dtype = _out(out, acc.shape, dtype)
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

    dtype = _out(out, acc.shape, dtype)
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


#: Depth (K) granularity of :func:`matmul`: one tile row (one zmm) holds 64 int8 values.
MATMUL_DEPTH = 64
#: ISA levels where the compiled :func:`matmul` runs: AVX-512 VNNI's ``vpdpbusd`` (avx512vnni,
#: avx512bf16) and AMX-INT8 tiles (amx).
MATMUL_LEVELS = ("avx512vnni", "avx512bf16", "amx")


@dataclass(frozen=True)
class PackedCodes:
    """A weight's int8 codes ``[N, K]`` in :func:`matmul`'s tile layout.

    ``data`` is int8 ``[ceil(N / 16), K / 4, 16, 4]``: column group ``j`` (output columns
    ``16 j .. 16 j + 15``, zero past ``N``), depth quad ``r``, column, depth within the quad.
    """

    data: Any
    n: int
    k: int

    def codes(self) -> Any:
        """The ``[N, K]`` codes back (what the reference multiplies)."""
        g = self.data.shape[0]
        return self.data.permute(0, 2, 1, 3).reshape(g * 16, self.k)[:self.n]


def pack_codes(codes: Any) -> PackedCodes:
    """Pack int8 codes ``[N, K]`` (K a multiple of 64) for :func:`matmul` (a copy, made once)."""
    import torch

    if codes.dtype != torch.int8 or codes.dim() != 2 or codes.device.type != "cpu":
        raise ValueError(f"w8a8: codes must be a 2-D int8 CPU tensor, got {codes.dtype} {tuple(codes.shape)}")
    n, k = codes.shape
    if n < 1 or k < MATMUL_DEPTH or k % MATMUL_DEPTH:
        raise ValueError(f"w8a8: the packed matmul needs N >= 1 and K a multiple of {MATMUL_DEPTH}, got [{n}, {k}]")
    g = (n + 15) // 16
    padded = codes.new_zeros((g * 16, k))
    padded[:n] = codes
    data = padded.view(g, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    return PackedCodes(data, n, k)


def matmul_available() -> bool:
    """Whether the compiled :func:`matmul` runs here (a level of :data:`MATMUL_LEVELS`, in this build)."""
    mod = cpp_module()
    return mod is not None and bool(mod.w8a8_matmul_available())


def matmul_engine() -> str | None:
    """What runs the compiled :func:`matmul` here, in words for a report: ``"AMX tiles"``,
    ``"AVX-512 VNNI"``, or None where it does not run."""
    if not matmul_available():
        return None
    return "AMX tiles" if cpp_module().isa_current() == "amx" else "AVX-512 VNNI"


def _check_matmul(xq: Any, xs: Any, w: PackedCodes, ws: Any, bias: Any, dtype: Any) -> None:
    import torch

    if xq.dtype != torch.int8 or xq.dim() != 2 or xq.device.type != "cpu" or xq.shape[1] != w.k:
        raise ValueError(f"w8a8: codes must be a 2-D int8 CPU tensor [rows, {w.k}], got {xq.dtype} {tuple(xq.shape)}")
    _check_scales(xq.shape[0], w.n, xs, ws, bias, dtype)


def matmul_ref(xq: Any, xs: Any, w: PackedCodes, ws: Any, bias: Any = None, dtype: Any = None,
               out: Any = None) -> Any:
    """Reference: exact int32 sums ``xq @ codes.T`` (an integer matmul), then :func:`dequantize_sums_ref`."""
    import torch

    _check_matmul(xq, xs, w, ws, bias, dtype if dtype is not None else (torch.float32 if out is None else out.dtype))
    acc = torch.mm(xq.to(torch.int32), w.codes().to(torch.int32).t())
    return dequantize_sums_ref(acc, xs, ws, bias, dtype, out)


def _packed_call(xq: Any, xs: Any, w: PackedCodes, ws: Any, bias: Any, dtype: Any, out: Any, silu: bool) -> Any:
    """``ragfast._C.w8a8_matmul`` after the checks: :func:`matmul`'s product, or with ``silu``
    :func:`gate_up`'s (``w.n / 2`` output columns)."""
    import torch

    M, width = xq.shape[0], w.n // 2 if silu else w.n
    dtype = _out(out, (M, width), dtype)
    _check_matmul(xq, xs, w, ws, bias, dtype)  # below MATMUL_LEVELS the C++ call refuses (RuntimeError)
    xq, xs, ws = xq.contiguous(), xs.contiguous(), ws.contiguous()
    bias = None if bias is None else bias.contiguous()
    y = torch.empty((M, width), dtype=dtype) if out is None else out
    cpp_module().w8a8_matmul(xq.data_ptr(), M, w.k, xs.data_ptr(), w.data.data_ptr(), w.n, ws.data_ptr(),
                             0 if bias is None else bias.data_ptr(), y.data_ptr(), dtype == torch.bfloat16,
                             y.stride(0) if M > 1 else width, torch.get_num_threads(), silu)
    return y


def matmul_cpp(xq: Any, xs: Any, w: PackedCodes, ws: Any, bias: Any = None, dtype: Any = None,
               out: Any = None) -> Any:
    return _packed_call(xq, xs, w, ws, bias, dtype, out, False)


def matmul(xq: Any, xs: Any, w: PackedCodes, ws: Any, bias: Any = None, dtype: Any = None, out: Any = None, *,
           backend: str | None = None) -> Any:
    """An int8 x int8 linear layer's product and its float end: ``dequantize_sums(xq @ codes.T, xs, ws, bias)``.

    Parameters
    ----------
    xq : torch.Tensor
        int8 ``[rows, K]`` codes (:func:`quantize_rows`), K the weight's depth.
    xs, ws : torch.Tensor
        fp32 ``[rows]`` and ``[N]``: the rows' and the weight's output channels' scales.
    w : PackedCodes
        The weight's codes ``[N, K]`` from :func:`pack_codes`.
    bias : torch.Tensor, optional
        fp32 ``[N]``.
    dtype : torch.dtype, optional
        fp32 or bf16; default ``out``'s, else fp32.
    out : torch.Tensor, optional
        ``[rows, N]`` of ``dtype`` with contiguous rows, written and returned.
    backend : str, optional
        ``"cpp"`` (:data:`MATMUL_LEVELS` only: :func:`matmul_available`) or ``"ref"``; by default
        the compiled one where it runs, else the reference.
    """
    if backend is None and not matmul_available():
        backend = "ref"
    _, fn = resolve("w8a8_matmul", backend, "cpu")
    return fn(xq, xs, w, ws, bias, dtype, out)


#: Output columns of a gate (then of the up projection) per strip of :func:`pack_gate_up`'s codes.
GATE_UP_COLUMNS = 64


def interleave_gate_up(gate: Any, up: Any) -> Any:
    """A gate's and an up projection's rows (codes ``[F, K]``, or scales ``[F]``) interleaved by
    :data:`GATE_UP_COLUMNS`: 64 gate rows, the 64 up rows of the same outputs, and so on (F a
    multiple of 64)."""
    import torch

    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() not in (1, 2):
        raise ValueError(f"w8a8: gate and up must have one shape and dtype, got {gate.dtype} {tuple(gate.shape)} "
                         f"and {up.dtype} {tuple(up.shape)}")
    f, c = gate.shape[0], GATE_UP_COLUMNS
    if f < c or f % c:
        raise ValueError(f"w8a8: gate_up needs a width that is a multiple of {c}, got {f}")
    rest = tuple(gate.shape[1:])
    return torch.stack([gate.reshape(f // c, c, *rest), up.reshape(f // c, c, *rest)], 1).reshape(2 * f, *rest)


def pack_gate_up(gate_codes: Any, up_codes: Any) -> PackedCodes:
    """Pack a SiLU MLP's gate and up codes (each ``[F, K]``, F a multiple of 64, K of 64) for
    :func:`gate_up`: :func:`pack_codes` of :func:`interleave_gate_up` (N = 2F)."""
    return pack_codes(interleave_gate_up(gate_codes, up_codes))


def _halves(y: Any) -> tuple[Any, Any]:
    """The gate's and the up projection's columns of an interleaved ``[rows, 2F]`` product."""
    m, n = y.shape
    y = y.view(m, n // (2 * GATE_UP_COLUMNS), 2, GATE_UP_COLUMNS)
    return y[:, :, 0].reshape(m, n // 2), y[:, :, 1].reshape(m, n // 2)


def gate_up_ref(xq: Any, xs: Any, w: PackedCodes, ws: Any, dtype: Any = None, out: Any = None) -> Any:
    """Reference: :func:`matmul_ref` of the interleaved codes in ``dtype``, then ``silu(gate) * up``
    in ``dtype`` by torch."""
    import torch

    dtype = _out(out, (xq.shape[0], w.n // 2), dtype)
    gate, up = _halves(matmul_ref(xq, xs, w, ws, None, dtype))
    y = torch.nn.functional.silu(gate) * up
    if out is None:
        return y
    out.copy_(y)
    return out


def gate_up_cpp(xq: Any, xs: Any, w: PackedCodes, ws: Any, dtype: Any = None, out: Any = None) -> Any:
    return _packed_call(xq, xs, w, ws, None, dtype, out, True)


def gate_up(xq: Any, xs: Any, w: PackedCodes, ws: Any, dtype: Any = None, out: Any = None, *,
            backend: str | None = None) -> Any:
    """A SiLU MLP's hidden activations ``silu(x @ gate.T) * (x @ up.T)`` from int8 codes, as w8a8
    layers compute them: each product dequantised (:func:`matmul`) and rounded to ``dtype``, then
    ``silu(gate) * up`` rounded as torch rounds in ``dtype``.

    Parameters
    ----------
    xq, xs : torch.Tensor
        int8 ``[rows, K]`` codes and fp32 ``[rows]`` scales (:func:`quantize_rows`).
    w : PackedCodes
        :func:`pack_gate_up` of the gate's and up projection's codes (``w.n`` = 2F).
    ws : torch.Tensor
        fp32 ``[2F]``: :func:`interleave_gate_up` of the two layers' output-channel scales.
    dtype, out :
        As for :func:`matmul`; the output is ``[rows, F]``.
    backend : str, optional
        ``"cpp"`` (:data:`MATMUL_LEVELS` only) or ``"ref"``; by default the compiled one where it runs.
        The compiled path's SiLU is ``ragfast.ops.silu_mul``'s kernel (within two bf16 steps of
        torch's, equal on nearly every value).
    """
    if backend is None and not matmul_available():
        backend = "ref"
    _, fn = resolve("w8a8_gate_up", backend, "cpu")
    return fn(xq, xs, w, ws, dtype, out)


def _quantize_rows_checked_ref(x: Any) -> tuple[Any, Any]:
    _check_x(x)  # the op's inputs; quantize_rows_ref also takes any float weight (quantize_int8)
    return quantize_rows_ref(x)


register("w8a8_quantize", "ref", _quantize_rows_checked_ref)
register("w8a8_quantize", "cpp", quantize_rows_cpp)
register("w8a8_dequantize", "ref", dequantize_sums_ref)
register("w8a8_dequantize", "cpp", dequantize_sums_cpp)
register("w8a8_matmul", "ref", matmul_ref)
register("w8a8_matmul", "cpp", matmul_cpp)
register("w8a8_gate_up", "ref", gate_up_ref)
register("w8a8_gate_up", "cpp", gate_up_cpp)

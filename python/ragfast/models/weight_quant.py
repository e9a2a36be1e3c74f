"""How a local generator's linear layers store their weights and run their passes.

Decoding a few sequences at a time reads every weight once per step and does little arithmetic
on it, so its time is the weight bytes over the memory bandwidth. Two things follow here:

* **int8 weights** (``HFGenerator(weights="int8")``): the linear layers' weights as int8 with one
  scale per output channel, a quarter of fp32's bytes (half of bf16's); activations, the KV
  cache, norms and embeddings keep the model's dtype. A pass runs torch's own
  ``aten._weight_int8pack_mm`` (x @ int8 weightᵀ, then the per-channel scale; its input in
  bf16), except a pass of more than :data:`KERNEL_ROWS` tokens in bf16/fp16 (prefill), which runs
  the dtype's matmul on the weight dequantised for the call. :func:`int8_linear_ref` is the
  reference the tests hold these paths to. The quantisation is symmetric round-to-nearest per
  output channel (scale = max |w| / 127), the scheme of weight-only int8 in llama.cpp's Q8_0
  (which uses blocks of 32) and gpt-fast. It is opt-in (``"auto"`` never picks it); the default
  reasoner's held-out EM with it was within bf16's paired CI.
* **int8 weights and activations** (``weights="w8a8"``): the same int8 weights; a pass of more
  than :data:`KERNEL_ROWS` rows (a decode step at a large batch, prefill; on packed codes, every pass
  that gemv does not take) also rounds its input
  to int8, one symmetric scale per row (token), and multiplies integers with torch's
  ``_int_mm`` (exact int32 sums; oneDNN's VNNI / AMX-INT8 kernels), then applies both scales.
  Where ragfast's packed product runs (AMX tiles at the amx ISA level, AVX-512 VNNI at
  avx512vnni and avx512bf16: :data:`ragfast.ops.w8a8.MATMUL_LEVELS`) the layer keeps its codes
  also in that packed layout and runs the product and both scales as one ragfast kernel
  (:func:`ragfast.ops.w8a8.matmul`, the same bits), since ``_int_mm`` re-blocks the row-major
  codes on every call. A SiLU MLP's gate and up projections share one packed copy there and run
  as one product with the SiLU applied in cache (:func:`gate_up_pass`): the input rounded once,
  one call, no ``[rows, 2 x width]`` intermediate. Integer multiply-adds run at twice bf16's rate
  on AVX-512 VNNI, and that is what bounds a batch-64 decode step. Fewer rows take the
  weight-only path above (bound by the weight bytes, where rounding the activations buys
  nothing), except on the packed codes, which beat torch's weight-only kernel from 4 rows.
  :func:`w8a8_linear_ref` is its reference. It is coarser than int8 (an outlier channel sets its
  row's scale), and the default (``"auto"``) only where its products run packed
  (:func:`auto_weights`), where both trained reasoners' held-out EM was measured within bf16's
  paired CI.
* **gemv for few rows**: every linear layer on the CPU, native or int8, runs its passes of a
  few rows on ragfast's gemv kernel (:mod:`ragfast.ops.gemv`), which reads the weights at the
  memory's rate where oneDNN's matmul reads them at half of it; the rows per weight storage
  and ISA level are where it was measured to win (:func:`ragfast.ops.gemv.default_rows`,
  :func:`set_gemv_rows`). A w8a8 layer with packed codes runs those passes in bf16 on the packed
  codes (:func:`ragfast.ops.gemv.gemv_packed`), its MLP's gate and up as one call with the SiLU,
  and its attention's q, k and v as one (:func:`qkv_pass`).
* **prepacked bf16 weights**: a native bf16 layer's other passes run on a copy of its weight in
  oneDNN's blocked layout (:func:`pack_weight`, :func:`set_packed`), so oneDNN does not re-block
  the weight on every call (B = 64 decode 1.34x on an AMX Xeon, for the weights' bytes again).

bench/bench_decode_weights.py measures every combination, gemv on and off, in one run.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from ragfast.errors import ConfigError
from ragfast.ops.gemv import GemvWeight, gemv_packed
from ragfast.ops.w8a8 import GATE_UP_COLUMNS, MATMUL_DEPTH, PackedCodes, dequantize_sums, gate_up, interleave_gate_up, \
    matmul, matmul_available, matmul_engine, pack_codes, pack_gate_up, quantize_rows, quantize_rows_ref

#: The ``weights`` settings of :class:`~ragfast.models.generator.HFGenerator`; ``auto`` resolves to
#: one of the others per machine and model (:func:`auto_weights`).
WEIGHTS = ("auto", "native", "int8", "w8a8")
#: Rows (tokens in a forward pass) up to which an int8 layer with bf16/fp16 activations runs
#: torch's int8 kernel; more take the dequantised weight through the dtype's own matmul. The
#: kernel reads half of bf16's bytes but does its arithmetic slower than oneDNN's bf16 matmul: on
#: a Zen 4 EPYC (2 cores) it was 1.4-2x faster than bf16 F.linear at 1 row and 2.4x slower at 64.
#: With fp32 activations the kernel (fed bf16) beat fp32 F.linear at 1, 64 and 512 rows of the
#: 0.5B's projections, so those layers always take it.
KERNEL_ROWS = 16
#: Output columns per integer product in a w8a8 pass of a layer wider than twice this (the lm
#: head): 4,096 to 32,768 all ran the 0.5B's head at 35-37 ms against 50 ms in one product (64
#: rows, two threads, AMD EPYC Zen 4).
W8A8_COLUMNS = 8192


def auto_dtype(device: str = "cpu") -> str | None:
    """What ``dtype="auto"`` loads a model in on ``device``: ``"bfloat16"`` where bf16 matmuls run
    natively (a CPU with AVX512-BF16 or AMX-BF16, a CUDA GPU with bf16), else None (the
    checkpoint's).

    Why: on a CPU with bf16 instructions the default reasoner's batched turns ran 1.8x faster in
    bf16 than in fp32 with the same held-out EM (README, *Weight precision*); without them
    torch emulates bf16 through fp32 and gains nothing.
    """
    import torch

    if str(device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else None
    from ragfast.ops.machine import cpu_features

    native = {"avx512bf16", "amx-bf16"} & set(cpu_features())
    return "bfloat16" if native and _onednn_bf16() else None


def _onednn_bf16() -> bool:
    """Whether torch's oneDNN runs bf16 matmuls on this CPU (AVX-512 and up; enabled)."""
    import torch

    mkldnn = torch.backends.mkldnn
    return mkldnn.is_available() and mkldnn.enabled and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_dtype(dtype: Any, device: str = "cpu") -> Any:
    """``dtype`` (a name, ``"auto"``, a torch dtype or None) as a torch dtype; None: the checkpoint's.

    Raises
    ------
    ConfigError
        An unknown name.
    """
    import torch

    if dtype == "auto":
        dtype = auto_dtype(device)
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64}
    if str(dtype) not in names:
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of auto, {', '.join(names)}")
    return names[str(dtype)]


def quantize_int8(weight: Any) -> tuple[Any, Any]:
    """Symmetric per-output-channel int8 codes and scales of a ``[out, in]`` weight.

    Parameters
    ----------
    weight : torch.Tensor
        A floating-point ``[out_features, in_features]`` matrix.

    Returns
    -------
    (codes, scales)
        ``codes`` int8 ``[out, in]`` in [-127, 127]; ``scales`` float32 ``[out]``, with
        ``weight ≈ codes * scales[:, None]``. An all-zero row gets scale 1 (codes 0).
    """
    return quantize_rows_ref(weight)


def int8_linear_ref(x: Any, codes: Any, scales: Any, bias: Any = None) -> Any:
    """Reference: ``x @ (codes * scales)ᵀ + bias`` computed in float32, returned in ``x``'s dtype."""
    import torch

    w = codes.float() * scales.float()[:, None]
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def w8a8_linear_ref(x: Any, codes: Any, scales: Any, bias: Any = None) -> Any:
    """Reference of the ``w8a8`` pass: ``x``'s rows rounded to int8 as a weight's output channels
    are (:func:`quantize_int8`), the integer products summed exactly (float64), both scales
    applied, ``bias`` added; returned in ``x``'s dtype."""
    shape = x.shape
    xq, xs = quantize_int8(x.reshape(-1, shape[-1]))
    acc = xq.double() @ codes.double().T
    y = (acc * xs.double()[:, None] * scales.double()[None, :]).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], codes.shape[0])


@functools.lru_cache(maxsize=None)
def int8_matmul_exact() -> bool:
    """Whether torch's ``_int_mm`` gives exact int32 sums on this CPU (checked once per process).

    oneDNN's int8 matmul without VNNI or AMX (AVX2, AVX-512 before VNNI) multiplies pairs into
    saturating int16 sums, so ±127 operands come out wrong (seen with ``ONEDNN_MAX_CPU_ISA=AVX2``
    and ``AVX512_CORE`` on a Zen 4: 40-55% of random products wrong). ``w8a8`` needs exact sums.
    """
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 96), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (96, 24), generator=g, dtype=torch.int8)
    a[0], b[:, 0] = 127, -127  # the extremes: every pair's sum overflows int16 as unsigned x signed
    try:
        got = torch._int_mm(a, b)
    except RuntimeError:
        return False
    return bool(torch.equal(got.long(), a.long() @ b.long()))


def auto_weights(model: Any) -> str:
    """What ``weights="auto"`` stores ``model``'s linear layers as: ``"w8a8"`` where every one of
    its integer passes runs on ragfast's packed product (a CPU model in bf16 at a level of
    :data:`ragfast.ops.w8a8.MATMUL_LEVELS`: AMX tiles or AVX-512 VNNI; exact int8 sums, every
    linear layer's depth a multiple of 64), else ``"native"``.

    Why: on an AMX Xeon (2 vCPUs) w8a8 on tiles ran the bench's 64 Search-R1 sessions 1.10x (0.5B)
    and 1.43x (1.5B) vLLM's CPU build where native bf16 ran 0.81-0.84x, and the held-out EM of
    both trained reasoners stayed within bf16's paired 95% CI (README, *w8a8 on AMX tiles*). On a
    Zen 4 EPYC (AVX-512 VNNI) the packed VNNI product ran a batch-64 decode step of the 0.5B 1.67x
    faster than bf16 and its held-out EM stayed within bf16's paired CI (README, *Stop 58*).
    Without a packed product its products run on ``_int_mm``, which did not beat bf16 by as much
    (0.94x vLLM on the Zen 4 EPYC, 0.60x on the Xeon before the tiles), so native stays the choice there.
    """
    import torch

    params = next(model.parameters())
    if params.device.type != "cpu" or params.dtype != torch.bfloat16 or not matmul_available():
        return "native"
    depths = [m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if not depths or any(k % MATMUL_DEPTH for k in depths) or not int8_matmul_exact():
        return "native"
    return "w8a8"


def _gemv_dtypes() -> tuple:
    import torch

    return (torch.float32, torch.bfloat16)


def _gemv_fits(layer: Any, x: Any, torch: Any) -> bool:
    """Whether ``layer``'s pass over ``x`` takes its gemv: few rows, on the CPU, nothing to differentiate."""
    g = layer.ragfast_gemv
    return (g is not None and x.numel() <= layer.ragfast_gemv_rows * layer.in_features and x.device.type == "cpu"
            and (x.dtype == torch.bfloat16 or x.dtype == torch.float32)
            and not (torch.is_grad_enabled() and x.requires_grad))


@functools.lru_cache(maxsize=None)
def _decode_linear_class():
    import torch

    class DecodeLinear(torch.nn.Linear):
        """``nn.Linear`` whose passes of few rows run ragfast's gemv kernel and whose other passes
        run on its weight prepacked for oneDNN where it has one (:func:`pack_weight`); same
        parameters, same state dict; anything else, gradients included, takes ``nn.Linear``'s own
        path."""

        def forward(self, x: Any) -> Any:
            if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
                return super().forward(x)
            if _gemv_fits(self, x, torch) and self.weight.dtype == self.ragfast_gemv_dtype:
                return self.ragfast_gemv(x)
            packed = self.ragfast_packed
            if packed is not None and x.dtype == packed.dtype and x.device.type == "cpu":
                if self.ragfast_packed_version != self.weight._version:
                    pack_weight(self)  # the weight changed in place since it was packed
                    packed = self.ragfast_packed
                return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            return super().forward(x)

    return DecodeLinear


#: The rows a packed weight's layout is chosen for (oneDNN's batch-size hint). At 64 and 1,024
#: rows of the 0.5B's MLP in bf16 the layout chosen for 1,024 ran as fast as the one for 64 and
#: faster than the one for 1 (1.60x / 1.27x plain F.linear against 1.06x / 1.21x; Intel Xeon, AMX).
PACK_ROWS_HINT = 1024


def packing_supported(weight: Any) -> bool:
    """Whether ``weight`` (a CPU linear layer's) gets a copy prepacked for oneDNN: bf16 weights
    where oneDNN supports bf16 on this CPU (AVX-512 and up).

    fp32 weights are not packed: torch runs them on MKL's sgemm, which packed oneDNN beat by only
    1.04x (prefill) and 1.11x (B = 64 decode) in the generator, for twice the fp32 weights' bytes
    (Intel Xeon, AMX; bf16 gained 1.34x at B = 64).
    """
    import torch

    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_bf16()


def pack_weight(layer: Any) -> None:
    """Give a prepared native layer a copy of its weight in oneDNN's blocked layout.

    torch's matmul hands oneDNN the row-major weight, and oneDNN re-blocks it on every call: at
    64 rows that re-blocking was about a third of a bf16 projection's time (Intel Xeon, AMX). The
    copy costs the weight's bytes again in memory; its results equal ``F.linear``'s on contiguous
    inputs. The weight's version counter is kept, so an in-place change (an adapter merged later)
    repacks at the next pass.
    """
    import torch

    with torch.no_grad():
        layer.ragfast_packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_ROWS_HINT)
    layer.ragfast_packed_version = layer.weight._version


def _int8_module_class():
    import torch

    class Int8Linear(torch.nn.Module):
        """A linear layer whose weight is stored as int8 codes with one scale per output channel."""

        def __init__(self, codes: Any, scales: Any, bias: Any, act_dtype: Any, int8_acts: bool = False):
            super().__init__()
            # w8a8: passes of more than KERNEL_ROWS rows in integers; packed, every pass gemv does not take
            self.int8_acts = bool(int8_acts)
            self.register_buffer("scales32", scales.float() if int8_acts else None)
            self.register_buffer("bias32", bias.detach().float() if int8_acts and bias is not None else None)
            self.in_features, self.out_features = codes.shape[1], codes.shape[0]
            self.register_buffer("codes", codes)
            # The kernel wants the scales in the activations' dtype.
            self.register_buffer("scales", scales.to(act_dtype))
            self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))
            # torch's kernel reads past the row with bf16/fp16 inputs unless the depth is a multiple
            # of 16 (seen as wrong results and crashes at depths 8, 24 and 37, on its AVX2 and
            # AVX-512 paths alike); such a layer always multiplies the dequantised weight.
            self.kernel = self.in_features % 16 == 0
            self.kernel_rows = 1 << 62 if act_dtype == torch.float32 and not int8_acts else KERNEL_ROWS
            self.register_buffer("scales16", scales.to(torch.bfloat16 if act_dtype == torch.float32 else act_dtype))
            self.ragfast_gemv, self.ragfast_gemv_rows = None, 0  # set by apply_weights
            self.ragfast_packed = None  # w8a8's codes in the packed product's layout (set_packed)

        def forward(self, x: Any) -> Any:
            if _gemv_fits(self, x, torch):
                if self.ragfast_packed is not None and x.dtype == torch.bfloat16:
                    # the packed codes stream front to back (ops/gemv.py, gemv_packed)
                    y = gemv_packed(x, self.ragfast_packed, self.scales32, self.bias32)
                    if y is not None:
                        return y
                return self.ragfast_gemv(x)
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            packed = self.ragfast_packed is not None and matmul_available()
            if self.kernel and x2.shape[0] <= self.kernel_rows and not packed:
                # Few rows (decoding): bound by the weight bytes, which the kernel reads as int8.
                # It takes bf16 inputs for fp32 activations: its fp32 path ran 2-20x slower than
                # fp32 F.linear where its bf16 path beat bf16 F.linear (bench_decode_weights.py).
                y = torch.ops.aten._weight_int8pack_mm(x2.to(self.scales16.dtype).contiguous(), self.codes,
                                                       self.scales16).to(x.dtype)
                if self.bias is not None:
                    y = y + self.bias
                return y.reshape(*shape[:-1], self.out_features)
            if self.int8_acts and not (torch.is_grad_enabled() and x.requires_grad):
                # Many rows, bound by the arithmetic: integer multiply-adds, twice bf16's rate.
                # Both ends in one pass each (ops/w8a8.py: as torch ops they were a fifth of a
                # batch-64 decode step); the same bits as quantize_int8 and w8a8_linear_ref's order.
                xq, xs = quantize_rows(x2)  # one scale per row (token)
                n, step = self.out_features, W8A8_COLUMNS
                if packed:
                    # AMX-INT8 or VNNI on the prepacked codes, both scales applied block by block
                    # in cache: every pass gemv does not take, since torch's weight-only kernel
                    # above ran 4-16 rows 1.3-12x slower than the tiles (the 0.5B's layers, Xeon,
                    # two threads) and 1.4-4.9x slower than VNNI with its rounding of the rows
                    # (the same layers, Zen 4 EPYC).
                    y = matmul(xq, xs, self.ragfast_packed, self.scales32, self.bias32, x.dtype)
                    return y.reshape(*shape[:-1], n)
                if n <= 2 * step:
                    y = dequantize_sums(torch._int_mm(xq, self.codes.t()), xs, self.scales32, self.bias32, x.dtype)
                    return y.reshape(*shape[:-1], n)
                # A wide layer (the lm head) in column blocks, each block's int32 sums scaled into
                # its columns of the output while still in cache: the 0.5B's head took 35 ms
                # instead of 50 (64 rows, two threads, Zen 4), and no [rows x 151,936] int32 block.
                y = x2.new_empty((x2.shape[0], n))
                for lo in range(0, n, step):
                    hi = min(n, lo + step)
                    dequantize_sums(torch._int_mm(xq, self.codes[lo:hi].t()), xs, self.scales32[lo:hi],
                                    None if self.bias32 is None else self.bias32[lo:hi], out=y[:, lo:hi])
                return y.reshape(*shape[:-1], n)
            # Many rows in bf16/fp16 (prefill): bound by the arithmetic, where the kernel lost to
            # the dtype's own matmul on the weight dequantised for the call.
            w = self.codes.to(x.dtype) * self.scales[:, None]
            return torch.nn.functional.linear(x, w, self.bias)

        def extra_repr(self) -> str:
            above = f"{self.ragfast_gemv_rows} rows (packed)" if self.ragfast_packed is not None else \
                f"{self.kernel_rows} rows"
            acts = f", activations int8 per row above {above}" if self.int8_acts else ""
            return f"in_features={self.in_features}, out_features={self.out_features}, weights=int8 per-channel{acts}"

    return Int8Linear


@dataclass(frozen=True)
class WeightInfo:
    """What a generator's weights are and how many bytes a forward pass reads.

    Attributes
    ----------
    scheme : str
        ``"native"`` (the model's dtype), ``"int8"`` (weight-only int8 linear layers) or
        ``"w8a8"`` (int8 weights, and int8 activations in passes of many rows).
    linear_layers : int
        Linear layers whose weight the scheme stores (all of them for native).
    read_bytes : int
        Bytes of weights one forward pass reads: every linear layer's weights (codes and scales
        for int8, the lm head included) and the norms; the embedding table is not counted (a
        step reads one row per token).
    gemv_rows : int
        The most rows a pass runs on ragfast's gemv kernel (0: none).
    packed_layers : int
        Linear layers whose other passes run on a prepacked weight: native ones in oneDNN's
        layout, w8a8 ones' codes in the packed product's layout.
    packed_on : str
        What runs the w8a8 layers' packed product (``"AMX tiles"``, ``"AVX-512 VNNI"``; empty: none).
    """

    scheme: str
    linear_layers: int
    read_bytes: int
    gemv_rows: int = 0
    packed_layers: int = 0
    packed_on: str = ""

    def describe(self, act_dtype: str) -> str:
        """One phrase for the report's reasoner slot, e.g. ``"int8 weight-only (activations float32)"``."""
        kernel = f"; passes of <= {self.gemv_rows} rows on ragfast's gemv" if self.gemv_rows else ""
        if self.scheme == "native":
            packed = f", prepacked for oneDNN ({self.packed_layers} linear layers)" if self.packed_layers else ""
            return f"{act_dtype} weights{packed}{kernel}"
        if self.scheme == "w8a8":
            on = self.packed_on or "packed codes"
            packed = (f", {self.packed_layers} of them on {on}, which take every pass of more than "
                     f"{self.gemv_rows} rows" if self.packed_layers else "")
            return (f"int8 weights per output channel, int8 activations per token in passes of more than "
                    f"{KERNEL_ROWS} rows ({self.linear_layers} linear layers{packed}; otherwise activations "
                    f"{act_dtype}{kernel})")
        return (f"int8 weight-only, per output channel ({self.linear_layers} linear layers; activations {act_dtype}"
                f"{kernel})")


def apply_weights(model: Any, scheme: str, gemv_rows: int | None = None) -> WeightInfo:
    """Store ``model``'s linear layers as ``scheme`` says, in place, and count the bytes a pass reads.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers causal LM (its ``lm_head`` included; with tied embeddings the head gets its
        own int8 copy and the embedding table keeps the model's dtype).
    scheme : str
        One of :data:`WEIGHTS` (``"auto"``: :func:`auto_weights`).
    gemv_rows : int, optional
        Passes of up to this many rows on the CPU run ragfast's gemv kernel, which reads the
        weights of a decode step at a small batch at the memory's rate where oneDNN's matmul
        does not. Default: per weight storage and ISA level, where it was measured to win
        (:func:`ragfast.ops.gemv.default_rows`); 0, no compiled kernels, or
        ``RAGFAST_BACKEND=ref``: torch's matmul for every pass.

    Returns
    -------
    WeightInfo
    """
    import torch

    if scheme not in WEIGHTS:
        raise ConfigError(f"unknown weights {scheme!r}; expected one of {', '.join(WEIGHTS)}")
    if scheme == "auto":
        scheme = auto_weights(model)
    act_dtype = next(model.parameters()).dtype
    if scheme != "native" and act_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"int8 weights need float activations, the model is {act_dtype}")
    if scheme == "w8a8" and not int8_matmul_exact():
        raise ConfigError("--weights w8a8 needs exact int8 matmuls (AVX-512 VNNI, AVX-VNNI or AMX); torch's int8 "
                          "matmul on this CPU saturates: use --weights int8")
    cls = _int8_module_class() if scheme != "native" else None
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    read = 0
    for name, mod in targets:
        if cls is None:
            read += mod.weight.nbytes + (0 if mod.bias is None else mod.bias.nbytes)
            if (type(mod) in (torch.nn.Linear, _decode_linear_class()) and mod.weight.dtype in _gemv_dtypes()
                    and mod.weight.device.type == "cpu"):
                mod.__class__ = _decode_linear_class()  # same parameters; only forward differs
                mod.ragfast_gemv_dtype = mod.weight.dtype
                mod.ragfast_gemv, mod.ragfast_gemv_rows = GemvWeight(mod.weight, None, mod.bias), 0
                mod.ragfast_packed = None
            continue
        codes, scales = quantize_int8(mod.weight)
        new = cls(codes, scales, mod.bias, act_dtype, int8_acts=scheme == "w8a8")
        if codes.device.type == "cpu":
            new.ragfast_gemv = GemvWeight(codes, scales, new.bias)
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], new)
        read += codes.nbytes + new.scales.nbytes + (0 if new.bias is None else new.bias.nbytes)
    for m in model.modules():
        _pair_gate_up_gemv(m)
    rows = set_gemv_rows(model, gemv_rows)
    # Native bf16 layers' other passes on a copy of the weight prepacked for oneDNN, w8a8 layers'
    # on their codes in the packed product's layout (set_packed).
    packed = set_packed(model) if scheme != "int8" else 0
    # The norms' weights (the other parameters but the embedding table) are read every pass too.
    linear_params = {id(p) for _, m in targets for p in m.parameters(recurse=False)}
    embed_params = {id(p) for p in embed.parameters()} if embed is not None else set()
    for p in model.parameters():
        if id(p) not in linear_params and id(p) not in embed_params:
            read += p.nbytes
    return WeightInfo(scheme=scheme, linear_layers=len(targets), read_bytes=int(read), gemv_rows=rows,
                      packed_layers=packed, packed_on=(matmul_engine() or "") if scheme == "w8a8" and packed else "")


def set_gemv_rows(model: Any, rows: int | None = None) -> int:
    """Let ``model``'s prepared linear layers run passes of up to ``rows`` rows on gemv (0: none;
    None: :func:`ragfast.ops.gemv.default_rows` for each layer's weights).

    Returns the most rows any layer now takes on gemv: 0 where the compiled kernel is not
    available (no build, or ``RAGFAST_BACKEND=ref``) or no layer was prepared by :func:`apply_weights`.
    """
    from ragfast.ops.gemv import default_rows
    from ragfast.ops.registry import default_backend

    if rows is not None and rows < 0:
        raise ConfigError(f"gemv rows must be >= 0, got {rows}")
    off = default_backend("gemv") != "cpp"
    most = 0
    for m in model.modules():
        if getattr(m, "ragfast_gemv", None) is not None:
            m.ragfast_gemv_rows = 0 if off else default_rows(m.ragfast_gemv.weight.dtype) if rows is None else rows
            most = max(most, m.ragfast_gemv_rows)
    return most


def codes_packing_supported(codes: Any) -> bool:
    """Whether a w8a8 layer's int8 codes ``[N, K]`` can run :func:`ragfast.ops.w8a8.matmul` here:
    on the CPU at a level of :data:`ragfast.ops.w8a8.MATMUL_LEVELS`, K a multiple of 64."""
    return codes.device.type == "cpu" and codes.shape[1] % MATMUL_DEPTH == 0 and matmul_available()


def set_packed(model: Any, on: bool = True) -> int:
    """Run ``model``'s prepared layers' passes that do not take gemv on prepacked weights: a native
    layer's in oneDNN's blocked layout (:func:`pack_weight`) where oneDNN supports the weight, a
    w8a8 layer's codes in the packed product's layout (:func:`codes_packing_supported`), and an MLP's w8a8
    gate and up projections as one packed product (:func:`gate_up_pass`); or drop every packed copy
    (``on=False``: torch's own matmul, and the copies' memory back).

    Returns how many layers now have a packed weight.
    """
    n = 0
    for m in model.modules():
        if not hasattr(m, "ragfast_packed"):
            continue
        if hasattr(m, "codes"):  # an int8 layer: only w8a8's integer passes use the packed codes
            m.ragfast_packed = pack_codes(m.codes) if on and m.int8_acts and codes_packing_supported(m.codes) else None
            n += m.ragfast_packed is not None
        elif on and packing_supported(m.weight):
            pack_weight(m)
            n += 1
        else:
            m.ragfast_packed = None
    for m in model.modules():
        _pair_gate_up(m, on)  # gate and up stay counted: their passes move onto the pair's codes
        _stack_qkv(m, on)
    return n


def _stack_qkv(attn: Any, on: bool) -> bool:
    """Give an attention module whose q, k and v projections are packed w8a8 layers of one depth,
    each a whole number of 16-row column groups, their packed codes as one stack
    (``ragfast_qkv``: the codes, scales, biases and the three widths); each layer's own packed
    codes become a view of its groups in it, so nothing is held twice. Whether it did.

    A decode step of few rows then reads the three in one :func:`qkv_pass`: the input rounded once
    and one call where the two small ones (k and v: 115 KB each in the 0.5B) cost more in the call
    than in the kernel; every output equals its layer's own pass (an output row's sums do not
    depend on the others')."""
    import torch

    layers = [getattr(attn, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    stack = None
    if on and all(hasattr(t, "codes") and t.ragfast_packed is not None for t in layers) \
            and len({t.ragfast_packed.k for t in layers}) == 1 and all(t.ragfast_packed.n % 16 == 0 for t in layers):
        data = torch.cat([t.ragfast_packed.data for t in layers])
        widths, g0 = tuple(t.ragfast_packed.n for t in layers), 0
        for t, n in zip(layers, widths):
            t.ragfast_packed = PackedCodes(data[g0:g0 + n // 16], n, t.ragfast_packed.k)
            g0 += n // 16
        bias = None
        if any(t.bias32 is not None for t in layers):
            bias = torch.cat([t.bias32 if t.bias32 is not None else t.scales32.new_zeros(t.out_features) for t in layers])
        stack = (PackedCodes(data, sum(widths), layers[0].ragfast_packed.k), torch.cat([t.scales32 for t in layers]),
                 bias, widths)
    if stack is not None or getattr(attn, "ragfast_qkv", None) is not None:
        attn.ragfast_qkv = stack
    return stack is not None


def qkv_pass(attn: Any, x: Any, joint: bool = False) -> Any:
    """``(q_proj(x), k_proj(x), v_proj(x))`` as one packed gemv call (:func:`_stack_qkv`) in a pass
    the layers would run on gemv with bf16 activations; None otherwise (the caller runs the layers).
    ``joint``: the one ``[..., q + k + v]`` output and the three widths instead of three views."""
    import torch

    stack = getattr(attn, "ragfast_qkv", None)
    if stack is None or x.dtype != torch.bfloat16 or not _gemv_fits(attn.q_proj, x, torch) \
            or len({attn.q_proj.ragfast_gemv_rows, attn.k_proj.ragfast_gemv_rows, attn.v_proj.ragfast_gemv_rows}) > 1:
        return None
    y = gemv_packed(x, stack[0], stack[1], stack[2])
    if y is None:
        return None
    return (y, stack[3]) if joint else y.split(stack[3], dim=-1)


def _pair_gate_up(mlp: Any, on: bool) -> bool:
    """Give ``mlp`` its gate and up projections' codes interleaved and packed (``ragfast_gate_up``:
    the packed codes and their scales) where both are packed w8a8 layers of one shape without
    bias and a width that is a multiple of 64; their own packed copies are dropped (the pair serves
    their integer passes; alone, they take ``_int_mm``, the same bits). Whether it did."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    pair = None
    if (on and all(getattr(t, "ragfast_packed", None) is not None and hasattr(t, "codes") for t in (gate, up))
            and gate.bias is None and up.bias is None and gate.codes.shape == up.codes.shape
            and gate.out_features % GATE_UP_COLUMNS == 0):
        pair = (pack_gate_up(gate.codes, up.codes), interleave_gate_up(gate.scales32, up.scales32))
        gate.ragfast_packed = up.ragfast_packed = None
    if pair is not None or getattr(mlp, "ragfast_gate_up", None) is not None:
        mlp.ragfast_gate_up = pair
    return pair is not None


def _pair_gate_up_gemv(mlp: Any) -> bool:
    """Give ``mlp`` one gemv over its int8 gate and up projections' codes stacked
    (``ragfast_gate_up_gemv``) where both have a gemv, one shape and no bias; the two layers' codes
    become views of the stack, so no weight is held twice. Whether it did.

    A decode step of few rows then reads both matrices in one call: one call and its Python
    fewer per layer (gemv's share of a one-row step of the 0.5B went from 18.1 to 15.5 ms under
    cProfile on a 2-core Zen 4 EPYC)."""
    import torch

    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    g, u = getattr(gate, "ragfast_gemv", None), getattr(up, "ragfast_gemv", None)
    if (g is None or u is None or not hasattr(gate, "codes") or not hasattr(up, "codes") or gate.bias is not None
            or up.bias is not None or gate.codes.shape != up.codes.shape):
        return False
    n = gate.out_features
    both = torch.cat([gate.codes, up.codes])
    gate.codes, up.codes = both[:n], both[n:]
    gate.ragfast_gemv, up.ragfast_gemv = GemvWeight(gate.codes, g.scales), GemvWeight(up.codes, u.scales)
    mlp.ragfast_gate_up_gemv = GemvWeight(both, torch.cat([g.scales, u.scales]))
    return True


def gate_up_pass(mlp: Any, x: Any) -> Any:
    """``silu(mlp.gate_proj(x)) * mlp.up_proj(x)`` as one packed product (AMX tiles or VNNI:
    :func:`ragfast.ops.w8a8.gate_up`) for an MLP whose w8a8 gate and up projections
    :func:`set_packed` paired, in a pass their layers would run packed (every pass
    their gemv does not take, no gradient wanted); None otherwise (the caller runs the layers).

    The input is rounded to int8 once for both projections and no ``[rows, 2 x width]``
    intermediate is written; the values are those of the two layers followed by
    ``ragfast.ops.silu_mul``'s kernel. In a pass their gemv takes, an MLP with the stacked gemv
    (:func:`_pair_gate_up_gemv`) runs it once and the activation on its halves: the same values
    as the two layers' own gemv calls. Only for MLPs whose activation is SiLU
    (:mod:`ragfast.models.fused_layers` calls it).
    """
    import torch

    stacked, pair = getattr(mlp, "ragfast_gate_up_gemv", None), getattr(mlp, "ragfast_gate_up", None)
    if stacked is None and pair is None:
        return None  # (only prepared int8 layers have the attributes _gemv_fits reads)
    if _gemv_fits(mlp.gate_proj, x, torch):
        if mlp.up_proj.ragfast_gemv_rows != mlp.gate_proj.ragfast_gemv_rows:
            return None
        if pair is not None and x.dtype == torch.bfloat16:
            y = gemv_packed(x, pair[0], pair[1], silu=True)  # both products and the SiLU in one call
            if y is not None:
                return y
        if stacked is None:
            return None
        y = stacked(x)
        n = mlp.gate_proj.out_features
        return mlp.act_fn(y[..., :n]) * y[..., n:]
    if pair is None or not matmul_available():
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and x.requires_grad:
        return None
    xq, xs = quantize_rows(x2)
    return gate_up(xq, xs, pair[0], pair[1], x.dtype).reshape(*x.shape[:-1], pair[0].n // 2)

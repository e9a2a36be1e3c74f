"""ragfast's fused CPU kernels inside a loaded transformers model: RMSNorm and SiLU-gated MLPs.

A decoder layer of Llama / Qwen2 / Qwen3 / Mistral runs two RMSNorms and a SwiGLU MLP
(``down_proj(silu(gate_proj(x)) * up_proj(x))``). torch runs the norm as six elementwise ops and the
gate as two, each a pass over the activations; a prefill pass is long enough for those passes to
show (bench/bench_fused_layers.py measures both ops against the modules' own torch code and the
generator with and without them, in one run). :func:`set_fused_layers` makes a model's norms
call :func:`ragfast.ops.rms_norm.rms_norm` and its MLPs :func:`ragfast.ops.silu_mul.silu_mul`
(from :data:`SILU_MIN_ROWS` tokens) where a call fits (CPU, fp32 or bf16, no gradient wanted, an ISA level in :data:`FAST_LEVELS`);
every other call runs the module's own forward, which is what the model ran before. An MLP
whose w8a8 gate and up projections share one packed copy (AMX tiles, VNNI) runs both products and the SiLU as one call
(:func:`ragfast.models.weight_quant.gate_up_pass`) in the passes those layers run in integers; an
int8 MLP's gate and up read their stacked codes in one gemv call in the passes gemv takes.
"""
from __future__ import annotations

import types
from typing import Any

from ragfast.models.weight_quant import gate_up_pass

__all__ = ["FAST_LEVELS", "NORMS", "MLPS", "SILU_MIN_ROWS", "set_fused_layers", "fused_layers_on", "norm_on_kernel"]

#: ISA levels where the kernels are used: their row kernels are AVX-512; below it the portable
#: loops would stand in for torch's vectorised ops, so the modules keep torch.
FAST_LEVELS = ("avx512", "avx512vnni", "avx512bf16", "amx")
#: RMSNorm classes whose forward is ``weight * (x * rsqrt(mean(x^2) + variance_epsilon)).to(dtype)``.
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
#: MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
#: Rows (tokens in the pass) from which an MLP's gate runs on the kernel: a prefill pass. At 1,920
#: rows it ran at 1.2-1.4x torch in bf16 and 1.8-1.9x in fp32; at 64 rows (a batch-64 decode step)
#: at 0.91-0.93x in bf16 (1.2-1.7x in fp32), and at one row 0.3-0.4x (the call's Python costs more
#: than its 4,864 values). Intel Xeon (Emerald Rapids), two threads, bench/bench_fused_layers.py.
#: The norms run on their kernel at every size (1.5-4.3x there).
SILU_MIN_ROWS = 128
_MARK = "_ragfast_fused"


def _fits(x: Any, *others: Any) -> bool:
    import torch

    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(t.dtype != x.dtype for t in others):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return False  # training: autograd needs torch's ops
    from ragfast.ops.registry import cpp_module

    return cpp_module().isa_current() in FAST_LEVELS


def _norm_forward(self: Any, hidden_states: Any) -> Any:
    if _fits(hidden_states, self.weight):
        from ragfast.ops.rms_norm import rms_norm

        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def _mlp_forward(self: Any, x: Any) -> Any:
    hidden = gate_up_pass(self, x)  # int8 gate and up as one product: packed (SiLU in it) or one gemv
    if hidden is not None:
        return self.down_proj(hidden)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.numel() >= SILU_MIN_ROWS * gate.shape[-1] and _fits(gate, up):
        from ragfast.ops.silu_mul import silu_mul

        return self.down_proj(silu_mul(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def norm_on_kernel(norm: Any) -> bool:
    """Whether ``norm``'s passes over CPU fp32 / bf16 activations of its weight's dtype, with no
    gradient wanted, run ragfast's rms_norm kernel (:func:`set_fused_layers` switched it, the ISA
    level is one of :data:`FAST_LEVELS` and the op's backend is the compiled one): what a caller
    that runs the kernel itself (:mod:`ragfast.models.lean_step`) checks once."""
    from ragfast.ops.registry import cpp_module, default_backend

    return (bool(norm.__dict__.get(_MARK)) and type(norm).__name__ in NORMS and cpp_module() is not None
            and cpp_module().isa_current() in FAST_LEVELS and default_backend("rms_norm") == "cpp")


def _silu(module: Any) -> bool:
    """Whether the MLP's activation is SiLU: torch's module, or transformers' ``SiLUActivation``
    (what ``ACT2FN["silu"]`` builds: ``F.silu``)."""
    import torch

    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fused_layers_on(model: Any) -> int:
    """How many of ``model``'s modules run the fused kernels."""
    return sum(1 for m in model.modules() if m.__dict__.get(_MARK))


def set_fused_layers(model: Any, on: bool = True) -> int:
    """Run ``model``'s RMSNorms and SiLU MLPs on ragfast's kernels (``on``) or on their own code.

    Only the classes in :data:`NORMS` and :data:`MLPS` (with a SiLU activation) are switched, and
    only where the compiled extension is built; a model on a GPU is left as it is.

    Parameters
    ----------
    model : torch.nn.Module
        A loaded model.
    on : bool
        ``True``: the kernels; ``False``: the modules' own forward.

    Returns
    -------
    int
        How many modules run the kernels now.
    """
    from ragfast.ops.registry import cpp_module

    want = on and cpp_module() is not None and next(model.parameters()).device.type == "cpu"
    for m in model.modules():
        name = type(m).__name__
        fused = (name in NORMS and hasattr(m, "variance_epsilon")) or (name in MLPS and _silu(m))
        if not fused:
            continue
        if want and not m.__dict__.get(_MARK):
            m.forward = types.MethodType(_norm_forward if name in NORMS else _mlp_forward, m)
            m.__dict__[_MARK] = True
        elif not want and m.__dict__.get(_MARK):
            del m.forward
            del m.__dict__[_MARK]
    return fused_layers_on(model)

"""A decode step of a Llama / Qwen2 decoder without transformers' module walk.

At one to a few rows a decode step's kernels are short (a gemv call of the 0.5B's k projection
reads 115 KB), and what runs around them is not: transformers' model forward builds the mask, then
walks 24 decoder layers through ``nn.Module.__call__``, keyword unpacking, its deprecation and
output-capturing decorators and the hub-kernel wrappers, about 13 ms of a 37 ms one-row step of
the default reasoner in w8a8 on a 2-core Zen 4 EPYC (cProfile: the gemv calls took the rest).
:func:`lean_forward` runs the same step as a flat loop: the same modules' own ``forward``
(ragfast's fused norms, MLP and gemv where the model has them; the norms' kernel called
directly; a w8a8 layer's q, k and v projections as one packed gemv call,
:func:`ragfast.models.weight_quant.qkv_pass`, the same values), transformers' own mask, rotary
embedding and attention function, and ``apply_rotary_pos_emb``'s products (q and k rotated as
one tensor where that call gives them side by side), in the same order, so its logits and
keys/values are the model's bit for bit (tests/test_lean_step.py holds it to that). It took the
step to 27 ms (1.59x the weight-read floor) with gemv on the packed codes (README, *Stop 65*).

:func:`lean_plan` says whether a model takes it (``None`` and why not otherwise): a causal LM of
:data:`MODEL_TYPES` on the CPU whose layers are the plain decoder layers (no sliding window, no
adapter wrappers, no hooks on the model or the modules the loop calls directly), in eval mode.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from ragfast.models.fused_layers import norm_on_kernel
from ragfast.models.weight_quant import qkv_pass

__all__ = ["MODEL_TYPES", "LeanPlan", "lean_forward", "lean_plan", "why_not_lean"]

#: Model types whose decoder layer is ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` with
#: q / k / v / o projections, rotary positions on q and k, and nothing else (Qwen3 adds q / k norms).
MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class LeanPlan:
    """The modules a lean step calls, gathered once (a generator builds it per ``generate`` call).

    Attributes
    ----------
    model : torch.nn.Module
        The causal LM.
    layers : tuple
        Per decoder layer: (input norm, q, k, v, o projections, post-attention norm, MLP,
        attention module, layer index).
    rope : callable
        The modeling module's ``apply_rotary_pos_emb``.
    norms_on_kernel : bool
        Every RMSNorm of the model runs ragfast's kernel
        (:func:`ragfast.models.fused_layers.norm_on_kernel`): the step calls it directly.
    """

    model: Any
    layers: tuple
    rope: Any
    norms_on_kernel: bool = False


def why_not_lean(model: Any) -> str | None:
    """Why ``model`` does not take :func:`lean_forward` (None: it does)."""
    import torch

    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {MODEL_TYPES}"
    if model.training:
        return "the model is in training mode"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return "the model has sliding-window layers"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return "no decoder body with layers and a rotary embedding"
    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global forward hooks are registered"
    for m in (model, *body.modules()):  # the head runs through its __call__, its hooks with it
        if m._forward_hooks or m._forward_pre_hooks:
            return f"a {type(m).__name__} has forward hooks"
    for layer in body.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or getattr(attn, "sliding_window", None) is not None:
            return "a layer without plain self-attention"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(getattr(attn, name, None), "in_features"):
                return f"{name} is not a linear layer (an adapter wrapper?)"
    return None


def lean_plan(model: Any) -> LeanPlan | None:
    """The plan for :func:`lean_forward` on ``model``, or None where it does not apply.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A loaded causal LM (its weights, norms and attention set as they will run).
    """
    if why_not_lean(model) is not None:
        return None
    layers = tuple((layer.input_layernorm, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                    layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp, layer.self_attn, i)
                   for i, layer in enumerate(model.model.layers[:model.config.num_hidden_layers]))
    rope = sys.modules[type(model.model.layers[0].self_attn).__module__].apply_rotary_pos_emb
    norms = [model.model.norm] + [n for layer in layers for n in (layer[0], layer[5])]
    return LeanPlan(model, layers, rope, all(norm_on_kernel(n) for n in norms))


def _norm(norm: Any, on_kernel: bool, x: Any, c: Any, threads: int) -> Any:
    """``norm(x)``: the rms_norm kernel called directly where the module runs it (the same call
    as :func:`ragfast.ops.rms_norm.rms_norm` makes, without its per-call checks: x is a contiguous
    fp32 or bf16 residual sum of the norm's dtype), else the module's forward."""
    import torch

    if not on_kernel or x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != norm.weight.dtype \
            or not x.is_contiguous():
        return norm.forward(x)

    n = x.shape[-1]
    out = torch.empty_like(x)
    c.rms_norm(x.data_ptr(), n, norm.weight.data_ptr(), out.data_ptr(), x.numel() // n, n,
               float(norm.variance_epsilon), x.dtype == torch.bfloat16, threads)
    return out


def lean_forward(plan: LeanPlan, input_ids: Any, attention_mask: Any, position_ids: Any, cache: Any,
                 logits_to_keep: int) -> Any:
    """The logits of the last ``logits_to_keep`` tokens of a pass, as ``model(...).logits`` gives them.

    Parameters
    ----------
    plan : LeanPlan
        From :func:`lean_plan`.
    input_ids : torch.Tensor
        ``[rows, t]`` token ids.
    attention_mask : torch.Tensor
        ``[rows, cached + t]``, 1 where a token is not padding.
    position_ids : torch.Tensor
        ``[rows, t]``.
    cache : transformers.DynamicCache
        The rows' keys and values; the pass appends its own.
    logits_to_keep : int
        Positions at the end whose logits are returned.
    """
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ragfast.ops.registry import cpp_module

    model = plan.model
    cfg = model.config
    body = model.model
    c, threads = cpp_module(), torch.get_num_threads()
    with torch.no_grad():
        x = body.embed_tokens.forward(input_ids)
        mask = create_causal_mask(config=cfg, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        cos, sin = body.rotary_emb(x, position_ids)
        # q and k rotated as one tensor where the stacked projection gives them side by side:
        # rotate_half(q) * sin is q's halves swapped times sin with its first half negated, the
        # same products (negation is exact), so the same bits as apply_rotary_pos_emb.
        half = cos.shape[-1] // 2
        cos4, sin4 = cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(cfg._attn_implementation, sdpa_attention_forward)
        rows, t = input_ids.shape
        for norm1, q_proj, k_proj, v_proj, o_proj, norm2, mlp, attn, i in plan.layers:
            h = _norm(norm1, plan.norms_on_kernel, x, c, threads)
            d = attn.head_dim
            joint = qkv_pass(attn, h, joint=True)  # one packed gemv call for the three where the layers have it
            if joint is not None:
                y, (wq, wk, _) = joint
                heads = y.view(rows, t, -1, d)  # q's heads, k's, v's
                qk = heads[:, :, :(wq + wk) // d]
                qk = qk * cos4 + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin4
                q, k = qk[:, :, :wq // d].transpose(1, 2), qk[:, :, wq // d:].transpose(1, 2)
                v = heads[:, :, (wq + wk) // d:].transpose(1, 2)
            else:
                qkv = (q_proj.forward(h), k_proj.forward(h), v_proj.forward(h))
                q, k, v = (y.view(rows, t, -1, d).transpose(1, 2) for y in qkv)
                q, k = plan.rope(q, k, cos, sin)
            k, v = cache.update(k, v, i)
            o, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling, sliding_window=None)
            x = x + o_proj.forward(o.reshape(rows, t, -1).contiguous())
            x = x + mlp.forward(_norm(norm2, plan.norms_on_kernel, x, c, threads))
        x = _norm(body.norm, plan.norms_on_kernel, x, c, threads)
        return model.get_output_embeddings()(x[:, -logits_to_keep:, :])

"""LoRA adapters for the cross-encoder judge's top layers (:func:`ragfast.judges.train.documents.train_cross_judge`)."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["LoRALinear", "add_lora", "lora_factors"]


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with ``base`` frozen; B starts at zero (identity at init)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.r = int(r)
        self.scale = float(alpha) / float(r)
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x):
        return self.base(x) + (self.dropout(x) @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def add_lora(model: Any, layer_ids: Sequence[int], r: int, alpha: float, dropout: float = 0.0) -> list[str]:
    """Wrap every ``nn.Linear`` inside ``model.encoder.layer[i]`` (i in ``layer_ids``) with LoRA.

    Returns
    -------
    list of str
        The wrapped modules' names (as :func:`ragfast.judges.cross.merge_lora` expects them).
    """
    names = []
    for i in layer_ids:
        layer = model.encoder.layer[i]
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, nn.Linear):
                parent_name, _, child = name.rpartition(".")
                parent = layer.get_submodule(parent_name) if parent_name else layer
                setattr(parent, child, LoRALinear(mod, r, alpha, dropout))
                names.append(f"encoder.layer.{i}.{name}")
    return names


def lora_factors(model: Any, names: Sequence[str]) -> dict[str, Any]:
    """``{"lora.<name>.lora_A": A, "lora.<name>.lora_B": B}`` (float16 copies) of wrapped modules."""
    out = {}
    for n in names:
        m = model.get_submodule(n)
        out[f"lora.{n}.lora_A"] = m.lora_A.detach().to(torch.float16).contiguous()
        out[f"lora.{n}.lora_B"] = m.lora_B.detach().to(torch.float16).contiguous()
    return out

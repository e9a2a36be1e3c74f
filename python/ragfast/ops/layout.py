"""How a tensor's rows are handed to a C++ row kernel.

The row kernels (argmax, gemv, rms_norm, silu_mul) read ``M`` rows of ``N`` contiguous values,
``ld`` elements apart. :func:`as_rows` makes that view of any ``[..., N]`` tensor, copying only
where the strides do not allow it.
"""
from __future__ import annotations

from typing import Any

__all__ = ["as_rows"]


def as_rows(t: Any) -> tuple[Any, int]:
    """``t`` as ``[M, N]`` rows with unit column stride, and the rows' stride in elements.

    A view where ``t``'s leading dimensions and strides allow it, else a contiguous copy. The
    stride is ``N`` for a single row (its own stride says nothing then).
    """
    N = t.shape[-1]
    rows = t.reshape(-1, N)
    if rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < N):
        rows = rows.contiguous()
    return rows, (rows.stride(0) if rows.shape[0] > 1 else N)

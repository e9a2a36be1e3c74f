"""One launch configuration of one Triton kernel: the record each kernel module lists in its
``aot_specs()`` and :mod:`ragfast.kernels.aot` compiles. It lives apart from ``aot`` so that the
kernel modules need not import the compiler driver that imports them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KernelSpec:
    """One launch configuration of one kernel, as the wrapper would launch it.

    Attributes
    ----------
    kernel : str
        Name shown in the table (module.kernel).
    config : str
        Short description of the constexprs and dtypes.
    fn : Any
        The ``@triton.jit`` function.
    signature : dict
        Argument name -> Triton type (``*fp32``, ``i32``, ``constexpr``...).
    constexprs : dict
        Compile-time values.
    num_warps, num_stages : int
        Launch options.
    aligned : tuple of str
        Arguments assumed divisible by 16 (pointers from torch allocations, d % 16 == 0), as
        Triton specialises them at launch in the common case.
    """

    kernel: str
    config: str
    fn: Any
    signature: dict
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    aligned: tuple = ()

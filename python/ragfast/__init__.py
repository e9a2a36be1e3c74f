"""ragfast: fast, batched, cost-measured multi-round retrieval-augmented generation.

Runs Search-R1, S2G-style stopping, StepGap and RELOOP on the same questions, with compiled
kernels for the hot paths (C++ through pybind11 on the CPU, Triton on the GPU) and a cost
ledger that measures reasoner, retrieval, judge and NLI compute side by side.
"""
from __future__ import annotations

__version__ = "0.1.0"



def backends():
    """Which op backends are available and which each op uses (:func:`ragfast.ops.registry.backends`)."""
    from ragfast.ops.registry import backends as report

    return report()


__all__ = ["__version__", "backends"]

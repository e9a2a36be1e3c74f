"""The thin public op layer: validate, allocate, dispatch (see ``ragfast._backend``).

Each op lives in its own module ``ragfast.ops.<op>`` (one stem per op across csrc/, kernels/,
tests/ and bench/) and registers its ``ref``, ``cpp`` and ``triton`` implementations on import.
"""
from __future__ import annotations

"""The thin public op layer: validate, allocate, dispatch (see ``ragfast.ops.registry``).

Each op lives in its own module ``ragfast.ops.<op>`` (one stem per op across csrc/, ragfast/kernels/,
tests/ and bench/) and registers its ``ref``, ``cpp`` and ``triton`` implementations on import.
"""
from __future__ import annotations
from ragfast.ops import prefix_attention as _prefix_attention  # noqa: E402,F401  (registers ref/triton)
from ragfast.ops import argmax as _argmax  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import decode_attention as _decode_attention  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import prefill_attention as _prefill_attention  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import gemv as _gemv  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import policy as _policy  # noqa: E402,F401  (registers sweep/bootstrap ref/cpp)
from ragfast.ops import rms_norm as _rms_norm  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import silu_mul as _silu_mul  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops import topk_ip as _topk_ip  # noqa: E402,F401  (registers ref/cpp/triton)
from ragfast.ops import w8a8 as _w8a8  # noqa: E402,F401  (registers ref/cpp)
from ragfast.ops.topk_ip import (  # noqa: E402,F401
    QuantizedCorpus, RetrieveStep, quantize, retrieve_step, retrieve_step_ref, topk_ip, topk_ip_ref)

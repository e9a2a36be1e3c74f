"""Triton kernels of ragfast, installed as ``ragfast.kernels``.

They run on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` (fp32/fp16 only) for tests.
Each module is imported lazily by its op in ``ragfast.ops`` so that importing ragfast never
requires triton.
"""

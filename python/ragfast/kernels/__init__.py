"""Triton kernels of ragfast, installed as ``ragfast.kernels``.

They run on CUDA GPUs, and on the CPU under ``TRITON_INTERPRET=1`` for tests (bf16 tensor-core
dots are emulated there in fp32, see ``topk_scan``). Each kernel module is imported lazily by its
op in ``ragfast.ops`` so that importing ragfast never requires triton. ``aot`` compiles every
configuration for sm_80 / sm_90 on the CPU and checks registers, spills and shared memory;
``roofline`` prices each kernel call on H100 / H200.
"""

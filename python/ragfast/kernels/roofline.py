"""Roofline of each Triton kernel on H100 and H200, from its FLOPs and bytes on nominal figures.

A kernel's floor is ``max(FLOPs / peak at its precision, bytes / HBM bandwidth)``: no real run
is faster, so ``floor / measured`` is the fraction of the machine it uses. The bf16 peak and the
bandwidth are those of ``ragfast report cost``'s device table (``ragfast.accounting.projection.DEVICES``,
checked equal by tests/test_triton_compile.py); this table adds the other precisions the kernels
run at. Nominal dense figures from NVIDIA's H100 / H200 SXM datasheets: fp32 (CUDA cores)
67 TFLOP/s, TF32 494.7, bf16 989 (989.4), int8 1,979 TOPS; HBM3 3.35 TB/s, HBM3e 4.8 TB/s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GpuPeaks", "GPUS", "KernelCost", "topk_ip_cost", "prefix_attention_cost", "floor_seconds",
           "gpu_for_name"]


@dataclass(frozen=True)
class GpuPeaks:
    """Nominal dense peaks of one GPU (FLOP/s or OP/s per precision, bytes/s of HBM)."""

    name: str
    hbm_bytes_per_s: float
    fp32: float
    tf32: float
    bf16: float
    int8: float
    source: str

    def peak(self, precision: str) -> float:
        """Peak rate at ``precision`` (``fp32``, ``tf32``, ``bf16``, ``fp16`` = bf16, ``int8``)."""
        return {"fp32": self.fp32, "tf32": self.tf32, "bf16": self.bf16, "fp16": self.bf16, "int8": self.int8}[precision]


GPUS: dict[str, GpuPeaks] = {
    "h100": GpuPeaks("NVIDIA H100 SXM", 3.35e12, 67e12, 494.7e12, 989e12, 1979e12,
                     "NVIDIA H100 SXM datasheet (dense): fp32 67 TFLOP/s, TF32 494.7, BF16 989, INT8 1,979 TOPS, "
                     "3.35 TB/s HBM3"),
    "h200": GpuPeaks("NVIDIA H200 SXM", 4.8e12, 67e12, 494.7e12, 989e12, 1979e12,
                     "NVIDIA H200 SXM datasheet (dense): fp32 67 TFLOP/s, TF32 494.7, BF16 989, INT8 1,979 TOPS, "
                     "4.8 TB/s HBM3e"),
}


def gpu_for_name(device_name: str) -> GpuPeaks | None:
    """The table entry for a ``torch.cuda.get_device_name()`` string (None if not H100/H200)."""
    n = device_name.lower()
    for key in ("h200", "h100"):
        if key in n:
            return GPUS[key]
    return None


@dataclass(frozen=True)
class KernelCost:
    """Work of one kernel call: FLOPs (or integer OPs) at ``precision`` and bytes moved to/from HBM."""

    flops: float
    bytes: float
    precision: str

    @property
    def intensity(self) -> float:
        """FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else math.inf


_ELEM = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1}


def topk_ip_cost(storage: str, B: int, N: int, d: int, k: int = 10, *, fetch: int = 128,
                 block_n: int = 128, rescore_elem: int = 2) -> KernelCost:
    """One :func:`ragfast.kernels.topk_ip.topk_ip_triton` call's first round.

    fp32/fp16: one fp32 dot per (query, row) on CUDA cores. bf16: two bf16 tensor-core dots (the
    query is split in two). int8: one int8 dot. Bytes: the corpus once (int8 adds the row
    scales), the queries, the per-block candidates (score + id, written then read by the merge)
    and, for bf16/int8, the ``fetch`` re-scored rows per query.
    """
    flops = 2.0 * B * N * d * (2 if storage == "bf16" else 1)
    precision = {"fp32": "fp32", "fp16": "fp32", "bf16": "bf16", "int8": "int8"}[storage]
    nbytes = N * d * _ELEM[storage] + B * d * 4
    ksel = min(block_n, max(16, k)) if storage in ("bf16", "int8") else min(k, 64)
    nblk = math.ceil(N / block_n)
    nbytes += 2 * B * nblk * ksel * 8
    if storage == "int8":
        nbytes += N * 4
    if storage in ("bf16", "int8"):
        nbytes += B * min(N, max(fetch, 2 * k)) * d * (rescore_elem if storage == "int8" else 2)
    return KernelCost(flops, float(nbytes), precision)


def prefix_attention_cost(B: int, H: int, Hkv: int, Lq: int, Lk: int, D: int, visible: float, dtype: str = "fp16"
                          ) -> KernelCost:
    """One prefix-attention forward: ``visible`` (query, key) pairs summed over the batch and one
    head, each costing a QK and a PV product of D multiply-adds per head. Bytes: Q, O once per
    head, K, V once per key/value head."""
    e = _ELEM[dtype]
    flops = 4.0 * H * D * visible
    nbytes = e * (2 * B * H * Lq * D + 2 * B * Hkv * Lk * D) + 8 * B * Lq
    return KernelCost(flops, float(nbytes), "fp32" if dtype == "fp32" else "bf16")


def floor_seconds(cost: KernelCost, gpu: GpuPeaks) -> float:
    """The roofline floor: ``max(FLOPs / peak, bytes / bandwidth)``."""
    return max(cost.flops / gpu.peak(cost.precision), cost.bytes / gpu.hbm_bytes_per_s)

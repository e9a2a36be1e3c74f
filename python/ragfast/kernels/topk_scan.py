"""Triton inner-product top-k, the scan: per-block candidates in one kernel, and the exact merge.

Each program scores a ``BLOCK_Q x BLOCK_N`` tile (queries x corpus rows) with ``tl.dot`` over
``BLOCK_D`` slices of d, masks excluded / sub-threshold / NaN scores to -inf, and extracts the
tile's best ``KSEL`` per query (repeated max + leftmost argmax, so equal scores leave in
ascending id order). The ``[B, N]`` score matrix is never written: only
``B x ceil(N / BLOCK_N) x KSEL`` candidates are.

Four modes (``MODE``, a compile-time constant):

0. exact: fp32 / fp16 / bf16 rows widened to fp32, ``input_precision="ieee"`` (fp32 on CUDA
   cores; TF32 would be the GPU default). The candidates' stable sort gives the final k.
1. bf16 tensor cores: the fp32 query is split into ``q_hi + q_lo`` (both bf16) and each tile is
   scored by two bf16 ``tl.dot`` with fp32 accumulation; the residual ``q - q_hi - q_lo`` is
   below 2^-16 of ``|q|``, so the first pass is within a small, computed bound of the exact score.
2. int8 tensor cores: the query is quantised to int8 codes with one scale per query
   (``max|q| / 127``, the corpus's own per-row rule), codes x codes go through an int8 dot with
   int32 accumulation (exact), and ``acc * q_scale * row_scale`` is the first-pass score.
3. exact over int8 codes: rows dequantised in registers (``code * scale`` in fp32, the same
   product :meth:`QuantizedCorpus.dequantize` forms) and scored as in mode 0.

Modes 1 and 2 are approximate first passes. :mod:`ragfast.kernels.topk_ip` turns them into exact
results: it re-scores the over-fetched candidates exactly and proves, per query, that no row
left out can reach the k-th exact score (the bound is built from the norms the kernel reports);
queries it cannot certify are searched again with more candidates, then by the exact mode.

Runs on CUDA, or on the CPU under ``TRITON_INTERPRET=1`` (the tests). Triton 3.9's interpreter
multiplies the raw bit patterns of bf16 tensors in ``tl.dot``, so under the interpreter mode 1
widens its bf16 operands to fp32 first (``EMULATE``): the arithmetic is the same, as a product of
two bf16 numbers is exact in fp32 and the sum is accumulated in fp32 either way.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

EXACT, BF16_TC, INT8_TC, INT8_EXACT = 0, 1, 2, 3
MODE_NAMES = {EXACT: "exact-fp32", BF16_TC: "bf16-tc", INT8_TC: "int8-tc", INT8_EXACT: "exact-int8"}


@triton.jit
def _topk_ip_block_kernel(
    q_ptr, q2_ptr, c_ptr, cs_ptr, ex_ptr, out_s_ptr, out_i_ptr, norm_ptr,
    B, N, D, E, stride_cn, min_score, NBLK, KSEL,
    MODE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_n = tl.program_id(1)
    rq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    qmask = rq < B
    nmask = rn < N
    # 64-bit offsets: N * stride passes 2^31 from about 2.8M rows of 768 dims.
    c_rows = c_ptr + rn.to(tl.int64)[:, None] * stride_cn
    q_rows = rq.to(tl.int64)[:, None] * D
    if MODE == 2:
        acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.int32)
        n2 = tl.zeros((BLOCK_N,), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_Q, BLOCK_N), dtype=tl.float32)
        n2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if MODE == 3:
        cs = tl.load(cs_ptr + rn, mask=nmask, other=0.0)
    for d0 in range(0, D, BLOCK_D):
        rd = d0 + tl.arange(0, BLOCK_D)
        dmask = rd < D
        qm = qmask[:, None] & dmask[None, :]
        ct = tl.load(c_rows + rd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        if MODE == 0:
            qt = tl.load(q_ptr + q_rows + rd[None, :], mask=qm, other=0.0)
            acc += tl.dot(qt, tl.trans(ct.to(tl.float32)), input_precision="ieee")
        elif MODE == 1:
            qh = tl.load(q_ptr + q_rows + rd[None, :], mask=qm, other=0.0)
            ql = tl.load(q2_ptr + q_rows + rd[None, :], mask=qm, other=0.0)
            cf = ct.to(tl.float32)
            n2 += tl.sum(cf * cf, axis=1)
            if EMULATE:
                acc += tl.dot(qh.to(tl.float32), tl.trans(cf), input_precision="ieee")
                acc += tl.dot(ql.to(tl.float32), tl.trans(cf), input_precision="ieee")
            else:
                acc = tl.dot(qh, tl.trans(ct), acc)
                acc = tl.dot(ql, tl.trans(ct), acc)
        elif MODE == 2:
            qt = tl.load(q_ptr + q_rows + rd[None, :], mask=qm, other=0)
            ci = ct.to(tl.int32)
            n2 += tl.sum(ci * ci, axis=1)
            acc = tl.dot(qt, tl.trans(ct), acc, out_dtype=tl.int32)
        else:
            qt = tl.load(q_ptr + q_rows + rd[None, :], mask=qm, other=0.0)
            cf = ct.to(tl.float32) * cs[:, None]
            acc += tl.dot(qt, tl.trans(cf), input_precision="ieee")
    neg = float("-inf")
    valid = qmask[:, None] & nmask[None, :]
    if MODE == 0 or MODE == 3:
        s = acc
        valid = valid & (s == s) & (s >= min_score)  # s == s drops NaN
    else:
        if MODE == 1:
            s = acc
            nrm = tl.sqrt(n2)
        else:
            rs = tl.load(cs_ptr + rn, mask=nmask, other=0.0)
            qs = tl.load(q2_ptr + rq, mask=qmask, other=0.0)
            s = acc.to(tl.float32) * qs[:, None] * rs[None, :]
            nrm = tl.sqrt(n2.to(tl.float32)) * rs
        # A NaN first-pass score is unknown, not low: rank it first so that it is re-scored.
        s = tl.where(s == s, s, float("inf"))
        # A row holding a NaN is never a hit (and always a candidate, above): no bound needed.
        nrm = tl.where(nmask & (nrm == nrm), nrm, 0.0)
        if pid_q == 0:
            tl.store(norm_ptr + pid_n, tl.max(nrm, axis=0))
    for e in range(0, E):
        xid = tl.load(ex_ptr + rq.to(tl.int64) * E + e, mask=qmask, other=-1)
        valid = valid & (rn[None, :] != xid[:, None])
    s = tl.where(valid, s, neg)
    cols = tl.arange(0, BLOCK_N)
    base = (rq.to(tl.int64) * NBLK + pid_n) * KSEL
    # KSEL is a run-time count (not unrolled), so one compiled kernel serves every k.
    for t in range(0, KSEL):
        best = tl.max(s, axis=1)
        arg = tl.argmax(s, axis=1, tie_break_left=True)
        ids = tl.where(best > neg, pid_n * BLOCK_N + arg, -1)
        tl.store(out_s_ptr + base + t, best, mask=qmask)
        tl.store(out_i_ptr + base + t, ids, mask=qmask)
        s = tl.where(cols[None, :] == arg[:, None], neg, s)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the top-k kernel (what the AOT check compiles)."""

    block_q: int
    block_n: int
    block_d: int
    num_warps: int = 4
    num_stages: int = 3


# Two tiles per mode, picked by batch: 16 queries (the smallest tl.dot edge) for B <= 16, where
# the scan is bound by reading the corpus, and 64 for larger batches, where it is bound by the
# dot. Mode 0's fp32 CUDA-core dot keeps BLOCK_D = 32 (as the original kernel); the tensor-core
# modes read 64-wide slices (128 B of bf16 per row, one 128-byte line). All fit the sm_80
# shared-memory limit with room to spare (tests/test_triton_compile.py checks them).
# The 64-query tiles run 8 warps: with 4, the AOT check measured spills on sm_80 / sm_90 for the
# widened fp16 / bf16 / int8 exact tiles (492-700 B) and the int8 tensor-core tile (104 B on
# sm_90); with 8 they take 147-254 registers and spill nothing. The 16-query exact tiles keep 2
# pipeline stages: with 3 the bf16 one spilled 4 B on sm_100 (2 stages: 168 registers, none).
CONFIGS: dict[int, tuple[TileConfig, TileConfig]] = {
    EXACT: (TileConfig(16, 64, 32, num_stages=2), TileConfig(64, 64, 32, num_warps=8)),
    BF16_TC: (TileConfig(16, 128, 64), TileConfig(64, 128, 64, num_warps=8)),
    INT8_TC: (TileConfig(16, 128, 64), TileConfig(64, 128, 64, num_warps=8)),
    INT8_EXACT: (TileConfig(16, 64, 32, num_stages=2), TileConfig(64, 64, 32, num_warps=8)),
}
SMALL_BATCH = 16
# Row dtypes each mode scans (the corpus pointer's type in the compiled kernel).
MODE_DTYPES: dict[int, tuple[torch.dtype, ...]] = {
    EXACT: (torch.float32, torch.float16, torch.bfloat16),
    BF16_TC: (torch.bfloat16,),
    INT8_TC: (torch.int8,),
    INT8_EXACT: (torch.int8,),
}


def choose_config(mode: int, batch: int) -> TileConfig:
    """The tile the wrapper launches for ``batch`` queries in ``mode``."""
    small, large = CONFIGS[mode]
    return small if batch <= SMALL_BATCH else large


def interpreted() -> bool:
    """True when Triton runs kernels on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass
class ScanResult:
    """Per-block candidates of one launch.

    Attributes
    ----------
    scores : torch.Tensor
        ``[B, nblk, ksel]`` float32 (first-pass scores in modes 1 and 2), -inf fill.
    ids : torch.Tensor
        ``[B, nblk, ksel]`` int32 row ids, -1 fill.
    norms : torch.Tensor or None
        ``[nblk]`` float32: each block's largest row norm (modes 1 and 2 only).
    """

    scores: torch.Tensor
    ids: torch.Tensor
    norms: torch.Tensor | None


def scan(mode: int, q: torch.Tensor, q2: torch.Tensor | None, rows: torch.Tensor, row_scale: torch.Tensor | None,
         ksel: int, *, min_score: float | None = None, exclude: torch.Tensor | None = None,
         config: TileConfig | None = None, out: ScanResult | None = None) -> ScanResult:
    """Launch the block kernel once.

    Parameters
    ----------
    mode : int
        ``EXACT``, ``BF16_TC``, ``INT8_TC`` or ``INT8_EXACT``.
    q : torch.Tensor
        ``[B, d]`` contiguous: fp32 (modes 0, 3), bf16 ``q_hi`` (mode 1), int8 codes (mode 2).
    q2 : torch.Tensor or None
        Mode 1: bf16 ``q_lo`` ``[B, d]``; mode 2: fp32 query scales ``[B]``.
    rows : torch.Tensor
        ``[N, d]`` with unit stride inside a row (any row stride).
    row_scale : torch.Tensor or None
        ``[N]`` fp32 per-row scales (modes 2, 3).
    ksel : int
        Candidates kept per query and block (``1 <= ksel <= block_n``).
    out : ScanResult, optional
        Buffers to write (``[B, nblk, ksel]`` scores and ids, ``[nblk]`` norms); the tests pass
        poisoned ones to check that every slot is written.
    """
    B, D = q.shape
    N = rows.shape[0]
    dev = rows.device
    cfg = config or choose_config(mode, B)
    ksel = max(1, min(int(ksel), cfg.block_n))
    nblk = triton.cdiv(N, cfg.block_n)
    if out is None:
        cand_s = torch.empty((B, nblk, ksel), dtype=torch.float32, device=dev)
        cand_i = torch.empty((B, nblk, ksel), dtype=torch.int32, device=dev)
        norms = torch.empty((nblk,), dtype=torch.float32, device=dev)
    else:
        cand_s, cand_i, norms = out.scores, out.ids, out.norms
        if cand_s.shape != (B, nblk, ksel) or cand_i.shape != (B, nblk, ksel) or norms.shape != (nblk,):
            raise ValueError(f"out buffers must be [{B}, {nblk}, {ksel}] and [{nblk}]")
    if exclude is not None and exclude.numel():
        ex = exclude.to(device=dev, dtype=torch.int64).contiguous()
        E = ex.shape[1]
    else:
        ex = torch.full((1,), -1, dtype=torch.int64, device=dev)
        E = 0
    dummy = torch.zeros((1,), dtype=torch.float32, device=dev)
    grid = (triton.cdiv(B, cfg.block_q), nblk)
    _topk_ip_block_kernel[grid](
        q, q2 if q2 is not None else dummy, rows, row_scale if row_scale is not None else dummy,
        ex, cand_s, cand_i, norms,
        B, N, D, E, rows.stride(0), -math.inf if min_score is None else float(min_score), nblk, ksel,
        MODE=mode, EMULATE=interpreted(),
        BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return ScanResult(cand_s, cand_i, norms if mode in (BF16_TC, INT8_TC) else None)


def merge_exact(res: ScanResult, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Final top-k of an exact scan (modes 0, 3) whose blocks kept ``min(k, block_n)`` each.

    Candidates are laid out block by block (ascending ids), each block's best-first with equal
    scores in ascending id order, so a stable descending sort keeps the tie rule.
    """
    B = res.scores.shape[0]
    cs = res.scores.reshape(B, -1)
    ci = res.ids.reshape(B, -1)
    vals, order = torch.sort(cs, dim=1, descending=True, stable=True)
    vals = vals[:, :k].contiguous()
    ids = torch.gather(ci, 1, order[:, :k]).to(torch.int64)
    empty = vals == -math.inf
    return vals, ids.masked_fill(empty, -1).contiguous()


def topk_exact(q: torch.Tensor, rows: torch.Tensor, k: int, *, row_scale: torch.Tensor | None = None,
               min_score: float | None = None, exclude: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k in fp32 (mode 0 over float rows, mode 3 over int8 codes with ``row_scale``)."""
    mode = INT8_EXACT if rows.dtype == torch.int8 else EXACT
    cfg = choose_config(mode, q.shape[0])
    res = scan(mode, q.float().contiguous(), None, rows, row_scale, min(k, cfg.block_n), min_score=min_score,
               exclude=exclude, config=cfg)
    return merge_exact(res, k)


TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8"}


def aot_specs() -> list:
    """Every configuration :func:`scan` can launch on a GPU (for :mod:`ragfast.kernels.aot`):
    each mode x row dtype x tile; ``KSEL`` and sizes are run-time values."""
    from ragfast.kernels.spec import KernelSpec

    q_type = {EXACT: "*fp32", BF16_TC: "*bf16", INT8_TC: "*i8", INT8_EXACT: "*fp32"}
    q2_type = {EXACT: "*fp32", BF16_TC: "*bf16", INT8_TC: "*fp32", INT8_EXACT: "*fp32"}
    specs = []
    for mode, dtypes in MODE_DTYPES.items():
        for dt in dtypes:
            for cfg in CONFIGS[mode]:
                sig = {"q_ptr": q_type[mode], "q2_ptr": q2_type[mode], "c_ptr": "*" + TRITON_TYPE[dt],
                       "cs_ptr": "*fp32", "ex_ptr": "*i64", "out_s_ptr": "*fp32", "out_i_ptr": "*i32",
                       "norm_ptr": "*fp32", "B": "i32", "N": "i32", "D": "i32", "E": "i32", "stride_cn": "i32",
                       "min_score": "fp32", "NBLK": "i32", "KSEL": "i32", "MODE": "constexpr",
                       "EMULATE": "constexpr", "BLOCK_Q": "constexpr", "BLOCK_N": "constexpr",
                       "BLOCK_D": "constexpr"}
                consts = {"MODE": mode, "EMULATE": False, "BLOCK_Q": cfg.block_q, "BLOCK_N": cfg.block_n,
                          "BLOCK_D": cfg.block_d}
                specs.append(KernelSpec(
                    "topk_scan._topk_ip_block_kernel",
                    f"{MODE_NAMES[mode]} {TRITON_TYPE[dt]} {cfg.block_q}x{cfg.block_n}x{cfg.block_d} w{cfg.num_warps}",
                    _topk_ip_block_kernel, sig, consts, cfg.num_warps, cfg.num_stages,
                    aligned=("q_ptr", "q2_ptr", "c_ptr", "cs_ptr", "ex_ptr", "out_s_ptr", "out_i_ptr", "norm_ptr",
                             "D", "stride_cn")))
    return specs

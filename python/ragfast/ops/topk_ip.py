"""Exact (and quantised) inner-product top-k over a corpus, and the fused retrieval round.

``topk_ip`` scores every query against every corpus row and keeps a running top-k per query;
the compiled backends never materialise the ``[B, N]`` score matrix (only the reference does).
Results are sorted by descending score, ties broken by the lower row id. A slot that cannot be
filled (fewer valid rows than ``k`` after ``exclude`` and ``min_score``) holds id ``-1`` and
score ``-inf``. A corpus row whose score is NaN or ``-inf`` is never a hit.

Corpus storage: a float32/float16/bfloat16 tensor, or a :class:`QuantizedCorpus` made by
:func:`quantize` (fp16, bf16, or int8 with a per-vector scale).

Backends (``ragfast.ops.registry``): ``ref`` (torch, the oracle and fallback), ``cpp``
(``ragfast._C.topk_ip``: OpenMP kernels compiled per ISA level, generic / AVX2+FMA / AVX-512 /
AVX-512 with VNNI / with BF16 and VNNI, the level chosen at import from the running CPU or ``RAGFAST_ISA``),
``triton`` (``ragfast.kernels.topk_ip``: per-block candidates, then a merge; fp32/fp16 exact,
bf16/int8 through tensor cores with certified exact re-scoring). By default on CPU a measured
table picks, per level, storage and batch size, between the compiled kernels and torch mm + topk
(:mod:`ragfast.ops.topk_ip_choice`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ragfast.ops.machine import last_level_cache_bytes
from ragfast.ops.registry import register, resolve
from ragfast.checks import check_k, check_min_score
from ragfast.ops.topk_ip_bf16 import bf16_bound_ok, topk_ip_torch_bf16
from ragfast.ops.topk_ip_choice import calibrate, machine_table
from ragfast.ops.topk_ip_choice import choose as choose_path

__all__ = [
    "QuantizedCorpus",
    "quantize",
    "topk_ip",
    "topk_ip_ref",
    "RetrieveStep",
    "retrieve_step",
    "retrieve_step_ref",
    "default_path",
    "topk_ip_torch",
    "isa_level",
    "calibrate_default_path",
]

_STORAGE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8"}
_TORCH_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class QuantizedCorpus:
    """A corpus stored at reduced precision, accepted by :func:`topk_ip` in place of a tensor.

    Attributes
    ----------
    data : torch.Tensor
        ``[N, d]`` storage: float16, bfloat16, or int8 codes.
    dtype : str
        ``"fp16"``, ``"bf16"`` or ``"int8"``.
    scale : torch.Tensor or None
        int8 only: ``[N]`` float32 per-vector scale; row ``i`` is ``data[i] * scale[i]``.
    rowsum : torch.Tensor or None
        int8 only: ``[N]`` int32 sums of each row's codes. The VNNI kernel multiplies unsigned
        query bytes (code + 128) by signed corpus bytes and subtracts ``128 * rowsum`` (the
        other ISA levels do not need it).
    rescore : torch.Tensor or None
        int8 only: an ``[N, d]`` fp16/bf16/fp32 copy of the vectors. The int8 scan over-fetches
        ``oversample * k`` candidates and re-scores them exactly against this copy with the
        fp32 query. Memory trade-off: int8 + fp16 copy is 3 bytes/dim (fp32 is 4), but a search
        reads only the 1 byte/dim codes plus ``oversample * k`` rows of the copy. Without a copy
        (``quantize(..., rescore=None)``: 1 byte/dim) the candidates are re-scored against the
        dequantised codes, which removes the query's quantisation error but not the corpus's.
    oversample : int
        Candidates fetched per requested result by the approximate first pass (bf16 and int8).
    """

    data: torch.Tensor
    dtype: str
    scale: torch.Tensor | None = None
    rowsum: torch.Tensor | None = None
    rescore: torch.Tensor | None = None
    oversample: int = 1

    @property
    def dim(self) -> int:
        return int(self.data.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __len__(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held, the re-score copy included."""
        n = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.rowsum, self.rescore):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    @property
    def scan_bytes(self) -> int:
        """Bytes one full scan reads (codes and per-row metadata; not the re-score rows)."""
        n = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.rowsum):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    def dequantize(self) -> torch.Tensor:
        """The ``[N, d]`` float32 vectors these codes stand for."""
        if self.dtype == "int8":
            return self.data.float() * self.scale[:, None]
        return self.data.float()


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x)
    raise TypeError(f"{what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def quantize(corpus: Any, dtype: str = "bf16", *, rescore: str | None = "fp16",
             oversample: int | None = None) -> QuantizedCorpus:
    """Store a corpus at reduced precision for :func:`topk_ip`.

    Parameters
    ----------
    corpus : torch.Tensor or numpy.ndarray
        ``[N, d]`` floating-point vectors.
    dtype : {"fp16", "bf16", "int8"}
        Storage. fp16 is scanned exactly (converted to fp32 in registers). bf16 is scanned with
        the AVX-512 BF16 dot product where the CPU has it (the query rounded to bf16 too); from
        a few queries up, the packed kernels quantise each 64-row tile on the fly (AVX-512 VNNI:
        int8 codes; AVX2: int16 codes) and the kernel doubles the over-fetch; otherwise bf16 is
        widened to fp32. The candidates are then re-scored with the fp32 query, so final scores
        are exact for the stored vectors. int8 uses a symmetric
        per-vector scale ``max|x| / 127`` and the VNNI dot product (AVX2: ``vpmaddwd`` on
        int16-widened codes).
    rescore : {"fp16", "bf16", "fp32", None}
        int8 only: the copy the over-fetched candidates are re-scored against (see
        :class:`QuantizedCorpus` for the memory trade-off). ``"fp32"`` keeps a reference to the
        input when it is already contiguous float32 (no copy).
    oversample : int, optional
        Candidates per result fetched by the approximate pass. Default 4 for int8, 2 for bf16,
        1 for fp16.

    Returns
    -------
    QuantizedCorpus

    Examples
    --------
    >>> qc = quantize(torch.nn.functional.normalize(torch.randn(1000, 64), dim=1), "int8")
    >>> scores, ids = topk_ip(torch.randn(2, 64), qc, 10)
    """
    x = _as_tensor(corpus, "corpus")
    if x.ndim != 2:
        raise ValueError(f"corpus must be 2-D [N, d], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"corpus must be floating point to quantize, got {x.dtype}")
    if dtype not in ("fp16", "bf16", "int8"):
        raise ValueError(f"dtype must be 'fp16', 'bf16' or 'int8', got {dtype!r}")
    if oversample is None:
        oversample = {"int8": 4, "bf16": 2, "fp16": 1}[dtype]
    if int(oversample) < 1:
        raise ValueError(f"oversample must be >= 1, got {oversample}")
    if dtype in ("fp16", "bf16"):
        return QuantizedCorpus(x.to(_TORCH_DTYPE[dtype]).contiguous(), dtype, oversample=int(oversample))
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).contiguous()
    codes = torch.round(xf / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    rowsum = codes.sum(dim=1, dtype=torch.int32).contiguous()
    if rescore is None:
        copy = None
    elif rescore in ("fp16", "bf16"):
        copy = x.to(_TORCH_DTYPE[rescore]).contiguous()
    elif rescore == "fp32":
        copy = x if (x.dtype == torch.float32 and x.is_contiguous()) else x.float().contiguous()
    else:
        raise ValueError(f"rescore must be 'fp16', 'bf16', 'fp32' or None, got {rescore!r}")
    return QuantizedCorpus(codes, "int8", scale=scale, rowsum=rowsum, rescore=copy, oversample=int(oversample))


# ----------------------------------------------------------------------------- validation


def _corpus_info(corpus: Any) -> tuple[int, int, str, torch.device]:
    if isinstance(corpus, QuantizedCorpus):
        return corpus.shape[0], corpus.shape[1], corpus.dtype, corpus.device
    t = corpus
    if t.ndim != 2:
        raise ValueError(f"corpus must be 2-D [N, d], got shape {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"corpus dtype must be float32, float16 or bfloat16 (or a QuantizedCorpus), got {t.dtype}")
    return int(t.shape[0]), int(t.shape[1]), _STORAGE[t.dtype], t.device


def _all_finite(x: torch.Tensor) -> bool:
    # numpy on CPU: 4.5 us against torch.isfinite(x).all()'s 18 us at 4 x 768 (a composite of
    # several ops), paid on every call (process time, AMD EPYC Zen 3)
    if x.device.type == "cpu":
        return bool(np.isfinite(x.detach().numpy()).all())
    return bool(torch.isfinite(x).all())


def _check_queries(queries: Any) -> torch.Tensor:
    q = _as_tensor(queries, "queries")
    if q.ndim != 2:
        raise ValueError(f"queries must be 2-D [B, d], got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise TypeError(f"queries must be floating point (float32 preferred), got {q.dtype}")
    if q.dtype != torch.float32:
        q = q.float()
    if q.numel() and not _all_finite(q):
        raise ValueError("queries contain NaN or inf; every query coordinate must be finite")
    return q


def _normalize_exclude(exclude: Any, B: int, N: int, device: torch.device) -> torch.Tensor | None:
    """A padded ``[B, E]`` int64 tensor (-1 = padding), or None when nothing is excluded."""
    if exclude is None:
        return None
    if isinstance(exclude, np.ndarray) and exclude.ndim == 2:
        exclude = torch.from_numpy(exclude)
    if isinstance(exclude, torch.Tensor):
        if exclude.ndim != 2 or exclude.shape[0] != B:
            raise ValueError(f"exclude tensor must be [B={B}, E], got shape {tuple(exclude.shape)}")
        if exclude.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"exclude must hold integer ids, got {exclude.dtype}")
        ex = exclude.to(device=device, dtype=torch.int64).contiguous()
    else:
        if not isinstance(exclude, Sequence) or len(exclude) != B:
            n = len(exclude) if hasattr(exclude, "__len__") else "?"
            raise ValueError(f"exclude must be a list of B={B} id sequences (or a [B, E] tensor), got {n}")
        rows = []
        for i, e in enumerate(exclude):
            a = np.asarray([] if e is None else e, dtype=np.int64).reshape(-1) if not isinstance(e, torch.Tensor) \
                else e.detach().cpu().to(torch.int64).reshape(-1).numpy()
            rows.append(a)
        E = max((len(a) for a in rows), default=0)
        buf = np.full((B, E), -1, dtype=np.int64)
        for i, a in enumerate(rows):
            buf[i, : len(a)] = a
        ex = torch.from_numpy(buf).to(device)
    if ex.numel():
        lo, hi = int(ex.min()), int(ex.max())
        if lo < -1 or hi >= N:
            raise ValueError(f"exclude ids must lie in [0, N={N}) (or be -1 padding); got range [{lo}, {hi}]")
        if hi < 0:
            return None
    else:
        return None
    return ex


def _validate(queries: Any, corpus: Any, k: Any, min_score: Any, exclude: Any):
    if isinstance(corpus, np.ndarray):
        corpus = torch.from_numpy(corpus)
    if not isinstance(corpus, (torch.Tensor, QuantizedCorpus)):
        raise TypeError(f"corpus must be a torch.Tensor, numpy.ndarray or QuantizedCorpus, got {type(corpus).__name__}")
    N, d, _, cdev = _corpus_info(corpus)
    q = _check_queries(queries)
    if N == 0:
        raise ValueError("corpus is empty (N = 0): nothing to search")
    if q.shape[1] != d:
        raise ValueError(f"dimension mismatch: queries have d={q.shape[1]}, corpus rows have d={d}")
    k = check_k(k, N, size=f"the corpus size N={N}", type_error=TypeError)
    min_score = check_min_score(min_score, finite=False)
    if q.device != cdev:
        if q.device.type == "cpu" and cdev.type != "cpu":
            q = q.to(cdev)
        else:
            raise ValueError(f"queries are on {q.device} but the corpus is on {cdev}")
    ex = _normalize_exclude(exclude, q.shape[0], N, cdev)
    return q, corpus, k, min_score, ex


# ----------------------------------------------------------------------------- reference


def _dense(corpus: torch.Tensor | QuantizedCorpus) -> torch.Tensor:
    """The fp32 vectors the final scores are computed against."""
    if isinstance(corpus, QuantizedCorpus):
        if corpus.dtype == "int8" and corpus.rescore is not None:
            return corpus.rescore.float()
        return corpus.dequantize()
    return corpus.float()


def _select(scores: torch.Tensor, k: int, min_score: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a dense score matrix: descending score, ties by lower id, -1/-inf for empties."""
    s = scores.float()
    s = s.masked_fill(torch.isnan(s), -math.inf)
    if min_score is not None:
        s = s.masked_fill(s < min_score, -math.inf)
    # A stable descending sort keeps equal scores in ascending id order: the tie rule.
    vals, idx = torch.sort(s, dim=1, descending=True, stable=True)
    vals, idx = vals[:, :k].contiguous(), idx[:, :k].to(torch.int64)
    empty = vals == -math.inf
    return vals.masked_fill(empty, -math.inf), idx.masked_fill(empty, -1).contiguous()


def _ref_impl(q: torch.Tensor, corpus, k: int, min_score: float | None, exclude: torch.Tensor | None):
    s = q.float() @ _dense(corpus).to(q.device).T
    if exclude is not None:
        rows = torch.arange(q.shape[0], device=s.device)[:, None].expand_as(exclude)
        keep = exclude >= 0
        s[rows[keep], exclude[keep]] = -math.inf
    return _select(s, k, min_score)


def topk_ip_ref(queries: Any, corpus: Any, k: int, *, min_score: float | None = None,
                exclude: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference :func:`topk_ip` in plain torch: the full score matrix, then a stable sort.

    Same parameters and results as :func:`topk_ip`; it materialises ``[B, N]`` scores, so use
    it as the oracle and fallback, not at scale. For an int8 :class:`QuantizedCorpus` it scores
    against the re-score copy when there is one (else the dequantised codes), which is what the
    compiled int8 path's final scores are.
    """
    q, corpus, k, min_score, ex = _validate(queries, corpus, k, min_score, exclude)
    return _ref_impl(q, corpus, k, min_score, ex)


# ----------------------------------------------------------------------------- C++ backend

_KIND = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3}


def _np_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view (bf16/fp16 as 16-bit integers, strides kept)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.detach().numpy()


def _rows_unit_stride(t: torch.Tensor) -> torch.Tensor:
    # The kernels walk rows with an arbitrary row stride but need unit stride inside a row;
    # anything else (a transposed view, a column slice with step) is copied once here.
    if t.shape[1] > 1 and t.stride(1) != 1:
        return t.contiguous()
    return t


def _cpp_impl(q: torch.Tensor, corpus, k: int, min_score: float | None, exclude: torch.Tensor | None,
              out: tuple[torch.Tensor, torch.Tensor] | None = None, threads: int = 0):
    from ragfast import _C

    B = q.shape[0]
    q = q.contiguous()
    if isinstance(corpus, QuantizedCorpus):
        kind = corpus.dtype
        data = _rows_unit_stride(corpus.data)
        scale = corpus.scale.contiguous().numpy() if corpus.scale is not None else None
        rowsum = corpus.rowsum.contiguous().numpy() if corpus.rowsum is not None else None
        rescore = _rows_unit_stride(corpus.rescore) if corpus.rescore is not None else None
        rkind = _KIND[_STORAGE[rescore.dtype]] if rescore is not None else -1
        rescore = _np_view(rescore) if rescore is not None else None
        fetch = min(len(corpus), k * corpus.oversample) if kind in ("bf16", "int8") else k
    else:
        kind = _STORAGE[corpus.dtype]
        data = _rows_unit_stride(corpus)
        scale = rowsum = rescore = None
        rkind = -1
        # a bare bf16 tensor gets quantize()'s default bf16 over-fetch (the first pass rounds the
        # query to bf16; the candidates are re-scored with the fp32 query)
        fetch = min(len(corpus), 2 * k) if kind == "bf16" else k
    if out is None:
        scores = torch.empty((B, k), dtype=torch.float32)
        ids = torch.empty((B, k), dtype=torch.int64)
    else:
        scores, ids = out
    ex = exclude.numpy() if exclude is not None else np.empty((B, 0), dtype=np.int64)
    _C.topk_ip(q.numpy(), _np_view(data), _KIND[kind], scale, rowsum, rescore, rkind, k, max(fetch, k),
               -math.inf if min_score is None else float(min_score), ex, scores.numpy(), ids.numpy(), int(threads))
    return scores, ids


# ----------------------------------------------------------------------------- torch path


def _torch_impl(q: torch.Tensor, corpus, k: int, min_score: float | None, exclude: torch.Tensor | None):
    """mm + topk with the reference's semantics: the same score matrix as :func:`topk_ip_ref`
    (so the same scores), selected by ``torch.topk`` instead of a full sort.

    ``topk`` does not order equal scores by id, so the tie rule applies only where ties exist:
    when each row's top k + 1 scores are strictly decreasing (no tie, no NaN, no -inf among the
    first k: the usual case), the first k are the reference's result as they stand. Otherwise
    the k results are re-sorted by (score desc, id asc), and a row whose k-th and (k+1)-th
    scores tie (the cut could have kept a higher id) is redone with the reference's stable sort.
    """
    s = q.float() @ _dense(corpus).to(q.device).T
    if exclude is not None:
        rows = torch.arange(q.shape[0], device=s.device)[:, None].expand_as(exclude)
        keep = exclude >= 0
        s[rows[keep], exclude[keep]] = -math.inf
    if min_score is not None:
        s.masked_fill_(s < min_score, -math.inf)
    N = s.shape[1]
    kk = min(k + 1, N)
    vals, idx = torch.topk(s, kk, dim=1)
    # The tie rule below is ~20 small tensor ops (0.2 ms a call, 2-3% of a 200k x 768 search at
    # B <= 4 on an Intel Xeon: issue 38); one comparison over the [B, k + 1] results says whether
    # a row needs it (numpy on CPU: 5 us against torch's 9 us). NaN and -inf fail `>`, and with
    # k + 1 columns a -inf k-th score is followed by another -inf.
    v = vals.detach().numpy() if vals.device.type == "cpu" else vals
    if bool((v[:, :-1] > v[:, 1:]).all()) and (kk > k or bool((v[:, -1] > -math.inf).all())):
        return (vals[:, :k].contiguous(), idx[:, :k].contiguous()) if kk > k else (vals, idx)
    if bool(torch.isnan(vals).any()):  # topk ranks NaN first: only then pay a pass over [B, N]
        s.masked_fill_(torch.isnan(s), -math.inf)
        vals, idx = torch.topk(s, kk, dim=1)
    if kk > k:
        cut_tie = (vals[:, k - 1] == vals[:, k]) & (vals[:, k - 1] > -math.inf)
        vals, idx = vals[:, :k], idx[:, :k]
    else:
        cut_tie = None
    # (score desc, id asc): sort by id, then a stable sort by score
    o = torch.argsort(idx, dim=1)
    vals, idx = vals.gather(1, o), idx.gather(1, o)
    o = torch.sort(vals, dim=1, descending=True, stable=True).indices
    vals, idx = vals.gather(1, o).contiguous(), idx.gather(1, o).contiguous()
    if cut_tie is not None and bool(cut_tie.any()):
        rows = torch.nonzero(cut_tie).reshape(-1)
        rv, ri = _select(s[rows], k, None)
        vals[rows], idx[rows] = rv, ri
    return vals, idx.masked_fill(vals == -math.inf, -1)


def _torch_bf16_impl(q: torch.Tensor, corpus, k: int, min_score: float | None, exclude: torch.Tensor | None):
    # bf16 storage through torch's bf16 mm (oneDNN: AMX tiles on Intel Xeon), certified exact
    # by ragfast.ops.topk_ip_bf16's bound; anything else (or a bound that cannot hold) in fp32
    x = corpus.data if isinstance(corpus, QuantizedCorpus) else corpus
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not bf16_bound_ok(q, x):
        return _torch_impl(q, corpus, k, min_score, exclude)
    return topk_ip_torch_bf16(q, x, k, min_score, exclude)


def topk_ip_torch(queries: Any, corpus: Any, k: int, *, min_score: float | None = None,
                  exclude: Any = None, bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_ip` through torch mm + topk, the path the default chooser takes where it is
    faster than the compiled kernels. Same parameters and results as :func:`topk_ip_ref`.
    ``bf16=True`` scores a bf16 corpus with torch's bf16 mm first and re-scores every row its
    error bound cannot rule out (:mod:`ragfast.ops.topk_ip_bf16`); other storage ignores it."""
    q, corpus, k, min_score, ex = _validate(queries, corpus, k, min_score, exclude)
    if q.shape[0] == 0:
        return torch.empty((0, k), dtype=torch.float32), torch.empty((0, k), dtype=torch.int64)
    return (_torch_bf16_impl if bf16 else _torch_impl)(q, corpus, k, min_score, ex)


def isa_level() -> str:
    """The ISA level the compiled kernels run at (``ragfast._C.isa_info()`` says why).

    Raises
    ------
    ConfigError
        ``RAGFAST_ISA`` names an unknown level, one not compiled in, or one this CPU lacks.
    """
    from ragfast import _C
    from ragfast.errors import ConfigError

    try:
        return _C.isa_current()
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None


def default_path(batch: int, storage: str = "fp32"):
    """What :func:`topk_ip` runs by default on this machine for ``batch`` queries over
    ``storage``: a :class:`~ragfast.ops.topk_ip_choice.Choice` (compiled kernels at the ISA
    level in use, or torch mm + topk), or None when the compiled backend is not available."""
    from ragfast.ops.registry import available

    if not available()["cpp"]:
        return None
    return choose_path(isa_level(), storage, batch, choice_table())


def choice_table() -> dict[str, Any]:
    """This machine's default-path table (:func:`ragfast.ops.topk_ip_choice.machine_table`): the
    shipped one measured on this CPU, else a cached calibration, else one calibrated now (seconds
    to half a minute, once per machine; ``RAGFAST_CALIBRATE=0``: none)."""
    return machine_table(calibrate_with=_calibrate_now)


def _calibrate_now() -> dict[str, Any]:
    return calibrate_default_path()


def calibration_rows(dim: int = 384) -> int:
    """Rows of the calibration corpus: its fp32 vectors as large as the last-level cache,
    clamped to 20,000-400,000 (the calibration: a few seconds on a desktop, about 30 on a
    300 MiB-L3 Xeon)."""
    return int(min(400_000, max(20_000, last_level_cache_bytes() // (4 * dim))))


#: ISA levels whose CPUs have no bf16 matmul in torch worth timing: oneDNN needs AVX-512 for
#: bf16, and without it torch's own bf16 gemm ran a 64 x 4096 x 4096 product in 5.6 s on an
#: Intel Xeon forced to AVX2 (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2; 21 ms at
#: AVX512_CORE_BF16): a calibration there would spend a minute to learn that torch_bf16 loses.
NO_NATIVE_BF16 = ("avx2", "generic")


def calibrate_default_path(reps: int = 3, progress=None) -> dict[str, Any]:
    """Measure which path (compiled kernels or torch) is faster on this machine at the ISA level
    in use, for every storage and batch class: ``{level: {storage: {B: "cpp"|"torch"}}}`` (for
    bf16 storage also ``"torch_bf16"``, torch's bf16 mm certified exact).

    Parameters
    ----------
    reps : int
        Round-robin timed calls per path and cell (the median decides).
    progress : callable, optional
        ``progress(storage, B, {path: median s}, chosen)`` after each cell.
    """
    # A corpus as large as the last-level cache (fp32 bytes), 20,000 to 400,000 rows of 384: a
    # corpus that fits in cache favours torch's matmul, which is compute-bound there, while an
    # index worth choosing a path for streams from memory. On an Intel Xeon (300 MiB L3)
    # 20,000 rows chose torch for fp32 at B >= 16, where at 200,000 rows the kernels ran
    # 1.5-3.3x torch (bench/bench_topk_ip.py --calibrate, 2026-12-06).
    level = isa_level()
    g = torch.Generator().manual_seed(0)
    corpus = torch.nn.functional.normalize(torch.randn(calibration_rows(), 384, generator=g), dim=1)
    stores = {"fp32": corpus, **{dt: quantize(corpus, dt) for dt in ("fp16", "bf16", "int8")}}

    def calls(storage: str, B: int):
        q = torch.nn.functional.normalize(torch.randn(B, 384, generator=g), dim=1)
        fns = {"cpp": lambda: topk_ip(q, stores[storage], 10, backend="cpp"),
               "torch": lambda: topk_ip_torch(q, stores[storage], 10)}
        if storage == "bf16" and level not in NO_NATIVE_BF16:
            fns["torch_bf16"] = lambda: topk_ip_torch(q, stores[storage], 10, bf16=True)
        return fns

    return calibrate(calls, level, reps=reps, progress=progress)


# ----------------------------------------------------------------------------- Triton backend


def _triton_impl(q: torch.Tensor, corpus, k: int, min_score: float | None, exclude: torch.Tensor | None):
    from ragfast.kernels.topk_ip import topk_ip_triton

    if isinstance(corpus, QuantizedCorpus):
        # fp16 is scanned exactly; bf16 and int8 take a tensor-core pass whose over-fetched
        # candidates are re-scored and certified exact (ragfast.kernels.topk_ip)
        extra = {}
        if corpus.dtype == "int8":
            extra = {"scale": corpus.scale,
                     "rescore": _rows_unit_stride(corpus.rescore) if corpus.rescore is not None else None}
        fetch = k * corpus.oversample if corpus.dtype != "fp16" else None
        return topk_ip_triton(q, _rows_unit_stride(corpus.data), k, min_score=min_score, exclude=exclude,
                              fetch=fetch, **extra)
    return topk_ip_triton(q, _rows_unit_stride(corpus), k, min_score=min_score, exclude=exclude)


def _reg_ref(q, corpus, k, min_score, exclude):
    return _ref_impl(q, corpus, k, min_score, exclude)


register("topk_ip", "ref", _reg_ref)
register("topk_ip", "cpp", _cpp_impl)
register("topk_ip", "triton", _triton_impl)


def topk_ip(queries: Any, corpus: Any, k: int, *, min_score: float | None = None, exclude: Any = None,
            backend: str | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` corpus rows by inner product for each query.

    Parameters
    ----------
    queries : torch.Tensor or numpy.ndarray
        ``[B, d]`` floating point (cast to float32; a non-contiguous batch is copied, which costs
        ``B * d`` floats, never the corpus). Every coordinate must be finite.
    corpus : torch.Tensor, numpy.ndarray or QuantizedCorpus
        ``[N, d]`` float32 / float16 / bfloat16 vectors (any row stride; a row whose elements are
        not contiguous forces one copy), or a :class:`QuantizedCorpus` from :func:`quantize`.
    k : int
        Results per query, ``1 <= k <= N``.
    min_score : float, optional
        Hits scoring below this are dropped (their slots hold id -1, score -inf).
    exclude : list of int sequences, or int tensor ``[B, E]``, optional
        Per-query corpus row ids never returned (e.g. what a trajectory already read). A padded
        tensor uses -1 as padding; duplicates are fine. Ids must lie in ``[0, N)``.
    backend : {"ref", "cpp", "triton"}, optional
        Implementation; default from ``RAGFAST_BACKEND`` or the device (see ``ragfast.backends()``).
        On CPU with neither set, the call takes the compiled kernels or torch mm + topk (for
        bf16 storage also torch's bf16 mm, re-scored exactly), whichever the measured table (:mod:`ragfast.ops.topk_ip_choice`) says is faster for
        this ISA level, storage and batch size; ``backend="cpp"`` forces the kernels.
    out : (torch.Tensor, torch.Tensor), optional
        Preallocated contiguous ``[B, k]`` float32 scores and int64 ids to write into.

    Returns
    -------
    scores : torch.Tensor
        ``[B, k]`` float32, descending per row.
    ids : torch.Tensor
        ``[B, k]`` int64 corpus row ids; ties in score are ordered by lower id.

    Raises
    ------
    ValueError
        Dimension mismatch, non-finite query, empty corpus, ``k`` outside ``[1, N]``, bad exclude.
    TypeError
        Non-floating queries, an unsupported corpus dtype, a non-integer ``k``.

    Examples
    --------
    >>> corpus = torch.nn.functional.normalize(torch.randn(10_000, 384), dim=1)
    >>> scores, ids = topk_ip(corpus[:3], corpus, 5, exclude=[[0], [1], [2]])
    """
    q, corpus, k, min_score, ex = _validate(queries, corpus, k, min_score, exclude)
    B = q.shape[0]
    if out is not None:
        s_out, i_out = out
        if (tuple(s_out.shape) != (B, k) or tuple(i_out.shape) != (B, k) or s_out.dtype != torch.float32
                or i_out.dtype != torch.int64 or not s_out.is_contiguous() or not i_out.is_contiguous()):
            raise ValueError(f"out must be contiguous ([{B}, {k}] float32, [{B}, {k}] int64) tensors")
    name, fn = resolve("topk_ip", backend, q.device.type)
    if name == "cpp":
        level = isa_level()  # a refused RAGFAST_ISA fails here, before any kernel runs
        if backend is None and not os.environ.get("RAGFAST_BACKEND") and B > 0 and q.device.type == "cpu":
            # default path: the compiled kernels or torch mm + topk, whichever the measured
            # table says is faster here (topk_ip_choice); naming backend="cpp" forces the kernels
            storage = corpus.dtype if isinstance(corpus, QuantizedCorpus) else _STORAGE[corpus.dtype]
            path = choose_path(level, storage, B, choice_table()).path
            if path == "torch":
                name, fn = "torch", _torch_impl
            elif path == "torch_bf16":
                name, fn = "torch_bf16", _torch_bf16_impl
    if B == 0:
        s, i = torch.empty((0, k), dtype=torch.float32, device=q.device), torch.empty((0, k), dtype=torch.int64, device=q.device)
    elif name == "cpp":
        if q.device.type != "cpu":
            raise ValueError(f"backend 'cpp' runs on CPU tensors, got {q.device}")
        s, i = fn(q, corpus, k, min_score, ex, out=out)
        return s, i
    else:
        s, i = fn(q, corpus, k, min_score, ex)
    if out is not None:
        out[0].copy_(s)
        out[1].copy_(i)
        return out
    return s, i


# ----------------------------------------------------------------------------- fused round


@dataclass
class RetrieveStep:
    """One retrieval round: who is still searching, and what they got.

    Attributes
    ----------
    active : torch.Tensor
        ``[B]`` bool: still searching after this round's stop decision.
    stopped : torch.Tensor
        ``[B]`` bool: stopped in this round (was active, stop score reached the threshold).
    scores : torch.Tensor
        ``[B, k]`` float32; rows of inactive trajectories are all -inf.
    ids : torch.Tensor
        ``[B, k]`` int64; rows of inactive trajectories are all -1.
    """

    active: torch.Tensor
    stopped: torch.Tensor
    scores: torch.Tensor
    ids: torch.Tensor

    @property
    def searched(self) -> int:
        """How many trajectories were searched this round."""
        return int(self.active.sum())


def _step_masks(B: int, stop_scores: Any, threshold: float, active: Any):
    s = _as_tensor(stop_scores, "stop_scores").reshape(-1).float().cpu()
    if s.shape[0] != B:
        raise ValueError(f"stop_scores has {s.shape[0]} entries for B={B} queries")
    if active is None:
        act = torch.ones(B, dtype=torch.bool)
    else:
        act = _as_tensor(active, "active").reshape(-1).cpu()
        if act.shape[0] != B:
            raise ValueError(f"active has {act.shape[0]} entries for B={B} queries")
        act = act.to(torch.bool)
    threshold = float(threshold)
    if math.isnan(threshold):
        raise ValueError("threshold is NaN")
    # NaN >= t is False: a state that could not be scored never stops.
    stop_now = act & (s >= threshold)
    return act & ~stop_now, stop_now


def _seen_rows(seen: Any, idx: torch.Tensor) -> Any:
    if seen is None:
        return None
    if isinstance(seen, (torch.Tensor, np.ndarray)):
        return _as_tensor(seen, "seen")[idx]
    return [seen[int(i)] for i in idx]


def _retrieve(queries, corpus, k, stop_scores, threshold, seen, active, min_score, search):
    q = _check_queries(queries)
    B = q.shape[0]
    if seen is not None and len(seen) != B:
        raise ValueError(f"seen has {len(seen)} entries for B={B} queries")
    new_active, stopped = _step_masks(B, stop_scores, threshold, active)
    scores = torch.full((B, k), -math.inf, dtype=torch.float32)
    ids = torch.full((B, k), -1, dtype=torch.int64)
    idx = torch.nonzero(new_active).reshape(-1)
    if len(idx):
        s, i = search(q[idx], corpus, k, min_score=min_score, exclude=_seen_rows(seen, idx))
        scores[idx] = s.cpu()
        ids[idx] = i.cpu()
    else:  # still validate the corpus and k, so a bad call fails on every round, not only busy ones
        _validate(q[:0], corpus, k, min_score, None)
    return RetrieveStep(new_active, stopped, scores, ids)


def retrieve_step(queries: Any, corpus: Any, k: int, *, stop_scores: Any, threshold: float, seen: Any = None,
                  active: Any = None, min_score: float | None = None, backend: str | None = None) -> RetrieveStep:
    """One fused retrieval round of a multi-round RAG loop.

    Trajectories still active whose stop score reaches ``threshold`` are marked stopped (a NaN
    score never stops); the others are searched in one batched :func:`topk_ip` call that skips
    the corpus rows each has already read.

    Parameters
    ----------
    queries : torch.Tensor
        ``[B, d]`` this round's query vectors (rows of inactive trajectories are ignored, but
        must still be finite).
    corpus : torch.Tensor or QuantizedCorpus
        As in :func:`topk_ip`.
    k : int
        Hits per searched trajectory.
    stop_scores : array-like
        ``[B]`` judge scores of the current states (NaN: could not be scored).
    threshold : float
        Stop when ``stop_score >= threshold``.
    seen : list of id sequences or int tensor ``[B, E]`` (-1 padded), optional
        Row ids each trajectory has read; they are excluded from its search.
    active : array-like of bool, optional
        ``[B]`` mask of trajectories still running before this round (default: all).
    min_score, backend
        As in :func:`topk_ip`.

    Returns
    -------
    RetrieveStep
        New active mask, the stopped-this-round mask, and ``[B, k]`` scores/ids (rows of
        inactive trajectories hold -inf / -1).
    """
    return _retrieve(queries, corpus, k, stop_scores, threshold, seen, active, min_score,
                     lambda *a, **kw: topk_ip(*a, backend=backend, **kw))


def retrieve_step_ref(queries: Any, corpus: Any, k: int, *, stop_scores: Any, threshold: float, seen: Any = None,
                      active: Any = None, min_score: float | None = None) -> RetrieveStep:
    """Reference :func:`retrieve_step`: searches every trajectory with :func:`topk_ip_ref`,
    then blanks the rows of the inactive ones (no gather, so it checks the fused path's
    bookkeeping independently)."""
    q = _check_queries(queries)
    B = q.shape[0]
    new_active, stopped = _step_masks(B, stop_scores, threshold, active)
    s, i = topk_ip_ref(q, corpus, k, min_score=min_score, exclude=seen)
    s = s.cpu().masked_fill(~new_active[:, None], -math.inf)
    i = i.cpu().masked_fill(~new_active[:, None], -1)
    return RetrieveStep(new_active, stopped, s, i)

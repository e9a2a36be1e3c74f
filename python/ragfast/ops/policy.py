"""Policy ops: the first-crossing sweep and paired-bootstrap resample means.

Two ops, each with a ``ref`` (numpy) and a ``cpp`` (``ragfast._C``, OpenMP) implementation
registered with :mod:`ragfast.ops.registry`:

``sweep``
    ``(scores[B, T], lengths[B], thresholds[M]) -> int64[B, M]``: the first state ``t <
    lengths[b]`` whose score is ``>=`` the threshold, ``-1`` where none is. NaN never crosses.
``bootstrap``
    ``(diffs[K, n], n_resamples, seed) -> float64[K, n_resamples]``: means of question
    resamples, one shared set of indices per resample for all K rows (so comparisons stay
    paired with each other). The ``ref`` stream is numpy's ``default_rng(seed).integers(0, n,
    (n_resamples, n))``, the same draws ``scipy.stats.bootstrap`` makes for that generator; the
    ``cpp`` stream is a counter-based hash of ``(seed, resample, draw)``, identical on any
    number of threads but different from numpy's.

The public wrappers :func:`sweep` and :func:`bootstrap_means` validate, then dispatch.
"""
from __future__ import annotations

import numpy as np

from ragfast.ops.registry import cpp_module, register, resolve

# Bound the [rows, T, M] boolean block of the reference sweep (~16 MB).
_REF_SWEEP_BLOCK = 1 << 24
# Bound the [resamples, n] index block of the reference bootstrap (~64 MB of int64).
_REF_BOOT_BLOCK = 1 << 23


# -- reference implementations ------------------------------------------------------------------
def _check_out(out, shape: tuple[int, ...], dtype, what: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, dtype=dtype)
    if not isinstance(out, np.ndarray) or out.dtype != dtype or out.shape != shape or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise ValueError(f"{what}: out must be a writeable C-contiguous {np.dtype(dtype).name} array of shape {shape}")
    return out


def sweep_ref(scores: np.ndarray, lengths: np.ndarray, thresholds: np.ndarray, out=None) -> np.ndarray:
    """Broadcast comparison of every state with every threshold; the oracle for ``sweep``."""
    B, T = scores.shape
    M = thresholds.shape[0]
    out = _check_out(out, (B, M), np.int64, "sweep")
    if B == 0 or M == 0:
        return out
    valid = np.arange(T)[None, :] < lengths[:, None]
    rows = max(1, _REF_SWEEP_BLOCK // max(1, T * M))
    for lo in range(0, B, rows):
        s = np.where(valid[lo:lo + rows], scores[lo:lo + rows].astype(np.float64), np.nan)
        hit = s[:, :, None] >= thresholds[None, None, :]  # NaN compares False
        any_hit = hit.any(axis=1)
        first = hit.argmax(axis=1) if T > 0 else np.zeros_like(any_hit, dtype=np.int64)
        out[lo:lo + rows] = np.where(any_hit, first, -1)
    return out


def bootstrap_ref(diffs: np.ndarray, n_resamples: int, seed: int, out=None) -> np.ndarray:
    """Resample means with numpy's generator, via per-resample counts and one matmul."""
    K, n = diffs.shape
    rng = np.random.default_rng(seed)
    out = _check_out(out, (K, n_resamples), np.float64, "bootstrap")
    rows = max(1, _REF_BOOT_BLOCK // n)
    for lo in range(0, n_resamples, rows):
        r = min(rows, n_resamples - lo)
        idx = rng.integers(0, n, (r, n))  # chunked draws continue the same stream
        counts = np.bincount((idx + (np.arange(r) * n)[:, None]).ravel(), minlength=r * n).reshape(r, n)
        out[:, lo:lo + r] = (diffs @ counts.T.astype(np.float64)) / n
    return out


# -- compiled implementations -------------------------------------------------------------------
def sweep_cpp(scores: np.ndarray, lengths: np.ndarray, thresholds: np.ndarray, out=None) -> np.ndarray:
    return cpp_module().sweep_first_crossing(scores, lengths, thresholds, out)


def bootstrap_cpp(diffs: np.ndarray, n_resamples: int, seed: int, out=None) -> np.ndarray:
    return cpp_module().bootstrap_means(diffs, int(n_resamples), int(seed), out)


register("sweep", "ref", sweep_ref)
register("sweep", "cpp", sweep_cpp)
register("bootstrap", "ref", bootstrap_ref)
register("bootstrap", "cpp", bootstrap_cpp)


# -- public wrappers: validate, then dispatch ---------------------------------------------------
def _as_scores(scores) -> np.ndarray:
    s = np.asarray(scores)
    if s.ndim != 2:
        raise ValueError(f"scores must be a 2-D [trajectories, states] array, got shape {s.shape}")
    if s.dtype not in (np.float32, np.float64):
        if not (np.issubdtype(s.dtype, np.number) or s.dtype == np.bool_):
            raise TypeError(f"scores must be numeric, got dtype {s.dtype}")
        s = s.astype(np.float64)
    return s


def _as_lengths(lengths, B: int, T: int) -> np.ndarray:
    if lengths is None:
        return np.full(B, T, dtype=np.int64)
    L = np.asarray(lengths)
    if L.ndim != 1 or L.shape[0] != B:
        raise ValueError(f"lengths must be 1-D with one entry per trajectory ({B}), got shape {L.shape}")
    if L.size and not np.issubdtype(L.dtype, np.integer):
        if not np.all(np.isfinite(L)) or np.any(L != np.round(L)):
            raise ValueError("lengths must be whole numbers of states")
    L = L.astype(np.int64)
    if L.size and (L.min() < 0 or L.max() > T):
        bad = int(np.flatnonzero((L < 0) | (L > T))[0])
        raise ValueError(f"lengths[{bad}]={int(L[bad])} is outside [0, {T}] (T = number of state columns)")
    return L


def sweep(scores, thresholds, lengths=None, *, out=None, backend: str | None = None) -> np.ndarray:
    """First-crossing state index of every trajectory at every threshold.

    Parameters
    ----------
    scores : array_like, shape (B, T)
        STOP scores; row b holds the states of trajectory b in order. float32 and float64 run
        as they are; other numeric types are converted to float64. Any strides.
    thresholds : array_like, shape (M,) or scalar
        A state crosses when ``score >= threshold``. NaN thresholds are rejected.
    lengths : array_like of int, shape (B,), optional
        Number of real states per row (0 = empty trajectory); later columns are padding and
        never cross. Default: all T.
    out : numpy.ndarray of int64, shape (B, M), optional
        Buffer to write into (C-contiguous).
    backend : {"ref", "cpp"}, optional
        Implementation; default from :func:`ragfast.ops.registry.resolve`.

    Returns
    -------
    numpy.ndarray of int64, shape (B, M)
        Index of the first crossing state, or -1 where the trajectory never crosses.
    """
    s = _as_scores(scores)
    h = np.atleast_1d(np.asarray(thresholds, dtype=np.float64))
    if h.ndim != 1:
        raise ValueError(f"thresholds must be a scalar or 1-D, got shape {h.shape}")
    if np.isnan(h).any():
        raise ValueError("thresholds contain NaN; use +inf for 'never stop'")
    B, T = s.shape
    L = _as_lengths(lengths, B, T)
    _, fn = resolve("sweep", backend)
    return fn(s, L, np.ascontiguousarray(h), out)


def bootstrap_means(diffs, n_resamples: int = 10000, seed: int = 0, *, out=None,
                    backend: str | None = None) -> np.ndarray:
    """Means of ``n_resamples`` resamples (with replacement) of the questions.

    Parameters
    ----------
    diffs : array_like, shape (n,) or (K, n)
        Per-question values (e.g. paired differences a - b). With K rows, every resample uses
        one set of question indices for all rows.
    n_resamples : int
    seed : int
        Non-negative. The ``ref`` backend follows ``numpy.random.default_rng(seed)``; the
        ``cpp`` backend its own counter-based stream (deterministic whatever the threads).
    out : numpy.ndarray of float64, optional
        Buffer of the result's shape to write into (C-contiguous).
    backend : {"ref", "cpp"}, optional

    Returns
    -------
    numpy.ndarray of float64, shape (n_resamples,) or (K, n_resamples)
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.ndim not in (1, 2):
        raise ValueError(f"diffs must be 1-D [n] or 2-D [K, n], got shape {d.shape}")
    if d.shape[-1] < 1:
        raise ValueError("diffs must hold at least one question")
    if not np.all(np.isfinite(d)):
        raise ValueError("diffs contain NaN or inf; drop or fill those questions first")
    if int(n_resamples) < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    if int(seed) < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    d2 = d[None, :] if d.ndim == 1 else d
    _, fn = resolve("bootstrap", backend)
    o2 = out
    if out is not None and d.ndim == 1:
        if not isinstance(out, np.ndarray) or out.shape != (int(n_resamples),):
            raise ValueError(f"bootstrap: out must have shape ({int(n_resamples)},)")
        o2 = out.reshape(1, -1)
        if not np.shares_memory(o2, out):
            raise ValueError("bootstrap: out must be C-contiguous")
    res = fn(d2, int(n_resamples), int(seed), o2)
    return res[0] if d.ndim == 1 else res

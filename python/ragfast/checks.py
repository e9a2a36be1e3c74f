"""Argument checks shared by the ops and the retrieval indexes.

Every search entry point (``ragfast.ops.topk_ip``, ``DenseIndex``, ``ShardedIndex``,
``RayShardedIndex``, ``BM25``) validates the same arguments: ``k``, per-query ``exclude`` lists,
``min_score``, query and corpus matrices, question ids. The checks live here once so their
error messages stay the same everywhere.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ragfast.errors import ConfigError, DataError

__all__ = [
    "is_int",
    "check_k",
    "check_positive_k",
    "check_exclude",
    "check_exclude_range",
    "check_min_score",
    "check_question_ids",
    "as_matrix",
    "as_query_tensor",
    "positive_int",
    "check_search",
    "check_texts",
    "check_safetensors",
    "check_port",
    "load_npy",
    "file_fingerprint",
]


def is_int(v: Any) -> bool:
    """True for a Python or numpy integer, False for a bool (``True`` is not a count)."""
    return not isinstance(v, bool) and isinstance(v, (int, np.integer))


def check_k(k: Any, n: int, *, size: str | None = None, type_error: type[Exception] = ValueError) -> int:
    """Check ``1 <= k <= n`` for a top-k search over ``n`` rows.

    Parameters
    ----------
    k : int
        Hits asked for.
    n : int
        Rows searched.
    size : str, optional
        How the message names ``n``; default ``"the number of indexed vectors (n)"``.
    type_error : exception class
        Raised when ``k`` is not an int (the ops raise ``TypeError``, the indexes ``ValueError``).

    Returns
    -------
    int
        ``k`` as a Python int.
    """
    if not is_int(k):
        raise type_error(f"k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"k={k} exceeds {size or f'the number of indexed vectors ({n})'}")
    return int(k)


def check_positive_k(k: Any) -> int:
    """Check ``k`` is an int >= 1 (a retriever clips it to its corpus size itself)."""
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    return int(k)


def check_exclude(exclude: Sequence[Sequence[Any]] | None, b: int, *, as_int: bool = True) -> list[list[Any]] | None:
    """Check there is one exclude list per query.

    Parameters
    ----------
    exclude : list of B lists, optional
        Row ids (or corpus ids) each query must skip.
    b : int
        Number of queries.
    as_int : bool
        Convert the entries to Python ints (row ids); False keeps them as they are (corpus ids).

    Returns
    -------
    list of lists, or None
    """
    if exclude is None:
        return None
    if len(exclude) != b:
        raise ValueError(f"exclude has {len(exclude)} lists for {b} queries")
    if not as_int:
        return [list(ex) for ex in exclude]
    return [[int(x) for x in ex] for ex in exclude]


def check_exclude_range(exclude: Sequence[Sequence[int]] | None, n: int) -> None:
    """Check every excluded row id lies in ``0..n-1``."""
    for e in exclude or []:
        bad = [x for x in e if not 0 <= x < n]
        if bad:
            raise ValueError(f"exclude ids {bad[:5]} are outside 0..{n - 1}")


def check_min_score(min_score: float | None, *, finite: bool = True) -> float | None:
    """Check a score floor: finite (indexes), or only not NaN (``finite=False``, the ops)."""
    if min_score is None:
        return None
    if finite:
        if not np.isfinite(min_score):
            raise ValueError(f"min_score must be finite, got {min_score}")
        return min_score
    min_score = float(min_score)
    if math.isnan(min_score):
        raise ValueError("min_score is NaN")
    return min_score


def check_question_ids(question_ids: Sequence[Any] | None, b: int) -> list[Any]:
    """One question id per query (``None`` for each when no ids are given)."""
    qids = list(question_ids) if question_ids is not None else [None] * b
    if len(qids) != b:
        raise ValueError(f"{len(qids)} question ids for {b} queries")
    return qids


def as_matrix(embeddings: Any) -> np.ndarray:
    """A non-empty float32 ``[N, d]`` numpy matrix of corpus vectors (no copy when it already is one).

    Parameters
    ----------
    embeddings : np.ndarray, torch.Tensor or nested sequence
        One row per corpus passage.
    """
    try:
        import torch

        if isinstance(embeddings, torch.Tensor):
            embeddings = embeddings.detach().to(torch.float32).cpu().numpy()
    except ImportError:
        pass
    arr = embeddings if isinstance(embeddings, np.ndarray) else np.asarray(embeddings)
    if arr.ndim != 2:
        raise DataError(f"embeddings must be a [N, d] matrix, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise DataError("cannot index an empty corpus (0 vectors)")
    if arr.dtype != np.float32:
        if not np.issubdtype(arr.dtype, np.floating):
            raise DataError(f"embeddings must be floating point, got {arr.dtype}")
        arr = arr.astype(np.float32)
    return arr


def as_query_tensor(queries: Any, dim: int):
    """A finite float32 ``[B, dim]`` torch tensor of queries (a single ``[dim]`` vector is B=1).

    Parameters
    ----------
    queries : torch.Tensor or np.ndarray
    dim : int
        The index dimension.
    """
    import torch

    q = queries if isinstance(queries, torch.Tensor) else torch.as_tensor(np.asarray(queries))
    if q.ndim == 1:
        q = q.unsqueeze(0)
    if q.ndim != 2:
        raise DataError(f"queries must be a [B, d] matrix, got shape {tuple(q.shape)}")
    if q.shape[1] != dim:
        raise DataError(f"query dimension {q.shape[1]} does not match the index dimension {dim}")
    if not q.is_floating_point():
        raise DataError(f"queries must be floating point, got {q.dtype}")
    q = q.to(torch.float32).contiguous()
    if q.numel() and not torch.isfinite(q).all():
        raise DataError("queries contain NaN or infinite values")
    return q


def positive_int(v: Any, name: str, minimum: int = 1) -> int:
    """A configuration count ``>= minimum``; a :class:`~ragfast.errors.ConfigError` naming it otherwise."""
    if not is_int(v) or v < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def check_search(queries: Any, k: Any, exclude: Sequence[Sequence[int]] | None, min_score: float | None, *,
                 dim: int, n: int):
    """The argument checks of every dense index ``search``, in one call.

    Parameters
    ----------
    queries : torch.Tensor or np.ndarray
        ``[B, dim]`` (or one ``[dim]`` vector).
    k : int
        ``1 <= k <= n``.
    exclude : list of B lists of int, optional
    min_score : float, optional
        Must be finite.
    dim, n : int
        The index dimension and row count.

    Returns
    -------
    (q, k, exclude) : (torch.Tensor, int, list of lists of int or None)
        float32 ``[B, dim]`` queries, ``k`` as an int, the exclude lists as ints.
    """
    q = as_query_tensor(queries, dim)
    k = check_k(k, n)
    ex = check_exclude(exclude, q.shape[0])
    check_min_score(min_score)
    return q, k, ex


def check_texts(texts: Any, expects: str, *, item: str = "text") -> list[str]:
    """A list of strings; one bare string, or a non-string item, is a DataError.

    Parameters
    ----------
    texts : sequence of str
    expects : str
        The message for a bare string, e.g. ``"BM25.search expects a list of query strings"``.
    item : str
        How the message names one item (``"query 3 is int, expected str"``).
    """
    if isinstance(texts, str):
        raise DataError(f"{expects}, got one string")
    out = list(texts)
    for i, t in enumerate(out):
        if not isinstance(t, str):
            raise DataError(f"{item} {i} is {type(t).__name__}, expected str")
    return out


def check_safetensors(model_dir: Any) -> None:
    """Refuse a model directory whose ``*.safetensors`` files are truncated or malformed.

    Reads only each file's header (8-byte little-endian length, then JSON): every tensor's
    ``data_offsets`` must lie inside the file. A truncated download otherwise fails deep in
    the loader with a ``SafetensorError`` traceback.

    Raises
    ------
    ModelError
        ``"<file>: truncated or not a safetensors file (...)"``.
    """
    import json
    import struct
    from pathlib import Path

    from ragfast.errors import ModelError

    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else ([d] if d.suffix == ".safetensors" else [])
    for f in files:
        size = f.stat().st_size
        why = None
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None or 8 + n > size or n > 100 * 2 ** 20:
                why = f"header of {n} bytes in a file of {size}"
            else:
                try:
                    header = json.loads(fh.read(n))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    header, why = None, "the header is not JSON"
                if header is not None:
                    if not isinstance(header, dict):
                        why = "the header is not a mapping"
                    else:
                        body = size - 8 - n
                        ends = [t.get("data_offsets", [0, 0])[1] for k, t in header.items()
                                if k != "__metadata__" and isinstance(t, dict)]
                        if any(not isinstance(e, int) or e > body for e in ends):
                            why = f"tensors end at byte {max(e for e in ends if isinstance(e, int))} of a " \
                                  f"{body}-byte body" if ends else "bad data offsets"
        if why:
            raise ModelError(f"{f}: truncated or not a safetensors file ({why}); download it again")


def check_port(port: Any, flag: str = "--port") -> int:
    """``port`` when it is a TCP port number (1-65535), else a ConfigError naming ``flag``."""
    if not is_int(port) or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{flag} must be a TCP port from 1 to 65535, got {port!r}")
    return int(port)


def load_npy(path: Any, mmap: bool = True) -> np.ndarray:
    """``np.load`` of a ``.npy`` matrix that never unpickles: a pickled or broken file is one DataError."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc) or "Python objects" in str(exc):
            raise DataError(f"{path}: holds pickled Python objects, not a numeric matrix; refused (a pickle can "
                            "run code)") from None
        raise DataError(f"{path}: not a readable .npy matrix ({' '.join(str(exc).split())[:160]})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npy matrix ({exc})") from None


def file_fingerprint(path: Any, sample: int = 1 << 16) -> str:
    """A cheap content key of a (possibly huge) file: size, mtime and a sha256 of three samples.

    The first, middle and last ``sample`` bytes are hashed with the size and the mtime in
    nanoseconds, so a rewritten or replaced file gets another key without reading it whole
    (60 GB indexes and multi-GB weights). A missing file is ``"missing"``.
    """
    import hashlib
    import os

    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "missing"
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for off in sorted({0, max(0, st.st_size // 2 - sample // 2), max(0, st.st_size - sample)}):
            f.seek(off)
            h.update(f.read(sample))
    return h.hexdigest()[:20]

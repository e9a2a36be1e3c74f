"""A least-recently-used mapping capped in bytes, for the in-memory caches of long-lived servers.

A cache capped by entry count is unbounded in memory when entries vary in size: 200k cached
1 MB passages are 200 GB. :class:`ByteLRU` counts the bytes of keys and values and evicts the
least recently used entries once the total passes ``max_bytes``, so a burst of large distinct
inputs cannot grow a server for good.

The default cap is :func:`default_max_bytes`: ``$RAGFAST_CACHE_MB`` MiB, else 256 MiB, or what
:func:`set_default_max_bytes` set (``serve-judge --cache-mb`` does). A cache reads it when built.
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator

__all__ = ["ByteLRU", "default_max_bytes", "set_default_max_bytes", "sizeof", "text_key"]

_DEFAULT_MB = 256.0
_override: int | None = None


def default_max_bytes() -> int:
    """The byte cap new caches get: set_default_max_bytes, else ``$RAGFAST_CACHE_MB``, else 256 MiB."""
    if _override is not None:
        return _override
    env = os.environ.get("RAGFAST_CACHE_MB")
    try:
        mb = float(env) if env else _DEFAULT_MB
    except ValueError:
        mb = _DEFAULT_MB
    return max(0, int(mb * 1024 * 1024))


def set_default_max_bytes(n: int | None) -> None:
    """Set (``None``: reset) the byte cap of caches built from now on in this process."""
    global _override
    if n is not None and n < 0:
        raise ValueError(f"cache size must be >= 0 bytes, got {n}")
    _override = None if n is None else int(n)


def text_key(text: str) -> bytes:
    """A 16-byte digest of ``text``: a cache keyed by it holds no copy of a long passage."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def sizeof(x: Any) -> int:
    """Bytes an entry holds: numpy/torch buffers by their data, lists and tuples summed, else getsizeof."""
    nbytes = getattr(x, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes + 112  # the array header
    if isinstance(x, (list, tuple)):
        # Lists of small ints (token ids) dominate: 8 bytes a pointer + the int objects (cached
        # small ints are shared, but counting them keeps the bound conservative).
        return sys.getsizeof(x) + sum(sizeof(v) for v in x)
    return sys.getsizeof(x)


class ByteLRU:
    """A dict-like LRU cache whose keys and values together stay under ``max_bytes``.

    Parameters
    ----------
    max_bytes : int, optional
        The cap (default :func:`default_max_bytes`). An entry larger than the cap on its own is
        not stored. 0 disables caching.
    size_of : callable, optional
        Bytes of one value (default :func:`sizeof`); keys are measured with ``sys.getsizeof``.

    Notes
    -----
    Thread-safe for single operations (a lock guards each call). ``get`` marks an entry as
    recently used.
    """

    def __init__(self, max_bytes: int | None = None, size_of: Callable[[Any], int] | None = None):
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")
        self._size_of = size_of or sizeof
        self._data: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value for ``key`` (now the most recently used), or ``default``."""
        with self._lock:
            got = self._data.get(key)
            if got is None:
                self.misses += 1
                return default
            self._data.move_to_end(key)
            self.hits += 1
            return got[0]

    def put(self, key: Hashable, value: Any) -> bool:
        """Store ``key -> value``, evicting least recently used entries; False if it cannot fit."""
        size = sys.getsizeof(key) + self._size_of(value)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes:
                return False
            self._data[key] = (value, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, s) = self._data.popitem(last=False)
                self.bytes -= s
                self.evictions += 1
            return True

    __setitem__ = put

    def __getitem__(self, key: Hashable) -> Any:
        got = self.get(key, _MISSING)
        if got is _MISSING:
            raise KeyError(key)
        return got

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Hashable]:
        with self._lock:
            return iter(list(self._data))

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()
            self.bytes = 0

    def describe(self) -> dict[str, Any]:
        """Entries, bytes held, cap, hits, misses and evictions."""
        return {"entries": len(self._data), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "evictions": self.evictions}


_MISSING = object()

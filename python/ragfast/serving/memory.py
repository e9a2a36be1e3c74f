"""A server process's memory: glibc's heap handed back after a burst, and the resident size for ``/health``."""
from __future__ import annotations

import os
from typing import Any

__all__ = ["trim_memory", "fix_mmap_threshold", "rss_bytes"]

_libc: Any = None


def trim_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    After a burst of large requests the freed buffers otherwise stay in the process's heap,
    and its resident size never returns to the baseline.
    """
    global _libc
    if _libc is None:
        try:
            import ctypes

            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_mmap_fixed = False


def fix_mmap_threshold(nbytes: int = 256 * 1024) -> None:
    """Serve every allocation of ``nbytes`` or more from its own mapping (glibc; a no-op elsewhere).

    glibc raises its mmap threshold each time a big mapped block is freed, so after one burst of
    megabyte-sized request bodies the next ones come from the heap, where they fragment it and
    stay resident. Measured on ``serve-judge`` (three 10 MB requests of 1 MB passages): +101 MB
    resident after the burst with the default, +7 MB with a fixed 256 KiB threshold. Called once
    per server process.
    """
    global _mmap_fixed
    if _mmap_fixed:
        return
    trim_memory()  # loads libc
    if _libc:
        _libc.mallopt(-3, int(nbytes))  # M_MMAP_THRESHOLD
    _mmap_fixed = True


def rss_bytes() -> int:
    """Resident memory of this process (Linux ``/proc``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

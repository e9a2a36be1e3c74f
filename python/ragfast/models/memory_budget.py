"""The memory budget of local generation (``--memory-budget``): what is free, what a chunk needs.

:class:`~ragfast.models.generator.HFGenerator` keeps every open session's keys/values between
turns and builds one batch cache per turn. Its budget covers what it allocates beyond its
weights (already resident when the budget is checked): the keys/values held by the open
sessions, the turn's batch cache and the activations of a forward pass. Before each chunk of
a turn it asks :meth:`GenerationBytes.chunk_peak` how many bytes a chunk of ``B`` sessions
may reach, and runs fewer sessions at once when that passes the budget.

The default budget (``auto``) is what the machine has free when the first turn starts (the
kernel's ``MemAvailable``, the cgroup's room, or the GPU's free memory) minus a margin: by then
every slot of a run is loaded. A process's resident size is then about its size before the
first turn plus the budget; the manifest records both the budget and the peak
(:func:`rss_peak_bytes`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragfast.errors import ConfigError

__all__ = ["AUTO", "NONE", "GenerationBytes", "auto_budget", "format_size", "free_bytes", "held_bytes", "parse_size",
           "release_free_heap", "rss_peak_bytes"]

#: The ``--memory-budget`` value that means: what the machine has free at the first turn, minus a margin.
AUTO = "auto"
#: The value that turns the budget off (the batch never shrinks for memory).
NONE = "none"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
#: The part of the free memory the automatic budget leaves alone (at least 1 GiB): the allocator's
#: slack over the tensors it counts (the resident size measured 1.3-2.5x the tensor peak of one
#: 0.5B prefill, bench/bench_kv_memory.py), and whatever else the process or machine allocates.
MARGIN_FRACTION = 0.10
MARGIN_MIN = 2**30


def parse_size(value: Any) -> int | None:
    """Bytes of a size such as ``"6GB"``, ``"5.5GiB"``, ``"800MB"`` or ``123456``; None for ``"none"``.

    GB, MB, kB are powers of 10; GiB, MiB, KiB powers of 2.

    Raises
    ------
    ConfigError
        One line naming the value, for anything else (``"auto"`` is resolved by :func:`auto_budget`).
    """
    if isinstance(value, bool):
        raise ConfigError(f"--memory-budget must be a size such as 6GB, 'auto' or 'none', got {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        text = str(value).strip().lower()
        if text == NONE:
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
        if m is None or m.group(2) not in _UNITS:
            raise ConfigError(f"--memory-budget must be a size such as 6GB, 5.5GiB or 800MB, 'auto' or 'none', "
                              f"got {value!r}")
        n = float(m.group(1)) * _UNITS[m.group(2)]
    if n < 1:
        raise ConfigError(f"--memory-budget must be a positive size, got {value!r}")
    return int(n)


def format_size(n: int | float | None) -> str:
    """``1234567890`` -> ``"1.23 GB"`` (powers of 10, as :func:`parse_size` reads ``GB``)."""
    if n is None:
        return "none"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return 0


def _cgroup_room() -> int | None:
    """Bytes the process's cgroup may still take (page cache it may reclaim counted as room); None without a limit."""
    # cgroup v2 (one hierarchy), then v1 (the memory controller's own); a limit near 2**63 means none.
    for limit_f, usage_f, stat_f, inactive in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                               ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                                "memory/memory.stat", "total_inactive_file")):
        root = Path("/sys/fs/cgroup")
        limit = _read_int(root / limit_f)
        usage = _read_int(root / usage_f)
        if limit is not None and usage is not None and limit < 2**60:
            return max(0, limit - usage + _stat(root / stat_f, inactive))
    return None


def free_bytes(device: str = "cpu") -> int | None:
    """What ``device``'s memory has free now, in bytes; None when the system does not say.

    The GPU's free memory for a CUDA device; else the smaller of the kernel's ``MemAvailable``
    and the room left in the process's cgroup.
    """
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None and hasattr(os, "sysconf"):
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = None
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def auto_budget(device: str = "cpu") -> tuple[int | None, str]:
    """The automatic budget: free memory minus a margin (10%, at least 1 GiB), and how it was found.

    Returns
    -------
    (bytes or None, note)
        None when the system reports no free memory (no budget, and the note says so).
    """
    free = free_bytes(device)
    if free is None:
        return None, "no budget: the system does not report its free memory"
    margin = max(MARGIN_MIN, int(free * MARGIN_FRACTION))
    return max(1, free - margin), (f"auto: {format_size(free)} free on {device} at the first turn, minus a "
                                   f"{format_size(margin)} margin")


def rss_peak_bytes() -> int | None:
    """The process's peak resident size so far (``getrusage``'s ``ru_maxrss``), in bytes; None where unknown."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # macOS says bytes, Linux KiB


_TRIM: list[Any] = []


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    The sessions' kept keys/values are many small tensors (one row, one layer: ~0.5 MB on a 1.5B),
    which glibc serves from its heap, not from their own mappings. Once a turn has moved them
    into its batch cache and freed them, the heap keeps their pages resident until something of
    a fitting size reuses them. On Qwen2.5-Coder-1.5B in bf16 (32 rows x 1,000 tokens, Zen 4
    EPYC) 0.9 GB stayed resident beside 0.9 GB of live keys/values after a prefill, and this
    call gave it back in 55 ms.
    """
    if not _TRIM:
        import ctypes
        import ctypes.util

        fn = None
        try:
            fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), "malloc_trim", None)
        except OSError:
            pass
        _TRIM.append(fn)
    if _TRIM[0] is None:
        return False
    _TRIM[0](0)
    return True


def held_bytes(caches: Mapping[str, Sequence[tuple[Any, Any]] | None],
               shared: Sequence[tuple[Any, Any]] | None = None) -> tuple[int, dict[str, int]]:
    """Bytes of kept keys/values: the total, and what dropping each cache alone would free.

    Counted by storage, each once: caches that are views of one storage (a kept prefix in
    ``shared``, nested probes of one session, sessions seeded from an ended one) hold its bytes
    together, and a cropped cache counts the whole storage it still holds. A cache's own bytes are
    the storages no other cache (nor ``shared``) holds.

    Parameters
    ----------
    caches : mapping
        Session id -> its per-layer (keys, values) tensors, or None.
    shared : sequence, optional
        The kept shared prefix's per-layer (keys, values).
    """
    size: dict[int, int] = {}
    holders: dict[int, set[str | None]] = {}

    def hold(pairs: Sequence[tuple[Any, Any]] | None, who: str | None) -> None:
        for pair in pairs or ():
            for t in pair:
                st = t.untyped_storage()
                size[st.data_ptr()] = st.nbytes()
                holders.setdefault(st.data_ptr(), set()).add(who)

    hold(shared, None)
    for sid, kv in caches.items():
        hold(kv, sid)
    own = dict.fromkeys(caches, 0)
    for ptr, who in holders.items():
        if len(who) == 1 and None not in who:
            own[next(iter(who))] += size[ptr]
    return sum(size.values()), own


@dataclass(frozen=True)
class GenerationBytes:
    """The bytes a batched turn of one model takes, from its config (the generator's budget arithmetic).

    Attributes
    ----------
    kv_per_token : int
        Keys and values of one token over every layer.
    layers : int
    act_per_token : int
        The live activations of one prefill token in one layer: the MLP's gate, up and product
        (3 x intermediate), the residual, norm (computed in fp32), attention and projection
        outputs (about 10 x hidden). The torch profiler measured 72-96 KiB per token on
        Qwen2.5-0.5B in fp32 against this formula's 94 KiB.
    gqa_per_position : int
        One layer's keys and values of one cached position repeated for every query head:
        transformers' SDPA path does that in a masked prefill when a model groups its query
        heads (decoding packs the heads instead).
    logits_per_row : int
        The last position's logits (fp32 or the model's dtype, whichever is wider).
    """

    kv_per_token: int
    layers: int
    act_per_token: int
    gqa_per_position: int
    logits_per_row: int

    @classmethod
    def of(cls, config: Any, dtype_bytes: int) -> "GenerationBytes":
        """The figures of a transformers config whose weights and cache use ``dtype_bytes`` per element."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        layers = int(cfg.num_hidden_layers)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        e = int(dtype_bytes)
        return cls(kv_per_token=2 * layers * kv_heads * head_dim * e, layers=layers,
                   act_per_token=(3 * inter + 8 * hidden) * e + 2 * hidden * 4 + (heads + 2 * kv_heads) * head_dim * e,
                   gqa_per_position=2 * heads * head_dim * e if heads > kv_heads else 0,
                   logits_per_row=int(cfg.vocab_size) * max(e, 4))

    def kv(self, tokens: int) -> int:
        """Keys and values of ``tokens`` tokens."""
        return self.kv_per_token * int(tokens)

    def chunk_peak(self, rows: int, past: int, new: int, max_new: int, step: int, held: int,
                   held_others: int, prefill_tokens: int = 0) -> int:
        """The most bytes a turn of ``rows`` sessions may hold at once, the sessions' kept caches included.

        The batch is left-padded to ``past`` cached and ``new`` fresh tokens per row; its cache
        starts at ``past + new + step`` tokens (the whole turn, ``past + new + max_new``, when
        ``step`` is 0) and grows to at most the whole turn. Three moments bound the turn:

        - filling the batch cache: the kept caches of the sessions outside the chunk, the new
          cache and one layer of the chunk's own (each layer's copies go once moved);
        - the prefill: the kept caches of the sessions outside the chunk (``held_others``: the
          chunk's own are dropped once copied), the cache and the forward pass's activations, of
          one row group of at most ``prefill_tokens`` new tokens (all rows when 0);
        - decoding: the cache at its largest plus one layer in flight (a growth, or finished
          rows cut out; a finished row's cut-out cache replaces its row of the batch).
        """
        per_layer = self.kv_per_token // max(1, self.layers)
        turn = past + new + max_new
        start = min(turn, past + new + step) if step else turn
        fill = held_others + rows * start * self.kv_per_token + (held - held_others) // max(1, self.layers)
        seen = past + new
        g = min(rows, max(1, prefill_tokens // max(1, new))) if prefill_tokens else rows
        prefill = (held_others + rows * start * self.kv_per_token + g * new * self.act_per_token
                   + g * seen * self.gqa_per_position + g * new * seen + rows * self.logits_per_row)
        decode = (held_others + rows * turn * (self.kv_per_token + per_layer)
                  + rows * (self.logits_per_row + turn))
        return max(fill, prefill, decode)

    def chunk_peaks(self, spans: Sequence[tuple[int, int, int]], max_new: int, step: int, held: int,
                    prefill_tokens: int = 0) -> list[int]:
        """:meth:`chunk_peak` of each chunk ``spans[:b]``, b = 1, 2, ...

        ``spans`` holds each session's (cached tokens, new tokens, bytes of its own kept cache),
        in the order chunks take them; ``held`` is every open session's kept bytes.
        """
        out, past, new, moved = [], 0, 0, 0
        for b, (p, f, own) in enumerate(spans, 1):
            past, new, moved = max(past, p), max(new, f), moved + own
            out.append(self.chunk_peak(b, past, new, max_new, step, held, held - moved, prefill_tokens))
        return out

"""A key/value cache for batched decoding that writes in place instead of concatenating.

transformers' ``DynamicLayer`` grows its keys and values with ``torch.cat`` on every forward
pass, so each decode step copies the whole cache of every layer once more. At batch 32 on
SmolLM2-135M (30 layers, ~200 cached tokens) that copy was 40% of a decode step's CPU time in
the torch profiler (1.56 s of 3.90 s over 5 steps, fp32, one thread; Intel Xeon, Emerald Rapids
family, load 10 on 2 cores). :class:`BufferedLayer` keeps one buffer per layer, writes each
step's keys/values into it and hands the attention a view of the filled part.

A buffer starts at what the turn has (cache + prompt) plus ``step`` tokens and grows by ``step``
tokens when decoding reaches its end (never past ``limit``, the longest the turn can get), so a
turn whose rows stop early never holds keys/values for the tokens it did not write. Growing
copies the filled part once per ``step`` decode steps instead of once per step. ``step=0``
keeps the older rule: a buffer sized by the caller (for the whole turn) that doubles when
passed.

:func:`buffered_cache` builds a ``DynamicCache`` whose layers are buffered, or returns ``None``
when the model's cache has other kinds of layers (sliding-window, linear attention);
:func:`cache_for` then falls back to transformers' own cache. :func:`cache_bytes` is what a
cache holds. :func:`extend_kv` runs one session's tokens alone (batch 1, no padding) on top of
its cached keys/values.

A long prefill runs in row groups (:func:`reserve_rows` and :func:`row_view`): the batch
cache's buffers are allocated for every row first, and each group's forward pass writes its
keys/values into its rows through a view, so the pass's activations scale with the group while
the batch decodes together afterwards. :func:`prefill_groups` chooses the groups: the rows come
sorted by their new tokens' count, and a group pads only to its own longest row (a view that
starts past the shorter rows' padding), so splitting a prefill also saves its padding.
"""
from __future__ import annotations

from typing import Any

__all__ = ["BufferedLayer", "buffered_cache", "cache_for", "cache_bytes", "cut_rows", "extend_kv", "fill_left_padded",
           "merge_left_padded", "prefill_groups", "reserve_rows", "row_view", "PASS_TOKENS"]

#: A forward pass's fixed cost in tokens' worth of work (reading every weight once, the Python
#: and op overhead of a pass), the price :func:`prefill_groups` puts on one more group.
PASS_TOKENS = 64


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        """A ``DynamicLayer`` backed by a ``[batch, heads, capacity, head_dim]`` buffer.

        ``capacity`` tokens at first; past them, ``step`` more (up to ``limit``), or twice as
        many when ``step`` is 0.
        """

        def __init__(self, capacity: int, step: int = 0, limit: int | None = None):
            super().__init__()
            self.capacity = max(1, int(capacity))
            self.step = max(0, int(step))
            self.limit = limit
            self.n = 0
            self.buf_k = self.buf_v = None
            self.fixed = False  # a view of another layer's rows: growing would detach it

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            b, h, t, d = key_states.shape
            cap = max(self.capacity, t)
            self.device = key_states.device
            self.buf_k = key_states.new_empty((b, h, cap, d))
            self.buf_v = value_states.new_empty((b, value_states.shape[1], cap, value_states.shape[3]))
            self.n = 0
            self.is_initialized = True

        def _view(self) -> None:
            self.keys = self.buf_k[:, :, :self.n]
            self.values = self.buf_v[:, :, :self.n]

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            t = key_states.shape[-2]
            if self.n + t > self.buf_k.shape[-2]:
                import torch

                if self.fixed:
                    raise RuntimeError(f"a row view of {self.buf_k.shape[-2]} tokens cannot take {self.n + t}")

                cap = self._grown(self.n + t)
                grow = (lambda x: torch.cat([x[:, :, :self.n], x.new_empty(
                    (x.shape[0], x.shape[1], cap - self.n, x.shape[3]))], dim=2))
                self.buf_k, self.buf_v = grow(self.buf_k), grow(self.buf_v)
            self.buf_k[:, :, self.n:self.n + t] = key_states
            self.buf_v[:, :, self.n:self.n + t] = value_states
            self.n += t
            self._view()
            return self.keys, self.values

        def _grown(self, need: int) -> int:
            old = self.buf_k.shape[-2]
            if not self.step:
                return max(2 * old, need)
            cap = old + self.step
            if self.limit is not None:
                cap = min(cap, self.limit)
            return max(cap, need)

        def reserve(self, batch: int, kv_heads: int, head_dim: int, dtype: Any, device: Any) -> None:
            """Allocate ``capacity`` tokens for ``batch`` rows now, before any keys/values arrive."""
            import torch

            self.buf_k = torch.empty((batch, kv_heads, self.capacity, head_dim), dtype=dtype, device=device)
            self.buf_v = torch.empty_like(self.buf_k)
            self.device, self.n, self.is_initialized = self.buf_k.device, 0, True
            self._view()

        def rows(self, lo: int, hi: int, skip: int = 0) -> "BufferedLayer":
            """A layer over rows ``lo:hi`` of this one's buffers, filled as far plus ``skip`` zeroed
            positions (padding the group's pass does not compute): what it writes lands here."""
            part = type(self)(self.buf_k.shape[-2])
            part.buf_k, part.buf_v = self.buf_k[lo:hi], self.buf_v[lo:hi]
            if skip:
                # masked out, but 0 x NaN is NaN: uninitialised memory must not reach the attention
                part.buf_k[:, :, self.n:self.n + skip].zero_()
                part.buf_v[:, :, self.n:self.n + skip].zero_()
            part.device, part.n, part.is_initialized, part.fixed = self.device, self.n + skip, True, True
            part._view()
            return part

        def fill_to(self, n: int) -> None:
            """Mark the first ``n`` tokens filled (row views wrote them)."""
            self.n = int(n)
            self._view()

        def nbytes(self) -> int:
            """Bytes of the buffers (their whole capacity, filled or not)."""
            return 0 if self.buf_k is None else self.buf_k.nbytes + self.buf_v.nbytes

        def get_seq_length(self) -> int:
            return self.n if self.is_initialized else 0

        def reset(self) -> None:
            self.buf_k = self.buf_v = None
            self.n = 0
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"BufferedLayer.crop takes a negative count, got {tokens_to_remove}")
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self.n = max(0, self.n + tokens_to_remove)
            self._view()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.buf_k = self.buf_k.repeat_interleave(repeats, dim=0)
                self.buf_v = self.buf_v.repeat_interleave(repeats, dim=0)
                self._view()

        def batch_select_indices(self, indices: Any) -> None:
            if self.is_initialized:
                self.buf_k = self.buf_k[indices]
                self.buf_v = self.buf_v[indices]
                self._view()

        def reorder_cache(self, beam_idx: Any) -> None:
            self.batch_select_indices(beam_idx)

    return BufferedLayer


_CLASS: list[Any] = []


def __getattr__(name: str) -> Any:
    # The class derives from a transformers class: built on first use, so importing this module
    # does not import transformers.
    if name == "BufferedLayer":
        if not _CLASS:
            _CLASS.append(_layer_class())
        return _CLASS[0]
    raise AttributeError(name)


def buffered_cache(config: Any, capacity: int, step: int = 0, limit: int | None = None) -> Any:
    """A ``DynamicCache`` for ``config`` whose layers write into ``capacity``-token buffers
    (growing by ``step`` tokens up to ``limit``, :class:`BufferedLayer`).

    Returns ``None`` when any of the model's cache layers is not a plain full-attention
    ``DynamicLayer`` (sliding-window, linear attention): those keep transformers' own layers.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cls = __getattr__("BufferedLayer")
    cache.layers = [cls(capacity, step, limit) for _ in cache.layers]
    return cache


def cache_for(config: Any, capacity: int, step: int = 0, limit: int | None = None) -> Any:
    """A buffered cache, or transformers' ``DynamicCache`` for models with other layer kinds."""
    from transformers import DynamicCache

    return buffered_cache(config, capacity, step, limit) or DynamicCache(config=config)


def reserve_rows(cache: Any, config: Any, batch: int, dtype: Any, device: Any) -> bool:
    """Allocate a buffered cache's buffers for ``batch`` rows; False (nothing done) for another cache."""
    cls = __getattr__("BufferedLayer")
    if not all(isinstance(layer, cls) for layer in cache.layers):
        return False
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    for layer in cache.layers:
        layer.reserve(batch, kv_heads, head_dim, dtype, device)
    return True


def row_view(cache: Any, config: Any, lo: int, hi: int, skip: int = 0) -> Any:
    """A cache over rows ``lo:hi`` of a reserved buffered cache: a forward pass on those rows writes
    its keys/values into ``cache``'s buffers (then :meth:`BufferedLayer.fill_to` marks them).

    ``skip`` positions after the filled part are zeroed and passed over: a group whose longest row
    has ``skip`` fewer new tokens than the batch's writes them right-aligned, as left padding puts them.
    """
    from transformers import DynamicCache

    view = DynamicCache(config=config)
    view.layers = [layer.rows(lo, hi, skip) for layer in cache.layers]
    return view


def prefill_groups(new: list[int], budget: int, pass_tokens: int | None = None) -> list[tuple[int, int]]:
    """Contiguous row groups ``(lo, hi)`` for a prefill whose rows have ``new[b]`` new tokens.

    Each group pads its rows to its own longest; the groups minimise the padded tokens computed
    plus ``pass_tokens`` (default :data:`PASS_TOKENS`) per group, with at most ``budget`` padded
    tokens in a group (a row alone may pass it). ``budget`` 0: one group. Rows sorted by ``new``
    (as ``HFGenerator`` chunks them) make the most of it; any order is valid.

    Examples
    --------
    >>> prefill_groups([10, 12, 40, 41], budget=4096, pass_tokens=20)
    [(0, 2), (2, 4)]
    >>> prefill_groups([10, 12, 40, 41], budget=0)
    [(0, 4)]
    """
    n = len(new)
    if not budget or n <= 1:
        return [(0, n)]
    pass_tokens = PASS_TOKENS if pass_tokens is None else pass_tokens
    inf = float("inf")
    best, cut = [0.0] + [inf] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # best[j]: the cheapest grouping of rows [0, j)
        top = 0
        for i in range(j - 1, -1, -1):
            top = max(top, new[i])
            if (j - i) * top > budget and j - i > 1:
                break  # wider groups only pad more
            cost = best[i] + (j - i) * top + pass_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j:
        groups.append((cut[j], j))
        j = cut[j]
    return groups[::-1]


def fill_left_padded(cache: Any, kept: list[list[tuple[Any, Any] | None] | None], width: int) -> None:
    """Left-pad each row's keys/values into the first ``width`` positions of an empty ``cache``.

    ``kept[b]`` is row b's list of per-layer ``(keys, values)``, each ``[kv_heads, n_b, head_dim]``
    (or None: nothing cached). Each layer's entries are set to None once moved, so a caller that
    dropped its own references holds at most one layer twice. A reserved cache
    (:func:`reserve_rows`) is written in place, its padding zeroed (masked out, but uninitialised
    memory may hold NaNs, and 0 x NaN is NaN); another cache gets one padded copy per layer.
    """
    reserved = all(getattr(layer, "buf_k", None) is not None for layer in cache.layers)
    for i, layer in enumerate(cache.layers):
        if reserved:
            buf_k, buf_v = layer.buf_k[:, :, :width], layer.buf_v[:, :, :width]
            buf_k.zero_()
            buf_v.zero_()
        elif width == 0:
            continue
        else:
            ref_k, ref_v = next(kv[i] for kv in kept if kv is not None)
            buf_k = ref_k.new_zeros((len(kept), ref_k.shape[0], width, ref_k.shape[2]))
            buf_v = ref_v.new_zeros((len(kept), ref_v.shape[0], width, ref_v.shape[2]))
        for b, kv in enumerate(kept):
            if kv is not None:
                k, v = kv[i]
                buf_k[b, :, width - k.shape[1]:] = k
                buf_v[b, :, width - v.shape[1]:] = v
                kv[i] = None
        if reserved:
            layer.fill_to(width)
        else:
            cache.update(buf_k, buf_v, i)


def merge_left_padded(config: Any, parts: list[tuple[Any, Any]], step: int, limit: int | None) -> tuple[Any, Any]:
    """One left-padded batch from several: each part's rows, right-aligned at the longest row's length.

    ``parts`` holds ``(cache, mask)`` pairs: a buffered cache (:func:`buffered_cache`) whose rows
    are left-padded and ``mask`` ``[rows, width]`` (1 where a row holds a token). The merged
    width is the longest part's span (columns that are padding in every row are dropped), and
    the buffers take ``step`` more tokens (at least one) before they grow. Each part's layers are
    freed as they are copied, so at most one layer is held twice.

    Returns
    -------
    (cache, mask)
        The merged buffered cache and its ``[rows, width]`` mask (the parts' rows in order).
    """
    import torch

    # A part's span: from its first column any row uses (a row's padding may also sit between its
    # cached and its new tokens, so a row's count of 1s is not its span) to its end.
    lengths = [int(m.shape[1]) - int(m.any(dim=0).nonzero()[0]) if m.any() else 0 for _, m in parts]
    width = max(lengths)
    rows = sum(int(m.shape[0]) for _, m in parts)
    ref = parts[0][1]
    mask = torch.zeros((rows, width), dtype=ref.dtype, device=ref.device)
    cache = buffered_cache(config, width + max(1, step), step, limit)
    if cache is None:
        raise ValueError("merge_left_padded: the model's cache has layers that are not plain full attention")
    r = 0
    for (_, m), n in zip(parts, lengths):
        if n:
            mask[r:r + m.shape[0], width - n:] = m[:, m.shape[1] - n:]
        r += m.shape[0]
    for i, layer in enumerate(cache.layers):
        olds = [c.layers[i] for c, _ in parts]
        k0 = olds[0].buf_k
        heads, dim = k0.shape[1], k0.shape[3]
        layer.reserve(rows, heads, dim, k0.dtype, k0.device)
        r = 0
        for old, (_, m), n in zip(olds, parts, lengths):
            b = m.shape[0]
            for src, dst in ((old.buf_k, layer.buf_k), (old.buf_v, layer.buf_v)):
                dst[r:r + b, :, :width - n].zero_()  # masked out, but 0 x NaN is NaN
                if n:
                    dst[r:r + b, :, width - n:width] = src[:, :, old.n - n:old.n]
            old.reset()
            r += b
        layer.fill_to(width)
    return cache, mask


def cut_rows(cache: Any, mask: Any, gone: list[int], keep_kv: list[bool]
             ) -> tuple[list[list[tuple[Any, Any]] | None], list[int]]:
    """Take rows ``gone`` out of a left-padded batch cache; return their keys/values and the new order.

    For each row of ``gone`` whose ``keep_kv`` entry is true, the per-layer ``(keys, values)``
    of its positions (``mask``'s 1s, each ``[kv_heads, n, head_dim]``, copies); None for the
    others. A buffered layer fills each hole below the new row count with one of the last rows
    and keeps a view of its first rows, so a cut copies as many rows as it removes, not the
    whole cache (at 64 rows of 1,500 tokens of the 0.5B a whole copy is 1.2 GB, and rows end on
    most steps of a full batch); another layer selects its rows. ``mask`` is not changed.

    Returns
    -------
    (kept, order)
        ``order[i]`` is the old index of the row now at ``i`` (the caller reorders its rows, mask
        and pending tokens alike).
    """
    import torch

    gone_set = set(gone)
    n = int(mask.shape[0]) - len(gone_set)
    movers = [r for r in range(n, int(mask.shape[0])) if r not in gone_set]
    holes = [r for r in sorted(gone_set) if r < n]
    order = list(range(n))
    for h, m in zip(holes, movers):
        order[h] = m
    valid = [mask[r].bool() if k else None for r, k in zip(gone, keep_kv)]
    out: list[list[tuple[Any, Any]] | None] = [[] if k else None for k in keep_kv]
    buffered = __getattr__("BufferedLayer")
    idx = torch.tensor(order, dtype=torch.long, device=mask.device)
    for layer in cache.layers:
        for j, (r, ok) in enumerate(zip(gone, valid)):
            if ok is not None:
                out[j].append((layer.keys[r][:, ok], layer.values[r][:, ok]))  # boolean indexing copies
        if n == 0:
            layer.reset()
        elif isinstance(layer, buffered) and layer.is_initialized:
            for h, m in zip(holes, movers):
                layer.buf_k[h] = layer.buf_k[m]
                layer.buf_v[h] = layer.buf_v[m]
            layer.buf_k, layer.buf_v = layer.buf_k[:n], layer.buf_v[:n]
            layer._view()
        else:
            layer.batch_select_indices(idx)
    return out, order


def cache_bytes(cache: Any) -> int:
    """Bytes a cache's layers hold: a buffered layer's whole buffers, another layer's tensors."""
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def extend_kv(model: Any, config: Any, ids: list[int], kv: list[tuple[Any, Any]] | None = None,
              device: str = "cpu") -> list[tuple[Any, Any]]:
    """Per-layer (keys, values) of ``kv`` followed by ``ids``, computed in one batch-1 forward pass.

    ``kv`` holds one ``[kv_heads, n, head_dim]`` pair per layer (or ``None`` for an empty
    cache); the new tokens take positions ``n, n + 1, ...``. Returns pairs of the same layout
    (views of the pass's cache), ``n + len(ids)`` tokens long.
    """
    import torch

    n = 0 if not kv else int(kv[0][0].shape[1])
    cache = cache_for(config, n + len(ids))
    for layer, (k, v) in enumerate(kv or []):
        cache.update(k[None], v[None], layer)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    pos = torch.arange(n, n + len(ids), dtype=torch.long, device=device)[None]
    # The decoder alone: only the keys/values are kept, so the lm head (a vocabulary-wide matmul
    # for the last position) is neither computed nor booked.
    with torch.inference_mode():
        model.get_decoder()(input_ids=x, position_ids=pos, cache=cache, use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]

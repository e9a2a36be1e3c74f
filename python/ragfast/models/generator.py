"""Reasoner backends behind :class:`ragfast.models.base.Generator`.

- :class:`HFGenerator`: transformers model from a local directory; batched greedy decoding with
  per-session KV caches reused across turns.
- :class:`ragfast.models.openai_generator.OpenAIGenerator` (its own module): a vLLM / SGLang
  OpenAI-compatible ``/v1/completions`` server.
- :class:`ragfast.models.scripted.ScriptedGenerator` (its own module): a deterministic evidence
  oracle that writes protocol-faithful Search-R1 text; its answers are NOT a model's answers.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ragfast.accounting.ledger import CostLedger, Timer
from ragfast.errors import ConfigError, ModelError
from ragfast.models.base import Generator, check_new_sessions, check_sessions, complete_ids, cut_at_stop
from ragfast.models.chunk_budget import ChunkBudget
from ragfast.models.decode_batch import (Row, RunningBatch, StopRule, admit_count, padded_inputs, return_now,
                                         share_time, turn_figures)
from ragfast.models.drafts import DRAFT_TOKENS, draft_width, propose, settle
from ragfast.models.kv_buffer import (cache_bytes, cache_for, fill_left_padded, merge_left_padded,
                                      prefill_groups, reserve_rows, row_view)
from ragfast.models.lean_step import lean_forward, lean_plan
from ragfast.models.memory_budget import AUTO, GenerationBytes, parse_size, release_free_heap
from ragfast.models.prefix_share import PrefixSeeding, common_prefix
from ragfast.ops.argmax import argmax as greedy_pick
from ragfast.text import whitespace_tokens

log = logging.getLogger(__name__)

__all__ = ["HFGenerator", "whitespace_tokens"]


@dataclass
class _HFSession:
    ids: list[int]  # every token of the session, exactly as Search-R1's rolling state holds them
    n_cached: int = 0  # leading tokens whose keys/values are in `kv`
    kv: list[tuple[Any, Any]] | None = None  # per layer (keys, values), each [kv_heads, n_cached, head_dim]
    truncations: int = 0  # times the context cap cut the front off
    prompt: tuple[int, ...] = ()  # the prompt's tokens (the context cap may cut them out of `ids`)
    row: Any = None  # a turn set aside mid-way (decode_batch.Row): `ids` end with its tokens so far


def _contiguous_input(module: Any, args: tuple) -> tuple:
    """Forward pre-hook: the module's first input in row-major strides (see ``HFGenerator.set_weights``).

    ``contiguous()`` alone is not enough: torch calls a ``[1, 1, d]`` view of ``[1, L, d]``
    contiguous (a size-1 dimension's stride is ignored) and hands it over as it is, and its
    bf16 matmul still takes the per-row path on that stride: 500-590 ms for Qwen2.5's head at
    one row on an Intel Xeon, against 20-28 ms for a copy (fp32 is not affected).
    """
    x = args[0]
    if x.dim() >= 2 and (not x.is_contiguous() or x.stride(0) != x[0].numel()):
        x = x.new_empty(x.shape).copy_(x)
    return (x, *args[1:])


class HFGenerator(ChunkBudget, PrefixSeeding, Generator):
    """Batched greedy generation with a transformers causal LM, reusing each session's KV cache.

    Design. Every session keeps its token ids and the keys/values of those tokens (one tensor
    pair per layer, unpadded). A call admits its sessions into the running batch
    (:mod:`~ragfast.models.decode_batch`): their caches left-padded into one batch cache and
    their new tokens (the observation since the last turn) prefilled together, then one decode
    step per token for every row. Zeros in the mask in front of each cache and each new-token
    block, and explicit position ids, make every row compute what it would alone. A row whose
    turn ends is cut out at once, its keys/values back with its session; sessions still waiting
    join when a quarter of ``max_batch`` is free (continuous batching), and with ``partial`` a
    call returns finished turns while the other rows keep decoding for the next call.

    Token-exactness. The generated text is cut after the first stop string and re-tokenised,
    as Search-R1 does when it builds the next turn's input; where the re-tokenised ids differ
    from the generated ones, the cache is kept only up to their common prefix and the rest is
    computed fresh. Observations are tokenised separately and appended (truncated to the cap
    in :meth:`truncate_tokens`). So the token sequence equals the reference's, and with
    ``kv_reuse=False`` (the whole session re-encoded every turn) the greedy tokens are the same.
    The tests check this in float32 on the CPU (batched vs one at a time, reuse vs re-encoding,
    qwen2 and qwen3 shapes). In bf16/fp16 on a GPU, different batch shapes take different
    kernels, so near-tied argmaxes can flip, as in any batched inference engine.

    Memory. The batch cache starts at the cached and new tokens plus ``kv_step`` and grows by
    ``kv_step`` tokens as decoding goes (kv_buffer.py); each session keeps only its own tokens'
    keys/values between turns, moved into the batch one layer at a time; a prefill of more than
    ``prefill_tokens`` new tokens runs in row groups writing their rows of the batch cache. Before
    admitting sessions the generator adds up what they may reach (the kept caches, the running
    batch at its largest, twice for the copy an admission makes, one prefill group's
    activations: :class:`~ragfast.models.memory_budget.GenerationBytes`) and admits fewer when
    that would pass ``memory_budget``, saying so in one log line. When the kept caches leave no
    room for one session, the largest kept caches of other sessions are dropped (recomputed at
    their next turn, with a warning); when one session's turn alone does not fit,
    :class:`~ragfast.errors.MemoryBudgetError` says so in one line. ``stats["kv_peak_bytes"]`` is
    the most the caches held at once, ``describe()["memory"]`` the budget and the peaks.

    Parameters
    ----------
    path : str or Path
        Local model directory (config, weights, tokenizer). Nothing is downloaded.
    device : str
        torch device.
    dtype : str or torch.dtype, optional
        Weights and cache dtype (default: the checkpoint's); ``"auto"``: :func:`~ragfast.models.weight_quant.auto_dtype`.
    max_batch : int
        Rows in the running batch at once; more sessions wait for room.
    kv_reuse : bool
        Keep each session's cache across turns (default). False re-encodes the whole session
        every turn: the baseline the benchmark compares against.
    max_context : int, optional
        Context cap in tokens (Search-R1's prompt budget, 4096): a longer session keeps its
        last ``max_context`` tokens, as the reference's rolling state does, and is re-encoded.
    attn_implementation : str, optional
        Passed to ``from_pretrained`` (e.g. "eager", "sdpa").
    share_prefix : bool
        With ``kv_reuse``: sessions that start with the same tokens (Search-R1's instruction and
        chat template: 139 of the 158-189 tokens of smollm2's prompts) compute those keys/values
        once. The last shared prefix is kept between calls, so one-at-a-time calls share it too.
    min_prefix : int
        Shortest common prefix (tokens) worth a separate forward pass.
    memory_budget : int, str or None
        Bytes the generator may allocate beyond its weights (kept and batch keys/values,
        activations): a number, a size such as ``"6GB"``, ``"auto"`` (default: what the device
        has free at the first turn minus a margin, :func:`~ragfast.models.memory_budget.auto_budget`)
        or ``None`` / ``"none"`` (no budget).
    kv_step : int
        Tokens a turn's batch cache grows by. 0 sizes it for the longest possible turn up front
        (cached + new + ``max_new_tokens`` tokens per row), the older path, kept as the
        benchmark's anchor (bench/bench_kv_memory.py).
    weights : str
        ``"native"`` (default: the linear layers in ``dtype``), ``"int8"``: weight-only int8
        linear layers, one scale per output channel, activations and cache in ``dtype``, or
        ``"w8a8"``: the same weights, with the activations of passes of more than 16 rows also
        rounded to int8 per token for integer matmuls (:mod:`ragfast.models.weight_quant`), or
        ``"auto"``: w8a8 where its products run packed (AMX tiles, AVX-512 VNNI), else native
        (``auto_weights``). The
        ledger books each turn's weight bytes read as the reasoner's ``bytes_scanned``, so the
        schemes' reads are comparable.
    prefill_tokens : int
        Most new (padded) tokens one prefill pass computes: a chunk whose prefill is longer runs
        it in row groups that write into the one batch cache, which then decodes as a whole, so
        the pass's activations scale with a group (the 1.5B's turns of 64 rows x up to 1,000 new
        tokens peaked at 7.3 GB resident in groups with the growing cache, 11.0 GB in one pass with
        each turn preallocated; bench/bench_kv_memory.py). Rows of a chunk come sorted by their
        new tokens, and each group pads only to its own longest row, so a prefill is also split
        where that saves more padding than a pass costs (:func:`~ragfast.models.kv_buffer.prefill_groups`).
        0: one pass.
    draft_tokens : int
        When few rows decode (:func:`~ragfast.models.drafts.draft_width`), each feeds up to this
        many tokens looked up in its own context after its picked one, and keeps those the pass's
        greedy picks confirm (:mod:`~ragfast.models.drafts`); the ledger books every token fed.
        0: one token a step.
    """

    meaningful = True

    def __init__(self, path: Any, device: str = "cpu", dtype: Any = None, max_batch: int = 64, *,
                 kv_reuse: bool = True, max_context: int | None = None, attn_implementation: str | None = None,
                 share_prefix: bool = True, min_prefix: int = 32, memory_budget: int | str | None = "auto",
                 kv_step: int = 64, weights: str = "native", prefill_tokens: int = 4096,
                 draft_tokens: int = DRAFT_TOKENS):
        from pathlib import Path

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        p = Path(path)
        if not (p / "config.json").is_file():
            raise ModelError(f"{p} is not a model directory (no config.json); HFGenerator loads local files only")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
        if max_context is not None and max_context < 2:
            raise ConfigError(f"max_context must be >= 2 tokens, got {max_context}")
        self.path = p
        self.device = str(device)
        self.max_batch = int(max_batch)
        self.kv_reuse = bool(kv_reuse)
        self.max_context = max_context
        if min_prefix < 1:
            raise ConfigError(f"min_prefix must be >= 1 token, got {min_prefix}")
        self.share_prefix = bool(share_prefix)
        self.min_prefix = int(min_prefix)
        if kv_step < 0:
            raise ConfigError(f"kv_step must be >= 0 tokens, got {kv_step}")
        self.kv_step = int(kv_step)
        if prefill_tokens < 0:
            raise ConfigError(f"prefill_tokens must be >= 0 tokens, got {prefill_tokens}")
        self.prefill_tokens = int(prefill_tokens)
        if draft_tokens < 0:
            raise ConfigError(f"draft_tokens must be >= 0, got {draft_tokens}")
        self.draft_tokens = int(draft_tokens)
        # Checked now (a bad size is one line before any model loads); "auto" is measured at the
        # first turn, when every other slot of a run has loaded.
        self._budget: int | None = None if memory_budget in (None, AUTO) else parse_size(memory_budget)
        self._budget_note = "" if memory_budget == AUTO else ("none" if self._budget is None else "given")
        #: The last shared prefix: its token ids and per-layer (keys, values), each [kv_heads, n, head_dim].
        self._template: tuple[list[int], list[tuple[Any, Any]]] | None = None
        #: Inside :meth:`keep_ended`: an ended session's prompt -> its token ids and keys/values.
        self._ended: dict[tuple[int, ...], tuple[list[int], list[tuple[Any, Any]]]] | None = None
        #: Inside :meth:`complete`: a session -> its prompt's ``settled`` test.
        self._settled: dict[str, Any] = {}
        #: ``keep_ended(shelve=name)``'s ended sessions, kept for a block that reuses them.
        self._shelves: dict[str, dict[tuple[int, ...], tuple[list[int], list[tuple[Any, Any]]]]] = {}
        from ragfast.models.weight_quant import resolve_dtype

        kw: dict[str, Any] = {}
        torch_dtype = resolve_dtype(dtype, self.device)
        if torch_dtype is not None:
            kw["dtype"] = torch_dtype
        if attn_implementation:
            kw["attn_implementation"] = attn_implementation
        from ragfast.checks import check_safetensors

        check_safetensors(p)  # a truncated download: one line, not a SafetensorError traceback
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True, **kw)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load a causal LM from {p}: {exc}") from None
        self.model.to(self.device).eval()
        if not attn_implementation:
            from ragfast.models.attention import set_decode_attention

            # Decode steps' attention on the kernel (models/attention.py; SDPA elsewhere).
            set_decode_attention(self.model)
        from ragfast.models.fused_layers import set_fused_layers

        set_fused_layers(self.model)  # RMSNorm and the SiLU gate on ragfast's kernels (models/fused_layers.py)
        self.config = self.model.config
        self.kv_reuse_note = ""
        if self.kv_reuse:
            from transformers import DynamicCache

            layers = getattr(DynamicCache(config=self.config), "layers", [])
            if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
                # Sliding-window and linear-attention layers do not keep one key/value per token,
                # so per-session caches cannot be cut out and re-padded: re-encode instead.
                self.kv_reuse = False
                self.kv_reuse_note = "KV reuse off: the model has sliding-window or linear-attention layers"
        self.dtype = next(self.model.parameters()).dtype
        eos: set[int] = set()
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), self.tokenizer.eos_token_id):
            if src is None:
                continue
            eos.update([src] if isinstance(src, int) else list(src))
        self.eos_ids = sorted(eos)
        self._eos = frozenset(eos)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
        from ragfast.models.tiny import tiny_marker

        marker = tiny_marker(p) or {}
        self.random_weights = bool(marker.get("random_weights", False))
        self.tiny_note = str(marker.get("note", "")) if marker else ""
        self.meaningful = bool(marker.get("meaningful", not self.random_weights)) if marker else True
        self.name = str(p)
        self._sessions: dict[str, _HFSession] = {}
        self._run: Any = None  # the running batch (decode_batch.RunningBatch), kept across calls
        self._held_base = 0  # kept keys/values outside the running batch (the peak's other part)
        self._pending: dict[str, list[int]] = {}  # truncated observation text -> its exact token ids
        self._torch = torch
        #: session id -> token ids generated by its last turn (before the stop cut), for audits.
        self.last_generated: dict[str, list[int]] = {}
        self._piece: dict[int, str] = {}  # token id -> its text alone (stop-string pre-check)
        self.bytes = GenerationBytes.of(self.config, self._torch.finfo(self.dtype).bits // 8)
        #: The chunk sizes of the last ``generate`` call (the budget may have split it).
        self.last_chunks: list[int] = []
        #: "memory budget: chunks of ..." after a call the budget split, else "" (progress status).
        self.budget_note = ""
        self._smallest_said: int | None = None  # the smallest chunk a log line announced
        self.set_weights(weights)
        self.stats = {"prefill_padding_tokens": 0, "decode_rows": 0, "decode_steps": 0, "cache_drops": 0,
                      "prefix_tokens_computed": 0, "prefix_tokens_reused": 0, "kv_peak_bytes": 0,
                      "planned_peak_bytes": 0, "shrunk_calls": 0, "smallest_chunk": 0, "caches_dropped_for_memory": 0,
                      "prefill_groups": 0, "draft_passes": 0, "draft_tokens_kept": 0, "lean_steps": 0}
        #: Decode steps as one flat loop over the layers where the model allows it
        #: (:mod:`ragfast.models.lean_step`: the model's logits, bit for bit); False: the model's forward.
        self.lean_steps = True
        self._lean: Any = None

    def set_weights(self, scheme: str) -> None:
        """Store the model's linear layers as ``scheme`` (one of ``weight_quant.WEIGHTS``) from now on.

        Called by the constructor; a subclass that changes the weights after loading (an adapter
        merged into them) calls it again once they are final.
        """
        from ragfast.models.weight_quant import apply_weights

        if getattr(self, "weight_info", None) is not None and self.weight_info.scheme != "native":
            raise ConfigError(f"the weights are already {self.weight_info.scheme}; load the model again")
        self.weight_info = apply_weights(self.model, scheme)
        head = self.model.get_output_embeddings()
        if head is not None and not getattr(head, "ragfast_contiguous_input", False):
            # transformers hands the head hidden[:, -1:, :], a strided view. When the head's weight
            # does not require grad (an adapter merged into the weights, or any model after
            # requires_grad_(False)), torch's matmul does not fold that view into one mm but runs a
            # bmm over a copy of the weight per row: 13.7 s and 4.3 GB for 16 rows of Qwen2.5-0.5B
            # in bf16 instead of 34 ms (the batch-64 prefill of the default reasoner took 18 GB).
            head.register_forward_pre_hook(_contiguous_input)
            head.ragfast_contiguous_input = True

    def describe(self) -> dict[str, Any]:
        dt = str(self.dtype).replace("torch.", "")
        d = {"name": self.name, "meaningful": self.meaningful, "class": type(self).__name__,
             "architecture": (self.config.architectures or [type(self.model).__name__])[0],
             "device": self.device, "dtype": dt, "weights": self.weight_info.describe(dt),
             "weight_read_bytes": self.weight_info.read_bytes, "kv_reuse": self.kv_reuse}
        if self.kv_reuse_note:
            d["kv_reuse_note"] = self.kv_reuse_note
        st = self.stats
        d["drafts"] = {"draft_tokens": self.draft_tokens, "passes": st["draft_passes"],
                       "tokens_kept": st["draft_tokens_kept"]}
        d["memory"] = {"budget_bytes": self._budget, "budget": self._budget_note or "auto (measured at the first turn)",
                       "kv_step_tokens": self.kv_step, "prefill_tokens": self.prefill_tokens,
                       "prefill_groups": st["prefill_groups"], "kv_peak_bytes": st["kv_peak_bytes"],
                       "planned_peak_bytes": st["planned_peak_bytes"], "shrunk_calls": st["shrunk_calls"],
                       "smallest_chunk": st["smallest_chunk"] or None,
                       "caches_dropped_for_memory": st["caches_dropped_for_memory"]}
        if self.random_weights:
            d["note"] = "random-weight tiny model: exercises the compute path only; answers are meaningless"
        elif not self.meaningful:
            d["note"] = self.tiny_note or "a tiny test model: answers are meaningless"
        return d

    # -- text <-> tokens ---------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (how every session piece is tokenised)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def format_prompt(self, user_text: str) -> str:
        """The user message through the chat template (``add_generation_prompt=True``), raw without one."""
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}],
                                                      add_generation_prompt=True, tokenize=False)
        return user_text

    def format_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """A whole conversation (role/content dicts) through the chat template, ready for the reply.

        Without a chat template: each message's text on its own line, then an empty line.
        """
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True,
                                                      tokenize=False)
        return "".join(f"{m['content']}\n" + ("\n" if m["role"] == "assistant" else "") for m in messages)

    def truncate_tokens(self, texts: Sequence[str], max_tokens: int) -> list[str]:
        """Cut each text to its first ``max_tokens`` tokens of this model's tokenizer.

        The cut ids are remembered, so appending the returned text appends exactly them (as the
        reference appends the truncated ids, not a re-tokenisation of their decoding).
        """
        out = []
        for t in texts:
            ids = self.encode(t)
            if len(ids) > max_tokens:
                ids = ids[:max_tokens]
                t = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._pending[t] = ids
            out.append(t)
        return out

    # -- sessions ----------------------------------------------------------------------------
    def start(self, ids: Sequence[str], prompts: Sequence[str]) -> None:
        check_new_sessions(self._sessions, ids, prompts, "HFGenerator.start")
        for i, p in zip(ids, prompts):
            toks = self.encode(p)
            if not toks:
                raise ValueError(f"HFGenerator.start: empty prompt for session {i!r}")
            self._sessions[i] = _HFSession(ids=toks, prompt=tuple(toks))

    def _check_idle(self, ids: Sequence[str], what: str) -> None:
        running = {r.sid for r in self._run.rows} if self._run is not None else set()
        busy = [i for i in ids if self._sessions[i].row is not None or i in running]
        if busy:
            raise RuntimeError(f"HFGenerator.{what}: session {busy[0]!r} is in the middle of a turn "
                               "(generate(partial=True) has not returned its text yet)")

    def append(self, ids: Sequence[str], texts: Sequence[str]) -> None:
        check_sessions(self._sessions, ids, "HFGenerator.append")
        self._check_idle(ids, "append")
        for i, t in zip(ids, texts):
            toks = self._pending.pop(t, None)
            self._sessions[i].ids.extend(toks if toks is not None else self.encode(t))

    def rewind(self, ids: Sequence[str], pieces: Sequence[Sequence[str]]) -> None:
        """Cut each session back to its prompt plus ``pieces`` (the text after the prompt, in the
        order it was appended), keeping the keys/values of the tokens that still match.

        What ``end`` + ``start`` + ``append`` of the same pieces would hold, without re-reading the
        prefix: S2G's stop rewinds a session to the state it judged, whose tokens it already has.
        """
        check_sessions(self._sessions, ids, "HFGenerator.rewind")
        self._check_idle(ids, "rewind")
        if len(ids) != len(pieces):
            raise ValueError(f"HFGenerator.rewind: {len(ids)} ids but {len(pieces)} lists of pieces")
        for i, p in zip(ids, pieces):
            s = self._sessions[i]
            new = list(s.prompt) + [t for x in p if x for t in self.encode(x)]
            keep = min(common_prefix(s.ids, new), s.n_cached)
            s.ids = new
            self._crop(s, keep)
            self.last_generated.pop(i, None)

    def complete(self, prompts: Sequence[str], *, stop: Sequence[str] = (), max_new_tokens: int = 256,
                 ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None,
                 settled: Sequence[Any] | None = None) -> list[str]:
        """:meth:`Generator.complete`; a completion ends at the first token after which its prompt's
        ``settled`` test holds (what is generated after it could not change the caller's outcome)."""
        self._settled = {sid: f for sid, f in zip(complete_ids(len(prompts)), settled or ()) if f is not None}
        try:
            return super().complete(prompts, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger,
                                    question_ids=question_ids)
        finally:
            self._settled = {}

    def end(self, ids: Sequence[str]) -> None:
        idx = self._run.index(ids) if self._run is not None else []
        if idx:  # turns in progress end with their sessions
            self._cut(self._run, idx, keep_kv=False)
        for i in ids:
            s = self._sessions.pop(i, None)
            self.last_generated.pop(i, None)
            if self._ended is not None and s is not None and s.kv is not None and s.n_cached:
                self._ended[s.prompt] = (s.ids[:s.n_cached], s.kv)
        if not self._sessions:
            self._pending.clear()

    def session_tokens(self, sid: str) -> list[int]:
        """A copy of a session's token ids (for tests and audits)."""
        return list(self._sessions[sid].ids)

    # -- generation --------------------------------------------------------------------------
    #: ``generate(..., partial=True)`` is supported (the Search-R1 loop's continuous batching).
    partial_turns = True

    def generate(self, ids: Sequence[str], *, stop: Sequence[str], max_new_tokens: int,
                 ledger: CostLedger | None = None, partial: bool = False) -> list[str | None]:
        """One turn of greedy generation for each session (see the class docstring).

        Parameters
        ----------
        ids : sequence of str
        stop : sequence of str
            A turn ends after the first of these strings (kept in the text), at EOS or after
            ``max_new_tokens`` tokens.
        max_new_tokens : int
        ledger : CostLedger, optional
            Gets one reasoner record per finished turn.
        partial : bool
            Return once some rows have finished; the others come back as None and keep their
            place in the running batch: a later call with their ids goes on with them. Running
            rows a call leaves out are set aside with their keys/values until a call names them.

        Returns
        -------
        list of str or None
            The turns' texts, in the order of ``ids``; None only with ``partial``.
        """
        check_sessions(self._sessions, ids, "HFGenerator.generate")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rule = StopRule.of(stop, max_new_tokens)
        self._eos = frozenset(self.eos_ids)
        self._lean = lean_plan(self.model) if self.lean_steps else None  # the modules as this turn runs them
        run = self._run
        inside = {r.sid for r in run.rows} if run is not None else set()
        if inside - set(ids):
            self._park(inside - set(ids))
            inside &= set(ids)
        new = [i for i in ids if i not in inside]
        seed = self.kv_reuse and self.share_prefix
        for i in new:
            self._prepare(self._sessions[i])
            if seed and self._sessions[i].kv is None:
                # an ended session's tokens, else the kept prefix, before planning: the chunks' sizes then count it
                self._seed_ended(self._sessions[i]) or self._seed(self._sessions[i])
        # Sessions on one prompt are admitted together: nested states (S2G's probes of one run) share
        # a prefix's keys/values only within an admission, which _admit sorts by new tokens.
        pending = sorted(new, key=lambda i: self._sessions[i].prompt)
        self.last_chunks = []
        out: dict[str, str] = {}
        done: list[Any] = []
        shrunk = False
        timer = Timer(self.device)  # wall seconds, and CUDA-event seconds on a GPU
        timer.__enter__()
        try:
            with self._torch.inference_mode():
                steps_since = None  # decode steps since this call's first row finished
                while True:
                    run = self._run
                    if run is not None and run.rows and run.last is None:
                        self._feed(run)
                    take = admit_count(run, len(pending), self.max_batch)
                    if take and run is not None and run.rows:
                        take = min(take, self._fit(pending, max_new_tokens, beside=True))  # or wait
                    elif take:
                        n = self._fit(pending, max_new_tokens)
                        shrunk = shrunk or n < take
                        take = min(take, n)
                    if take:
                        self.last_chunks.append(take)
                        self._admit(pending[:take], rule)
                        pending = pending[take:]
                    run = self._run
                    if run is None or not run.rows:
                        break
                    finished = self._pick(run)
                    done.extend(finished)
                    if done:
                        steps_since = 0 if steps_since is None else steps_since + 1
                    if partial and done and return_now(len(done), len(run.rows), steps_since):
                        break
        except BaseException:
            self._drop_batch()
            raise
        finally:
            timer.__exit__(None, None, None)
        share_time(self.config, (list(self._run.rows) if self._run is not None else []) + done, timer.seconds,
                   timer.device_seconds)
        booked = [self._finish(row, out) for row in done]
        if ledger is not None and booked:
            # one batched record set per call; each turn's seconds are its shares of the calls it ran in
            cols = list(zip(*booked))
            ledger.add_batch("reasoner", [r.sid for r in done], seconds=[r.seconds for r in done],
                             device_seconds=[r.device_seconds for r in done], input_tokens=cols[0],
                             cached_tokens=cols[1], output_tokens=cols[2], flops=cols[3], flops_uncached=cols[4],
                             bytes_scanned=cols[5])
        self.budget_note = ""
        if shrunk:
            self._say_shrunk(len(ids))
        if not partial and len(out) < len(ids):
            raise RuntimeError(f"HFGenerator.generate: {len(ids) - len(out)} of {len(ids)} sessions did not finish")
        return [out.get(i) for i in ids]

    def _running_bytes(self) -> int:
        # Twice the running batch at its largest: an admission copies it (beside the new rows' cache).
        run = self._run
        return 0 if run is None else 2 * run.planned_bytes(self.bytes.kv_per_token)

    def _prepare(self, sess: _HFSession) -> None:
        if sess.row is not None:
            return  # a turn set aside mid-way: its cache holds every token it fed
        if self.max_context is not None and len(sess.ids) > self.max_context:
            # Reference: the rolling input keeps its last max_prompt_length tokens.
            sess.ids = sess.ids[-self.max_context:]
            sess.kv, sess.n_cached = None, 0
            sess.truncations += 1
        if not self.kv_reuse or sess.kv is None:
            sess.kv, sess.n_cached = None, 0
        if sess.n_cached >= len(sess.ids):
            # Nothing new since the cache was filled: recompute the last token to get its logits.
            self._crop(sess, len(sess.ids) - 1)

    @staticmethod
    def _crop(sess: _HFSession, n: int) -> None:
        if sess.kv is None or n <= 0:
            sess.kv, sess.n_cached = None, 0
            return
        sess.kv = [(k[:, :n], v[:, :n]) for k, v in sess.kv]
        sess.n_cached = n

    def _admit(self, sids: list[str], rule: Any) -> None:
        """Prefill ``sids`` (their cached keys/values left-padded into a batch cache, their new
        tokens computed) and add them to the running batch with their last logits."""
        torch = self._torch
        sids = sorted(sids, key=lambda i: len(self._sessions[i].ids) - self._sessions[i].n_cached)
        sessions = [self._sessions[i] for i in sids]
        paid = self._share_prefix(sessions) if self.kv_reuse and self.share_prefix else {}
        n_past = [s.n_cached for s in sessions]
        fresh = [s.ids[s.n_cached:] for s in sessions]
        n_new = [len(f) for f in fresh]
        P, F = max(n_past), max(n_new)
        dev = self.device
        rows = []
        for b, (sid, s) in enumerate(zip(sids, sessions)):
            row = s.row
            if row is None:  # a new turn (else one set aside, going on: its accounting goes on too)
                own = self._settled.get(sid)  # a completion's own settled test (complete)
                row = Row(sid, rule if own is None else dataclasses.replace(rule, settled=own), base=len(s.ids),
                          n_past=n_past[b], n_new=n_new[b], paid=list(paid.get(b, ())))
            s.row = None
            row.pos = len(s.ids)
            row.passes = [(n_new[b], n_past[b])] + list(paid.get(b, ()))
            rows.append(row)
        input_ids, mask, pos = (t.to(dev) for t in padded_inputs(n_past, fresh, self.pad_id))
        # Decoding writes in place (kv_buffer.py: the per-step torch.cat of DynamicCache was 40% of
        # a batch-32 decode step) into a buffer that grows by kv_step tokens up to the whole turn.
        turn = P + F + max(r.left() for r in rows)
        cache = cache_for(self.config, min(turn, P + F + self.kv_step) if self.kv_step else turn, self.kv_step, turn)
        groups = prefill_groups(n_new, self.prefill_tokens)  # each pads to its own longest row
        # The batch cache takes the sessions' keys/values, one layer at a time (each layer's copies go
        # once moved); a failed turn leaves the sessions without a cache, so their next turn computes it.
        kept = [list(s.kv) if s.kv is not None else None for s in sessions]
        for s in sessions:
            s.kv, s.n_cached = None, 0
        mergeable = reserve_rows(cache, self.config, len(sids), self.dtype, dev)
        if not mergeable:
            groups = [(0, len(sids))]  # transformers' own cache (other layer kinds): one pass
        widths = [max(n_new[lo:hi]) for lo, hi in groups]
        self.stats["prefill_padding_tokens"] += sum((hi - lo) * w for (lo, hi), w in zip(groups, widths)) - sum(n_new)
        fill_left_padded(cache, kept, P)
        del kept
        if P:
            release_free_heap()
        parts = []
        for (lo, hi), w in zip(groups, widths):
            # A long prefill in row groups, each writing its rows of the batch cache: the pass's
            # activations scale with the group. A group computes only its own longest row's width
            # (the rest of its left padding is zeroed, not computed). The row view is never kept: a
            # view pins its whole buffer (a kept view held about 1.6 GB of the 1.5B's through decoding).
            parts.append(self.model(input_ids=input_ids[lo:hi, F - w:], attention_mask=mask[lo:hi],
                                    position_ids=pos[lo:hi, F - w:], use_cache=True, logits_to_keep=1,
                                    cache=cache if len(groups) == 1 else row_view(cache, self.config, lo, hi,
                                                                                  skip=F - w)).logits[:, -1, :])
        if len(groups) > 1:
            for layer in cache.layers:
                layer.fill_to(P + F)
            self.stats["prefill_groups"] += len(groups)
        last = torch.cat(parts)
        run = self._run
        if run is None or not run.rows:
            self._run = RunningBatch(cache, mask, rows, mergeable, last=last)
        else:
            # Both parts right-aligned at the longest row: the running rows' padding may widen.
            limit = max(run.mask.shape[1], P + F) + max(r.left() for r in run.rows + rows)
            merged, mmask = merge_left_padded(self.config, [(run.cache, run.mask), (cache, mask)], self.kv_step, limit)
            self._run = RunningBatch(merged, mmask, run.rows + rows, True, last=torch.cat([run.last, last]))
            release_free_heap()  # the parts' buffers, freed layer by layer
        self._held_base = self._held(running=False)[0]
        self._note_kv(self._held_base + cache_bytes(self._run.cache))

    def _feed(self, run: Any) -> None:
        """One decode step: the rows' picked tokens through the model, their logits kept; with few
        rows, each row's draft after its token (:mod:`ragfast.models.drafts`)."""
        torch = self._torch
        dev, rows = self.device, run.rows
        drafts = self._drafts(run)
        t = 1 + max(map(len, drafts)) if drafts else 1
        if t == 1:
            x = run.nxt.view(-1, 1)
        else:  # a short draft is padded with its last token: computed, never accepted past its length
            x = [[n] + d for n, d in zip(run.nxt.tolist(), drafts)]
            x = torch.tensor([r + r[-1:] * (t - len(r)) for r in x], dtype=torch.long, device=dev)
        p = torch.tensor([[r.pos + j for j in range(t)] for r in rows], dtype=torch.long, device=dev)
        self.stats["decode_rows"] += len(rows)
        self.stats["decode_steps"] += 1
        mask = torch.cat([run.mask, run.mask.new_ones((len(rows), t))], dim=1)
        if self._lean is not None:  # the same logits without transformers' module walk
            logits = lean_forward(self._lean, x, mask, p, run.cache, t)
            self.stats["lean_steps"] += 1
        else:
            logits = self.model(input_ids=x, attention_mask=mask, position_ids=p, cache=run.cache, use_cache=True,
                                logits_to_keep=t).logits
        keeps = [0] * len(rows)
        if t > 1:
            keeps = settle([r.gen for r in rows], drafts, self._argmax(logits).tolist(),
                           lambda b, g: self._ends(g, rows[b].rule))
            top = max(keeps)
            for layer in run.cache.layers:  # columns no row keeps go; a row's rejected drafts stay, masked
                layer.crop(top + 1 - t)
            k = torch.tensor(keeps, dtype=torch.long, device=dev)
            kept_cols = (torch.arange(top + 1, device=dev)[None, :] <= k[:, None]).to(run.mask.dtype)
            run.mask = torch.cat([run.mask, kept_cols], dim=1)
            run.last = logits[torch.arange(len(rows), device=dev), k]
            self.stats["draft_passes"] += 1
            self.stats["draft_tokens_kept"] += sum(keeps)
        else:
            run.mask = torch.cat([run.mask, run.mask.new_ones((len(rows), 1))], dim=1)
            run.last = logits[:, -1, :]
        for r, kept in zip(rows, keeps):
            r.passes.append((t, r.pos))
            if t > 1:
                r.drafted.append((t, r.pos, kept + 1))
            r.pos += kept + 1
        run.nxt = None
        self._note_kv(self._held_base + cache_bytes(run.cache))

    def _drafts(self, run: Any) -> list[list[int]] | None:
        """Each row's draft when few enough rows run for a drafted pass (and some row has one), else None."""
        k = draft_width(len(run.rows), self.draft_tokens) if run.mergeable else 0
        if k < 1:
            return None
        out = [propose(self._sessions[r.sid].ids[:r.base] + r.gen, min(k, r.left() - 1)) for r in run.rows]
        return out if any(out) else None

    def _pick(self, run: Any) -> list[Any]:
        """Pick each row's next token; cut the rows whose turn ended out of the batch.

        Returns the finished rows, each with its keys/values (``row.kept``) when they are kept.
        """
        nxt = self._argmax(run.last)
        run.last = None
        toks = nxt.tolist()  # one device->host copy per step, not one per row
        fin = []
        for r, (row, tok) in enumerate(zip(run.rows, toks)):
            row.gen.append(tok)
            if self._ends(row.gen, row.rule):
                fin.append(r)
        run.nxt = nxt
        # Drop finished rows now: decoding padding for them would waste a full row.
        return self._cut(run, fin, keep_kv=self.kv_reuse) if fin else []

    def _argmax(self, logits: Any) -> Any:
        # ragfast's argmax on the CPU (fp32 and bf16 logits): torch's is not vectorised for bf16
        # (17 ms of a 285 ms step at 64 rows of the 0.5B); the same answer, the first of equals.
        ours = logits.device.type == "cpu" and logits.dtype in (self._torch.float32, self._torch.bfloat16)
        return greedy_pick(logits) if ours else logits.argmax(dim=-1)

    def _cut(self, run: Any, gone: list[int], keep_kv: bool) -> list[Any]:
        rows = run.cut(gone, keep_kv)
        self._held_base += sum(a.nbytes + b.nbytes for r in rows for a, b in r.kept or ())
        release_free_heap()  # the rows' freed buffers and copies (55 ms at most once a step)
        return rows

    def _park(self, sids: Any) -> None:
        """Set running rows aside (a call that does not name them): each session keeps its turn's
        tokens so far and their keys/values, and the row goes on when a call names it again."""
        run = self._run
        if run.last is not None:
            raise RuntimeError("HFGenerator: rows cannot be set aside between a pass and its pick")
        for row in self._cut(run, run.index(sids), keep_kv=True):
            s = self._sessions[row.sid]
            s.ids = s.ids[:row.base] + row.gen  # the last generated token is not fed yet
            s.kv, s.n_cached, s.row = row.kept, len(s.ids) - 1, row
            row.kept = None

    def _drop_batch(self) -> None:
        """After an error mid-call: every running or set-aside turn is dropped, its session as it
        was before the turn and without a cache (its next turn computes it)."""
        rows = list(self._run.rows) if self._run is not None else []
        rows += [s.row for s in self._sessions.values() if s.row is not None]
        self._run = None
        for s, row in ((self._sessions[r.sid], r) for r in rows if r.sid in self._sessions):
            s.ids, s.kv, s.n_cached, s.row = s.ids[:row.base], None, 0, None

    def _finish(self, row: Any, out: dict[str, str]) -> tuple[int, int, int, float, float, int]:
        """A finished turn: its text (into ``out``), the session's tokens and keys/values, and its
        ledger figures (:func:`~ragfast.models.decode_batch.turn_figures`)."""
        sid, g = row.sid, row.gen
        s = self._sessions[sid]
        s.ids = s.ids[:row.base]
        self.last_generated[sid] = list(g)
        # The end-of-sequence token is never text (also when a checkpoint's EOS is not marked special).
        body = g[:-1] if g and g[-1] in self._eos else g
        raw = self.tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        text, _ = cut_at_stop(raw, list(row.rule.stop))
        resp = self.encode(text)
        # Keys/values exist for every fed token: the session's ids plus all generated but the last.
        fed_gen = g[:-1]
        common = 0
        for a, c in zip(fed_gen, resp):
            if a != c:
                break
            common += 1
        base = len(s.ids)
        if self.kv_reuse and row.kept is not None:
            s.kv = row.kept
            s.n_cached = base + len(fed_gen)
            if common < len(fed_gen):
                self.stats["cache_drops"] += 1
            self._crop(s, base + common)
        else:
            s.kv, s.n_cached = None, 0
        row.kept = None
        s.ids.extend(resp)
        out[sid] = text
        return turn_figures(self.config, row, self.weight_info.read_bytes)

    def _ends(self, gen: list[int], rule: StopRule) -> bool:
        """Whether a turn's tokens end it at their last one: EOS, its length, or a stop string."""
        tok = gen[-1]
        if tok in self._eos or len(gen) >= rule.max_new:
            return True
        if rule.settled is not None and rule.settled(self.tokenizer.decode(gen, skip_special_tokens=True)):
            return True
        if not rule.stop:
            return False
        if rule.last_chars is not None:
            text = self._piece.get(tok)
            if text is None:
                text = self._piece[tok] = self.tokenizer.decode([tok], skip_special_tokens=True)
            if not any(c in text for c in rule.last_chars):
                return False
        tail = self.tokenizer.decode(gen[-rule.window:], skip_special_tokens=True)
        return any(x in tail for x in rule.stop)

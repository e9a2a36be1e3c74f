"""The causal-LM stopping judge (S2G protocol, see ``shared/PROTOCOLS.md``).

The STOP score of a state is ``log P("true") - log P("false")`` for the next token after the
chat-templated prompt (:mod:`ragfast.judges.prompt`) followed by the assistant prefix
``{"sufficient":``. By default the states of one trajectory (nested prefixes of each other) are
scored in ONE forward pass with a prefix/segment attention mask, on top of a system-prompt KV
cache computed once per judge.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ragfast.infra.cache import ByteLRU, text_key
from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.judges.base import Judge
from ragfast.judges.prompt import (ANSWER_PREFIX, BLOCK_SEP, NO_CONTEXT, SYSTEM_PROMPT, Verdict, as_states,
                                         context_blocks, group_states, parse_verdict, user_text)
from ragfast.types import State

__all__ = ["ATTN_IMPL", "CausalJudge"]

# Marks where the user text goes in the chat template, so the template splits around it.
_SENTINEL = "\u2063RAGFAST_USER_TEXT\u2063"

# ---------------------------------------------------------------------------------------------
# the custom attention hook for transformers
# ---------------------------------------------------------------------------------------------
ATTN_IMPL = "ragfast_prefix"
_REGISTERED = False


def _register_attention() -> None:
    """Register ``ragfast_prefix`` with transformers' AttentionInterface (idempotent).

    With a ``ragfast_mask=(prefix_hi, seg_lo, backend)`` keyword in the forward call, attention
    runs :func:`ragfast.ops.prefix_attention.prefix_attention`; without it, it is plain SDPA
    with the model's usual mask (naive scoring, generation, the system-prompt prefill).
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def ragfast_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        spec = kwargs.pop("ragfast_mask", None)
        if spec is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        from ragfast.ops.prefix_attention import prefix_attention, prefix_attention_flex, prefix_attention_ref

        hi, lo, backend, prebuilt = spec
        if backend == "flex":
            out = prefix_attention_flex(query, key, value, hi, lo, scaling, block_mask=prebuilt)
        elif backend == "ref":
            out = prefix_attention_ref(query, key, value, hi, lo, scaling, mask=prebuilt)
        else:
            # The description comes from CausalJudge._pack (valid by construction): no per-layer checks.
            out = prefix_attention(query, key, value, hi, lo, scaling, backend=backend, check=False)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(ATTN_IMPL, ragfast_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPL, sdpa_mask)
    _REGISTERED = True


def _forward_flops(config: Any, lengths: Sequence[int], past: Sequence[int] | None = None,
                   heads: Sequence[int] | None = None) -> list[float]:
    """Analytic FLOPs per sequence; ``heads[i]`` = positions whose lm-head logits were computed."""
    from ragfast.accounting.flops import forward_flops_per_sequence

    out = forward_flops_per_sequence(config, [int(n) for n in lengths],
                                     None if past is None else [int(p) for p in past], logits="last")
    if heads is not None:
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        hidden = int(getattr(config, "hidden_size", 0) or 0)
        out = [f + 2.0 * hidden * vocab * (max(int(h), 1) - 1) for f, h in zip(out, heads)]
    return [float(f) for f in out]


# ---------------------------------------------------------------------------------------------
# CausalJudge
# ---------------------------------------------------------------------------------------------
class CausalJudge(Judge):
    """A causal-LM sufficiency judge with prefix-shared batch scoring.

    Parameters
    ----------
    path : str or Path
        Local Hugging Face causal-LM directory (nothing is downloaded).
    device : str
        ``"cpu"`` or ``"cuda[:i]"``.
    dtype : str or torch.dtype, optional
        Default fp32 on the CPU, bf16 on CUDA.
    system_prompt : str, optional
        Replaces :data:`SYSTEM_PROMPT`.
    attention : {"auto", "ref", "flex", "triton"}
        Masked-attention implementation of the packed path: ``ref`` = dense mask + SDPA,
        ``flex`` = FlexAttention block mask, ``triton`` = the Triton kernel; ``auto`` picks
        triton on CUDA (fp16/fp32), else ref.
    max_batch_tokens : int
        Token budget (rows x padded length) of one forward pass.
    meaningful : bool, optional
        Override the check; by default a model written by ``ragfast.models.tiny`` (random
        weights, marked by ``ragfast_tiny.json``) is not meaningful, anything else is.
    chat_template_kwargs : dict, optional
        Extra template variables; default ``{"enable_thinking": False}`` (Qwen3: answer
        directly, no think block).

    Notes
    -----
    Word variants: the "true" side of the score sums the probabilities of the FIRST token of
    the tokenisations of " true" and "true" (likewise " false"/"false"); duplicate ids are
    counted once, and an id that starts both words is dropped from both (it says nothing).
    """

    def __init__(self, path: str | Path, device: str = "cpu", dtype: Any = None, system_prompt: str | None = None,
                 *, attention: str = "auto", max_batch_tokens: int = 32768, meaningful: bool | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(path).expanduser()
        if not path.is_dir() or not (path / "config.json").exists():
            raise ModelError(f"judge model directory not found or has no config.json: {path}")
        if attention not in ("auto", "ref", "flex", "triton"):
            raise ConfigError(f"attention must be auto, ref, flex or triton; got {attention!r}")
        if max_batch_tokens < 64:
            raise ConfigError(f"max_batch_tokens must be >= 64, got {max_batch_tokens}")
        self.path = path
        self.device = str(device)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} requested but CUDA is not available")
        if dtype is None:
            dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        elif isinstance(dtype, str):
            names = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
                     "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
            if dtype.lower() not in names:
                raise ConfigError(f"unknown dtype {dtype!r}; expected fp32, fp16 or bf16")
            dtype = names[dtype.lower()]
        self.dtype = dtype
        _register_attention()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype,
                                                              attn_implementation=ATTN_IMPL)
        except Exception as exc:
            raise ModelError(f"cannot load judge LM from {path}: {exc}") from exc
        self.model.eval().to(self.device)
        self.config = self.model.config
        if attention == "auto":
            attention = "triton" if self.device.startswith("cuda") and dtype != torch.bfloat16 else "ref"
        self.attention = attention
        self.max_batch_tokens = int(max_batch_tokens)
        self.system_prompt = SYSTEM_PROMPT if system_prompt is None else str(system_prompt)
        self.chat_template_kwargs = {"enable_thinking": False} if chat_template_kwargs is None else dict(chat_template_kwargs)
        tiny = path / "ragfast_tiny.json"
        random_weights = False
        if tiny.exists():
            try:
                random_weights = bool(json.loads(tiny.read_text()).get("random_weights", True))
            except json.JSONDecodeError:
                random_weights = True
        self.meaningful = (not random_weights) if meaningful is None else bool(meaningful)
        self.name = str(path)
        self.parse_stats: Counter = Counter()
        self._piece_cache = ByteLRU()  # text digest -> token ids, capped in bytes
        self._sys_kv = None
        self._build_prompt_pieces()
        self._true_ids, self._false_ids = self._word_ids()

    # -- description --------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """Model path, whether the scores mean anything, and how it scores."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": ("random-weight tiny model: scores exercise the compute path only" if not self.meaningful
                        else "causal LM judge (S2G protocol)"),
                "device": self.device, "dtype": str(self.dtype).replace("torch.", ""), "attention": self.attention,
                "true_ids": self._true_ids, "false_ids": self._false_ids, "system_tokens": len(self._sys_ids),
                "parse_stats": dict(self.parse_stats)}

    # -- prompt pieces ------------------------------------------------------------------------
    def set_system_prompt(self, text: str | None) -> None:
        """Use another system instruction (None: :data:`SYSTEM_PROMPT`); drops the cached prefix KV."""
        self.system_prompt = SYSTEM_PROMPT if text is None else str(text)
        self._piece_cache.clear()
        self._sys_kv = None
        self._build_prompt_pieces()

    def _build_prompt_pieces(self) -> None:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            msgs = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": _SENTINEL}]
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs)
            if text.count(_SENTINEL) != 1:
                raise ModelError(f"the chat template of {self.path} does not place the user message verbatim")
            before, after = text.split(_SENTINEL)
        else:
            # No template (a base LM): a plain layout, documented here because scores depend on it.
            before, after = f"{self.system_prompt}\n\n", "\n\n"
        self._template_before, self._template_after = before, after
        self._sys_ids = self._ids(before)
        self._tail_ids = self._ids(after + ANSWER_PREFIX)
        self._marker_ids = self._ids(NO_CONTEXT)
        if not self._sys_ids:
            raise ModelError("the judge's system prefix tokenised to nothing")

    def _ids(self, text: str) -> list[int]:
        # Pieces are tokenised on their own, so the naive and packed paths use identical ids.
        key = text_key(text)
        got = self._piece_cache.get(key)
        if got is None:
            got = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            self._piece_cache.put(key, got)
        return got

    def _word_ids(self) -> tuple[list[int], list[int]]:
        def first(words):
            ids = []
            for w in words:
                t = self.tokenizer(w, add_special_tokens=False)["input_ids"]
                if t and t[0] not in ids:
                    ids.append(int(t[0]))
            return ids

        t_ids, f_ids = first((" true", "true")), first((" false", "false"))
        both = set(t_ids) & set(f_ids)
        t_ids = [i for i in t_ids if i not in both]
        f_ids = [i for i in f_ids if i not in both]
        if not t_ids or not f_ids:
            raise ModelError(f"the tokenizer of {self.path} gives 'true' and 'false' the same first token")
        return t_ids, f_ids

    def _head_ids(self, question: str) -> list[int]:
        return self._ids(f"QUESTION:\n{question}\n\nCONTEXT:\n")

    def _block_ids(self, blocks: Sequence[str]) -> list[list[int]]:
        # The separator opens the next block, so a state's prefix ends exactly at its last block.
        return [self._ids(b if i == 0 else BLOCK_SEP + b) for i, b in enumerate(blocks)]

    def _suffix_ids(self, n_blocks: int) -> list[int]:
        return (self._marker_ids if n_blocks == 0 else []) + self._tail_ids

    def prompt_ids(self, state: State | tuple[str, list[str]]) -> list[int]:
        """The full token ids the judge reads for one state (system, user message, answer prefix)."""
        st = as_states([state])[0]
        blocks = context_blocks(st)
        out = list(self._sys_ids) + self._head_ids(st.question)
        for b in self._block_ids(blocks):
            out += b
        return out + self._suffix_ids(len(blocks))

    def prompt_text(self, state: State | tuple[str, list[str]]) -> str:
        """The chat-templated prompt text of one state (what :meth:`prompt_ids` tokenises)."""
        st = as_states([state])[0]
        return self._template_before + user_text(st) + self._template_after + ANSWER_PREFIX

    # -- scoring ------------------------------------------------------------------------------
    def _score_hidden(self, h: Any) -> np.ndarray:
        import torch

        logits = self.model.get_output_embeddings()(h).float()
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        lp = torch.log_softmax(logits, dim=-1)
        t = torch.logsumexp(lp[:, self._true_ids], dim=-1)
        f = torch.logsumexp(lp[:, self._false_ids], dim=-1)
        return (t - f).double().cpu().numpy()

    def _decoder(self):
        return getattr(self.model, self.model.base_model_prefix)

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None, packed: bool = True) -> np.ndarray:
        """STOP score per state: ``log P(true) - log P(false)`` after ``{"sufficient":``.

        Parameters
        ----------
        states : sequence of State or (question, [evidence, ...])
            May mix trajectories; states of one trajectory are found by ``trajectory_id`` or by
            evidence-prefix nesting under the same question (:func:`group_states`).
        ledger : CostLedger, optional
            Receives ``judge`` records: fresh vs cached tokens, FLOPs, seconds.
        question_ids : sequence of str, optional
            One id per state for the per-question ledger split.
        packed : bool
            True (default): one forward pass per trajectory with a prefix mask, on a shared
            system-prompt KV cache. False: every state as its own full prompt.

        Returns
        -------
        numpy.ndarray
            float64 ``[len(states)]``.
        """
        sts = as_states(states)
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        if not sts:
            return np.zeros(0, dtype=np.float64)
        if packed:
            return self._scores_packed(sts, ledger, question_ids)
        return self._scores_naive(sts, ledger, question_ids)

    def _batches(self, lengths: Sequence[int]) -> list[list[int]]:
        # Longest first, rows added while rows x longest stays within the token budget.
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        out, cur, width = [], [], 0
        for i in order:
            w = max(width, lengths[i])
            if cur and w * (len(cur) + 1) > self.max_batch_tokens:
                out.append(cur)
                cur, w = [], lengths[i]
            cur.append(i)
            width = w
        if cur:
            out.append(cur)
        return out

    def _scores_naive(self, sts: list[State], ledger, question_ids) -> np.ndarray:
        import torch

        t0 = time.perf_counter()
        seqs = [self.prompt_ids(s) for s in sts]
        lengths = [len(s) for s in seqs]
        scores = np.full(len(sts), np.nan)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dec = self._decoder()
        with torch.inference_mode():
            for rows in self._batches(lengths):
                W = max(lengths[i] for i in rows)
                ids = torch.full((len(rows), W), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), W), dtype=torch.long)
                for r, i in enumerate(rows):
                    ids[r, :lengths[i]] = torch.tensor(seqs[i])
                    mask[r, :lengths[i]] = 1
                h = dec(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
                last = torch.tensor([lengths[i] - 1 for i in rows], device=self.device)
                hs = h[torch.arange(len(rows), device=self.device), last]
                scores[rows] = self._score_hidden(hs)
        if ledger is not None:
            qids = list(question_ids) if question_ids is not None else [None] * len(sts)
            ledger.add_batch("judge", qids, seconds=time.perf_counter() - t0, input_tokens=lengths,
                             flops=_forward_flops(self.config, lengths))
        return scores

    def _system_kv(self):
        """Per-layer (key, value) of the system prefix, computed once and reused."""
        import torch
        from transformers import DynamicCache

        if self._sys_kv is None:
            t0 = time.perf_counter()
            cache = DynamicCache(config=self.config)
            ids = torch.tensor([self._sys_ids], device=self.device)
            with torch.inference_mode():
                self._decoder()(input_ids=ids, cache=cache, use_cache=True)
            self._sys_kv = [(layer.keys, layer.values) for layer in cache.layers]
            self._sys_kv_new = True
            self._sys_kv_seconds = time.perf_counter() - t0
        return self._sys_kv

    def _pack(self, sts: list[State], chain: list[int]) -> dict[str, Any]:
        """Token ids, positions and mask description of one trajectory (relative to the cache)."""
        S = len(self._sys_ids)
        root = sts[chain[-1]]
        blocks = context_blocks(root)
        ids = list(self._head_ids(root.question))
        ends = [S + len(ids)]
        for b in self._block_ids(blocks):
            ids += b
            ends.append(S + len(ids))
        main = len(ids)
        pos = list(range(S, S + main))
        hi = [0] * main
        lo = [0] * main
        last = []
        for i in chain:
            n = len(sts[i].evidence)
            suf = self._suffix_ids(n)
            start = S + len(ids)
            ids += suf
            pos += range(ends[n], ends[n] + len(suf))
            hi += [ends[n]] * len(suf)
            lo += [start] * len(suf)
            last.append(len(ids) - 1)
        return {"ids": ids, "pos": pos, "hi": hi, "lo": lo, "last": last, "main": main}

    def _scores_packed(self, sts: list[State], ledger, question_ids) -> np.ndarray:
        import torch
        from transformers import DynamicCache

        t0 = time.perf_counter()
        self._sys_kv_new = False
        sys_kv = self._system_kv()
        S = len(self._sys_ids)
        chains = group_states(sts)
        packs = [self._pack(sts, ch) for ch in chains]
        lengths = [len(p["ids"]) for p in packs]
        scores = np.full(len(sts), np.nan)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        dec = self._decoder()
        with torch.inference_mode():
            for rows in self._batches(lengths):
                B, W = len(rows), max(lengths[g] for g in rows)
                ids = torch.full((B, W), pad, dtype=torch.long)
                # Padding rows sit after the real tokens and see only themselves.
                a = torch.arange(W) + S
                pos = a.clone().repeat(B, 1)
                hi = torch.zeros((B, W), dtype=torch.int32)
                lo = a.to(torch.int32).repeat(B, 1)
                for r, g in enumerate(rows):
                    p, L = packs[g], lengths[g]
                    ids[r, :L] = torch.tensor(p["ids"])
                    pos[r, :L] = torch.tensor(p["pos"])
                    hi[r, :L] = torch.tensor(p["hi"], dtype=torch.int32)
                    lo[r, :L] = torch.tensor(p["lo"], dtype=torch.int32)
                ids, pos, hi, lo = (t.to(self.device) for t in (ids, pos, hi, lo))
                # The mask is built once per forward and shared by every layer.
                prebuilt = None
                if self.attention == "flex":
                    from ragfast.ops.prefix_attention import flex_block_mask

                    prebuilt = flex_block_mask(hi, lo, S + W)
                elif self.attention == "ref":
                    from ragfast.ops.prefix_attention import dense_mask

                    prebuilt = dense_mask(hi, lo, S + W)
                cache = DynamicCache(ddp_cache_data=[(k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1))
                                                     for k, v in sys_kv], config=self.config)
                # The mask lives in ragfast_mask, read by the registered attention function. Every
                # decoder family hands a 4-D attention_mask through unchanged (transformers'
                # create_causal_mask returns a 4-D mask as it is), so a 4-D tensor is the one
                # mask argument Llama, Mistral, Qwen2 and Qwen3 all accept without building
                # their own; a dict of masks is read only by the families that route per layer
                # type (Llama crashed on it). The "ref" path's dense mask serves as it is;
                # otherwise a broadcast view of one element costs nothing.
                mask4 = prebuilt if self.attention == "ref" else torch.ones(
                    (1, 1, 1, 1), dtype=torch.bool, device=self.device).expand(B, 1, W, S + W)
                h = dec(input_ids=ids, position_ids=pos, attention_mask=mask4, cache=cache, use_cache=True,
                        ragfast_mask=(hi, lo, self.attention, prebuilt)).last_hidden_state
                sel_r, sel_c, dest = [], [], []
                for r, g in enumerate(rows):
                    for i, c in zip(chains[g], packs[g]["last"]):
                        sel_r.append(r)
                        sel_c.append(c)
                        dest.append(i)
                hs = h[torch.tensor(sel_r, device=self.device), torch.tensor(sel_c, device=self.device)]
                scores[dest] = self._score_hidden(hs)
        if ledger is not None:
            qids = [question_ids[ch[0]] if question_ids is not None else None for ch in chains]
            # Attention FLOPs count each row as fully causal: an upper bound for the suffixes,
            # which see only their own prefix.
            flops = _forward_flops(self.config, lengths, [S] * len(lengths), [len(ch) for ch in chains])
            seconds = time.perf_counter() - t0
            if self._sys_kv_new:
                # The one-off system-prompt prefill is this judge's setup, not any question's: it
                # is booked with no question, so a question's cost does not depend on whether
                # it was the first this judge scored. Every trajectory reads it as cached tokens.
                ledger.add("judge", None, calls=0, input_tokens=S, flops=_forward_flops(self.config, [S])[0],
                           seconds=self._sys_kv_seconds)
                seconds = max(0.0, seconds - self._sys_kv_seconds)
            ledger.add_batch("judge", qids, seconds=seconds, input_tokens=list(lengths),
                             cached_tokens=[S] * len(lengths), flops=flops)
        return scores

    # -- generation ---------------------------------------------------------------------------
    def verdicts(self, states: Sequence[State | tuple[str, list[str]]], max_new_tokens: int = 160, *,
                 ledger: CostLedger | None = None, question_ids: Sequence[str] | None = None) -> list[Verdict]:
        """Generate and parse the full JSON verdict of each state (greedy).

        Parse failures are counted in ``self.parse_stats["failed"]`` and mean CONTINUE.

        Parameters
        ----------
        states : sequence of State or (question, [evidence, ...])
        max_new_tokens : int
            Generation budget after the forced ``{"sufficient":`` prefix.

        Returns
        -------
        list of Verdict
        """
        import torch

        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sts = as_states(states)
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        t0 = time.perf_counter()
        seqs = [self.prompt_ids(s) for s in sts]
        lengths = [len(s) for s in seqs]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        eos = self.tokenizer.eos_token_id
        texts: list[str] = [""] * len(sts)
        n_out = [0] * len(sts)
        with torch.inference_mode():
            for rows in self._batches([n + max_new_tokens for n in lengths]):
                W = max(lengths[i] for i in rows)
                ids = torch.full((len(rows), W), pad, dtype=torch.long)
                mask = torch.zeros((len(rows), W), dtype=torch.long)
                for r, i in enumerate(rows):  # left padding for generation
                    ids[r, W - lengths[i]:] = torch.tensor(seqs[i])
                    mask[r, W - lengths[i]:] = 1
                out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                                          eos_token_id=eos)
                for r, i in enumerate(rows):
                    gen = out[r, W:].tolist()
                    if eos is not None and eos in gen:
                        gen = gen[:gen.index(eos)]
                    n_out[i] = len(gen)
                    texts[i] = self.tokenizer.decode(gen, skip_special_tokens=True)
        res = [parse_verdict(ANSWER_PREFIX + t) for t in texts]
        for v in res:
            self.parse_stats[v.parse] += 1
        if ledger is not None:
            qids = list(question_ids) if question_ids is not None else [None] * len(sts)
            flops = [_forward_flops(self.config, [n])[0] + sum(_forward_flops(self.config, [1] * k, list(range(n, n + k))))
                     for n, k in zip(lengths, n_out)]
            ledger.add_batch("judge", qids, seconds=time.perf_counter() - t0, input_tokens=lengths,
                             output_tokens=n_out, flops=flops)
        return res


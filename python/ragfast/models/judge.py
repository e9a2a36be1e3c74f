"""Stopping judges: score a retrieval state "stop now, the evidence is sufficient".

Two backends behind :class:`ragfast.models.Judge`:

- :class:`CausalJudge`: a causal LM (S2G protocol, see ``shared/PROTOCOLS.md``). The STOP score
  of a state is ``log P("true") - log P("false")`` for the next token after the chat-templated
  prompt followed by the assistant prefix ``{"sufficient":``. By default the states of one
  trajectory (nested prefixes of each other) are scored in ONE forward pass with a
  prefix/segment attention mask, on top of a system-prompt KV cache computed once per judge.
- :class:`EncoderJudge`: a frozen sentence encoder (the bundled all-MiniLM-L6-v2) with a small
  logistic head over question/evidence features; trained by :func:`train_encoder_judge`
  (``ragfast train-judge``) on states labelled by supporting facts.

:func:`load_judge` turns a CLI spec (``encoder``, a head file, or an LM directory) into a judge.
"""
from __future__ import annotations

import json
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from ragfast.cache import ByteLRU, text_key
from ragfast.cost import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.models.base import Judge
from ragfast.text import content_words
from ragfast.types import State

__all__ = [
    "SYSTEM_PROMPT", "NO_CONTEXT", "ANSWER_PREFIX", "GAP_CATEGORIES", "Verdict", "CausalJudge", "EncoderJudge",
    "as_states", "context_blocks", "user_text", "group_states", "parse_verdict", "load_judge",
    "default_encoder_judge_path", "build_training_states", "train_encoder_judge",
]

# Our own wording (PROTOCOLS.md asks for a system instruction that requests a JSON verdict).
SYSTEM_PROMPT = (
    "You decide whether retrieved evidence is enough to answer a question. Read the QUESTION "
    "and the CONTEXT (search results collected so far). Reply with one JSON object and nothing "
    'else: {"sufficient": true or false, "gap_items": [...]}. Use "sufficient": true only when '
    "the CONTEXT alone supports a complete, specific answer; then gap_items must be an empty "
    'list. Otherwise use "sufficient": false and list what is missing, each gap item as '
    '{"category": one of "bridge entity", "attribute", "relation", "evidence span", "other", '
    '"target": the entity the missing fact is about, "slot": the property or relation that is '
    'missing, "description": a short phrase saying what to search for next}.'
)
#: Context text of a state that has no evidence yet.
NO_CONTEXT = "(no documents retrieved)"
#: The assistant turn is forced to start with this; the STOP score reads the next token.
ANSWER_PREFIX = '{"sufficient":'
GAP_CATEGORIES = ("bridge entity", "attribute", "relation", "evidence span", "other")
_BLOCK_SEP = "\n\n"
_SENTINEL = "\u2063RAGFAST_USER_TEXT\u2063"


# ---------------------------------------------------------------------------------------------
# states, prompt text, trajectory grouping
# ---------------------------------------------------------------------------------------------
def as_states(states: Iterable[State | tuple[str, list[str]]]) -> list[State]:
    """Coerce states or ``(question, [evidence, ...])`` pairs to :class:`State`, checking types.

    Raises
    ------
    DataError
        When an item is neither, or its question/evidence are not strings.
    """
    if isinstance(states, (State, str)) or (isinstance(states, tuple) and len(states) == 2
                                            and isinstance(states[0], str)):
        raise DataError("expected a list of states, got a single state")
    out = []
    for i, s in enumerate(states):
        try:
            st = State.coerce(s)
        except TypeError as exc:
            raise DataError(f"state {i}: {exc}") from None
        if not isinstance(st.question, str):
            raise DataError(f"state {i}: question must be a str, got {type(st.question).__name__}")
        if isinstance(st.evidence, str) or not all(isinstance(e, str) for e in st.evidence):
            raise DataError(f"state {i}: evidence must be a list of strings")
        out.append(st)
    return out


def context_blocks(state: State) -> list[str]:
    """The state's evidence blocks, each stripped of surrounding whitespace.

    Search-R1 observations arrive as ``"\\n\\n<information>...</information>\\n\\n"``; the
    judge's context joins the ``<information>`` blocks themselves with one blank line.
    """
    return [e.strip() for e in state.evidence]


def user_text(state: State) -> str:
    """The judge's user message: ``QUESTION:\\n{q}\\n\\nCONTEXT:\\n{context}`` (PROTOCOLS.md)."""
    blocks = context_blocks(state)
    ctx = _BLOCK_SEP.join(blocks) if blocks else NO_CONTEXT
    return f"QUESTION:\n{state.question}\n\nCONTEXT:\n{ctx}"


def group_states(states: Sequence[State]) -> list[list[int]]:
    """Group states into trajectories whose evidence lists are nested prefixes.

    States with a ``trajectory_id`` are grouped by (question, id); states without one by
    question. Inside a group, each state joins the first chain whose longest member has its
    evidence as a prefix (longest states placed first), so every chain is a set of prefixes of
    one root state and can be scored in one packed pass.

    Returns
    -------
    list of list of int
        Indices into ``states``; each chain is ordered by evidence length.
    """
    buckets: dict[tuple, list[int]] = {}
    blocks = [context_blocks(s) for s in states]
    for i, s in enumerate(states):
        key = ("t", s.question, s.trajectory_id) if s.trajectory_id is not None else ("q", s.question)
        buckets.setdefault(key, []).append(i)
    chains: list[list[int]] = []
    for idxs in buckets.values():
        order = sorted(idxs, key=lambda i: -len(blocks[i]))
        mine: list[list[int]] = []
        for i in order:
            b = blocks[i]
            for ch in mine:
                root = blocks[ch[0]]
                if root[:len(b)] == b:
                    ch.append(i)
                    break
            else:
                mine.append([i])
        chains.extend(sorted(ch, key=lambda i: (len(blocks[i]), i)) for ch in mine)
    return chains


# ---------------------------------------------------------------------------------------------
# verdict parsing
# ---------------------------------------------------------------------------------------------
@dataclass
class Verdict:
    """A generated judge verdict. ``parse`` is "strict", "lenient" or "failed" (failed = CONTINUE)."""

    sufficient: bool
    gap_items: list[dict[str, str]] = field(default_factory=list)
    parse: str = "failed"
    raw: str = ""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"sufficient": self.sufficient, "gap_items": self.gap_items, "parse": self.parse, "raw": self.raw,
                "error": self.error}


def _first_object(text: str) -> str | None:
    """The first balanced ``{...}`` in text (string-aware); closes what is left open at the end."""
    start = text.find("{")
    if start < 0:
        return None
    stack, in_str, esc = [], False, False
    for j in range(start, len(text)):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
            continue
        if c == '"':
            in_str = True
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack[-1] != c:
                return text[start:j]  # mismatched closer: cut here and let the repair close it
            stack.pop()
            if not stack:
                return text[start:j + 1]
    # Ran out of text (generation budget): close the open string and brackets.
    tail = text[start:]
    if in_str:
        tail += '"'
    return tail.rstrip().rstrip(",") + "".join(reversed(stack))


def _repair(s: str) -> str:
    s = re.sub(r",\s*([}\]])", r"\1", s)  # trailing commas
    s = re.sub(r"\bTrue\b", "true", s)
    s = re.sub(r"\bFalse\b", "false", s)
    s = re.sub(r"\bNone\b", "null", s)
    if '"' not in s and "'" in s:
        s = s.replace("'", '"')
    return s


def _check_schema(obj: Any, strict: bool) -> tuple[bool, list[dict[str, str]]]:
    if not isinstance(obj, dict):
        raise ValueError("verdict is not a JSON object")
    suff = obj.get("sufficient")
    if not strict and isinstance(suff, str) and suff.strip().lower() in ("true", "false"):
        suff = suff.strip().lower() == "true"
    if not isinstance(suff, bool):
        raise ValueError(f"'sufficient' must be true or false, got {suff!r}")
    if strict and list(obj) != ["sufficient", "gap_items"]:
        raise ValueError(f"keys must be exactly sufficient, gap_items (in that order); got {list(obj)}")
    items = obj.get("gap_items", None if strict else [])
    if items is None and not strict:
        items = []
    if not isinstance(items, list):
        raise ValueError("'gap_items' must be a list")
    out = []
    for it in items:
        if not isinstance(it, dict):
            raise ValueError("each gap item must be an object")
        if strict and set(it) != {"category", "target", "slot", "description"}:
            raise ValueError(f"gap item keys must be category, target, slot, description; got {sorted(it)}")
        row = {k: it.get(k, "") for k in ("category", "target", "slot", "description")}
        if any(not isinstance(v, str) for v in row.values()):
            raise ValueError("gap item fields must be strings")
        cat = row["category"].strip().lower()
        if cat not in GAP_CATEGORIES:
            if strict:
                raise ValueError(f"unknown gap category {row['category']!r}")
            cat = "other"
        row["category"] = cat
        out.append(row)
    # The schema ties the two fields together; a contradiction is not a usable verdict.
    if suff and out:
        raise ValueError("sufficient=true with a non-empty gap_items list")
    if not suff and not out:
        raise ValueError("sufficient=false with an empty gap_items list")
    return suff, out


def parse_verdict(text: str) -> Verdict:
    """Parse a judge's JSON verdict, strictly first, then with a lenient fallback.

    Strict: the whole text (stripped) is exactly one JSON object with keys ``sufficient`` then
    ``gap_items``, known categories and the consistency rule (true ⇔ empty list). Lenient: the
    first balanced ``{...}`` (closed if generation was cut off), with trailing commas, Python
    literals and single quotes repaired, missing ``gap_items`` read as empty, unknown
    categories mapped to "other"; the consistency rule still holds. Anything else is a parse
    failure, which means CONTINUE (``sufficient=False``).

    Parameters
    ----------
    text : str
        The full verdict text, including the forced ``{"sufficient":`` prefix.

    Returns
    -------
    Verdict
    """
    try:
        suff, items = _check_schema(json.loads(text.strip()), strict=True)
        return Verdict(suff, items, "strict", text)
    except (ValueError, json.JSONDecodeError) as exc:
        strict_err = str(exc)
    cand = _first_object(text)
    if cand is None:
        return Verdict(False, [], "failed", text, f"no JSON object ({strict_err})")
    try:
        suff, items = _check_schema(json.loads(_repair(cand)), strict=False)
        return Verdict(suff, items, "lenient", text)
    except (ValueError, json.JSONDecodeError) as exc:
        return Verdict(False, [], "failed", text, str(exc))


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
    from ragfast.flops import forward_flops_per_sequence

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
        return [self._ids(b if i == 0 else _BLOCK_SEP + b) for i, b in enumerate(blocks)]

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
        layer_types = set(getattr(self.config, "layer_types", None) or ["full_attention"])
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
                # A dict of masks skips transformers' own mask construction; the mask lives in
                # ragfast_mask, read by the registered attention function.
                h = dec(input_ids=ids, position_ids=pos, attention_mask={t: None for t in layer_types},
                        cache=cache, use_cache=True, ragfast_mask=(hi, lo, self.attention, prebuilt)).last_hidden_state
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


# ---------------------------------------------------------------------------------------------
# EncoderJudge
# ---------------------------------------------------------------------------------------------
#: Bumped when the feature layout changes; a head trained on another layout will not load.
FEATURE_VERSION = 1
_DOC_SPLIT = re.compile(r"(?:^|\n)\s*Doc \d+\(Title: ")
_INFO_TAGS = re.compile(r"^\s*<information>|</information>\s*$")
_N_SCALARS = 7


def default_encoder_judge_path() -> Path:
    """The bundled EncoderJudge head (``ragfast/models/weights/encoder_judge.safetensors``)."""
    return Path(__file__).resolve().parent / "weights" / "encoder_judge.safetensors"


def _split_docs(block: str) -> list[str]:
    """The documents of one evidence block (Search-R1 ``Doc i(Title: ...) ...`` lines), else the block."""
    body = _INFO_TAGS.sub("", block.strip()).strip()
    docs = [p.strip() for p in _DOC_SPLIT.split(body) if p.strip()]
    return docs if docs else ([body] if body else [])


def _content_words(text: str) -> set[str]:
    return set(content_words(text, min_len=3))


class _FeatureMaker:
    """Question/evidence features on a frozen sentence encoder, with an embedding cache.

    Per state: the question vector q, the mean c of its document vectors, q*c, |q-c|, then
    seven scalars: the three highest and the mean question-document cosines, log(1 + #docs),
    an empty-state flag, and the fraction of the question's content words found in the
    evidence text. Documents are embedded one by one (the encoder reads 256 tokens), and each
    distinct text only once: the states of a trajectory share their documents.
    """

    def __init__(self, encoder: Any, cache_bytes: int | None = None):
        from ragfast.retrieval.encoder import EmbeddingCache

        self.encoder = encoder
        self.dim = int(encoder.dim)
        # Least recently used first out once over the byte cap; a hit is charged as a miss.
        self._q = EmbeddingCache(encoder, "query", cache_bytes)
        self._d = EmbeddingCache(encoder, "passage", cache_bytes)

    @property
    def n_features(self) -> int:
        return 4 * self.dim + _N_SCALARS

    def embed_documents(self, texts: Sequence[str]) -> None:
        """Embed document texts into the cache (as the judge reads them)."""
        self._d.embed(list(texts))

    def doc_vector(self, text: str) -> np.ndarray:
        v = self._d.get(text)
        return v if v is not None else self._d.embed([text]).vectors[text]

    def __call__(self, states: Sequence[State], question_ids: Sequence[Any] | None = None,
                 ledger: CostLedger | None = None) -> np.ndarray:
        """Features ``[len(states), n_features]``; the embeddings are charged to ``ledger`` as ``judge``."""
        from ragfast.retrieval.encoder import record_embedded

        qids = list(question_ids) if question_ids is not None else [None] * len(states)
        docs = [[d for b in context_blocks(s) for d in _split_docs(b)] for s in states]
        qe = self._q.embed([s.question for s in states], qids)
        flat = [(d, qid) for ds, qid in zip(docs, qids) for d in ds]
        de = self._d.embed([d for d, _ in flat], [q for _, q in flat])
        record_embedded(ledger, "judge", [qe, de])
        qv, dv = qe.vectors, de.vectors
        X = np.zeros((len(states), self.n_features), dtype=np.float32)
        D = self.dim
        for i, (s, ds) in enumerate(zip(states, docs)):
            q = qv[s.question]
            if ds:
                E = np.stack([dv[d] for d in ds])
                c = E.mean(0)
                sims = np.sort(E @ q)[::-1]
            else:
                c = np.zeros(D, dtype=np.float32)
                sims = np.zeros(0, dtype=np.float32)
            top = np.zeros(3, dtype=np.float32)
            top[:min(3, len(sims))] = sims[:3]
            qw = _content_words(s.question)
            ev = _content_words(" ".join(ds)) if ds else set()
            overlap = len(qw & ev) / len(qw) if qw else 0.0
            X[i, :D] = q
            X[i, D:2 * D] = c
            X[i, 2 * D:3 * D] = q * c
            X[i, 3 * D:4 * D] = np.abs(q - c)
            X[i, 4 * D:] = [top[0], top[1], top[2], float(sims.mean()) if len(sims) else 0.0,
                            math.log1p(len(ds)), float(not ds), overlap]
        return X


class EncoderJudge(Judge):
    """A frozen sentence encoder with a logistic head; STOP score = the head's logit.

    Parameters
    ----------
    path : str or Path, optional
        A head file (``*.safetensors`` with its ``.json`` card beside it) or a directory holding
        ``encoder_judge.safetensors``; default: the bundled head (:func:`default_encoder_judge_path`),
        trained by ``ragfast train-judge`` on the bundled HotpotQA train sample.
    device : str
        Encoder device.
    encoder : ragfast.retrieval.encoder.Encoder, optional
        Reuse an already loaded encoder (must match the card's encoder).

    Notes
    -----
    ``describe()`` carries the card's validation metrics: the bundled head is trained on real
    sufficiency labels but on 240 questions only, so its scores are a weak, honest signal.
    """

    def __init__(self, path: str | Path | None = None, device: str = "cpu", encoder: Any = None):
        from safetensors.numpy import load_file

        p = default_encoder_judge_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            p = p / "encoder_judge.safetensors"
        card_path = p.with_suffix(".json")
        if not p.exists() or not card_path.exists():
            raise ModelError(f"EncoderJudge head not found: need {p} and {card_path} "
                             "(train one with `ragfast train-judge`)")
        self.card = json.loads(card_path.read_text())
        if self.card.get("format") != "ragfast-encoder-judge" or self.card.get("feature_version") != FEATURE_VERSION:
            raise ModelError(f"{card_path} is not a ragfast encoder-judge card of feature version {FEATURE_VERSION}")
        t = load_file(str(p))
        self.weight = t["weight"].astype(np.float64).reshape(-1)
        self.bias = float(t["bias"].reshape(-1)[0])
        if encoder is None:
            from ragfast.retrieval.encoder import Encoder

            encoder = Encoder(self.card["encoder"], device=device)
        self.encoder = encoder
        self.features = _FeatureMaker(encoder)
        if self.features.n_features != self.weight.size:
            raise ModelError(f"{p}: head has {self.weight.size} weights but the encoder gives "
                             f"{self.features.n_features} features")
        self.path = p
        self.name = f"encoder-judge:{p.name} on {self.card['encoder']}"
        self.meaningful = True

    def describe(self) -> dict[str, Any]:
        """Head path, encoder, training data and the held-out metrics from the card."""
        return {"name": self.name, "class": type(self).__name__, "meaningful": self.meaningful,
                "why": "logistic head trained on supporting-fact sufficiency labels; see metrics",
                "path": str(self.path), "encoder": self.card["encoder"], "trained_on": self.card.get("data"),
                "metrics": self.card.get("metrics")}

    def stop_scores(self, states: Sequence[State | tuple[str, list[str]]], *, ledger: CostLedger | None = None,
                    question_ids: Sequence[str] | None = None) -> np.ndarray:
        """The head's logit per state (float64). Encoder compute goes to the ledger as ``judge``."""
        sts = as_states(states)
        if question_ids is not None and len(question_ids) != len(sts):
            raise DataError(f"{len(question_ids)} question ids for {len(sts)} states")
        if not sts:
            return np.zeros(0, dtype=np.float64)
        X = self.features(sts, question_ids, ledger)
        return X.astype(np.float64) @ self.weight + self.bias


def load_judge(spec: str, device: str = "cpu") -> Any:
    """A judge from a CLI spec.

    ``encoder``: the bundled default judge (:class:`ragfast.models.doc_judge.DocSetJudge`);
    ``head``: the bundled frozen-feature :class:`EncoderJudge`; or a path: a doc-set judge or a
    cross-encoder judge (``docset_judge.safetensors`` / ``cross_judge.safetensors`` or a directory
    holding one), an encoder-judge head (``.safetensors`` or a directory with
    ``encoder_judge.safetensors``), or a causal-LM directory.

    Raises
    ------
    ragfast.errors.ConfigError
        When the spec names nothing loadable.
    """
    from ragfast.models.cross_judge import CrossEncoderJudge
    from ragfast.models.doc_judge import DocSetJudge

    if spec == "encoder":
        return DocSetJudge(device=device)
    if spec == "head":
        return EncoderJudge(device=device)
    p = Path(spec).expanduser()
    for name, cls in (("docset_judge.safetensors", DocSetJudge), ("cross_judge.safetensors", CrossEncoderJudge)):
        if p.name == name or (p.is_dir() and (p / name).exists()):
            return cls(p, device=device)
    if p.suffix == ".safetensors" or (p.is_dir() and (p / "encoder_judge.safetensors").exists()):
        return EncoderJudge(p, device=device)
    if p.is_dir() and (p / "config.json").exists():
        return CausalJudge(p, device=device)
    raise ConfigError(f"--judge {spec!r}: expected 'encoder' (the bundled doc-set judge), 'head' (the bundled "
                      "frozen-feature head), a docset_judge/cross_judge .safetensors (or a directory with one), an "
                      "encoder-judge head (.safetensors or a directory with encoder_judge.safetensors), or a "
                      "causal-LM directory with config.json")


# ---------------------------------------------------------------------------------------------
# training the EncoderJudge head
# ---------------------------------------------------------------------------------------------
def _observation(passages: Sequence[Any]) -> str:
    docs = "".join(f"Doc {i + 1}(Title: {p.title}) {p.text}\n" for i, p in enumerate(passages))
    return f"<information>{docs.strip()}</information>"


def build_training_states(questions: Sequence[Any], corpus: Any, features: "_FeatureMaker", *, k: int = 3,
                          turns: int = 4) -> tuple[list[State], np.ndarray, list[str]]:
    """Retrieval states with gold sufficiency labels, from questions with supporting titles.

    Per question, state 0 has no evidence; turn 1 adds the top-``k`` passages for the
    question; turn t >= 2 adds the top-``k`` unseen passages for "question + title of the best
    hit of turn t-1" (a crude bridge query, as a multi-hop reasoner would issue). Retrieval is
    dense inner product with the judge's own encoder over ``corpus``: each passage is embedded
    once, in exactly the form the judge reads it inside an observation, and that vector is
    stored in the judge's feature cache, so building the states costs one corpus pass. Each
    evidence block is a Search-R1 observation (``<information>Doc i(Title: ...) ...</information>``).
    A state is labelled 1 when every supporting title has been retrieved
    (:func:`ragfast.metrics.sufficient`).

    Returns
    -------
    states, labels (int8), question ids (one per state)
    """
    from ragfast.metrics import normalize_title, sufficient

    qs = [q for q in questions if q.supporting_titles]
    if not qs:
        raise DataError("no question has supporting titles; cannot label sufficiency")
    n = len(corpus)
    if n < k:
        raise DataError(f"corpus has {n} passages, fewer than k={k}")
    passages = [corpus.passage(i) for i in range(n)]
    doc_texts = [_split_docs(_observation([p]))[0] for p in passages]
    features.embed_documents(doc_texts)
    P = np.stack([features.doc_vector(t) for t in doc_texts])
    # Turn by turn over all questions, so each turn's queries are one batched encoder call.
    per_q: list[list[tuple[State, int]]] = [[(State(q.question, [], q.id, 0), 0)] for q in qs]
    seen: list[set[int]] = [set() for _ in qs]
    evs: list[list[str]] = [[] for _ in qs]
    titles: list[list[str]] = [[] for _ in qs]
    best: list[str] = [""] * len(qs)
    for t in range(turns):
        texts = [q.question if t == 0 else f"{q.question} {normalize_title(best[i])}" for i, q in enumerate(qs)]
        sims = features.encoder.encode_queries(texts).numpy() @ P.T
        for i, q in enumerate(qs):
            s = sims[i]
            s[list(seen[i])] = -np.inf
            hits = [int(j) for j in np.argsort(-s, kind="stable")[:k]]
            seen[i].update(hits)
            best[i] = passages[hits[0]].title
            titles[i] += [passages[j].title for j in hits]
            evs[i] = evs[i] + [_observation([passages[j] for j in hits])]
            per_q[i].append((State(q.question, list(evs[i]), q.id, t + 1),
                             int(sufficient(titles[i], q.supporting_titles))))
    states = [st for rows in per_q for st, _ in rows]
    labels = [lab for rows in per_q for _, lab in rows]
    qids = [st.trajectory_id for st in states]
    return states, np.asarray(labels, dtype=np.int8), qids


def _metrics(labels: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import brier_score_loss

    probs = 1.0 / (1.0 + np.exp(-logits))
    return {"ap": _ap(labels, logits), "brier": float(brier_score_loss(labels, probs)),
            "n_states": int(labels.size), "base_rate": float(labels.mean())}


def _fmt(x: float | None) -> str:
    return "undefined (one class)" if x is None else f"{x:.4f}"


def _ap(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Average precision, or None when the labels hold one class only (AP is undefined)."""
    from sklearn.metrics import average_precision_score

    if labels.size == 0 or labels.min() == labels.max():
        return None
    return float(average_precision_score(labels, scores))


def train_encoder_judge(data: str | Path, out_dir: str | Path, *, dev: str | Path | None = None,
                        val_fraction: float = 0.2, seed: int = 0, k: int = 3, turns: int = 4,
                        encoder: str = "minilm", device: str = "cpu", log: Any = print) -> dict[str, Any]:
    """Train the EncoderJudge head; write ``encoder_judge.safetensors`` and its JSON card.

    Parameters
    ----------
    data : str or Path
        A QA file with supporting facts and context paragraphs (HotpotQA layout) or a sample
        name (e.g. ``"hotpotqa-train"``). The retrieval corpus is its context paragraphs
        (:func:`ragfast.data.corpus_from_contexts`).
    out_dir : str or Path
        Output directory.
    dev : str or Path, optional
        A second QA file evaluated with its own context corpus (reported, never trained on).
    val_fraction : float
        Share of questions held out (grouped by question) for the validation metrics.
    seed, k, turns
        Split seed; passages per turn; search turns per question.
    encoder : str
        Encoder preset or checkpoint directory (frozen).

    Returns
    -------
    dict
        The card written next to the weights.
    """
    from safetensors.numpy import save_file
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import GroupKFold

    import ragfast
    from ragfast.data import corpus_from_contexts, load_qa
    from ragfast.retrieval.encoder import Encoder

    if not 0.0 < val_fraction < 0.9:
        raise ConfigError(f"val_fraction must be in (0, 0.9), got {val_fraction}")
    t_start = time.perf_counter()
    questions = load_qa(data)
    corpus = corpus_from_contexts(questions)
    enc = Encoder(encoder, device=device)
    feats = _FeatureMaker(enc)
    log(f"train-judge: {len(questions)} questions, corpus of {len(corpus)} context paragraphs, encoder {enc.name}")
    states, y, qids = build_training_states(questions, corpus, feats, k=k, turns=turns)
    X = feats(states)
    uq = sorted(set(qids))
    rng = np.random.default_rng(seed)
    val_q = set(rng.permutation(uq)[: max(1, int(round(len(uq) * val_fraction)))].tolist())
    is_val = np.array([q in val_q for q in qids])
    Xtr, ytr, gtr = X[~is_val], y[~is_val], [q for q, v in zip(qids, is_val) if not v]
    mu = Xtr.mean(0)
    sd = Xtr.std(0) + 1e-6
    Z = (Xtr - mu) / sd
    # C by question-grouped 5-fold CV on the training questions only (validation stays unseen).
    best_c, best_ap = None, -1.0
    from sklearn.metrics import average_precision_score

    for c in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3):
        aps = []
        for tr, te in GroupKFold(n_splits=min(5, len(set(gtr)))).split(Z, ytr, gtr):
            if len(set(ytr[tr].tolist())) < 2 or ytr[te].sum() == 0:
                continue  # a fold without both classes says nothing about ranking
            m = LogisticRegression(C=c, max_iter=2000).fit(Z[tr], ytr[tr])
            aps.append(average_precision_score(ytr[te], m.decision_function(Z[te])))
        if not aps:
            raise DataError("too few sufficient/insufficient states to choose the head's regularisation")
        ap = float(np.mean(aps))
        log(f"  C={c:g}: grouped-CV AP {ap:.4f}")
        if ap > best_ap:
            best_c, best_ap = c, ap
    model = LogisticRegression(C=best_c, max_iter=5000).fit(Z, ytr)
    # Fold the standardisation into the weights: logit = x @ (w / sd) + (b - sum(w * mu / sd)).
    w = (model.coef_[0] / sd).astype(np.float32)
    b = np.float32(model.intercept_[0] - float(np.sum(model.coef_[0] * mu / sd)))
    val_logits = X[is_val].astype(np.float64) @ w.astype(np.float64) + float(b)
    ndocs = X[:, 4 * feats.dim + 4]
    metrics: dict[str, Any] = {
        "train": {**_metrics(ytr, Z @ model.coef_[0] + model.intercept_[0]), "n_questions": len(uq) - len(val_q)},
        "validation": {**_metrics(y[is_val], val_logits), "n_questions": len(val_q),
                       "ap_ndocs_baseline": _ap(y[is_val], ndocs[is_val])},
        "cv_ap": best_ap,
    }
    log(f"  chose C={best_c:g}; validation AP {_fmt(metrics['validation']['ap'])} "
        f"(#docs baseline {_fmt(metrics['validation']['ap_ndocs_baseline'])}), Brier {metrics['validation']['brier']:.4f}")
    if dev is not None:
        dq = load_qa(dev)
        ds, dy, _ = build_training_states(dq, corpus_from_contexts(dq), feats, k=k, turns=turns)
        DX = feats(ds)
        dl = DX.astype(np.float64) @ w.astype(np.float64) + float(b)
        metrics["dev"] = {**_metrics(dy, dl), "n_questions": len(set(s.trajectory_id for s in ds)),
                          "ap_ndocs_baseline": _ap(dy, DX[:, 4 * feats.dim + 4]),
                          "source": str(dev)}
        log(f"  dev ({dev}): AP {_fmt(metrics['dev']['ap'])} (#docs baseline {_fmt(metrics['dev']['ap_ndocs_baseline'])}), "
            f"Brier {metrics['dev']['brier']:.4f}")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    save_file({"weight": w, "bias": np.asarray([b], dtype=np.float32)}, str(out / "encoder_judge.safetensors"))
    card = {
        "format": "ragfast-encoder-judge", "feature_version": FEATURE_VERSION, "encoder": encoder,
        "n_features": int(w.size), "head": "logistic regression (L2, sklearn lbfgs) on standardised features; "
                                          "standardisation folded into weight/bias",
        "features": ("question vector q, mean document vector c, q*c, |q-c|, top-3 and mean q-doc cosine, "
                     "log(1+#docs), empty flag, question content-word overlap"),
        "data": str(data),
        "states": (f"per question: an empty state, then {turns} turns of top-{k} dense (encoder) retrieval over "
                   "the questions' context paragraphs; turn 1 queries the question, later turns the question "
                   "plus the best previous hit's title; label = all supporting titles retrieved"),
        "split": {"val_fraction": val_fraction, "seed": seed, "grouped_by": "question"},
        "C": best_c, "metrics": metrics, "ragfast_version": ragfast.__version__,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "encoder_judge.json").write_text(json.dumps(card, indent=2) + "\n")
    return card

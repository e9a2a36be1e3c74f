"""Analytic FLOPs of one transformer forward pass, from a transformers config.

Counts what the matmuls of an eager forward execute, 2 FLOPs per multiply-add, the same
convention as ``torch.utils.flop_counter.FlopCounterMode``:

- every linear layer (projections, MLP, heads; biases and element-wise work are not counted);
- attention scores and the value product densely over all key positions, past and present
  (what eager attention runs; a causal mask does not skip the masked half);
- grouped-query attention: k/v projections are ``num_key_value_heads * head_dim`` wide, while
  the score and value products run over all query heads (eager repeats the k/v heads);
- DeBERTa-v2's disentangled attention: the content->position and position->content products
  against ``2 * span`` relative embeddings, plus the projection of those embeddings (done once
  per forward pass, independent of the batch size).

Rotary angles (``inv_freq @ positions``, about ``head_dim`` FLOPs per token) and all
element-wise work are left out: FlopCounterMode does not see them either, and they are
negligible next to the projections.

Supported families: decoder-only Llama / Mistral / Qwen2 / Qwen3 (dense MLP), and BERT /
RoBERTa / XLM-R / DeBERTa-v2 encoders.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ragfast.errors import ConfigError, ModelError

__all__ = ["DECODERS", "ENCODERS", "forward_flops", "forward_flops_per_sequence", "completion_flops", "read_config"]

DECODERS = ("llama", "mistral", "qwen2", "qwen3")
ENCODERS = ("bert", "roberta", "xlm-roberta", "deberta-v2")
_HEADS = ("lm", "classifier", "pooler", "none")


def read_config(config: str | Path) -> dict[str, Any]:
    """A model's ``config.json`` as a dict, from the file or from the model directory.

    Raises
    ------
    ModelError
        When there is no such file.
    """
    p = Path(config)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ModelError(f"no config.json at {config}")
    return json.loads(p.read_text(encoding="utf-8"))


class _Cfg:
    """Attribute access over a transformers config, a config dict or a model directory.

    Reads attributes directly (no ``to_dict()`` copy): decode loops call forward_flops once
    per step.
    """

    def __init__(self, config: Any):
        if isinstance(config, (str, Path)):
            config = read_config(config)
        if isinstance(config, dict):
            d = config.get("text_config") if "hidden_size" not in config and "text_config" in config else config
            self._get = lambda k, _d=dict(d): _d.get(k)
        elif hasattr(config, "to_dict"):
            obj = getattr(config, "text_config", None) if not hasattr(config, "hidden_size") else config
            if obj is None:
                obj = config
            self._get = lambda k, _o=obj: getattr(_o, k, None)
        else:
            raise ConfigError(f"forward_flops needs a transformers config, a config dict or a model path, "
                              f"got {type(config).__name__}")

    def get(self, name: str, default: Any = None) -> Any:
        v = self._get(name)
        if v is None and name == "num_labels":
            labels = self._get("id2label")
            v = len(labels) if labels else None
        return default if v is None else v

    def need(self, name: str) -> Any:
        v = self._get(name)
        if v is None:
            raise ConfigError(f"config of model_type {self._get('model_type')!r} lacks {name!r}")
        return v


def _default_head(cfg: _Cfg, family: str) -> str:
    archs = " ".join(cfg.get("architectures", []) or [])
    if "SequenceClassification" in archs:
        return "classifier"
    if family == "decoder":
        return "lm" if ("CausalLM" in archs or not archs) else "none"
    # A bare BertModel runs its pooler (add_pooling_layer=True); RoBERTa/DeBERTa bases have none.
    return "pooler" if cfg.get("model_type") == "bert" else "none"


def forward_flops_per_sequence(config: Any, input_lengths: Sequence[int], past_lengths: Sequence[int] | None = None,
                               *, head: str | None = None, logits: str = "all") -> list[float]:
    """FLOPs of one forward pass, one entry per sequence of the batch.

    Work that the model does once per call whatever the batch size (DeBERTa's projection of
    the relative-position embeddings) is split evenly over the sequences, so the entries add
    up to :func:`forward_flops` exactly; pass them to ``CostLedger.add_batch(flops=...)``.

    Parameters
    ----------
    config : transformers.PretrainedConfig, dict, str or Path
        The model's config (or its directory / config.json).
    input_lengths : sequence of int
        New tokens per sequence. For a padded batch, pass the padded length to count what the
        kernels execute, or the true lengths to count the useful work.
    past_lengths : sequence of int, optional
        Tokens already in each sequence's KV cache (decoders only; default 0).
    head : {"lm", "classifier", "pooler", "none"}, optional
        Output head. Default: read from ``config.architectures`` (``*ForCausalLM`` -> lm,
        ``*ForSequenceClassification`` -> classifier (pooler included), bare BertModel ->
        pooler, other bare models -> none).
    logits : {"all", "last"}
        Decoders: compute the lm head for every new token, or only the last one of each
        sequence (what ``generate`` and a next-token scorer do).

    Returns
    -------
    list of float

    Raises
    ------
    ModelError
        For an architecture outside :data:`DECODERS` and :data:`ENCODERS`.
    ValueError
        For negative lengths, mismatched lists, or a KV cache on an encoder.
    """
    cfg = _Cfg(config)
    mt = cfg.get("model_type", "")
    n_in = [int(x) for x in input_lengths]
    past = [0] * len(n_in) if past_lengths is None else [int(x) for x in past_lengths]
    if len(past) != len(n_in):
        raise ValueError(f"forward_flops: {len(n_in)} input lengths but {len(past)} past lengths")
    if any(x < 0 for x in n_in) or any(x < 0 for x in past):
        raise ValueError("forward_flops: lengths must be >= 0")
    if logits not in ("all", "last"):
        raise ValueError(f"forward_flops: logits must be 'all' or 'last', got {logits!r}")
    if head is not None and head not in _HEADS:
        raise ValueError(f"forward_flops: head must be one of {_HEADS}, got {head!r}")
    if not n_in:
        return []
    if mt in DECODERS:
        return _decoder(cfg, n_in, past, head or _default_head(cfg, "decoder"), logits)
    if mt in ENCODERS:
        if any(past):
            raise ValueError(f"forward_flops: {mt} is an encoder; it has no KV cache (past_lengths must be 0)")
        return _encoder(cfg, n_in, head or _default_head(cfg, "encoder"))
    raise ModelError(f"forward_flops: unsupported model_type {mt!r}; supported: {', '.join(DECODERS + ENCODERS)}")


def forward_flops(config: Any, input_lengths: Sequence[int], past_lengths: Sequence[int] | None = None,
                  *, head: str | None = None, logits: str = "all") -> float:
    """Analytic matmul + attention FLOPs of one forward pass over a batch.

    Parameters
    ----------
    config : transformers.PretrainedConfig, dict, str or Path
        The model's config (or its directory / config.json).
    input_lengths : sequence of int
        New tokens per sequence.
    past_lengths : sequence of int, optional
        KV-cache length per sequence (decoders; attention runs over past + new keys).
    head, logits
        See :func:`forward_flops_per_sequence`.

    Returns
    -------
    float
        Total FLOPs (2 per multiply-add), comparable to ``FlopCounterMode`` on an eager model.
    """
    return float(sum(forward_flops_per_sequence(config, input_lengths, past_lengths, head=head, logits=logits)))


def _decoder(cfg: _Cfg, n_in: list[int], past: list[int], head: str, logits: str) -> list[float]:
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ModelError(f"forward_flops: mixture-of-experts configs ({cfg.get('model_type')}) are not supported")
    hid = cfg.need("hidden_size")
    heads = cfg.need("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", hid // heads)
    ffn = cfg.need("intermediate_size")
    layers = cfg.need("num_hidden_layers")
    vocab = cfg.need("vocab_size")
    # Projections per token: q and o are heads*hd wide, k and v kv*hd; gated MLP has 3 matmuls.
    per_tok_layer = 2 * hid * (2 * heads * hd + 2 * kv * hd) + 2 * 3 * hid * ffn
    out = []
    for n, p in zip(n_in, past):
        attn = 2 * 2 * heads * hd * n * (p + n)  # scores + value product, dense over all keys
        body = layers * (per_tok_layer * n + attn)
        if head == "lm":
            body += 2 * hid * vocab * (n if logits == "all" else min(n, 1))
        elif head == "classifier":
            body += 2 * hid * cfg.get("num_labels", 2) * min(n, 1)
        out.append(float(body))
    return out


def _encoder(cfg: _Cfg, n_in: list[int], head: str) -> list[float]:
    hid = cfg.need("hidden_size")
    heads = cfg.need("num_attention_heads")
    ahs = cfg.get("attention_head_size", hid // heads) * heads  # all_head_size
    ffn = cfg.need("intermediate_size")
    layers = cfg.need("num_hidden_layers")
    deberta = cfg.get("model_type") == "deberta-v2"
    rel = deberta and bool(cfg.get("relative_attention", False))
    pos_types = list(cfg.get("pos_att_type", []) or []) if rel else []
    if isinstance(pos_types, str):  # older configs store "p2c|c2p"
        pos_types = [t.strip() for t in pos_types.split("|")]
    span = 0
    if rel:
        span = cfg.get("position_buckets", -1)
        if span <= 0:
            mrp = cfg.get("max_relative_positions", -1)
            span = mrp if mrp >= 1 else cfg.need("max_position_embeddings")
    n_pos = sum(1 for t in ("c2p", "p2c") if t in pos_types)
    conv_k = cfg.get("conv_kernel_size", 0) if deberta else 0
    out = []
    for n in n_in:
        per_layer = (2 * n * hid * ahs * 3  # q, k, v
                     + 2 * n * hid * hid  # attention output dense
                     + 2 * 2 * n * n * ahs  # scores + value product
                     + 2 * 2 * n * hid * ffn  # MLP
                     + 2 * n * ahs * 2 * span * n_pos)  # c2p / p2c against 2*span relative embeddings
        body = layers * per_layer
        if conv_k:
            # DeBERTa-v2 xlarge-style ConvLayer after the first layer: Conv1d(hid, hid, k, groups)
            body += 2 * n * hid * (hid // cfg.get("conv_groups", 1)) * conv_k
        if n > 0 and head in ("classifier", "pooler"):
            pool = cfg.get("pooler_hidden_size", hid) if deberta else hid
            body += 2 * hid * pool if not deberta else 2 * pool * pool
            if head == "classifier":
                body += 2 * pool * cfg.get("num_labels", 2)
        out.append(float(body))
    if rel and n_pos:
        # The 2*span relative embeddings are projected once per call and shared by the batch:
        # with share_att_key through query_proj and key_proj (both run whatever pos_att_type
        # holds), otherwise through one extra projection per position type.
        n_proj = 2 if cfg.get("share_att_key", False) else n_pos
        shared = layers * n_proj * 2 * (2 * span) * hid * ahs
        out = [x + shared / len(out) for x in out]
    return out


def completion_flops(config: Any, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
    """FLOPs of one greedy completion, from the token counts a server reports.

    The prompt's uncached tokens are one prefill pass over the cached prefix; every generated
    token but the last is fed back for one decode step (the last is sampled, never fed), each
    attending over everything before it. Only the last position's logits are computed, as
    ``generate`` does.

    Parameters
    ----------
    config : transformers.PretrainedConfig, dict, str or Path
        The served decoder's config.
    prompt_tokens, cached_tokens, completion_tokens : int
        As in an OpenAI ``usage`` object (``cached_tokens`` from ``prompt_tokens_details``).

    Returns
    -------
    float
    """
    if cached_tokens > prompt_tokens:
        raise ValueError(f"completion_flops: {cached_tokens} cached of only {prompt_tokens} prompt tokens")
    fresh = max(1, prompt_tokens - cached_tokens)
    n_dec = max(0, completion_tokens - 1)
    past = prompt_tokens - fresh
    return forward_flops(config, [fresh] + [1] * n_dec, [past] + [past + fresh + j for j in range(n_dec)],
                         logits="last")

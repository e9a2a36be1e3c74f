"""Tiny random-weight models: loadable offline, deterministic, the right shapes."""
import hashlib

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ragfast.errors import ModelError
from ragfast.models import make_tiny, tiny_path
from ragfast.models import tiny as tiny_mod


def _hashes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {k: make_tiny(k, root / k) for k in tiny_mod.KINDS}


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_causal_lm_loads_and_chats(built, kind):
    d = built[kind]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    cfg = model.config
    assert cfg.model_type == kind and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.max_position_embeddings >= 8192
    assert 2000 <= len(tok) <= 4096 and cfg.vocab_size == len(tok)
    if kind == "qwen3":
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "Who wrote <search> Ed Wood </search>?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    enc = tok(text, return_tensors="pt")
    assert tok.decode(enc["input_ids"][0]) == text
    with torch.no_grad():
        logits = model(**enc).logits
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert logits.shape == (1, enc["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert out.shape[1] <= enc["input_ids"].shape[1] + 4
    assert set(model.generation_config.eos_token_id) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}


@pytest.mark.parametrize("kind", ["bert", "deberta-v2"])
def test_cross_encoder_loads_and_scores_pairs(built, kind):
    d = built[kind]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForSequenceClassification.from_pretrained(d, attn_implementation="eager")
    assert model.config.id2label == tiny_mod.DEFAULT_ID2LABEL
    assert model.config.max_position_embeddings >= 8192
    enc = tok(["A man plays.", "x " * 600], ["Someone plays.", "y"], return_tensors="pt", padding=True)
    assert enc["input_ids"].shape[1] > 512  # the context is not capped at BERT's usual 512
    assert tok.decode(enc["input_ids"][0], skip_special_tokens=False).startswith("[CLS] a man plays. [SEP]")
    if kind == "bert":
        assert "token_type_ids" in enc
    with torch.no_grad():
        logits = model(**enc).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()
    if kind == "deberta-v2":
        assert model.config.relative_attention and set(model.config.pos_att_type) == {"c2p", "p2c"}


def test_same_seed_same_bytes_other_seed_other_weights(built, tmp_path):
    tiny_mod._bpe_json.cache_clear()  # retrain the BPE too, not only re-init the weights
    for kind in ("qwen3", "deberta-v2"):
        again = make_tiny(kind, tmp_path / f"{kind}-again", seed=0)
        assert _hashes(again) == _hashes(built[kind])
        other = make_tiny(kind, tmp_path / f"{kind}-seed1", seed=1)
        h_other = _hashes(other)
        assert h_other["model.safetensors"] != _hashes(built[kind])["model.safetensors"]
        assert h_other["tokenizer.json"] == _hashes(built[kind])["tokenizer.json"]


def test_permuted_labels_and_bad_arguments(tmp_path):
    perm = {0: "entailment", 1: "neutral", 2: "contradiction"}
    d = make_tiny("bert", tmp_path / "perm", id2label=perm)
    cfg = AutoModelForSequenceClassification.from_pretrained(d).config
    assert cfg.id2label == perm and cfg.label2id["contradiction"] == 2
    with pytest.raises(ModelError, match="unknown tiny model kind 'gpt2'"):
        make_tiny("gpt2", tmp_path / "x")
    with pytest.raises(ModelError, match="id2label must map"):
        make_tiny("bert", tmp_path / "y", id2label={0: "a", 1: "b"})
    with pytest.raises(ModelError, match="cross-encoders"):
        make_tiny("qwen2", tmp_path / "z", id2label=perm)


def test_tiny_path_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    p = tiny_path("bert")
    assert p == tmp_path / "tiny" / f"bert-0-v{tiny_mod.TINY_VERSION}"
    stamp = (p / "model.safetensors").stat().st_mtime_ns
    assert tiny_path("bert") == p and (p / "model.safetensors").stat().st_mtime_ns == stamp
    assert [x.name for x in (tmp_path / "tiny").iterdir()] == [p.name]  # no temporary leftovers
    assert tiny_path("bert", id2label={0: "entailment", 1: "neutral", 2: "contradiction"}) != p
    with pytest.raises(ModelError, match="unknown tiny model kind"):
        tiny_path("llama")

"""Analytic forward FLOPs against torch's FlopCounterMode on tiny random eager models."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, BertConfig,
                          DebertaV2Config, LlamaConfig)

from ragfast.accounting.ledger import forward_flops as ledger_forward_flops
from ragfast.errors import ModelError
from ragfast.accounting.flops import forward_flops, forward_flops_per_sequence
from ragfast.models import make_tiny

TOL = 0.05


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("flops")
    return {k: make_tiny(k, root / k) for k in ("qwen2", "qwen3", "bert", "deberta-v2")}


@pytest.fixture(scope="module")
def eager(tiny):
    """Each tiny model loaded once, with eager attention (what FlopCounterMode can see)."""
    loaded = {k: AutoModelForCausalLM.from_pretrained(tiny[k], attn_implementation="eager").eval()
              for k in ("qwen2", "qwen3")}
    loaded.update({k: AutoModelForSequenceClassification.from_pretrained(tiny[k], attn_implementation="eager").eval()
                   for k in ("bert", "deberta-v2")})
    return loaded


def _counted(fn):
    fc = FlopCounterMode(display=False)
    with fc, torch.no_grad():
        fn()
    return fc.get_total_flops()


def _close(expected, counted):
    assert counted > 0
    assert abs(expected - counted) / counted < TOL, (expected, counted)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("batch,new,past", [(1, 37, 0), (2, 19, 0), (1, 5, 41), (3, 1, 23)])
def test_decoder_matches_flop_counter(eager, kind, batch, new, past):
    torch.manual_seed(batch * 100 + new)
    model = eager[kind]
    vocab = model.config.vocab_size
    kw = {}
    if past:
        prefix = torch.randint(0, vocab, (batch, past))
        with torch.no_grad():
            cache = model(prefix, use_cache=True).cache
        kw = {"cache": cache, "use_cache": True,
              "attention_mask": torch.ones(batch, past + new, dtype=torch.long)}
    ids = torch.randint(0, vocab, (batch, new))
    counted = _counted(lambda: model(ids, **kw))
    _close(forward_flops(model.config, [new] * batch, [past] * batch), counted)
    if not past:
        last = _counted(lambda: model(ids, logits_to_keep=1))
        _close(forward_flops(model.config, [new] * batch, logits="last"), last)


@pytest.mark.parametrize("kind", ["bert", "deberta-v2"])
@pytest.mark.parametrize("batch,length", [(1, 37), (2, 19), (3, 101)])
def test_cross_encoder_matches_flop_counter(eager, kind, batch, length):
    model = eager[kind]
    ids = torch.randint(1000, 5000, (batch, length))
    counted = _counted(lambda: model(ids, attention_mask=torch.ones_like(ids)))
    _close(forward_flops(model.config, [length] * batch), counted)


def test_other_configs_match_flop_counter():
    """Llama (no GQA head_dim override), a bare BertModel with pooler, DeBERTa without shared keys."""
    torch.manual_seed(0)
    cases = [
        (AutoModelForCausalLM, LlamaConfig(vocab_size=500, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=6, num_key_value_heads=3)),
        (AutoModel, BertConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4)),
        (AutoModelForSequenceClassification,
         DebertaV2Config(vocab_size=500, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, relative_attention=True, position_buckets=-1,
                         max_relative_positions=64, pos_att_type=["c2p"], share_att_key=False,
                         num_labels=3)),
    ]
    for auto, cfg in cases:
        cfg._attn_implementation = "eager"
        # frozen weights: FlopCounterMode's module tracker trips over a raw trainable Parameter
        # fed straight into a Linear (DeBERTa's un-normalised rel_embeddings)
        model = auto.from_config(cfg).eval().requires_grad_(False)
        ids = torch.randint(0, 500, (2, 29))
        counted = _counted(lambda: model(ids, attention_mask=torch.ones_like(ids)))
        head = "pooler" if auto is AutoModel else None
        _close(forward_flops(model.config, [29, 29], head=head), counted)


def test_linear_in_batch_and_exact_split(tiny):
    for kind in ("qwen2", "qwen3", "bert"):
        d = tiny[kind]
        past = [0, 0, 0] if kind == "bert" else [3, 0, 100]
        total = forward_flops(d, [10, 20, 7], past)
        singles = sum(forward_flops(d, [n], [p]) for n, p in zip([10, 20, 7], past))
        assert total == pytest.approx(singles, rel=1e-12)
        assert forward_flops(d, [10] * 4) == pytest.approx(4 * forward_flops(d, [10]))
    # DeBERTa projects the relative embeddings once per call: batching saves exactly that.
    d = tiny["deberta-v2"]
    per = forward_flops_per_sequence(d, [10, 20, 7])
    assert sum(per) == pytest.approx(forward_flops(d, [10, 20, 7]))
    assert forward_flops(d, [10, 20]) < forward_flops(d, [10]) + forward_flops(d, [20])
    # longer past -> more attention FLOPs; lm head on the last token only -> fewer
    q = tiny["qwen2"]
    assert forward_flops(q, [1], [500]) > forward_flops(q, [1], [50])
    assert forward_flops(q, [30], logits="last") < forward_flops(q, [30])
    assert forward_flops(q, []) == 0.0
    # the ledger re-exports the same function
    assert ledger_forward_flops(q, [5], [2]) == forward_flops(q, [5], [2])


def test_config_forms_and_errors(tiny):
    import json

    d = tiny["qwen3"]
    as_dict = json.loads((d / "config.json").read_text())
    assert forward_flops(as_dict, [9]) == forward_flops(d, [9]) == forward_flops(d / "config.json", [9])
    for kind in ("bert", "deberta-v2", "qwen2"):
        live = AutoConfig.from_pretrained(tiny[kind])
        assert forward_flops(live, [9, 4]) == forward_flops(tiny[kind], [9, 4])
    with pytest.raises(ModelError, match="unsupported model_type 'gpt2'"):
        forward_flops({"model_type": "gpt2"}, [3])
    with pytest.raises(ValueError, match="no KV cache"):
        forward_flops(tiny["bert"], [3], [2])
    with pytest.raises(ValueError, match="2 input lengths but 1 past"):
        forward_flops(d, [3, 4], [1])
    with pytest.raises(ValueError, match=">= 0"):
        forward_flops(d, [-1])
    with pytest.raises(ValueError, match="logits"):
        forward_flops(d, [3], logits="first")
    with pytest.raises(ModelError, match="no config.json"):
        forward_flops(d / "nowhere", [3])

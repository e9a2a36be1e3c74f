"""Replaying frozen lower decoder layers from cached hidden states (LoRA on the top layers):
the cached states, the replayed forward and whole training runs equal the plain path."""
import numpy as np
import pytest
import torch

from ragfast.models.frozen_layers import frozen_inputs, replay_from, supports_replay


def _model(kind):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if kind == "llama":  # SmolLM2's architecture, random weights
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return LlamaForCausalLM(cfg).eval()
    from ragfast.models.tiny import tiny_path

    return AutoModelForCausalLM.from_pretrained(str(tiny_path(kind)), dtype=torch.float32).eval()


def _ids(rng, vocab, lengths):
    return [rng.integers(3, min(vocab, 300), n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_replay_equals_the_whole_decoder(kind):
    model = _model(kind)
    dec = model.get_decoder()
    n = model.config.num_hidden_layers
    first = n - 1
    assert supports_replay(model, first) and not supports_replay(model, 0) and not supports_replay(model, n)
    rng = np.random.default_rng()
    seqs = _ids(rng, model.config.vocab_size, [7, 19, 12])
    got = frozen_inputs(dec, first, seqs)
    for ids, h in zip(seqs, got):
        with torch.no_grad():
            ref = dec(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[first][0]
        assert h.shape == (len(ids), model.config.hidden_size)
        torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    # A right-padded batch from the cached states equals the full decoder at every real position.
    W = max(map(len, seqs))
    ids = torch.zeros((len(seqs), W), dtype=torch.long)
    att = torch.zeros_like(ids)
    hid = torch.full((len(seqs), W, model.config.hidden_size), float("nan"))
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = torch.tensor(s)
        att[j, :len(s)] = 1
        hid[j] = 0.0
        hid[j, :len(s)] = got[j]
    keys = list(model.state_dict())
    with torch.no_grad():
        full = dec(input_ids=ids, attention_mask=att).last_hidden_state
        with replay_from(dec, first) as rp:
            assert len(dec.layers) == 1
            rp.hidden = hid
            part = dec(input_ids=ids, attention_mask=att).last_hidden_state
            with pytest.raises(RuntimeError, match="do not match"):
                dec(input_ids=ids[:, :3], attention_mask=att[:, :3])
    assert list(model.state_dict()) == keys and len(dec.layers) == n  # put back, names and order kept
    for j, s in enumerate(seqs):
        torch.testing.assert_close(part[j, :len(s)], full[j, :len(s)], atol=1e-5, rtol=1e-5)


def test_architectures_that_cannot_replay():
    from types import SimpleNamespace

    gemma = SimpleNamespace(config=SimpleNamespace(model_type="gemma", num_hidden_layers=4, layer_types=None))
    mixed = SimpleNamespace(config=SimpleNamespace(model_type="qwen2", num_hidden_layers=4,
                                                   layer_types=["full_attention", "sliding_attention"] * 2))
    assert not supports_replay(gemma, 2) and not supports_replay(mixed, 2)


def test_lora_training_with_replay_equals_without(tmp_path):
    """Two epochs on the top layer: the same step losses, the same adapter (names included)."""
    from safetensors.torch import load_file

    from ragfast.models.lora_sft import lora_sft

    rng = np.random.default_rng()
    lengths = rng.integers(5, 30, 7)
    examples = []
    for ids in _ids(rng, 300, lengths):
        cut = int(rng.integers(2, len(ids) - 1))
        examples.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    runs, said = {}, []
    for name, budget in (("replay", 4 << 30), ("plain", 0)):
        model = _model("qwen2")
        runs[name] = lora_sft(model, examples, tmp_path / name, pad_id=0, identity={}, epochs=3, batch_size=3,
                              micro_batch=2, r=4, dropout=0.0, lr=1e-2, top_layers=1, replay_budget_bytes=budget,
                              save_every=2, log=said.append)
    assert any("frozen layers done" in m for m in said) and any("run in every step" in m for m in said)
    np.testing.assert_allclose(runs["replay"].losses, runs["plain"].losses, rtol=1e-4, atol=1e-6)
    assert runs["plain"].losses[-1] < runs["plain"].losses[0]
    a = load_file(str(tmp_path / "replay" / "checkpoint" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "plain" / "checkpoint" / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and all(".layers." in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3)

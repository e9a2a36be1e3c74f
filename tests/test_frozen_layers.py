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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_pass_runs_on_the_kernels_and_puts_the_model_back(isa_level, dtype):
    """The one frozen pass runs ragfast's fused layers and attention kernel interface, equals the
    model's own modules within the dtype's rounding, and leaves the model as it was (here an eager
    model: a judge's own attention implementation must come back too)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ragfast.models.attention import ATTN_IMPL
    from ragfast.models.fused_layers import fused_layers_on

    torch.manual_seed(0)
    # Head dim 64: the prefill kernel's shapes (multiples of 32), unlike the tiny models' 16.
    cfg = Qwen2Config(vocab_size=320, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation("eager")
    dec = model.get_decoder()
    seen = []
    dec.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append((model.config._attn_implementation, fused_layers_on(dec.layers[0]))))
    rng = np.random.default_rng()
    seqs = _ids(rng, 320, [150, 33, 1])  # 150 rows reach the gate's kernel (SILU_MIN_ROWS); 1 row a decode-shaped pass
    seqs[1] = seqs[0][:100] + seqs[1]  # one of the two runs after the other's 100 cached tokens
    plain = frozen_inputs(dec, 2, seqs, kernels=False)
    fast = frozen_inputs(dec, 2, seqs)
    assert seen == [("eager", 0)] * 3 + [(ATTN_IMPL, 3)] * 3  # two norms and the MLP of the layer patched
    assert model.config._attn_implementation == "eager" and fused_layers_on(model) == 0
    for a, b in zip(plain, fast):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        else:
            assert float((b.float() - a.float()).norm() / a.float().norm()) < 2e-2
    assert all(torch.equal(x, y) for x, y in zip(plain, frozen_inputs(dec, 2, seqs, kernels=False)))


def test_shared_prefixes_run_once_and_equal_the_whole_decoder():
    """Examples sharing leading ids (a judge's states of one question) run on the previous one's
    cache: each equals the full decoder's state, and duplicates and prefixes come out right."""
    from ragfast.models.frozen_layers import prefix_order, tokens_run

    model = _model("qwen2")
    dec = model.get_decoder()
    rng = np.random.default_rng()
    base = _ids(rng, model.config.vocab_size, [40])[0]
    tails = _ids(rng, model.config.vocab_size, [5, 9, 1, 13])
    seqs = [base + tails[0], base[:25] + tails[1], base + tails[0] + tails[2], base + tails[0],
            tails[3], base[:25]]
    order, shared = prefix_order(seqs)
    assert sorted(order) == list(range(len(seqs))) and shared[0] == 0
    for j in range(1, len(order)):
        a, b = seqs[order[j - 1]], seqs[order[j]]
        assert a <= b and a[:shared[j]] == b[:shared[j]]
        assert shared[j] == min(len(a), len(b)) or a[shared[j]] != b[shared[j]]
    rows = []
    dec.layers[0].register_forward_pre_hook(lambda m, a, k: rows.append((a[0] if a else k["hidden_states"]).shape[1]),
                                            with_kwargs=True)
    got = frozen_inputs(dec, 1, seqs)
    unshared = sum(len(seqs[i]) - p for i, p in zip(order, shared) if p < len(seqs[i]))
    assert sum(rows) == tokens_run(seqs) == unshared < 2 * 40
    for ids, h in zip(seqs, got):
        with torch.no_grad():
            ref = dec(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0]
        assert h.shape == (len(ids), model.config.hidden_size)
        torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    assert got[0] is not got[3] and torch.equal(got[0], got[3])  # the same ids: a copy, not a rerun

"""The fused RMSNorm / SiLU-gate kernels inside real transformers architectures (models/fused_layers.py)."""
import pytest
import torch

from ragfast.ops.registry import available

pytestmark = pytest.mark.skipif(not available()["cpp"], reason="ragfast._C not built")


@pytest.fixture(scope="module")
def models(tmp_path_factory, random_lm):
    """Random-weight Qwen2, Qwen3 (q/k norms too) and Llama (SmolLM2's architecture), odd widths."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(hidden_size=72, intermediate_size=118, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    out = {}
    for name, cls, extra in (("qwen2", Qwen2Config, {}), ("qwen3", Qwen3Config, {"head_dim": 18}),
                             ("llama", LlamaConfig, {})):
        out[name] = random_lm(cls, tmp_path_factory.mktemp(name), 11, **shape, **extra)
    return out


def load(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


def logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits.float()


def count_kernel_calls(monkeypatch):
    """Calls of the two ops from here on, by name (the model's forwards look them up per call)."""
    import ragfast.ops.rms_norm as R
    import ragfast.ops.silu_mul as S

    calls = {"rms_norm": 0, "silu_mul": 0}
    for mod, name in ((R, "rms_norm"), (S, "silu_mul")):
        def wrapped(*a, _real=getattr(mod, name), _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)
    return calls


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_matches_the_modules_own(models, arch, dtype, isa_level, monkeypatch):
    from ragfast.models.fused_layers import FAST_LEVELS, set_fused_layers

    model = load(models[arch], dtype)
    L = model.config.num_hidden_layers
    norms = 2 * L + 1 + (2 * L if arch == "qwen3" else 0)  # Qwen3 norms its queries and keys per head
    ids = torch.randint(0, model.config.vocab_size, (5, 37))  # 185 rows: the gate's kernel too (SILU_MIN_ROWS)
    before = logits(model, ids)
    assert set_fused_layers(model) == norms + L
    calls = count_kernel_calls(monkeypatch)
    after = logits(model, ids)
    fast = isa_level in FAST_LEVELS
    assert calls == ({"rms_norm": norms, "silu_mul": L} if fast else {"rms_norm": 0, "silu_mul": 0})
    if not fast:
        assert torch.equal(after, before)  # the modules' own code ran
    elif dtype == torch.float32:
        torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    else:  # bf16 rounding of a two-layer model: close, and the same greedy picks nearly everywhere
        assert (after - before).abs().max() < 0.1 * before.abs().max()
        assert (after.argmax(-1) == before.argmax(-1)).float().mean() >= 0.9
    calls.update(rms_norm=0, silu_mul=0)
    logits(model, ids[:1, :20])  # fewer rows than SILU_MIN_ROWS: torch's gate, the norms still fused
    assert calls == ({"rms_norm": norms, "silu_mul": 0} if fast else {"rms_norm": 0, "silu_mul": 0})
    assert set_fused_layers(model, False) == 0
    assert torch.equal(logits(model, ids), before)


def test_gradients_take_the_modules_own_code(models):
    from ragfast.models.fused_layers import set_fused_layers

    ids = torch.randint(0, 500, (2, 9))
    grads = []
    for on in (False, True):
        model = load(models["qwen2"], torch.float32).train()
        set_fused_layers(model, on)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_the_generator_runs_them_and_its_greedy_tokens_are_unchanged_in_fp32(tiny_qwen2_dir):
    from ragfast.models.fused_layers import fused_layers_on, set_fused_layers
    from ragfast.models.generator import HFGenerator

    gen = HFGenerator(tiny_qwen2_dir, dtype="float32", memory_budget=None)
    L = gen.config.num_hidden_layers
    assert fused_layers_on(gen.model) == 3 * L + 1  # patched; each call checks the level (FAST_LEVELS)
    prompts = ["alpha beta", "gamma delta epsilon zeta", "eta"]
    tokens = []
    for on in (True, False):
        set_fused_layers(gen.model, on)
        sids = [f"{on}-{i}" for i in range(len(prompts))]
        gen.start(sids, prompts)
        gen.generate(sids, stop=[], max_new_tokens=12)
        tokens.append([list(gen.last_generated[s]) for s in sids])
        gen.end(sids)
    assert tokens[0] == tokens[1]

"""Prefix-packed causal-judge scoring on every decoder family: Llama, Mistral, Qwen2, Qwen3.

The packed path once passed transformers a dict of per-layer-type masks, which only the Qwen
families read (Llama crashed on it). Each family's tiny random model is checked here against
the per-state reference (every state its own full prompt, transformers' own causal mask).
"""
import numpy as np
import pytest

from ragfast.judges.causal import CausalJudge
from ragfast.types import State

WORDS = "river album film born city capital singer novel treaty king league season".split()


def _family_dir(family, out, random_lm):
    """A random-weight model of ``family`` sharing the tiny Qwen2's tokenizer and chat template."""
    from transformers import LlamaConfig, MistralConfig

    from ragfast.models.tiny import tiny_path

    if family in ("qwen2", "qwen3"):
        return tiny_path(family)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
    if family == "mistral":
        shape["sliding_window"] = 4096
    # a wider spread than the init's makes scores differ clearly between states
    return random_lm(LlamaConfig if family == "llama" else MistralConfig, out, 7, spread=0.2, **shape)


def _states(seed):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(3):
        q = f"Which {rng.choice(WORDS)} was {rng.choice(WORDS)} number {t}?"
        ev = []
        for s in range(int(rng.integers(2, 4)) + 1):
            out.append(State(q, list(ev), trajectory_id=f"t{t}", index=s))
            n = int(rng.integers(3, 12))
            ev.append("\n\n<information>Doc 1(Title: \"" + rng.choice(WORDS).title() + "\") "
                      + " ".join(rng.choice(WORDS, size=n)) + "</information>\n\n")
    return [out[i] for i in rng.permutation(len(out))]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_packed_equals_per_state_reference(family, tmp_path, random_lm):
    path = _family_dir(family, tmp_path / family, random_lm)
    judge = CausalJudge(path, attention="ref", system_prompt="Judge sufficiency; reply in JSON.")
    arch = judge.config.architectures[0].lower()
    assert arch.startswith(family), arch
    states = _states(seed=len(family))
    naive = judge.stop_scores(states, packed=False)
    packed = judge.stop_scores(states)
    assert np.isfinite(naive).all() and np.ptp(naive) > 1e-3
    np.testing.assert_allclose(packed, naive, atol=1e-4, rtol=0)
    judge.attention = "flex"
    np.testing.assert_allclose(judge.stop_scores(states), naive, atol=1e-4, rtol=0)

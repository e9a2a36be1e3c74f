"""The LLM-prompted NLI scorer (``--nli smollm2``) on the tiny random-weight Qwen2.

Oracle: each pair alone, unpadded, through the model; softmax of the last position; the
probability mass of each label word's first tokens, summed and renormalised by hand here.
"""
from __future__ import annotations

import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger

torch = pytest.importorskip("torch")

PAIRS = [("Paris is the capital of France.", "France's capital is Paris."),
         ("The Seine runs through Paris, a city in the north of France, and reaches the sea at Le Havre. " * 3,
          "The Seine reaches the sea."),
         ("Tom Avery was born in 1951.", "Tom Avery was born in 1960."),
         ("x", "y")]


@pytest.fixture(scope="module")
def scorer():
    from ragfast.models.llm_nli import LLMNLIScorer
    from ragfast.models.tiny import tiny_path

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLMNLIScorer(tiny_path("qwen2"), max_length=256, token_budget=1024)
    torch.set_num_threads(n)


def _oracle(s, premise, hypothesis):
    ids = torch.tensor([s.prompt_ids(premise, hypothesis)])
    with torch.inference_mode():
        p = torch.softmax(s.model(input_ids=ids).logits[0, -1].double(), dim=-1)
    mass = []
    for word in ("yes", "maybe", "no"):
        firsts = {s.tokenizer(f, add_special_tokens=False)["input_ids"][0]
                  for f in (word, " " + word, word.capitalize(), " " + word.capitalize())}
        mass.append(float(sum(p[i] for i in firsts)))
    return np.array(mass) / sum(mass)


def test_batched_scores_equal_each_pair_alone(scorer):
    led = CostLedger()
    got = scorer.score([p for p, _ in PAIRS], [h for _, h in PAIRS], ledger=led, question_ids=["a", "b", "c", "d"])
    assert got.shape == (len(PAIRS), 3) and got.dtype == np.float32
    want = np.stack([_oracle(scorer, p, h) for p, h in PAIRS])
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert scorer.last_stats["padded_tokens"] > scorer.last_stats["real_tokens"]  # rows really were padded
    per_q = led.per_question()
    assert set(per_q) == {"a", "b", "c", "d"}
    assert all(per_q[q]["nli"]["input_tokens"] == len(scorer.prompt_ids(*PAIRS[i])) for i, q in enumerate("abcd"))


def test_describe_names_it_an_llm_prompted_scorer_and_truncates(scorer):
    d = scorer.describe()
    assert "LLM-prompted" in d["kind"] and d["meaningful"] is False  # random weights
    from ragfast.models.llm_nli import LLMNLIScorer
    from ragfast.models.tiny import tiny_path

    short = LLMNLIScorer(tiny_path("qwen2"), max_length=96)
    full = scorer.prompt_ids("word " * 500, "a claim")
    ids = short.prompt_ids("word " * 500, "a claim")
    assert len(full) > 96 >= len(ids) > 80
    tail = scorer.prompt_ids("", "a claim")[-30:]  # the hypothesis, the question and the template's end stay
    assert ids[-30:] == tail
    assert short.score([], []).shape == (0, 3)


def test_slot_picks_the_scorer_by_model_kind(tmp_path):
    from ragfast.errors import ConfigError, ModelError
    from ragfast.models.llm_nli import LLMNLIScorer
    from ragfast.models.nli import NLIScorer
    from ragfast.models.tiny import tiny_path
    from ragfast.runner import slots

    assert isinstance(slots.nli(str(tiny_path("qwen2"))), LLMNLIScorer)
    assert isinstance(slots.nli("tiny", backend="torch"), NLIScorer)
    with pytest.raises(ConfigError, match="catalogue model"):
        slots.nli(str(tmp_path / "missing"))
    with pytest.raises(ModelError):
        LLMNLIScorer(tiny_path("deberta-v2"))  # a classifier, not a causal LM

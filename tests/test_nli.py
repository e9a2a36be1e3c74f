"""NLIScorer: bucketing, canonical label order from config.id2label, ONNX parity, ledger."""
import numpy as np
import pytest

from ragfast.accounting.ledger import CostLedger, forward_flops
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.models.nli import CANONICAL_LABELS, NLIScorer, canonical_order, plan_batches


def _pairs(n, seed=0):
    """Pairs of very different lengths (1 to ~120 words), like StepGap's quotes and evidence."""
    rng = np.random.default_rng(seed)
    words = "the band album city river founded born actor film director league river season album".split()
    prem = [" ".join(rng.choice(words, size=int(rng.pareto(1.2) * 8) + 1)) for _ in range(n)]
    hyp = [" ".join(rng.choice(words, size=int(rng.integers(2, 15)))) for _ in range(n)]
    return prem, hyp


@pytest.fixture(scope="module")
def deberta():
    from ragfast.models.tiny import tiny_path

    return tiny_path("deberta-v2")


@pytest.fixture(scope="module")
def scorer(deberta):
    return NLIScorer(deberta, max_length=128, token_budget=512)


def test_canonical_order_by_name():
    assert canonical_order({0: "contradiction", 1: "entailment", 2: "neutral"}) == [1, 2, 0]
    assert canonical_order({"0": "ENTAILMENT", "1": "Neutral", "2": "contradiction"}) == [0, 1, 2]
    with pytest.raises(ModelError, match="missing"):
        canonical_order({0: "LABEL_0", 1: "LABEL_1", 2: "LABEL_2"})
    with pytest.raises(ModelError, match="exactly"):
        canonical_order({0: "entailment", 1: "not_entailment"})


def test_plan_batches_respects_budget_and_covers_all():
    rng = np.random.default_rng(1)
    lens = rng.integers(3, 300, size=989)
    for frac in (1.0, 0.3, 0.0):
        batches = plan_batches(lens, 1024, max_padding=frac)
        seen = np.concatenate(batches)
        assert sorted(seen.tolist()) == list(range(989))
        for b in batches:
            assert len(b) * lens[b].max() <= 1024
            assert lens[b[0]] == lens[b].max()  # first row is the longest: padding known up front
            assert lens[b].min() >= (1 - frac) * lens[b].max()
    # The spread cap only ever splits batches.
    assert len(plan_batches(lens, 1024, 0.3)) >= len(plan_batches(lens, 1024, 1.0))
    assert [len(b) for b in plan_batches([10, 9, 5, 4], 100, 0.3)] == [2, 2]
    assert [len(b) for b in plan_batches([10, 9, 5, 4], 100, 1.0)] == [4]
    assert plan_batches([], 64) == []
    with pytest.raises(ConfigError, match="max_padding"):
        plan_batches([3], 64, 1.5)
    # A pair longer than the budget still runs, alone.
    assert [len(b) for b in plan_batches([100, 5], 50)] == [1, 1]


def test_bucketed_equals_naive_and_restores_order(scorer):
    prem, hyp = _pairs(123)
    a = scorer.score(prem, hyp)
    bucket_stats = dict(scorer.last_stats)
    b = scorer.score(prem, hyp, strategy="naive", batch_size=16)
    naive_stats = dict(scorer.last_stats)
    assert a.shape == (123, 3) and a.dtype == np.float32
    np.testing.assert_allclose(a, b, atol=2e-5)
    np.testing.assert_allclose(a.sum(1), 1.0, atol=1e-5)
    # Single-pair calls (no padding at all) give the same rows: input order was restored.
    for i in (0, 7, 122):
        np.testing.assert_allclose(scorer.score([prem[i]], [hyp[i]])[0], a[i], atol=2e-5)
    assert bucket_stats["real_tokens"] == naive_stats["real_tokens"]
    assert bucket_stats["padded_tokens"] < naive_stats["padded_tokens"]
    assert 0 <= bucket_stats["padding_share"] < naive_stats["padding_share"]
    assert all(k in bucket_stats for k in ("batches", "flops", "seconds"))


def test_permuted_id2label_gives_same_canonical_probs(deberta, scorer, tmp_path):
    """Permute the classifier rows and id2label together: the canonical probabilities must not move."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    m = AutoModelForSequenceClassification.from_pretrained(str(deberta))
    old = {int(k): v for k, v in m.config.id2label.items()}
    perm = [2, 0, 1]  # new column j holds old column perm[j]
    with torch.no_grad():
        m.classifier.weight.copy_(m.classifier.weight[perm].clone())
        m.classifier.bias.copy_(m.classifier.bias[perm].clone())
    new = {j: old[perm[j]] for j in range(3)}
    m.config.id2label = new
    m.config.label2id = {v: k for k, v in new.items()}
    m.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(str(deberta)).save_pretrained(tmp_path)
    (tmp_path / "ragfast_tiny.json").write_text((deberta / "ragfast_tiny.json").read_text())
    permuted = NLIScorer(tmp_path, max_length=128, token_budget=512)
    assert permuted.model_labels() != scorer.model_labels()
    prem, hyp = _pairs(40, seed=2)
    np.testing.assert_allclose(permuted.score(prem, hyp), scorer.score(prem, hyp), atol=1e-5)
    assert permuted.labels() == CANONICAL_LABELS


def test_onnx_backend_parity(deberta, scorer, tmp_path):
    from ragfast.encoders.export import export_onnx

    export_onnx(deberta, tmp_path / "onnx", max_length=128)
    onnx = NLIScorer(tmp_path / "onnx", backend="onnx", max_length=128, token_budget=512)
    assert onnx.meaningful is False  # the tiny marker travels with the export
    prem, hyp = _pairs(64, seed=3)
    np.testing.assert_allclose(onnx.score(prem, hyp), scorer.score(prem, hyp), atol=1e-4)


def test_ledger_records_pairs_tokens_flops(scorer):
    prem, hyp = _pairs(30, seed=4)
    qids = [f"q{i % 3}" for i in range(30)]
    led = CostLedger()
    scorer.score(prem, hyp, ledger=led, question_ids=qids)
    st = scorer.last_stats
    tot = led.totals()["nli"]
    assert tot["calls"] == 30
    assert tot["input_tokens"] == st["real_tokens"]
    assert tot["batches"] == st["batches"]
    # each pair is charged what its unpadded sequence adds to a batch (batch-independent, so a
    # resume costs what a clean run does); the batches also computed padding and per-call work
    lens = [len(x) for x in scorer.tokenize(prem, hyp)["input_ids"]]
    want = sum(forward_flops(scorer.config, [n, n]) - forward_flops(scorer.config, [n]) for n in lens)
    assert tot["flops"] == pytest.approx(want) and 0 < tot["flops"] <= st["flops"] * (1 + 1e-9)
    alone = CostLedger()  # the same pairs scored one call each: the same charges
    for i in (0, 7, 29):
        scorer.score([prem[i]], [hyp[i]], ledger=alone, question_ids=[qids[i]])
        got = [r.flops for r in alone.records][-1]
        assert got == pytest.approx(forward_flops(scorer.config, [lens[i]] * 2) - forward_flops(scorer.config, [lens[i]]))
    per_q = led.per_question()
    assert set(per_q) == {"q0", "q1", "q2"} and per_q["q0"]["nli"]["calls"] == 10
    lens = [len(x) for x in scorer.tokenize(prem, hyp)["input_ids"]]
    assert per_q["q1"]["nli"]["input_tokens"] == sum(lens[i] for i in range(1, 30, 3))
    assert st["padded_tokens"] >= st["real_tokens"]


def test_bad_input_is_named(deberta, scorer):
    with pytest.raises(DataError, match="2 premises but 1 hypotheses"):
        scorer.score(["a", "b"], ["c"])
    with pytest.raises(DataError, match="expected str"):
        scorer.score(["a", None], ["c", "d"])
    with pytest.raises(ConfigError, match="token_budget"):
        NLIScorer(deberta, max_length=512, token_budget=100)
    with pytest.raises(ConfigError, match="backend"):
        NLIScorer(deberta, backend="tensorrt")
    with pytest.raises(ModelError, match="does not exist"):
        NLIScorer("/nonexistent/model")
    assert scorer.score([], []).shape == (0, 3)
    assert scorer.meaningful is False and scorer.describe()["meaningful"] is False


def test_onnx_backend_exports_once_into_cache(deberta, scorer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    a = NLIScorer(deberta, backend="onnx", max_length=128, token_budget=512)
    assert a.onnx_file.is_file() and tmp_path in a.onnx_file.parents
    mtime = a.onnx_file.stat().st_mtime_ns
    b = NLIScorer(deberta, backend="onnx", max_length=128, token_budget=512)
    assert b.onnx_file == a.onnx_file and b.onnx_file.stat().st_mtime_ns == mtime  # reused, not re-exported
    prem, hyp = _pairs(9, seed=5)
    np.testing.assert_allclose(b.score(prem, hyp), scorer.score(prem, hyp), atol=1e-4)

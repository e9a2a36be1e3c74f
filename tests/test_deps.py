"""Optional runtimes: one build of ONNX Runtime / faiss, missing providers are errors."""
import pytest

from ragfast.infra import deps
from ragfast.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh_cache():
    deps._load.cache_clear()
    yield
    deps._load.cache_clear()


def test_mixed_cpu_and_gpu_builds_are_refused_with_the_repair(monkeypatch):
    monkeypatch.setattr(deps, "installed", lambda d: d in {"onnxruntime", "onnxruntime-gpu", "faiss-cpu"})
    with pytest.raises(ConfigError, match="both onnxruntime and onnxruntime-gpu .*pip uninstall -y"):
        deps.onnxruntime()
    assert deps.faiss() is not None  # one build only: fine
    assert "error" in deps.status()["onnxruntime"]


def test_missing_runtime_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def no_faiss(name, *a, **kw):
        if name == "faiss":
            raise ImportError("no faiss")
        return real(name, *a, **kw)

    monkeypatch.setattr(importlib, "import_module", no_faiss)
    with pytest.raises(ConfigError, match=r"faiss is not installed: pip install 'ragfast\[cpu\]'"):
        deps.faiss()


def test_a_missing_provider_is_an_error_not_a_fallback(tmp_path):
    pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" in deps.ort_providers():
        pytest.skip("this machine has the CUDA provider")
    assert deps.require_ort_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    with pytest.raises(ConfigError, match=r"lacks CUDAExecutionProvider.*ragfast\[gpu\]"):
        deps.require_ort_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])
    from ragfast.encoders.export import ort_session

    with pytest.raises(ConfigError, match="lacks CUDAExecutionProvider"):
        ort_session(tmp_path / "x.onnx", providers=["CUDAExecutionProvider"])


def test_status_reports_providers_and_gpus():
    s = deps.status()
    assert "CPUExecutionProvider" in s["onnxruntime"]["providers"]
    assert s["faiss"]["gpus"] >= 0 and s["faiss"]["distributions"]

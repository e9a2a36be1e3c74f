"""Optional runtime dependencies: import them with an error that says what to install.

ONNX Runtime and faiss come in CPU and CUDA builds that install under the same module name
(``onnxruntime`` / ``onnxruntime-gpu``, ``faiss-cpu`` / ``faiss-gpu-cu12``). With both builds
installed, the one unpacked last owns the module and the other's files are mixed in: for ONNX
Runtime the known result is a CUDA provider that silently goes missing (onnxruntime issue
26996). So ragfast depends on neither directly: the ``[cpu]`` and ``[gpu]`` extras pick one,
and this module refuses a mixed install with the command that repairs it.
"""
from __future__ import annotations

import functools
import importlib
from importlib import metadata
from typing import Any

from ragfast.errors import ConfigError

__all__ = ["installed", "onnxruntime", "faiss", "ort_providers", "require_ort_providers", "status"]

# module -> (CPU distribution, GPU distribution)
_BUILDS = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu"), "faiss": ("faiss-cpu", "faiss-gpu-cu12")}


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` is installed (by its metadata, without importing it)."""
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _check_builds(module: str) -> None:
    cpu, gpu = _BUILDS[module]
    if installed(cpu) and installed(gpu):
        raise ConfigError(f"both {cpu} and {gpu} are installed and share the module {module!r}; keep one: "
                          f"pip uninstall -y {cpu} {gpu} && pip install {gpu}  (or {cpu} on a CPU-only machine)")


@functools.lru_cache(maxsize=None)
def _load(module: str) -> Any:
    _check_builds(module)
    try:
        return importlib.import_module(module)
    except ImportError:
        cpu, gpu = _BUILDS[module]
        raise ConfigError(f"{module} is not installed: pip install 'ragfast[cpu]' (or 'ragfast[gpu]' on a CUDA "
                          f"machine), which brings {cpu} (or {gpu})") from None


def onnxruntime() -> Any:
    """The ``onnxruntime`` module, after checking that exactly one build is installed."""
    return _load("onnxruntime")


def faiss() -> Any:
    """The ``faiss`` module, after checking that exactly one build is installed."""
    return _load("faiss")


def ort_providers() -> list[str]:
    """ONNX Runtime's available execution providers."""
    return list(onnxruntime().get_available_providers())


def require_ort_providers(wanted: list[str]) -> list[str]:
    """Return ``wanted`` if every provider is available, else raise naming what is missing.

    A GPU run that silently falls back to the CPU measures the wrong thing, so a missing
    provider is an error, not a fallback.
    """
    avail = ort_providers()
    missing = [p for p in wanted if p not in avail]
    if missing:
        hint = (" (install 'ragfast[gpu]' on a CUDA machine: it brings onnxruntime-gpu)"
                if "CUDAExecutionProvider" in missing else "")
        raise ConfigError(f"ONNX Runtime lacks {', '.join(missing)}; available: {', '.join(avail)}{hint}")
    return list(wanted)


def status() -> dict[str, Any]:
    """What ``ragfast backends`` reports: installed builds, ORT providers, faiss GPUs."""
    out: dict[str, Any] = {}
    for module, (cpu, gpu) in _BUILDS.items():
        row: dict[str, Any] = {"distributions": [d for d in (cpu, gpu) if installed(d)]}
        try:
            mod = _load(module)
        except ConfigError as exc:
            row["error"] = str(exc)
        else:
            row["version"] = getattr(mod, "__version__", "?")
            if module == "onnxruntime":
                row["providers"] = list(mod.get_available_providers())
            else:
                row["gpus"] = int(mod.get_num_gpus()) if hasattr(mod, "get_num_gpus") else 0
        out[module] = row
    return out

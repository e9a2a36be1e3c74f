"""The two Ray facts every Ray actor in ragfast needs: the module itself, and its device."""
from __future__ import annotations

from typing import Any

from ragfast.errors import ConfigError

__all__ = ["require_ray", "actor_device"]


def require_ray() -> Any:
    """The ``ray`` module, or a :class:`~ragfast.errors.ConfigError` saying how to install it."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is in the [dist] extra
        raise ConfigError("Ray is not installed; install it with: pip install 'ragfast[dist]'") from None
    return ray


def actor_device() -> str:
    """``"cuda"`` inside a Ray actor that holds a GPU, else ``"cpu"``."""
    ray = require_ray()
    try:
        gpus = ray.get_gpu_ids()
    except Exception:
        gpus = []
    # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs, so its first GPU is always cuda:0.
    return "cuda" if gpus else "cpu"

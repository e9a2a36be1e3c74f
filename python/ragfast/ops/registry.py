"""Backend registry for ragfast ops.

Every op has up to three implementations with one signature: ``ref`` (plain torch/numpy, the
oracle and fallback), ``cpp`` (``ragfast._C``) and ``triton`` (``ragfast.kernels``). The op
modules register them here; :func:`resolve` picks one per call.

This module imports no op module, so there is no import loop: the op modules import it, and
importing it (``ragfast.ops.registry``) first runs ``ragfast/ops/__init__.py``, which imports
every op module, so every op is registered before anything here is called.

Choice order: the ``backend=`` argument of the call, then ``RAGFAST_BACKEND``, then the default
for the data's device (triton for CUDA tensors, cpp for CPU ones), falling back to ``ref`` when
the preferred one is not available for that op.
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Any, Callable

__all__ = ["BACKENDS", "BackendError", "register", "cpp_module", "available", "default_backend", "resolve",
           "backends"]

BACKENDS = ("ref", "cpp", "triton")

# op name -> backend name -> implementation
_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}
# (op, backend asked, device, RAGFAST_BACKEND) -> resolve's answer. A decode step resolves about 380
# times (every layer's ops), and answering afresh took 5.6 ms of a 220 ms batch-64 step of
# Qwen2.5-Coder-0.5B (w8a8, two threads, AMD EPYC Zen 4). Cleared whenever an op is registered.
_RESOLVED: dict[tuple[str, str | None, str, str], tuple[str, Callable[..., Any]]] = {}


class BackendError(RuntimeError):
    """A requested backend is unknown or not available for an op."""


def register(op: str, backend: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Register ``fn`` as the ``backend`` implementation of ``op``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _REGISTRY.setdefault(op, {})[backend] = fn
    _RESOLVED.clear()
    return fn


@functools.lru_cache(maxsize=None)
def cpp_module():
    """The compiled extension ``ragfast._C``, or None when it did not build or import."""
    try:
        return importlib.import_module("ragfast._C")
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _triton_status() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton not importable ({type(exc).__name__})"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "interpreter (TRITON_INTERPRET=1)"
    try:
        import torch

        if torch.cuda.is_available():
            return True, f"cuda ({torch.cuda.get_device_name(0)})"
    except Exception:
        pass
    return False, "no GPU (set TRITON_INTERPRET=1 to run kernels on the CPU)"


def available() -> dict[str, bool]:
    """Which backends can run on this machine."""
    return {"ref": True, "cpp": cpp_module() is not None, "triton": _triton_status()[0]}


def _env_backend() -> str | None:
    env = os.environ.get("RAGFAST_BACKEND", "").strip().lower()
    if not env:
        return None
    if env not in BACKENDS:
        raise BackendError(f"RAGFAST_BACKEND={env!r} is not one of {', '.join(BACKENDS)}")
    return env


def default_backend(op: str, device: str = "cpu") -> str:
    """The backend ``op`` uses when the call names none."""
    impls = _REGISTRY.get(op, {})
    avail = available()
    env = _env_backend()
    if env is not None:
        return env
    prefs = ("triton", "cpp", "ref") if device.startswith("cuda") else ("cpp", "ref")
    for b in prefs:
        if b in impls and avail[b]:
            return b
    return "ref"


def resolve(op: str, backend: str | None = None, device: str = "cpu") -> tuple[str, Callable[..., Any]]:
    """Return ``(backend_name, implementation)`` for one call of ``op``.

    Raises
    ------
    BackendError
        When the named backend does not exist, is not available here, or has no
        implementation of this op.
    """
    key = (op, backend, device, os.environ.get("RAGFAST_BACKEND", ""))
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit
    impls = _REGISTRY.get(op)
    if not impls:
        raise BackendError(f"unknown op {op!r}; known: {sorted(_REGISTRY)}")
    name = (backend or "").lower() or default_backend(op, device)
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r} for {op}; expected one of {BACKENDS}")
    if name not in impls:
        raise BackendError(f"op {op!r} has no {name!r} implementation (has: {sorted(impls)})")
    if not available()[name]:
        why = _triton_status()[1] if name == "triton" else "ragfast._C did not import (no compiler at install?)"
        raise BackendError(f"backend {name!r} is not available here: {why}")
    _RESOLVED[key] = (name, impls[name])
    return _RESOLVED[key]


def _topk_ip_paths(c) -> dict[str, Any] | None:
    """What topk_ip runs by default at the ISA level in use: storage -> {batch class: path}."""
    if c is None:
        return None
    from ragfast.ops.topk_ip_choice import BATCH_CLASSES, choose, machine_table

    try:
        level = c.isa_current()
    except RuntimeError:  # RAGFAST_ISA refused: reported under "isa"
        return None
    table = machine_table()  # this machine's: shipped, or cached by a calibration (none made here)
    return {
        "isa": level,
        "table_machine": table.get("machine"),
        "table_source": table.get("source"),
        "paths": {st: {b: choose(level, st, b, table).path for b in BATCH_CLASSES}
                  for st in ("fp32", "fp16", "bf16", "int8")},
    }


def backends() -> dict[str, Any]:
    """Say which op backends are available and which one each op uses.

    Returns
    -------
    dict
        ``available``: backend -> bool; ``ops``: op -> {"implementations": [...],
        "default": backend}; ``override``: the ``RAGFAST_BACKEND`` value or None;
        ``triton``: why triton is or is not usable; ``build``: ``ragfast._C.build_info()``
        or None; ``isa``: ``ragfast._C.isa_info()`` (ISA levels compiled in, supported by this
        CPU, the one chosen and why; set ``RAGFAST_ISA`` to force one) or None;
        ``topk_ip_paths``: per storage and batch class, whether the default topk_ip runs the
        compiled kernels (``cpp``) or torch mm + topk at that level, from the measured table.
    """
    c = cpp_module()
    return {
        "available": available(),
        "override": _env_backend(),
        "triton": _triton_status()[1],
        "build": dict(c.build_info()) if c is not None else None,
        "isa": dict(c.isa_info()) if c is not None else None,
        "topk_ip_paths": _topk_ip_paths(c),
        "ops": {
            op: {"implementations": sorted(impls), "default": default_backend(op)}
            for op, impls in sorted(_REGISTRY.items())
        },
    }

"""Where each model slot runs: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked up front."""
from __future__ import annotations

from typing import Mapping

from ragfast.errors import ConfigError

__all__ = ["SLOTS", "DEVICE_HELP", "device_option", "resolve_device", "slot_devices"]

#: The model slots that take a device.
SLOTS = ("reasoner", "encoder", "judge", "nli")


def resolve_device(spec: str | None) -> str:
    """``auto`` (or None) -> ``cuda`` when a GPU is visible, else ``cpu``; others are checked.

    Raises
    ------
    ConfigError
        For an unknown spelling, or a CUDA device this machine does not have (rather than a
        crash deep inside the first forward pass).
    """
    s = (spec or "auto").strip().lower()
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if s == "auto":
        return "cuda" if n else "cpu"
    if s == "cpu":
        return "cpu"
    if s == "cuda" or (s.startswith("cuda:") and s[5:].isdigit()):
        idx = int(s[5:]) if ":" in s else 0
        if idx >= n:
            have = f"{n} CUDA device(s)" if n else "no CUDA device (CPU-only torch or no GPU)"
            raise ConfigError(f"device {spec!r} is not available: this machine has {have}; use --device cpu or auto")
        return s
    raise ConfigError(f"unknown device {spec!r}; expected auto, cpu, cuda or cuda:N")


def slot_devices(device: str | None, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """Resolve the run's device and per-slot overrides (e.g. ``{"judge": "cpu"}``) to one per slot."""
    over = {k: v for k, v in (overrides or {}).items() if v}
    bad = sorted(set(over) - set(SLOTS))
    if bad:
        raise ConfigError(f"unknown device slot(s) {bad}; expected {list(SLOTS)}")
    base = resolve_device(device)
    return {s: resolve_device(over[s]) if s in over else base for s in SLOTS}


DEVICE_HELP = "Where the models run: auto (the GPU when there is one) | cpu | cuda | cuda:N."


def device_option(value: str | None) -> str:
    """Typer callback for every ``--device`` option: resolve ``auto`` and check the device exists."""
    return resolve_device(value)

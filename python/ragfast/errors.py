"""Errors that name the problem. The CLI prints them as one line instead of a traceback."""
from __future__ import annotations


class RagfastError(Exception):
    """Base class of every error ragfast raises on purpose."""


class DataError(RagfastError, ValueError):
    """Bad input data: a missing file, an unknown layout, a line that does not parse."""


class ModelError(RagfastError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""


class ConfigError(RagfastError, ValueError):
    """A bad option, preset or configuration file."""


# Optional packages by import name: (what to pip install, the ragfast extra that brings it).
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "fastapi": ("fastapi", "serve"), "uvicorn": ("uvicorn", "serve"), "httpx": ("httpx", "serve"),
    "starlette": ("fastapi", "serve"), "ray": ("ray", "dist"), "sklearn": ("scikit-learn", "train"),
    "optimum": ("optimum", "optimum"), "triton": ("triton", "gpu"),
    "gguf": ("gguf", "models"),
}


def missing_dependency_message(exc: ModuleNotFoundError) -> str | None:
    """One line naming the missing package and the extra to install; None for ragfast's own modules.

    A missing module of ragfast itself is a broken install or a bug, not bad input: the caller
    lets that one through as a traceback.
    """
    name = (exc.name or "").split(".")[0]
    if not name or name == "ragfast":
        return None
    pkg, extra = OPTIONAL_PACKAGES.get(name, (name, ""))
    how = f"pip install 'ragfast[{extra}]' (or pip install {pkg})" if extra else f"pip install {pkg}"
    return f"this command needs the Python package {pkg!r}, which is not installed: {how}"

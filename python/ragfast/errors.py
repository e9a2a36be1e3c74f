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

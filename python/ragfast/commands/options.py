"""The flags every command that runs methods shares, and the ``--config`` YAML they all read.

A shared flag defaults to ``None`` on the command line, so :func:`resolve` can tell a flag the
user typed (it wins) from one a ``--config`` file sets (it comes next) from the shared default
(:data:`ragfast.runner.slots.DEFAULTS`, last). The same YAML therefore means the same run
whichever command reads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from ragfast.errors import ConfigError
from ragfast.runner.slots import DEFAULTS

__all__ = ["CONFIG", "OFFSET", "LIMIT", "BATCH_SIZE", "CORPUS", "DEVICE", "VAL_DATA", "VAL_OFFSET", "VAL_LIMIT",
           "load_yaml", "resolve"]

CONFIG = typer.Option(None, "--config", help="A YAML file of settings (flag names with _ for -); flags typed on the "
                                             "command line win over it.")
OFFSET = typer.Option(None, "--offset", help="Skip the first N questions of --data (default 0).")
LIMIT = typer.Option(None, "--limit", "-n", help="Only N questions (after --offset).")
BATCH_SIZE = typer.Option(None, "--batch-size", help=f"Questions run together (default {DEFAULTS['batch_size']}).")
CORPUS = typer.Option(None, "--corpus", help="Corpus part; repeat for several: contexts (the data's own "
                                             "paragraphs), a sample name or a jsonl path (default: "
                                             + " + ".join(DEFAULTS["corpus"]) + ", the same as ragfast bench, "
                                             "so their cached embeddings are shared).")
DEVICE = typer.Option(None, "--device", help="Where local models run: auto (the GPU when there is one; default) | "
                                             "cpu | cuda | cuda:N.")
VAL_DATA = typer.Option(None, "--val-data", help="Validation QA file or sample (S2G threshold selection).")
VAL_OFFSET = typer.Option(None, "--val-offset", help="Skip the first N validation questions (default 0).")
VAL_LIMIT = typer.Option(None, "--val-limit", help="Validation questions used to choose the STOP threshold "
                                                   "(default 100).")

# Defaults of the shared flags that are not slots.
_FLAG_DEFAULTS: dict[str, Any] = {"offset": 0, "device": "auto", "val_offset": 0, "val_limit": 100}


def load_yaml(path: str | None) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file (empty without one).

    Raises
    ------
    ConfigError
        A missing file, invalid YAML or anything but a mapping.
    """
    if not path:
        return {}
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({exc})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping of settings, got {type(loaded).__name__}")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


def resolve(config: str | None, given: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each setting from the command line, else the ``--config`` file, else the shared default.

    Parameters
    ----------
    config : str, optional
        The ``--config`` path.
    given : mapping
        The command's flags (``None`` = not typed).
    defaults : mapping, optional
        The command's own defaults for flags that are not shared.

    Raises
    ------
    ConfigError
        The file sets something the command has no flag for.
    """
    from_file = load_yaml(config)
    unknown = sorted(set(from_file) - set(given))
    if unknown:
        raise ConfigError(f"{config}: unknown setting(s) {unknown} for this command; known: {sorted(given)}")
    base = {**DEFAULTS, **_FLAG_DEFAULTS, **(defaults or {})}
    out = {}
    for k, v in given.items():
        out[k] = v if v is not None else from_file.get(k, base.get(k))
    if out.get("corpus") is not None and isinstance(out["corpus"], str):
        out["corpus"] = [out["corpus"]]
    for k in ("offset", "val_offset"):
        if k in out and out[k] is not None and (not isinstance(out[k], int) or out[k] < 0):
            raise ConfigError(f"--{k.replace('_', '-')} must be an integer >= 0, got {out[k]!r}")
    if out.get("limit") is not None and (not isinstance(out["limit"], int) or out["limit"] < 1):
        raise ConfigError(f"--limit must be >= 1, got {out['limit']!r}")
    return out


CorpusList = Optional[List[str]]

"""The ``--config`` YAML file every command that runs methods reads, and the names it may use.

``ragfast bench`` and the ``ragfast run`` commands name three settings differently (the bench
after its slots, the run commands after the Search-R1 loop); a file may use either name.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ragfast.errors import ConfigError

__all__ = ["BENCH_NAMES", "RUN_NAMES", "RUN_ONLY", "load_yaml"]

#: run-command name -> bench name of the same setting.
BENCH_NAMES: dict[str, str] = {"model": "reasoner", "retriever": "index", "max_turns": "budget",
                               "tokenizer": "reasoner_tokenizer", "model_config": "reasoner_config"}
#: Settings only the run commands take; the bench leaves them to those commands.
RUN_ONLY: frozenset[str] = frozenset({"max_new_tokens", "max_obs_tokens", "prompt_budget", "checker_llm",
                                      "no_progress"})
#: bench name -> run-command name.
RUN_NAMES: dict[str, str] = {v: k for k, v in BENCH_NAMES.items()}


def load_yaml(path: str | None) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file (empty without one), keys with ``_`` for ``-``.

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

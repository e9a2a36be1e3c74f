"""The ``--config`` YAML file every command that runs methods reads, and the names it may use.

Every setting has one name; older spellings (the hand-written run commands', named after the
Search-R1 loop and RELOOP's config) are accepted as aliases, in one table: :data:`BENCH_NAMES`.
"""
from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any

from ragfast.errors import ConfigError

__all__ = ["BENCH_NAMES", "RUN_ONLY", "ALIASES_OF_KEYS", "load_yaml", "type_problem", "check_types"]

#: YAML keys accepted for another key's name (the flag's spelling: ``--method`` fills ``methods``).
ALIASES_OF_KEYS: dict[str, str] = {"method": "methods"}

#: The Search-R1 run commands' old spellings -> the setting's one name.
_LOOP_NAMES: dict[str, str] = {"model": "reasoner", "retriever": "index", "max_turns": "budget",
                               "tokenizer": "reasoner_tokenizer", "model_config": "reasoner_config"}
#: Every old spelling -> the setting's one name, as a flag alias and a YAML key alike: the loop's,
#: then RELOOP's (its step budget is ``budget``, the segments it reads per step ``topk``, its head
#: ``head``, its evidence budget ``evidence_tokens``).
BENCH_NAMES: dict[str, str] = {**_LOOP_NAMES, "max_steps": "budget", "k": "topk", "generator": "head",
                               "max_tokens": "evidence_tokens"}
#: Settings no method takes (a command's own switches); a ``--config`` file may hold them.
RUN_ONLY: frozenset[str] = frozenset({"no_progress"})


def _loader() -> Any:
    """A safe YAML loader that refuses a key given twice (PyYAML silently keeps the last)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader: Any, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key].start_mark.line + 1})",
                    key_node.start_mark)
            seen[key] = key_node
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def load_yaml(path: str | None) -> dict[str, Any]:
    """The settings of a ``--config`` YAML file (empty without one), keys with ``_`` for ``-``.

    ``method`` is read as ``methods`` (the flag is ``--method``).

    Raises
    ------
    ConfigError
        A missing file, invalid YAML (one line: file, line, column, problem), a key given
        twice, or anything but a mapping.
    """
    if not path:
        return {}
    import yaml

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.load(p.read_text(encoding="utf-8"), Loader=_loader()) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte at offset {exc.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(problem).split())})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{p}: expected a mapping of settings, got {type(loaded).__name__}")
    out: dict[str, Any] = {}
    for k, v in loaded.items():
        key = str(k).replace("-", "_")
        key = ALIASES_OF_KEYS.get(key, key)
        if key in out:
            raise ConfigError(f"{p}: {k!r} and {key!r} set the same setting; keep one")
        out[key] = v
    return out


def type_problem(value: Any, hint: Any) -> str | None:
    """What is wrong with ``value`` for the type ``hint``, or None when it fits.

    Understands ``int``, ``float`` (an int is accepted; NaN and infinities are not), ``str``,
    ``bool``, ``list[X]``, ``dict[K, V]`` and optional/union types. A float refuses NaN (every
    comparison with it is false, so a NaN threshold silently never fires). An int field refuses a
    bool and a string, so YAML's ``budget: "4"`` is named rather than failing deep inside.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        probs = [type_problem(value, h) for h in typing.get_args(hint)]
        if any(pr is None for pr in probs):
            return None
        return " or ".join(dict.fromkeys(pr for pr in probs if pr))
    if hint is type(None):
        return None if value is None else "null"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return None if not math.isnan(value) else "a number (not NaN)"
        return "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if origin is list:
        (inner,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, list):
            return "a list"
        bad = [type_problem(v, inner) for v in value if inner is not Any]
        bad = [b for b in bad if b]
        return f"a list of {bad[0].removeprefix('a ').removeprefix('an ')}s" if bad else None
    if origin is dict:
        kt, vt = typing.get_args(hint) or (Any, Any)
        if not isinstance(value, dict):
            return "a mapping"
        for k, v in value.items():
            if (kt is not Any and type_problem(k, kt)) or (vt is not Any and type_problem(v, vt)):
                return "a mapping of " + (type_problem(v, vt) or "strings").removeprefix("a ") + "s"
        return None
    return None


def check_types(obj: Any) -> None:
    """Refuse a dataclass instance (a run's settings) whose fields do not have their declared types.

    Raises
    ------
    ConfigError
        ``"--budget must be an integer, got str '4'"``: one line naming the setting as a flag.
    """
    import dataclasses

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        v = getattr(obj, f.name)
        problem = type_problem(v, hints.get(f.name, Any))
        if problem:
            raise ConfigError(f"--{f.name.replace('_', '-')} must be {problem}, got {type(v).__name__} {v!r}"[:300])

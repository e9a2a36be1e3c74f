"""The flags every command that runs methods shares, and the ``--config`` YAML they all read.

Each shared flag is declared once, in :data:`FLAGS`; :func:`with_flags` adds the ones a command
takes to its signature, so the hand-written ``ragfast study s2g`` spells, documents and defaults
them as the generated run commands (:class:`~ragfast.runner.settings.RunSettings`) do. A shared
flag defaults to ``None`` on the command line, so :func:`resolve` can tell a flag the user typed
(it wins) from one a ``--config`` file sets (it comes next) from the shared default
(:data:`DEFAULTS`, last). The same YAML therefore means the
same run whichever command reads it, ``ragfast bench`` included: the bench's names for the same
settings (``reasoner``, ``index``, ``budget``) are accepted as aliases, and a key only another
command uses is ignored rather than refused.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, List, Mapping, Optional

import typer

from ragfast.errors import ConfigError
from ragfast.runner.slots import DEFAULTS as SLOT_DEFAULTS
from ragfast.settings import BENCH_NAMES, RUN_NAMES, load_yaml

__all__ = ["FLAGS", "LOOP_FLAGS", "spellings", "DEFAULTS", "ALIASES", "CONFIG", "VAL_DATA", "VAL_OFFSET", "VAL_LIMIT",
           "BATCH_SIZE", "CORPUS", "with_flags", "load_yaml", "resolve", "require"]

#: Defaults of every shared setting (the slots' from :mod:`ragfast.runner.slots`; the loop's are
#: the Search-R1 reference evaluation's).
DEFAULTS: dict[str, Any] = {**SLOT_DEFAULTS, "model": "scripted", "data": "hotpotqa-dev", "offset": 0,
                            "device": "auto", "val_offset": 0, "val_limit": 100, "max_turns": 4, "topk": 3, "seed": 0, "max_new_tokens": 500, "max_obs_tokens": 500,
                            "prompt_budget": 4096}

#: ``ragfast bench``'s names for settings the run commands name otherwise (YAML keys and flags).
ALIASES: dict[str, str] = RUN_NAMES


def spellings(name: str) -> tuple[str, ...]:
    """The flags of a run command's setting ``name``: its own, then the bench's spelling of the same
    setting as an alias (``--model`` and ``--reasoner``), from the one table of old spellings,
    :data:`ragfast.settings.BENCH_NAMES` (:func:`ragfast.runner.settings.flag_names` reads it the
    other way)."""
    own = "--" + name.replace("_", "-")
    return (own, "--" + BENCH_NAMES[name].replace("_", "-")) if name in BENCH_NAMES else (own,)


CONFIG = typer.Option(None, "--config", help="A YAML file of settings (flag names, - or _); flags typed on the "
                                             "command line win over it. ragfast bench and every ragfast run command "
                                             "read the same file.")
VAL_DATA = typer.Option(None, "--val-data", help="Validation QA file or sample (S2G threshold selection; accepted "
                                                 "by every running command so one --config serves all).")
# The serving commands' connection options (serve-retriever and serve-judge share them).
GRACEFUL_S = typer.Option(30.0, "--graceful-s", help="On SIGTERM, how long in-flight requests may take to finish.")
API_KEY = typer.Option(None, "--api-key", help="Bearer token every request must carry (default $RAGFAST_API_KEY; "
                                               "required beyond loopback).")
HEAD_TIMEOUT_S = typer.Option(10.0, "--head-timeout-s", help="A connection that has not sent a whole request head "
                                                             "within this is closed (idle and slow-loris sockets); "
                                                             "a body not whole within as long after its head gets 408.")
KEEP_ALIVE_S = typer.Option(5.0, "--keep-alive-s", help="Idle keep-alive connections close after this.")
MAX_CONNECTIONS = typer.Option(2048, "--max-connections", help="Connections or requests in flight beyond this "
                                                               "get 503.")
VAL_OFFSET = typer.Option(None, "--val-offset", help="Skip the first N validation questions (default 0).")
VAL_LIMIT = typer.Option(None, "--val-limit", help="Validation questions used to choose the STOP threshold "
                                                   "(default 100).")
BATCH_SIZE = typer.Option(None, "--batch-size", help=f"Questions run together (default {DEFAULTS['batch_size']}).")
CORPUS = typer.Option(None, "--corpus", help="Corpus part; repeat for several: contexts (the data's own "
                                             "paragraphs), a sample name or a jsonl path (default: "
                                             + " + ".join(DEFAULTS["corpus"]) + ", the same for every command, "
                                             "so their cached embeddings are shared).")

#: The flags of the hand-written command that runs the Search-R1 loop (study s2g), in --help order.
LOOP_FLAGS = ("model", "data", "out", "retriever", "config", "limit", "offset", "batch_size", "corpus", "encoder",
              "device", "val_data", "val_offset", "max_turns", "topk", "seed", "max_new_tokens", "max_obs_tokens",
              "prompt_budget", "no_progress")

#: Every shared flag: name -> (annotation, typer option). Declared once, used by every command.
FLAGS: dict[str, tuple[Any, Any]] = {
    "model": (Optional[str], typer.Option(
        None, *spellings("model"), help="Reasoner: scripted (default) | tiny | a local model directory | an "
                                            "http(s) URL of an OpenAI-compatible server (vLLM, SGLang); URL#name "
                                            "names the served model.")),
    "data": (Optional[str], typer.Option(
        None, "--data", help="QA file (HotpotQA, FlashRAG, Search-R1 parquet, TAT-QA, MetaQA...) or a sample name "
                             "such as hotpotqa-dev.")),
    "out": (Optional[str], typer.Option(None, "--out", "-o", help="Output directory (results, manifest.json, "
                                                                  "summary.json).")),
    "retriever": (Optional[str], typer.Option(
        None, *spellings("retriever"), help="default (the encoder over --corpus, flat kernel) | bm25 | "
                                             "faiss:<factory> | an index path | an http(s) URL of a Search-R1 "
                                             "retrieval server.")),
    "config": (Optional[str], CONFIG),
    "limit": (Optional[int], typer.Option(None, "--limit", "-n", help="Only N questions (after --offset).")),
    "offset": (Optional[int], typer.Option(None, "--offset", help="Skip the first N questions of --data "
                                                                  "(default 0).")),
    "batch_size": (Optional[int], BATCH_SIZE),
    "corpus": (Optional[List[str]], CORPUS),
    "encoder": (Optional[str], typer.Option(None, "--encoder", help="minilm (bundled all-MiniLM-L6-v2; default) | "
                                                                    "a local encoder path.")),
    "device": (Optional[str], typer.Option(None, "--device", help="Where local models run: auto (the GPU when there "
                                                                  "is one; default) | cpu | cuda | cuda:N.")),
    "val_data": (Optional[str], VAL_DATA),
    "val_offset": (Optional[int], VAL_OFFSET),
    "val_limit": (Optional[int], VAL_LIMIT),
    "max_turns": (Optional[int], typer.Option(None, *spellings("max_turns"), help="Search-enabled turns "
                                                                                    "(reference: 4; injected searches "
                                                                                    "count).")),
    "topk": (Optional[int], typer.Option(None, "--topk", help="Documents per search (reference: 3).")),
    "seed": (Optional[int], typer.Option(None, "--seed", help="Seed of the scripted reasoner, the bootstrap and "
                                                              "sampling (default 0).")),
    "max_new_tokens": (Optional[int], typer.Option(None, "--max-new-tokens", help="New tokens per turn "
                                                                                  "(reference: 500).")),
    "max_obs_tokens": (Optional[int], typer.Option(None, "--max-obs-tokens", help="Observation cap in tokens "
                                                                                  "(reference: 500).")),
    "prompt_budget": (Optional[int], typer.Option(None, "--prompt-budget", help="Context cap in tokens "
                                                                                "(reference: 4096).")),
    "no_progress": (bool, typer.Option(False, "--no-progress", help="No progress bars.")),
}


def with_flags(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the shared flags ``names`` to a typer command, which receives them in ``**flags``.

    The command's own parameters come first in ``--help``; the shared ones follow in the order
    given, with the one spelling, help and default of :data:`FLAGS`.
    """
    unknown = [n for n in names if n not in FLAGS]
    if unknown:
        raise KeyError(f"no shared flag {unknown}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        shared = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=FLAGS[n][1], annotation=FLAGS[n][0])
                  for n in names]
        fn.__signature__ = sig.replace(parameters=own + shared)  # typer reads the signature
        return fn

    return add


def _known_elsewhere() -> set[str]:
    import dataclasses

    from ragfast.runner.settings import RunSettings

    from ragfast.settings import BENCH_NAMES, RUN_ONLY

    # every running command's settings, under either name
    others = {"judge", "nli", "nli_backend", "served_model", "tokenizer", "model_config", "threshold",
              "min_precision"}
    return (set(FLAGS) | set(ALIASES) | set(BENCH_NAMES) | set(RUN_ONLY) | others
            | {f.name for f in dataclasses.fields(RunSettings)})


def resolve(config: str | None, given: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Each setting from the command line, else the ``--config`` file, else the shared default.

    Parameters
    ----------
    config : str, optional
        The ``--config`` path.
    given : mapping
        The command's flags (``None`` = not typed).
    defaults : mapping, optional
        The command's own defaults where they differ from :data:`DEFAULTS`.

    Raises
    ------
    ConfigError
        The file sets something no running command knows, or a value is out of range.
    """
    from_file = {ALIASES.get(k, k): v for k, v in load_yaml(config).items()}
    unknown = sorted(set(from_file) - set(given) - _known_elsewhere())
    if unknown:
        raise ConfigError(f"{config}: unknown setting(s) {unknown}; known here: {sorted(given)}")
    base = {**DEFAULTS, **(defaults or {})}
    out = {k: v if v is not None else from_file.get(k, base.get(k)) for k, v in given.items()}
    if isinstance(out.get("corpus"), str):
        out["corpus"] = [out["corpus"]]
    from ragfast.settings import type_problem

    for k, v in out.items():  # a YAML string for a number is one line here, not a TypeError later
        if k in FLAGS and v is not None and given.get(k) is None:
            problem = type_problem(v, FLAGS[k][0])
            if problem:
                raise ConfigError(f"{config}: {k} must be {problem}, got {type(v).__name__} {v!r}"[:300])
    for k in ("offset", "val_offset"):
        if out.get(k) is not None and (not isinstance(out[k], int) or out[k] < 0):
            raise ConfigError(f"--{k.replace('_', '-')} must be an integer >= 0, got {out[k]!r}")
    if out.get("limit") is not None and (not isinstance(out["limit"], int) or out["limit"] < 1):
        raise ConfigError(f"--limit must be >= 1, got {out['limit']!r}")
    if out.get("val_limit") is not None and (not isinstance(out["val_limit"], int) or out["val_limit"] < 1):
        raise ConfigError(f"--val-limit must be >= 1, got {out['val_limit']!r}")
    return out


def require(settings: Mapping[str, Any], *names: str) -> None:
    """Refuse a run whose required settings came neither from the command line nor from ``--config``."""
    for name in names:
        if not settings.get(name):
            raise ConfigError(f"--{name.replace('_', '-')} is required (on the command line or in --config)")

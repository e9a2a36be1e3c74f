"""``ragfast run M`` for every registered method, generated from the registry and :class:`RunSettings`.

Each generated command runs one method through the same runner as ``ragfast bench``
(:func:`ragfast.runner.run_methods.run_methods`), so ``ragfast run s2g`` and ``ragfast bench
--method s2g`` with the same settings write the same files: ``trajectories/``, ``ledgers/``,
``manifest.json``, ``summary.json`` and the report. Its flags are the fields of
:class:`~ragfast.runner.settings.RunSettings` (one name each, old spellings as aliases from
:func:`~ragfast.runner.settings.flag_names`). ``ragfast study s2g`` takes the same switches and
flags for the settings it reads (:func:`switches`, :func:`setting_flags`), so every running command
spells, documents and defaults a setting alike.
"""
from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, List, Optional, Sequence

import typer

__all__ = ["register", "add_run_command", "run_command", "running_command", "settings_parameters", "switches",
           "setting_flags", "run_one", "one_method_settings", "BENCH_HELP"]

_SLOT_DEVICES = ("reasoner", "encoder", "judge", "nli")


def _annotation(hint: Any) -> Any:
    """The Optional[...] typer annotation of a settings field's type."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if union else hint
    if typing.get_origin(base) is list:
        return Optional[List[str]]
    return Optional[base]


def one_method_settings(name: str | list[str] | None, *, preset: str = "default", config: str | None = None,
                        devices: dict[str, str] | None = None, **settings: Any) -> Any:
    """The :class:`RunSettings` of ``ragfast run NAME``: the bench's, with the method ``name`` alone
    (a list: those methods; None: the bench's, from ``config`` or the default).

    ``settings`` are :class:`RunSettings` fields (None = not given: ``config``, then the preset,
    then the default decide).
    """
    from ragfast.methods.base import get
    from ragfast.runner.settings import make_config

    methods = [name] if isinstance(name, str) else name
    cfg = make_config(preset, config, methods=methods, devices=devices or None, **settings)
    if (settings.get("limit") is not None and settings.get("val_limit") is None and cfg.val_limit > settings["limit"]
            and any(get(m).validation for m in cfg.methods)):
        # A quick look (--limit) should be quick everywhere, validation included (as in the bench);
        # a run without validation questions keeps the setting as it is, so --resume may add questions.
        cfg = dataclasses.replace(cfg, val_limit=settings["limit"])
    return cfg


def run_one(name: str, *, resume: bool = False, console: Any = None, progress: bool = True,
            components: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    """What ``ragfast run NAME`` does (:func:`one_method_settings`, then the bench's runner); returns the summary.

    ``components`` fill slots with objects the caller built (``{"head": my_model}``:
    :func:`ragfast.runner.run_methods.build_slots`).
    """
    from ragfast.comparison.pipeline import run_bench

    return run_bench(one_method_settings(name, **kw), resume=resume, console=console, progress=progress,
                     table=False, components=components)


def switches() -> dict[str, inspect.Parameter]:
    """A running command's switches beside its settings, by name: ``--no-progress``, ``--json``, ``--resume``,
    ``--preset`` and ``--config`` (``ragfast study s2g`` takes all but ``--json``)."""

    def switch(name: str, annotation: Any, option: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=option)

    return {
        "no_progress": switch("no_progress", bool, typer.Option(
            False, "--no-progress", help="No progress bars (messages and the summary still print).")),
        "as_json": switch("as_json", bool, typer.Option(
            False, "--json", help="Print summary.json's content on stdout instead of the results table.")),
        "resume": switch("resume", bool, typer.Option(
            False, "--resume/--no-resume", help="Continue an interrupted run in --out; finished work is not redone; "
                                                "other data, questions, slots or settings are refused.")),
        "preset": switch("preset", str, typer.Option(
            "default", "--preset", help="'default' (bundled data and models, offline) or 'paper' (the S2G study's "
                                        "setting; needs its models under $RAGFAST_MODELS).")),
        "config": switch("config", Optional[str], typer.Option(
            None, "--config", help="A YAML file of settings (flag names, - or _); flags typed on the command line "
                                   "win over it. ragfast bench, every ragfast run command and ragfast study s2g "
                                   "read the same file.")),
    }


def setting_flags(names: Sequence[str]) -> list[inspect.Parameter]:
    """One typer flag per :class:`RunSettings` field in ``names``: its spellings from :func:`flag_names`, its
    help from :data:`HELP`, and None as its default, so that the field's default (or ``--config``) decides."""
    from ragfast.runner.settings import HELP, RunSettings, flag_names

    hints = typing.get_type_hints(RunSettings)
    params = []
    for name in names:
        flags = flag_names(name)
        if hints[name] is bool:  # an on/off setting: --repair/--no-repair
            flags = (f"{flags[0]}/--no-{flags[0][2:]}",)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=_annotation(hints[name]),
                                        default=typer.Option(None, *flags, help=HELP[name])))
    return params


def settings_parameters(*, with_methods: bool) -> list[inspect.Parameter]:
    """The typer parameters of a running command: its :func:`switches`, one flag per :class:`RunSettings` field
    (:func:`setting_flags`), and the four per-slot device overrides."""
    from ragfast.runner.settings import RunSettings

    names = [f.name for f in dataclasses.fields(RunSettings)
             if f.init and f.name != "devices" and (f.name != "methods" or with_methods)]
    params = [*switches().values(), *setting_flags(names)]
    for s in _SLOT_DEVICES:
        params.append(inspect.Parameter(f"{s}_device", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[str],
                                        default=typer.Option(None, f"--{s}-device",
                                                             help=f"Override --device for the {s}.")))
    return params


def _settings_from_flags(kw: dict[str, Any], methods: list[str] | None) -> Any:
    """The :class:`RunSettings` of a running command's flags: ``methods`` when the command is one
    method's, else the ``--method`` flags (none given: ``--config``'s, else the default)."""
    devices = {s: kw.pop(f"{s}_device") for s in _SLOT_DEVICES}
    kw = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in kw.items()}
    given = kw.pop("methods", None)
    return one_method_settings(methods if methods is not None else (given or None),
                               devices={k: v for k, v in devices.items() if v}, **kw)


def running_command(name: str | None) -> Callable[..., None]:
    """The typer command of ``ragfast run NAME`` (or of ``ragfast bench`` for None), flags from :class:`RunSettings`."""

    def command(**kw: Any) -> None:
        from ragfast.comparison.pipeline import run_bench
        from ragfast.outputs.outdir import output_dir

        resume, progress, as_json = kw.pop("resume"), not kw.pop("no_progress"), kw.pop("as_json")
        cfg = _settings_from_flags(kw, [name] if name else None)
        with output_dir(cfg.out):
            summary = run_bench(cfg, resume=resume, progress=progress, table=not as_json)
        if as_json:
            from ragfast.outputs.results import dumps

            print(dumps(summary, indent=2))

    command.__signature__ = inspect.Signature(settings_parameters(with_methods=name is None))  # typer reads it
    if name is None:
        command.__name__ = "bench"
        command.__doc__ = BENCH_HELP
    else:
        from ragfast.methods.base import get

        command.__name__ = f"run_{name}"
        doc = (get(name).__doc__ or name).strip().splitlines()[0]
        command.__doc__ = (f"{doc}\n\nThe same runner, files and summary as `ragfast bench --method {name}` "
                           "(trajectories/, ledgers/, manifest.json, summary.json, report); --resume continues it.")
    return command


def run_command(name: str) -> Callable[..., None]:
    """The typer command of ``ragfast run NAME``."""
    return running_command(name)


#: ``ragfast bench --help``'s text.
BENCH_HELP = ("Run native Search-R1, S2G stopping, StepGap and RELOOP on the same questions.\n\n"
              "Prints a side-by-side table (EM, F1, searches, tokens/FLOPs/seconds per component, total cost, ΔEM "
              "and Δcost against native with paired-bootstrap CIs) and writes trajectories, summary.json, "
              "summary.csv, report.md, report.html and PNG plots to --out. With no arguments it runs offline on the "
              "bundled HotpotQA dev sample, and says which model filled each slot and whether its answers mean "
              "anything.")


def add_run_command(run_app: typer.Typer, name: str) -> None:
    """Add ``ragfast run NAME`` (generated) to the ``run`` group, replacing a command of that name."""
    run_app.registered_commands = [c for c in run_app.registered_commands if c.name != name]
    run_app.command(name)(run_command(name))


def register(app: typer.Typer) -> None:
    """Generate ``ragfast run M`` for every registered method."""
    from ragfast.commands.run import run_app
    from ragfast.methods.base import names

    for name in names():
        add_run_command(run_app, name)

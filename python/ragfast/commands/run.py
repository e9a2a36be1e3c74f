"""``ragfast run ...``: the group that holds one command per method.

``ragfast run M`` for every registered method is generated from the registry and
:class:`~ragfast.runner.settings.RunSettings` (:mod:`ragfast.commands.methods`) and runs through
the bench's runner, so every running command writes the bench's layout.
"""
from __future__ import annotations

import typer

run_app = typer.Typer(help="Run one method over a QA file (the bench's files and summary, resumable).",
                      no_args_is_help=True)

__all__ = ["run_app", "register"]


def register(app: typer.Typer) -> None:
    """Add the shared ``run`` group (with every command other modules put on ``run_app``)."""
    app.add_typer(run_app, name="run")

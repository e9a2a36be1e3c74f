"""``ragfast bench``: the main job, every registered method on the same questions.

Its flags are generated from :class:`~ragfast.runner.settings.RunSettings`, as those of the
generated ``ragfast run M`` commands (:mod:`ragfast.commands.methods`).
"""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from ragfast.commands.methods import running_command

    app.command("bench")(running_command(None))

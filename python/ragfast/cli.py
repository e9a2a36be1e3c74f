"""The ``ragfast`` command line. Each area adds its commands from ``ragfast.commands.<area>``."""
from __future__ import annotations

import errno
import importlib
import json
import os
import sys

from typing import Optional

import typer
from rich.console import Console

import ragfast
from ragfast.cli_help import hide_flag_types
from ragfast.errors import RagfastError, missing_dependency_message

# ragfast loads every model from a local path: never reach for a hub, and keep the loaders'
# own per-file progress bars out of the run's output (ragfast shows its own). Nothing above
# imports transformers, so this takes effect for every command.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

hide_flag_types()  # flags render as `--resume / --no-resume`, not `--resume <bool>`

app = typer.Typer(
    name="ragfast",
    help="Fast, batched, cost-measured multi-round RAG (Search-R1, S2G stopping, StepGap, RELOOP).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)

# Each module defines register(app); listed explicitly so a broken one fails loudly in tests.
COMMAND_MODULES = (
    "ragfast.commands.stepgap",
    "ragfast.commands.data",
    "ragfast.commands.judge",
    "ragfast.commands.run",
    "ragfast.commands.bench",
    "ragfast.commands.retrieval",
    "ragfast.commands.s2g",
    "ragfast.commands.judge_training",
    "ragfast.commands.reasoner",
    "ragfast.commands.report",
    "ragfast.commands.export",
    "ragfast.commands.cost",
    "ragfast.commands.models",
    "ragfast.commands.calibrate",
    "ragfast.commands.methods",  # last: generates `run M` for the registered methods
)


def _version(value: bool) -> None:
    if value:
        print(f"ragfast {ragfast.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True,
                                help="More detail on the console (debug messages); put it before the command."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors on the console (results "
                               "tables still print); put it before the command."),
    call_timeout: Optional[float] = typer.Option(
        None, "--call-timeout", metavar="S", help="Longest wait for one answer of a remote reasoner, retriever, "
        "judge or teacher (default 300, or $RAGFAST_CALL_TIMEOUT); put it before the command."),
    total_timeout: Optional[float] = typer.Option(
        None, "--total-timeout", metavar="S", help="Longest wait for one request with its retries (default 900, "
        "or $RAGFAST_TOTAL_TIMEOUT); put it before the command."),
    max_question_chars: Optional[int] = typer.Option(
        None, "--max-question-chars", metavar="N", help="Longest question a QA file may hold (default 4096); put "
        "it before the command."),
    max_passage_chars: Optional[int] = typer.Option(
        None, "--max-passage-chars", metavar="N", help="Longest corpus passage (default 100000); put it before "
        "the command."),
) -> None:
    """ragfast: run and cost-measure multi-round RAG methods on the same questions.

    Runs write a log file (ragfast.log, every message including third-party warnings) into
    their results directory.
    """
    from ragfast.infra.http import set_timeouts, timeouts
    from ragfast.infra.logs import setup

    setup(verbose=verbose, quiet=quiet)
    set_timeouts(call_timeout, total_timeout)
    if max_question_chars is not None or max_passage_chars is not None:
        from ragfast.data import set_length_caps

        set_length_caps(max_question_chars, max_passage_chars)
    timeouts()  # a bad environment value is one line now, not at the first request


@app.command("backends")
def backends_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Say which op backends (ref, cpp, triton) are available and which one each op uses."""
    from ragfast.infra.deps import status

    info = ragfast.backends()
    info["runtimes"] = status()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    from rich.table import Table

    out = Console()
    out.print(f"available: {info['available']}  (RAGFAST_BACKEND override: {info['override']})")
    out.print(f"triton: {info['triton']}")
    if info["build"]:
        b = info["build"]
        out.print(f"_C build: openmp={b['openmp']} threads={b['max_threads']} native={b.get('native', False)}")
    isa = info.get("isa")
    if isa:
        missing = "; ".join(f"{lvl} lacks {', '.join(f)}" for lvl, f in isa["missing"].items())
        out.print(f"ISA levels compiled: {', '.join(isa['compiled'])}; this CPU runs: {', '.join(isa['supported'])}"
                  + (f" ({missing})" if missing else ""))
        if isa["chosen"]:
            out.print(f"ISA level chosen: {isa['chosen']} ({isa['reason']})")
        else:
            out.print(f"[bold red]ISA level refused:[/] {isa['error']}")
    tp = info.get("topk_ip_paths")
    if tp:
        cells = "; ".join(f"{st} " + " ".join(f"B{b}:{p}" for b, p in per.items()) for st, per in tp["paths"].items())
        out.print(f"topk_ip default path at {tp['isa']}: {cells}")
        out.print(f"  (table: {tp.get('table_source') or tp['table_machine'] or 'no table'})")
    t = Table(title="ops")
    t.add_column("op")
    t.add_column("implementations")
    t.add_column("default")
    for op, d in info["ops"].items():
        t.add_row(op, ", ".join(d["implementations"]), d["default"])
    out.print(t)
    ort, fa = info["runtimes"]["onnxruntime"], info["runtimes"]["faiss"]
    out.print("onnxruntime: " + (ort.get("error") or f"{ort['version']} providers={','.join(ort['providers'])}"),
              soft_wrap=True)
    out.print("faiss: " + (fa.get("error") or f"{fa['version']} gpus={fa['gpus']}"), soft_wrap=True)


for _mod in COMMAND_MODULES:
    importlib.import_module(_mod).register(app)


def _fail(message: str) -> None:
    """Print one ``error:`` line (bad input, never a traceback) and exit with status 2."""
    from rich.markup import escape

    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    sys.exit(2)


def main() -> None:
    """Entry point: run the app, turning ragfast's own errors into one clear line."""
    try:
        app()
    except RagfastError as exc:
        _fail(str(exc))
    except ModuleNotFoundError as exc:  # an optional extra that is not installed
        msg = missing_dependency_message(exc)
        if msg is None:
            raise
        _fail(msg)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Results and ledgers are written a whole line per call and a resume cuts a torn last
            # line, so what finished is valid: say so in one line instead of a long traceback.
            where = f" writing {exc.filename}" if exc.filename else ""
            _fail(f"the disk is full{where} ({exc.strerror}); the results finished so far are kept: free some "
                  "space and rerun with --resume")
        if exc.filename is None:  # not about a path the user gave: a real failure, keep its traceback
            raise
        # A path the user named that cannot be read or written (permissions, a file for a directory...).
        _fail(f"{exc.strerror or type(exc).__name__}: {exc.filename}")
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; finished results are on disk (use --resume)[/]")
        sys.exit(130)


if __name__ == "__main__":
    main()

"""``ragfast run reloop``: RELOOP on HotpotQA (text), TAT-QA (table + text) and MetaQA (KG)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from ragfast.devices import DEVICE_HELP, device_option


def reloop_cmd(
    data: str = typer.Option(..., "--data", help="QA file or sample name (hotpotqa-dev, tatqa-dev, metaqa-3hop, ...)."),
    planner: str = typer.Option("heuristic", "--planner", help="heuristic | kg-path (MetaQA) | llm."),
    out: str = typer.Option(..., "--out", help="Output directory (results.jsonl, manifest.json, summary.json)."),
    kb: Optional[str] = typer.Option(None, "--kb", help="Triple file for MetaQA questions (default: bundled KB)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N questions."),
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue an interrupted run in --out."),
    encoder: str = typer.Option("minilm", "--encoder", help="minilm (bundled all-MiniLM-L6-v2) | hashing (lexical)."),
    judge: str = typer.Option("auto", "--judge", help="auto | heuristic | encoder (trained EncoderJudge)."),
    generator: Optional[str] = typer.Option(None, "--generator",
                                            help="Head: 'extractive' (default, NOT an LLM) or a local LM directory."),
    planner_model: Optional[str] = typer.Option(None, "--planner-model", help="Local LM directory for --planner llm."),
    k: int = typer.Option(2, "--k", help="Segments read per step."),
    window: int = typer.Option(8, "--window", help="Sliding-window size (best unread candidates)."),
    max_steps: int = typer.Option(4, "--max-steps", help="Step budget per question."),
    max_tokens: int = typer.Option(400, "--max-tokens", help="Evidence token budget per question."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Verifier + one reduced-budget refinement."),
    batch_size: int = typer.Option(16, "--batch-size", help="Questions per batched step."),
    device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Run RELOOP (HSEQ + guided budget-aware iterator + canonical-evidence head) and write results as they finish."""
    from ragfast.methods.reloop import ReloopConfig, run

    cfg = ReloopConfig(planner=planner, k=k, window=window, max_steps=max_steps, max_tokens=max_tokens,
                       verify=verify, batch_size=batch_size)
    from ragfast.outdir import output_dir

    with output_dir(out):
        summary = run(data, out, cfg, kb=kb, limit=limit, resume=resume, encoder=encoder, judge=judge,
                      generator=generator, planner_model=planner_model, device=device)
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    _print_summary(summary)


def _print_summary(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"RELOOP on {s['data']} ({s['kind']}, planner {s['planner']})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for key in ("questions", "em", "f1", "precision", "recall", "set_f1", "steps_per_question",
                "evidence_tokens_per_question", "seconds_per_question", "refined"):
        if key in s:
            v = s[key]
            t.add_row(key, f"{v:.4f}" if isinstance(v, float) else str(v))
    con.print(t)
    c = Table(title="ledger cost by component (sum over questions)")
    for h in ("component", "calls", "input tok", "output tok", "seconds"):
        c.add_column(h, justify="right" if h != "component" else "left")
    for comp, row in s.get("cost", {}).items():
        c.add_row(comp, str(int(row.get("calls", 0))), str(int(row.get("input_tokens", 0))),
                  str(int(row.get("output_tokens", 0))), f"{row.get('seconds', 0.0):.3f}")
    con.print(c)
    for slot, d in s.get("slots", {}).items():
        mean = d.get("meaningful", True)
        con.print(f"{slot}: {d.get('name')}  [answers meaningful: {'yes' if mean else 'NO'}]")
    if not s.get("answers_meaningful", True):
        con.print("[yellow]The head is the rule-based extractive picker, not a language model: accuracy measures "
                  "the evidence pack, not an LLM's answers.[/]")


def register(app: typer.Typer) -> None:
    try:
        from ragfast.commands.run import run_app
    except ImportError:
        # The shared `ragfast run` sub-app is not there: give RELOOP its own `run` group.
        run_app = typer.Typer(help="Run a multi-round RAG pipeline.", no_args_is_help=True)
        app.add_typer(run_app, name="run")
    run_app.command("reloop")(reloop_cmd)

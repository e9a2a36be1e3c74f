"""``ragfast run reloop``: RELOOP on HotpotQA (text), TAT-QA (table + text) and MetaQA (KG)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import typer

from ragfast.commands import options as opt
from ragfast.errors import ConfigError, DataError

__all__ = ["run_reloop_command", "reloop_cmd", "register"]


def _spec_name(spec: Any) -> str:
    if spec is None or isinstance(spec, str):
        return spec or "extractive"
    return getattr(spec, "name", type(spec).__name__)


def run_reloop_command(data: str, out: str, cfg: Any, *, kb: str | None = None, limit: int | None = None,
                       offset: int = 0, resume: bool = False, encoder: str = "minilm", judge: str = "auto",
                       generator: Any = None, planner_model: Any = None, device: str = "cpu", progress: bool = True,
                       topk_backend: str | None = None) -> dict[str, Any]:
    """What ``ragfast run reloop`` does: build the slots, run RELOOP, write results as they finish.

    The dataset kind comes from the file's layout: MetaQA questions run on the knowledge graph
    (``kb`` or the bundled MetaQA KB), TAT-QA on each document's table and paragraphs, HotpotQA
    (and any layout with ``metadata["context"]``) on the question's context documents. Writes
    ``OUT/results.jsonl``, ``manifest.json`` (with the run's fingerprint) and ``summary.json``.

    Parameters
    ----------
    data : str
        A QA file path or a bundled sample name (``hotpotqa-dev``, ``tatqa-dev``, ``metaqa-3hop``...).
    out : str
        Output directory; results are appended as questions finish.
    cfg : ReloopConfig
    offset, limit : int, optional
        Run ``data[offset:offset + limit]``.
    resume : bool
        Continue an interrupted run (finished questions are skipped; other settings are refused).
    encoder, judge, generator, planner_model
        Slot specs (:mod:`ragfast.runner.slots`): encoder ``minilm`` | ``hashing`` | path; judge
        ``auto`` (the bundled judge on text, the heuristic rule on tables) | ``heuristic`` |
        ``encoder`` | ``head`` | path; head ``extractive`` (not an LLM) | a local LM directory (or a
        Generator); the planner LM for ``--planner llm``.

    Returns
    -------
    dict
        The summary (also written to ``summary.json``).
    """
    from ragfast.cost import CostLedger
    from ragfast.data import SAMPLES, detect_layout, load_qa, sample
    from ragfast.methods.reloop import check_setup, dataset_kind, metaqa_kg, run_questions, summarise_rows
    from ragfast.results import ResultsWriter, read_results, slot_entry, write_manifest
    from ragfast.runner import slots as build
    from ragfast.runner.drive import check_resume, data_identity, fingerprint, prepare_out

    path = sample(data) if data in SAMPLES else Path(data)
    if not Path(path).exists():
        raise DataError(f"no such data file or sample: {data!r} (samples: {', '.join(SAMPLES)})")
    layout = detect_layout(path)
    kind = dataset_kind(layout)
    all_q = load_qa(path)
    if offset >= len(all_q):
        raise ConfigError(f"--offset {offset} is past the {len(all_q)} questions of {data}")
    questions = all_q[offset: offset + limit if limit else None]
    check_setup(kind, cfg, questions, f"{path} (layout {layout!r})")
    if cfg.planner == "llm" and planner_model is None:
        raise ConfigError("--planner llm needs --planner-model PATH (a local causal LM); none is bundled")
    out_dir = prepare_out(out, "results.jsonl", resume)
    config = {**asdict(cfg), "kind": kind, "encoder": encoder, "judge": judge, "generator": _spec_name(generator)}
    fp = fingerprint(method="reloop", data={"test": data_identity(path)}, questions=questions,
                     slots={"encoder": encoder, "judge": judge, "head": _spec_name(generator),
                            "planner_model": _spec_name(planner_model) if planner_model is not None else None,
                            "kb": kb}, config=config)
    if resume:
        check_resume(out_dir, fp)
    head = build.head(generator, device=device)
    enc = jd = plan_gen = kg = docs = None
    if kind == "kg":
        slots: dict[str, Any] = {
            "planner": {"name": "kg-path template parser (deterministic)", "meaningful": True},
            "iterator": {"name": "CSR relation hops over the MetaQA KB", "meaningful": True}, "head": head}
        kg = metaqa_kg(kb)
    else:
        enc = build.encoder(encoder, device=device)
        jd = build.judge(judge, device=device, kind=kind, shared_encoder=enc)
        # one model instance when the planner and the head are the same checkpoint
        plan_gen = (head if planner_model is generator or planner_model == generator else
                    build.head(planner_model, device=device)) if cfg.planner == "llm" else None
        slots = {"planner": plan_gen if plan_gen is not None else
                 {"name": f"{cfg.planner} question templates", "meaningful": True},
                 "encoder": enc, "judge": jd, "head": head}
        if kind == "tatqa":
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
            docs = raw if isinstance(raw, list) else raw["data"]
    write_manifest(out_dir, pipeline="reloop", slots=slots, config=config, seed=0,
                   extra={"data": str(path), "layout": layout, "limit": limit, "offset": offset, "kb": kb,
                          "fingerprint": fp})
    ledger = CostLedger()
    res_path = out_dir / "results.jsonl"
    t0 = time.perf_counter()
    with ResultsWriter(res_path, resume=resume) as writer:
        todo = [q for q in questions if q.id not in writer.done]
        bar = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"reloop {kind}", total=len(todo))

        def on_result(row: dict[str, Any]) -> None:
            writer.write(row)
            if bar is not None:
                bar.advance(task)

        try:
            run_questions(todo, kind, cfg, head=head, ledger=ledger, encoder=enc, judge=jd,
                          planner_generator=plan_gen, kg=kg, tatqa_docs=docs, on_result=on_result,
                          topk_backend=topk_backend)
        finally:
            if bar is not None:
                bar.stop()
    wall = time.perf_counter() - t0
    want = {q.id for q in questions}
    rows = [r for r in read_results(res_path) if r["id"] in want]
    summary = {"data": str(path), "kind": kind, "planner": cfg.planner,
               "slots": {k: (v if isinstance(v, dict) else slot_entry(v)) for k, v in slots.items()},
               **summarise_rows(rows, wall)}
    summary["answers_meaningful"] = bool(getattr(head, "meaningful", True))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n", encoding="utf-8")
    # this run's records only (a resumed run adds a second file rather than overwriting)
    ledger.save(out_dir / ("ledger.jsonl" if not resume else f"ledger.resume-{int(time.time())}.jsonl"))
    return summary


@opt.with_flags("data", "out", "config", "limit", "offset", "batch_size", "device", "val_data", "val_offset",
                "no_progress")
def reloop_cmd(
    planner: str = typer.Option("heuristic", "--planner", help="heuristic | kg-path (MetaQA) | llm."),
    kb: Optional[str] = typer.Option(None, "--kb", help="Triple file for MetaQA questions (default: bundled KB)."),
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue an interrupted run in --out; refused "
                                                                     "when data, questions, slots or settings differ."),
    encoder: Optional[str] = typer.Option(None, "--encoder", help="minilm (bundled all-MiniLM-L6-v2; default) | "
                                                                   "hashing (lexical) | a local encoder path."),
    judge: str = typer.Option("auto", "--judge", help="auto (the bundled judge on text, the heuristic rule on "
                                                      "tables) | heuristic | encoder | head | a judge path."),
    generator: Optional[str] = typer.Option(None, "--generator",
                                            help="Head: 'extractive' (default, NOT an LLM) or a local LM directory."),
    planner_model: Optional[str] = typer.Option(None, "--planner-model", help="Local LM directory for --planner llm."),
    k: int = typer.Option(2, "--k", help="Segments read per step."),
    window: int = typer.Option(8, "--window", help="Sliding-window size (best unread candidates)."),
    max_steps: int = typer.Option(4, "--max-steps", help="Step budget per question."),
    max_tokens: int = typer.Option(400, "--max-tokens", help="Evidence token budget per question."),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Verifier + one reduced-budget refinement."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    **flags: Any,
) -> None:
    """Run RELOOP (HSEQ + guided budget-aware iterator + canonical-evidence head) and write results as they finish.

    RELOOP batches per step: its --batch-size defaults to 16. --val-data/--val-offset are accepted
    for a shared --config file; RELOOP has no validation split.
    """
    from ragfast.devices import resolve_device
    from ragfast.methods.reloop import ReloopConfig
    from ragfast.outdir import output_dir

    config, no_progress = flags.pop("config"), flags.pop("no_progress")
    s = opt.resolve(config, {**flags, "encoder": encoder}, defaults={"batch_size": 16})
    opt.require(s, "out")
    cfg = ReloopConfig(planner=planner, k=k, window=window, max_steps=max_steps, max_tokens=max_tokens,
                       verify=verify, batch_size=s["batch_size"])
    with output_dir(s["out"]):
        summary = run_reloop_command(s["data"], s["out"], cfg, kb=kb, limit=s["limit"], offset=s["offset"],
                                     resume=resume, encoder=s["encoder"], judge=judge, generator=generator,
                                     planner_model=planner_model, device=resolve_device(s["device"]),
                                     progress=not no_progress)
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

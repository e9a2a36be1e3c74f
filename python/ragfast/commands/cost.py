"""``ragfast report cost``: a finished run's recorded cost priced on a declared model and device."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from ragfast.errors import ConfigError

__all__ = ["register", "report_cost", "load_trajectories"]


def load_trajectories(results_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Method -> trajectory records of a results directory.

    ``ragfast bench`` writes ``trajectories/<method>.jsonl``; ``ragfast run`` writes its records
    as ``*.jsonl`` in the directory itself (ledgers and per-state files, whose lines carry no
    ``cost``, are skipped).

    Raises
    ------
    ConfigError
        When the directory holds no trajectory records.
    """
    from ragfast.outputs.results import read_results

    d = Path(results_dir)
    if not d.is_dir():
        raise ConfigError(f"no results directory at {d}")
    files = sorted((d / "trajectories").glob("*.jsonl")) or sorted(d.glob("*.jsonl"))
    out: dict[str, list[dict[str, Any]]] = {}
    for f in files:
        if f.name.startswith("ledger"):
            continue
        recs = [r for r in read_results(f) if isinstance(r.get("cost"), dict) and "id" in r]
        if recs:
            out[f.stem] = recs
    if not out:
        raise ConfigError(f"{d} holds no trajectory records (expected trajectories/<method>.jsonl or results .jsonl files)")
    return out


def report_cost(results_dir: str | Path, *, device: str = "h200", reasoner_config: str | None = None,
                judge_config: str | None = None, batch: int = 64, dtype_bytes: int = 2) -> dict[str, Any]:
    """Write ``cost_projection.json`` and ``cost_projection.md`` into ``results_dir``; return the projection."""
    from ragfast.accounting.projection import project_run, render_markdown

    proj = project_run(load_trajectories(results_dir), device, reasoner=reasoner_config, judge=judge_config,
                       batch=batch, dtype_bytes=dtype_bytes)
    d = Path(results_dir)
    (d / "cost_projection.json").write_text(json.dumps(proj, indent=1) + "\n", encoding="utf-8")
    (d / "cost_projection.md").write_text(render_markdown(proj), encoding="utf-8")
    return proj


def report_cost_cmd(
    results_dir: str = typer.Argument(..., help="A directory written by `ragfast bench` or `ragfast run`."),
    device_profile: str = typer.Option("h200", "--device-profile",
                                       help="Device to price on: h200, h100, a100, l4 or cpu-N (nominal peaks)."),
    reasoner_config: Optional[str] = typer.Option(
        None, "--reasoner-config",
        help="Declared reasoner: a preset (qwen2.5-7b, qwen2.5-3b), a config.json or a model directory. "
             "Its FLOPs are recomputed from the recorded tokens. Without it, recorded FLOPs are used."),
    judge_config: Optional[str] = typer.Option(None, "--judge-config",
                                               help="Declared causal judge, as for --reasoner-config."),
    batch: int = typer.Option(64, "--batch", help="Sequences decoded together on the device."),
    dtype_bytes: int = typer.Option(2, "--dtype-bytes", help="Bytes per weight / KV element (2 = bf16)."),
) -> None:
    """Price a run's recorded tokens and FLOPs on a declared model and device (roofline, projected)."""
    report_cost(results_dir, device=device_profile, reasoner_config=reasoner_config, judge_config=judge_config,
                batch=batch, dtype_bytes=dtype_bytes)
    print((Path(results_dir) / "cost_projection.md").read_text(encoding="utf-8"))


def register(app: typer.Typer) -> None:
    """Add ``report cost`` to the ``report`` group (created by :mod:`ragfast.commands.s2g`)."""
    from ragfast.commands.report import report_app

    report_app.command("cost")(report_cost_cmd)

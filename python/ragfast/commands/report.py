"""``ragfast report ...``: evaluate finished runs from their results directories.

``report s2g RESULTS_DIR`` recomputes the S2G report from a ``study s2g`` directory; other areas
add theirs to :data:`report_app` (``report cost`` in :mod:`ragfast.commands.cost`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

report_app = typer.Typer(help="Evaluate finished runs from their results directories.", no_args_is_help=True)

__all__ = ["report_app", "register", "report_s2g"]


def report_s2g(results_dir: str | Path, *, n_resamples: int = 10000, seed: int = 0,
               margin: float = 0.02) -> dict[str, Any]:
    """Evaluate a ``study s2g`` directory; write ``s2g_report.md`` and ``s2g_report.json`` there.

    The study's figures go to ``s2g_judges.json``, computed from ``s2g_states.jsonl`` (built from
    ``states.jsonl`` for a run that predates it).

    Returns
    -------
    dict
        The evaluation (see :func:`ragfast.methods.s2g.evaluation.evaluate`).
    """
    from ragfast.methods.s2g.evaluation import evaluate, render_markdown
    from ragfast.methods.s2g.study import json_clean

    d = Path(results_dir)
    ev = evaluate(d, n_resamples=n_resamples, seed=seed, margin=margin)
    man = json.loads((d / "manifest.json").read_text()) if (d / "manifest.json").exists() else None
    md = render_markdown(ev, man)
    (d / "s2g_report.md").write_text(md, encoding="utf-8")

    (d / "s2g_report.json").write_text(json.dumps(json_clean(ev), indent=1) + "\n", encoding="utf-8")
    return ev



@report_app.command("s2g")
def s2g_report_cmd(
    results_dir: str = typer.Argument(..., help="A directory written by `ragfast study s2g`."),
    n_resamples: int = typer.Option(10000, "--n-resamples", help="Bootstrap resamples for the confidence intervals."),
    seed: int = typer.Option(0, "--seed", help="Seed of the scripted reasoner, the bootstrap and sampling."),
    margin: float = typer.Option(0.02, "--margin", help="Non-inferiority margin on EM (0.02 = 2 points)."),
    judge: Optional[list[str]] = typer.Option(None, "--judge", help="Also compare judges side by side on the recorded "
                                                                    "states (repeatable): recorded | encoder | head | "
                                                                    "a judge path. Adds their scores to "
                                                                    "s2g_states.jsonl; writes s2g_judges.md/.json."),
    labels: str = typer.Option("probe", "--labels", help="With --judge: the label source shown (probe or gold); "
                                                          "s2g_judges.json holds every source."),
    min_precision: float = typer.Option(0.90, "--min-precision", help="With --judge: validation precision the "
                                                                      "frozen threshold must reach."),
    judge_dtype: Optional[str] = typer.Option(None, "--judge-dtype", help="With --judge: weights and compute of the "
                                                                          "causal-LM judges: fp32 | bf16 | fp16 "
                                                                          "(default fp32 on the CPU; bf16 is faster "
                                                                          "where the CPU has bf16 instructions, "
                                                                          "and rounds the scores)."),
) -> None:
    """Four-part S2G evaluation and the judge's cost balance; writes s2g_report.md/.json."""
    report_s2g(results_dir, n_resamples=n_resamples, seed=seed, margin=margin)
    print((Path(results_dir) / "s2g_report.md").read_text(encoding="utf-8"))
    if judge:
        from ragfast.methods.s2g.judges import compare_judges, render_judges

        cmp = compare_judges(results_dir, judge, labels=labels, min_precision=min_precision, seed=seed,
                             judge_dtype=judge_dtype, log=lambda m: typer.echo(m, err=True))
        md = render_judges(cmp)
        d = Path(results_dir)
        (d / "s2g_judges.md").write_text(md, encoding="utf-8")
        from ragfast.methods.s2g.study import json_clean

        (d / "s2g_judges.json").write_text(json.dumps(json_clean(cmp), indent=1) + "\n", encoding="utf-8")
        print(md)


def register(app: typer.Typer) -> None:
    """Add the ``report`` group."""
    app.add_typer(report_app, name="report")

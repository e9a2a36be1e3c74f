"""``ragfast stepgap ...``: check, ablate, metrics over saved trajectories.

``ragfast run stepgap`` (Search-R1 with the checker and typed repairs in the loop) is generated
from the method registry (:mod:`ragfast.commands.methods`) and writes the bench's layout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from ragfast.infra.devices import DEVICE_HELP, device_option
from ragfast.errors import ConfigError
from ragfast.runner import slots as build
from ragfast.runner.recording import slot_lines


def _read_trajectories(path: str) -> list[Any]:
    """A results file, or a run directory of either layout (``results.jsonl``, or the bench's
    ``trajectories/searchr1.jsonl``, else ``trajectories/stepgap.jsonl`` of ``ragfast run stepgap``)."""
    from ragfast.errors import DataError
    from ragfast.outputs.results import read_results, trajectories_path
    from ragfast.types import Trajectory

    p = Path(path)
    if p.is_dir():
        try:
            p = trajectories_path(p, "searchr1")
        except DataError:
            p = trajectories_path(p, "stepgap")
    if not p.is_file():
        raise ConfigError(f"--results {path!r}: no such results file")
    return [Trajectory.from_dict(r) for r in read_results(p)]


# ---------------------------------------------------------------------------------------------
# ragfast stepgap check | ablate | metrics
# ---------------------------------------------------------------------------------------------
def _register_stepgap(app: typer.Typer) -> None:
    sg = typer.Typer(help="StepGap over saved trajectories: label steps, ablate stages, score against human labels.",
                     no_args_is_help=True)

    @sg.command("check")
    def check_cmd(results: str = typer.Option(..., "--results", help="results.jsonl (or a run or bench directory)."),
                  out: str = typer.Option(..., "--out", help="Labels JSONL (one record per step)."),
                  rewards: Optional[str] = typer.Option(None, "--rewards", help="Also write process rewards here."),
                  nli: str = typer.Option("tiny", "--nli", help="Local NLI directory | tiny | none."),
                  nli_backend: str = typer.Option("torch", "--nli-backend", help="NLI runtime: torch | onnx."),
                  llm: str = typer.Option("none", "--llm", help="LLM of stages A-C: local directory | tiny | none."),
                  stages: str = typer.Option("ABCDE", "--stages", help="Checker stages to run, a subset of ABCDE (A-C need an LLM, D-E the NLI model)."),
                  entail: float = typer.Option(0.5, "--entail", help="Entailment probability at or above which a step counts as supported."),
                  contra: float = typer.Option(0.5, "--contra", help="Contradiction probability at or above which a step counts as contradicted."),
                  device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP)) -> None:
        """Label every step of saved trajectories (one batched call per stage)."""
        from ragfast.accounting.ledger import CostLedger
        from ragfast.methods.stepgap.checker import check
        from ragfast.methods.stepgap.rewards import process_rewards, write_jsonl

        trajs = _read_trajectories(results)
        checker = build.checker(llm, device=device)
        scorer = build.nli(nli, backend=nli_backend, device=device)
        led = CostLedger()
        res = check(trajs, checker, scorer, stages, (entail, contra), ledger=led)
        write_jsonl((lab.to_dict() for lab in res.labels), out)
        if rewards:
            write_jsonl(process_rewards(res), rewards)
        summ = res.summary()
        summ["cost"] = led.totals()
        for line in slot_lines({"checker_llm": summ["slots"]["llm"], "nli": summ["slots"]["nli"]}):
            print(line)
        print(json.dumps({k: v for k, v in summ.items() if k != "slots"}, indent=2, default=str))

    @sg.command("ablate")
    def ablate_cmd(results: str = typer.Option(..., "--results", help="results.jsonl (or a run or bench directory)."),
                   annotations: Optional[str] = typer.Option(None, "--annotations",
                                                             help="Human step labels (JSONL: question_id, step, label)."),
                   nli: str = typer.Option("tiny", "--nli", help="NLI cross-encoder: local directory | tiny (random weights, not meaningful) | none."),
                   nli_backend: str = typer.Option("torch", "--nli-backend", help="NLI runtime: torch | onnx."),
                   llm: str = typer.Option("none", "--llm", help="LLM of stages A-C: local directory | tiny | none."),
                   stages: str = typer.Option("ABCDE", "--stages", help="Checker stages to run, a subset of ABCDE (A-C need an LLM, D-E the NLI model)."),
                   device: str = typer.Option("auto", "--device", callback=device_option, help=DEVICE_HELP),
                   as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        """Remove one stage at a time and report how labels (and metrics, with annotations) change."""
        from ragfast.methods.stepgap.evaluation import ablate, load_annotations

        trajs = _read_trajectories(results)
        gold = load_annotations(annotations) if annotations else None
        rep = ablate(trajs, build.checker(llm, device=device), build.nli(nli, backend=nli_backend, device=device),
                     stages=stages, gold=gold)
        if as_json:
            print(json.dumps(rep, indent=2, default=str))
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        t = Table(title=f"StepGap ablation over {rep['steps']} steps")
        cols = ["variant", "stages", "changed", "no_gap", "CC", "IE", "MB"]
        if gold:
            cols += ["sF1", "QF1", "BA", "typed F1", "dsF1", "dBA"]
        for c in cols:
            t.add_column(c, justify="left" if c in ("variant", "stages") else "right")
        for name, v in rep["variants"].items():
            mix = v["label_mix"]
            row = [name, v["stages"] or "-", str(v["changed_steps"]), f"{mix['no_gap']:.2f}",
                   f"{mix['CONTRADICTED_CLAIM']:.2f}", f"{mix['IRRELEVANT_EVIDENCE']:.2f}", f"{mix['MISSING_BRIDGE']:.2f}"]
            if gold:
                m, d = v["metrics"], v["delta"]
                row += [f"{m['sF1']:.3f}", f"{m['QF1']:.3f}", f"{m['BA']:.3f}", f"{m['typed_macro_F1']:.3f}",
                        f"{d['sF1']:+.3f}", f"{d['BA']:+.3f}"]
            t.add_row(*row)
        con.print(t)
        if gold:
            fa = rep["flag_all"]
            con.print(f"flag-everything baseline ({fa['label']}): sF1 {fa['sF1']:.3f}  QF1 {fa['QF1']:.3f}  "
                      f"BA {fa['BA']:.3f}  typed F1 {fa['typed_macro_F1']:.3f}  (Q-F1 alone rewards flagging all)")
        for line in slot_lines({"checker_llm": rep["slots"]["llm"], "nli": rep["slots"]["nli"]}):
            con.print(line)

    @sg.command("metrics")
    def metrics_cmd(annotations: str = typer.Option(..., "--annotations", help="Human step labels JSONL."),
                    labels: str = typer.Option(..., "--labels", help="Labels JSONL from `ragfast stepgap check`.")) -> None:
        """Score checker labels against human labels (sF1, QF1, BA, typed F1, flag-everything baseline)."""
        from ragfast.errors import DataError
        from ragfast.methods.stepgap.evaluation import load_annotations, step_metrics

        gold = load_annotations(annotations)
        pred = {}
        with open(labels, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    pred[(str(r["trajectory_id"]), int(r["step"]))] = r["label"]
        missing = [k for k in gold if k not in pred]
        if missing:
            raise DataError(f"{len(missing)} annotated steps have no predicted label, e.g. {missing[:3]}")
        keys = sorted(gold)
        print(json.dumps(step_metrics([gold[k] for k in keys], [pred[k] for k in keys], [k[0] for k in keys]),
                         indent=2))

    app.add_typer(sg, name="stepgap")


def register(app: typer.Typer) -> None:
    """Add ``stepgap check|ablate|metrics`` (``ragfast run stepgap`` is generated from the registry)."""
    _register_stepgap(app)

"""``ragfast stepgap ...`` (check, ablate, metrics over saved trajectories) and ``ragfast run stepgap``
(Search-R1 with the checker and typed repairs in the loop).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import typer

from ragfast.commands import options as opt
from ragfast.devices import DEVICE_HELP, device_option
from ragfast.errors import ConfigError
from ragfast.runner import slots as build
from ragfast.runner.drive import MethodRecorder, slot_lines


#: The run's cost ledger: every finished question's records, appended as each one finishes.
STEPGAP_LEDGER = "ledger-stepgap.jsonl"


def _read_trajectories(path: str) -> list[Any]:
    """A results file, or a run directory of either layout (``results.jsonl``, or ``ragfast
    bench``'s ``trajectories/searchr1.jsonl``)."""
    from ragfast.results import read_results, trajectories_path
    from ragfast.types import Trajectory

    p = trajectories_path(path, "searchr1") if Path(path).is_dir() else Path(path)
    if not p.is_file():
        raise ConfigError(f"--results {path!r}: no such results file")
    return [Trajectory.from_dict(r) for r in read_results(p)]


# ---------------------------------------------------------------------------------------------
# ragfast run stepgap
# ---------------------------------------------------------------------------------------------
def run_stepgap_command(*, model: str, data: str, out: str, retriever: str = "default", nli: str = "tiny",
                        nli_backend: str = "auto", checker_llm: str = "reasoner", stages: str = "ABCDE",
                        entail: float = 0.5, contra: float = 0.5, repair: bool = True, max_repairs: int = 2,
                        limit: int | None = None, offset: int = 0, resume: bool = False, batch_size: int = 64,
                        max_turns: int = 4, topk: int = 3, seed: int = 0, max_new_tokens: int = 500,
                        max_obs_tokens: int = 500, prompt_budget: int = 4096,
                        corpus: str | Sequence[str] | None = None, encoder: str = "minilm", device: str = "cpu",
                        progress: bool = True) -> dict[str, Any]:
    """What ``ragfast run stepgap`` does; returns the summary it prints.

    Writes ``OUT/results.jsonl`` (trajectories with ``extra.stepgap``: labels, repairs, rewards),
    ``OUT/rewards.jsonl`` (one process-reward record per step), ``OUT/manifest.json`` and
    ``OUT/summary.json`` (EM, searches, repairs, label mix, and the checker's cost per question
    beside the reasoner's). ``resume`` refuses a run whose data, questions, slots or settings
    differ from the manifest's fingerprint.
    """
    from rich.console import Console

    from ragfast.results import summarise
    from ragfast.runner.drive import check_resume, data_identity, fingerprint, prepare_out
    from ragfast.cost import CostLedger
    from ragfast.data import load_qa
    from ragfast.methods.searchr1.loop import SearchR1Config
    from ragfast.methods.stepgap.loop import StepGapConfig, StepGapPipeline
    from ragfast.results import read_results, slot_entry, write_manifest

    con = Console(stderr=True)
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    s1 = SearchR1Config(max_turns=max_turns, topk=topk, max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens,
                        prompt_budget=prompt_budget, batch_size=batch_size, seed=seed)
    cfg = StepGapConfig(searchr1=s1, stages=stages.upper(), thresholds=(entail, contra), repair=repair,
                        max_repairs=max_repairs)
    all_q = load_qa(data)
    if offset >= len(all_q):
        raise ConfigError(f"--offset {offset} is past the {len(all_q)} questions of {data}")
    questions = all_q[offset: offset + limit if limit else None]
    out_dir = prepare_out(out, "results.jsonl", resume)
    results_path = out_dir / "results.jsonl"
    fp = fingerprint(method="stepgap", data={"test": data_identity(data)}, questions=questions,
                     slots={"reasoner": model, "retriever": retriever, "corpus": corpus, "encoder": encoder,
                            "nli": nli, "checker_llm": checker_llm}, config=cfg.to_dict())
    if resume:
        check_resume(out_dir, fp)
    gen = build.reasoner(model, seed=seed, device=device, batch_size=batch_size, max_context=prompt_budget,
                         max_turns=max_turns)
    ret = build.retriever_over(retriever, all_q, corpus_parts=corpus, encoder_spec=encoder, device=device,
                               progress=progress)
    checker = build.checker(checker_llm, gen, device=device)
    scorer = build.nli(nli, backend=nli_backend, device=device)
    pipe = StepGapPipeline(gen, ret, checker, scorer, cfg, ledger=CostLedger())
    slots = {"reasoner": slot_entry(gen), "retriever": slot_entry(ret),
             "checker_llm": slot_entry(checker) if checker is not None else None,
             "nli": slot_entry(scorer) if scorer is not None else None}
    write_manifest(out_dir, pipeline="stepgap", slots={k: v for k, v in slots.items() if v is not None},
                   config=cfg.to_dict(), seed=seed,
                   extra={"data": str(data), "model_arg": model, "nli_arg": nli, "checker_llm_arg": checker_llm,
                          "fingerprint": fp})
    for line in slot_lines(slots):
        con.print(line)
    t0 = time.perf_counter()
    # Each finished question's cost records are appended (and flushed) with its result, so a
    # killed run keeps the costs of what it finished; a resume drops those of unfinished ones.
    with MethodRecorder(results_path, out_dir / STEPGAP_LEDGER, resume) as rec:
        rec.ledger = pipe.ledger  # the records the recorder appends as each question finishes
        todo = [q for q in questions if q.id not in rec.done]
        with open(out_dir / "rewards.jsonl", "a" if resume else "w", encoding="utf-8") as rw:
            def on_finish(traj):
                rec.finish(traj)
                for r in traj.extra.get("stepgap", {}).get("rewards", []):
                    rw.write(json.dumps(r) + "\n")
            pipe.run(todo, on_finish=on_finish)
        done_now = rec.written
    wall = time.perf_counter() - t0
    want = {q.id for q in questions}
    records = [r for r in read_results(results_path) if r["id"] in want]
    s = summarise(records)
    labels = [lab["label"] for r in records for lab in r.get("extra", {}).get("stepgap", {}).get("labels", [])]
    from collections import Counter

    repairs = Counter(rep["repair"] for r in records for rep in r.get("extra", {}).get("stepgap", {}).get("repairs", [])
                      if rep.get("done"))
    skipped = sum(1 for r in records for rep in r.get("extra", {}).get("stepgap", {}).get("repairs", [])
                  if not rep.get("done"))
    tot = pipe.ledger.totals()
    nq = max(1, done_now)

    def per_q(comp: str, key: str) -> float:
        return tot.get(comp, {}).get(key, 0.0) / nq

    checker_cost = {"judge_seconds": per_q("judge", "seconds"), "nli_seconds": per_q("nli", "seconds"),
                    "judge_tokens": per_q("judge", "input_tokens") + per_q("judge", "output_tokens"),
                    "nli_pairs": per_q("nli", "calls"), "nli_flops": per_q("nli", "flops"),
                    "judge_flops": per_q("judge", "flops")}
    reasoner_cost = {"seconds": per_q("reasoner", "seconds"), "flops": per_q("reasoner", "flops"),
                     "tokens": per_q("reasoner", "input_tokens") + per_q("reasoner", "output_tokens")}
    summary = {**s, "this_run_questions": done_now, "seconds": wall,
               "label_mix": {k: v / len(labels) for k, v in Counter(labels).items()} if labels else {},
               "steps": len(labels), "repairs": dict(repairs), "repairs_skipped_budget": skipped,
               "checker_failures": dict(pipe.hook.failures),
               "checker_cost_per_question": checker_cost, "reasoner_cost_per_question": reasoner_cost,
               "checker_to_reasoner_seconds": (checker_cost["judge_seconds"] + checker_cost["nli_seconds"])
               / reasoner_cost["seconds"] if reasoner_cost["seconds"] > 0 else None,
               "cost": tot, "slots": slots,
               "answers_meaningful": all(d["meaningful"] for d in slots.values() if d is not None)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"stepgap: {s['questions']} questions  EM {s['em']:.4f}  {s['searches_per_question']:.2f} searches/q  "
          f"steps {len(labels)}  repairs {dict(repairs)} (skipped for budget: {skipped})  "
          f"checker/reasoner seconds {summary['checker_to_reasoner_seconds'] if summary['checker_to_reasoner_seconds'] is None else round(summary['checker_to_reasoner_seconds'], 3)}")
    if not summary["answers_meaningful"]:
        print("NOTE: outputs are NOT meaningful (" + "; ".join(
            f"{k} = {d.get('name')}" for k, d in slots.items() if d is not None and not d["meaningful"]) + ")")
    return summary


@opt.with_flags(*opt.LOOP_FLAGS)
def stepgap_run_cmd(
    nli: Optional[str] = typer.Option(None, "--nli", help="NLI cross-encoder: a local directory (e.g. "
                                                           "nli-deberta-v3-large), 'tiny' (random weights, NOT "
                                                           "meaningful; default), 'none', or 'smollm2' / a causal-LM "
                                                           "directory (an LLM-prompted scorer, torch)."),
    nli_backend: Optional[str] = typer.Option(None, "--nli-backend", help="auto (ONNX Runtime on CPU; default) | "
                                                                           "torch | onnx."),
    checker_llm: Optional[str] = typer.Option(None, "--checker-llm", help="LLM of stages A-C: reasoner (default) | "
                                                                           "tiny | a local directory | none."),
    stages: str = typer.Option("ABCDE", "--stages", help="Checker stages to run."),
    entail: float = typer.Option(0.5, "--entail", help="Entailment threshold."),
    contra: float = typer.Option(0.5, "--contra", help="Contradiction threshold."),
    no_repair: bool = typer.Option(False, "--no-repair", help="Label steps only; inject no repairs."),
    max_repairs: int = typer.Option(2, "--max-repairs", help="Repairs per question."),
    resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue an interrupted run in --out; finished "
                                                                     "questions are not redone."),
    **flags: Any,
) -> None:
    """Run Search-R1 with the StepGap checker after every turn and typed repairs (retract / re-search / bridge).

    --val-data/--val-offset are accepted for a shared --config file; StepGap has no validation split.
    """
    from ragfast.devices import resolve_device
    from ragfast.outdir import output_dir

    config, no_progress = flags.pop("config"), flags.pop("no_progress")
    s = opt.resolve(config, {**flags, "nli": nli, "nli_backend": nli_backend, "checker_llm": checker_llm})
    opt.require(s, "out")
    with output_dir(s["out"]):
        run_stepgap_command(model=s["model"], retriever=s["retriever"], data=s["data"], out=s["out"], nli=s["nli"],
                            nli_backend=s["nli_backend"], checker_llm=s["checker_llm"], stages=stages, entail=entail,
                            contra=contra, repair=not no_repair, max_repairs=max_repairs, limit=s["limit"],
                            offset=s["offset"], resume=resume, batch_size=s["batch_size"], max_turns=s["max_turns"],
                            topk=s["topk"], seed=s["seed"], max_new_tokens=s["max_new_tokens"],
                            max_obs_tokens=s["max_obs_tokens"], prompt_budget=s["prompt_budget"], corpus=s["corpus"],
                            encoder=s["encoder"], device=resolve_device(s["device"]), progress=not no_progress)


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
        from ragfast.cost import CostLedger
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
    """Add ``stepgap check|ablate|metrics`` and ``run stepgap``."""
    _register_stepgap(app)
    from ragfast.commands.run import run_app

    run_app.command("stepgap")(stepgap_run_cmd)

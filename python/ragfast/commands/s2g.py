"""``ragfast study s2g``: the S2G stopping judge, run and evaluated (``ragfast report s2g`` re-evaluates).

``ragfast run s2g`` runs the registered method through the bench's runner; this study does more
and writes its own files. ``study s2g`` writes, into ``--out``:

- ``native.jsonl``: native Search-R1 trajectories (validation and test questions);
- ``states.jsonl``: per state 0..S, the judge's score and the answer-only probe's answer and EM
  (the replay table);
- ``s2g_states.jsonl``: the study's states 0..S-1, one line each (README, S2G evaluation);
- ``s2g_judges.json``: the study's figures, computed from ``s2g_states.jsonl``;
- ``s2g_threshold.json``: the frozen threshold (given, or selected on the validation states);
- ``s2g.jsonl``: the live run with the judge in the loop (test questions);
- ``ledger-*.jsonl``, ``manifest.json``, and the report (``s2g_report.md``/``.json``).

``report s2g RESULTS_DIR`` recomputes the report from those files. ``--resume`` continues a killed
study: the native and live passes keep their finished questions, the rest is computed again.
"""
from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path
from typing import Any, Sequence

import typer

from ragfast.errors import ConfigError

__all__ = ["register", "run_s2g_command", "study_command", "study_settings", "study_app", "STUDY_SETTINGS"]


def run_s2g_command(*, model: str, data: str, out: str, judge: str = "encoder", retriever: str = "default",
                    threshold: float | None = None, val_data: str | None = None, val_limit: int = 60,
                    val_offset: int = 0, min_precision: float = 0.90, limit: int | None = None, offset: int = 0,
                    batch_size: int = 64, max_turns: int = 4, topk: int = 3, seed: int = 0,
                    max_new_tokens: int = 500, max_obs_tokens: int = 500, gap_queries: bool = False,
                    live: bool = True, n_resamples: int = 10000, corpus: str | Sequence[str] | None = None,
                    encoder: str = "minilm", device: str = "cpu", overwrite: bool = False,
                    resume: bool = False, progress: bool = True, dtype: str | None = None,
                    weights: str = "auto", memory_budget: str | int | None = "auto",
                    threads: int | None = None) -> dict[str, Any]:
    """What ``ragfast study s2g`` does; returns the evaluation it reports.

    With ``resume``, the native and live passes continue their files (``native.jsonl``,
    ``s2g.jsonl`` and their ledgers) and run only the questions not finished yet; the states,
    threshold and report, computed from those files, are made afresh.

    Raises
    ------
    ConfigError
        On a missing threshold source, overlapping validation and test questions, an output
        directory that already holds a run (without ``overwrite`` or ``resume``), or a resume
        whose settings, data or questions differ from the run on disk.

    ``dtype``, ``weights``, ``memory_budget`` and ``threads`` are the local reasoner's, as in
    ``ragfast run``.
    """
    from rich.console import Console

    from ragfast.accounting.ledger import CostLedger
    from ragfast.data import load_qa
    from ragfast.methods.s2g.loop import run_s2g
    from ragfast.methods.s2g.states import record_states
    from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop
    from ragfast.methods.s2g.study import state_lines
    from ragfast.outputs.results import read_results, slot_entry, write_manifest
    from ragfast.runner import slots as build
    from ragfast.runner.recording import MethodRecorder, data_identity, fingerprint
    from ragfast.runner.run_methods import in_question_order
    from ragfast.types import Trajectory

    con = Console(stderr=True)
    if threshold is None and not val_data:
        raise ConfigError("give --threshold, or --val-data to select one (max STOP recall at --min-precision)")
    if threshold is not None and math.isnan(threshold):
        raise ConfigError("--threshold must be a number")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: give one")
    out_dir = Path(out)

    all_test = load_qa(data)
    test = all_test[offset: offset + limit if limit else None]
    val: list = []
    all_val: list = []
    if threshold is None:
        all_val = load_qa(val_data)
        val = all_val[val_offset: val_offset + val_limit]
        clash = {q.id for q in val} & {q.id for q in test}
        if clash:
            raise ConfigError(f"{len(clash)} question ids are in both the validation and the test questions "
                              f"(e.g. {sorted(clash)[0]!r}); use --val-offset/--offset to separate them")
    if not test:
        raise ConfigError("no test questions (check --offset/--limit)")
    cfg = SearchR1Config(max_turns=max_turns, topk=topk, max_new_tokens=max_new_tokens, max_obs_tokens=max_obs_tokens,
                         batch_size=batch_size, seed=seed)
    questions = list(val) + list(test)
    study_cfg = {**cfg.to_dict(), "gap_queries": gap_queries, "min_precision": min_precision}
    fp = fingerprint(method="study-s2g",
                     data={"test": data_identity(data), **({"val": data_identity(val_data)} if val_data else {})},
                     questions=questions,
                     slots={"reasoner": model, "retriever": retriever, "judge": judge, "encoder": encoder,
                            "corpus": corpus},
                     # the reasoner's precision where it is not the default (earlier runs resume as they were)
                     config={**study_cfg, "threshold": threshold, "live": live, **({"dtype": dtype} if dtype else {}),
                             **({"weights": weights} if weights != "native" else {})})
    _prepare_out(out_dir, fp, overwrite=overwrite, resume=resume)  # before any model loads
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    gen = build.reasoner(model, seed=seed, device=device, batch_size=batch_size, max_turns=max_turns, dtype=dtype,
                         weights=weights, memory_budget=memory_budget)
    # The corpus comes from every question of both files (deduplicated by id: validation and test
    # may be two slices of one file), so it does not depend on --limit.
    pool = list({q.id: q for q in list(all_test) + list(all_val)}.values())
    ret = build.retriever_over(retriever, pool, corpus_parts=corpus, encoder_spec=encoder, device=device,
                               progress=progress)
    jd = build.judge(judge, device=device, shared_encoder=getattr(ret, "encoder", None))
    slots = {"reasoner": slot_entry(gen), "retriever": slot_entry(ret), "judge": slot_entry(jd)}
    write_manifest(out_dir, pipeline="s2g", slots=slots, config=study_cfg, seed=seed,
                   extra={"data": str(data), "val_data": val_data, "offset": offset, "limit": limit,
                          "val_offset": val_offset, "val_limit": val_limit, "threshold_arg": threshold,
                          "fingerprint": fp})

    t0 = time.perf_counter()
    # 1. native trajectories (validation + test), written with their cost records as they finish
    with MethodRecorder(out_dir / "native.jsonl", out_dir / "ledger-native.jsonl", resume=resume) as nat:
        todo = [q for q in questions if q.id not in nat.done]
        if resume:
            con.print(f"native: resume: {len(questions) - len(todo)} of {len(questions)} questions already done")
        SearchR1Loop(gen, ret, cfg, ledger=nat.ledger).run(todo, on_finish=nat.finish)
    # Read back in question order, this run's and the resumed ones alike, so a resumed study
    # computes its states and bootstrap intervals on the same sequence as a clean one.
    native = [Trajectory.from_dict(dict(r))
              for r in in_question_order(read_results(out_dir / "native.jsonl"), questions)]
    con.print(f"native: {len(native)} trajectories, {sum(t.searches for t in native) / len(native):.2f} searches/q")
    # 2. judge scores and answer-only probes of every recorded state
    jl, pl = CostLedger(), CostLedger()
    val_ids = {q.id for q in val}
    rec = record_states(native, jd, gen, max_new_tokens=max_new_tokens, batch_size=batch_size, judge_ledger=jl,
                        probe_ledger=pl, split=["val" if t.id in val_ids else "test" for t in native])
    rec.save(out_dir / "states.jsonl")
    jl.save(out_dir / "ledger-judge-states.jsonl")
    pl.save(out_dir / "ledger-probe.jsonl")
    # 3. the per-state export (the study's states 0..S-1) and the frozen threshold chosen on it
    from ragfast.methods.s2g.study import (STATES_FILE, ThresholdError, choose_threshold, json_clean,
                                           read_state_lines, threshold_record, write_state_lines)

    write_state_lines(out_dir / STATES_FILE, state_lines(rec, judge, trajectories=native))
    if threshold is None:
        try:
            ft = choose_threshold(read_state_lines(out_dir / STATES_FILE), judge, "probe", min_precision=min_precision)
        except ThresholdError as e:  # exit 2; the recorded files stay
            raise ThresholdError(f"{e}; the recorded states are in {out_dir / STATES_FILE}: give --threshold, or "
                                 "other validation questions") from None
        thr = ft.threshold
        info = threshold_record(ft, judge=judge, source="selected", val_questions=len(val))
    else:
        thr = float(threshold)
        info = threshold_record(None, judge=judge, source="given", given=thr)
    (out_dir / "s2g_threshold.json").write_text(json.dumps(json_clean(info), indent=1) + "\n")
    con.print(f"threshold: {thr} ({info['source']})")
    # 4. the live run with the judge in the loop
    if live:
        # A fresh judge: one that kept the recording pass's caches (EncoderJudge embeds each
        # document once) would score the live states for free and understate the judge's cost.
        live_judge = build.judge(judge, device=device, shared_encoder=getattr(ret, "encoder", None))
        with MethodRecorder(out_dir / "s2g.jsonl", out_dir / "ledger-s2g.jsonl", resume=resume) as rec_live:
            run_s2g([q for q in test if q.id not in rec_live.done], gen, ret, live_judge, thr, cfg,
                    gap_queries=gap_queries, ledger=rec_live.ledger, on_finish=rec_live.finish)
    from ragfast.commands.report import report_s2g

    ev = report_s2g(out_dir, n_resamples=n_resamples, seed=seed)
    p = ev["paired"].get("live", ev["paired"]["replay"])
    print(f"s2g: {p['questions']} test questions in {time.perf_counter() - t0:.1f}s  threshold {thr:.4g}  "
          f"EM {p['em_new']:.4f} (native {p['em_native']:.4f})  searches/q {p['searches_new']:.3f} "
          f"(native {p['searches_native']:.3f})  report: {out_dir / 's2g_report.md'}")
    if not all(d["meaningful"] for d in slots.values()):
        print("NOTE: some slots are NOT meaningful (" + "; ".join(f"{k} = {d.get('name')}" for k, d in slots.items()
                                                               if not d["meaningful"]) + ")")
    return ev


#: Computed from the native and live passes afresh on every run, a resumed one too.
DERIVED = ("states.jsonl", "s2g_states.jsonl", "s2g_judges.json", "s2g_threshold.json", "ledger-judge-states.jsonl",
           "ledger-probe.jsonl")
#: Written as questions finish: a resume continues them.
PASSES = ("native.jsonl", "ledger-native.jsonl", "s2g.jsonl", "ledger-s2g.jsonl")


def _prepare_out(out_dir: Path, fp: dict[str, Any], *, overwrite: bool, resume: bool) -> None:
    """Check ``out_dir`` against this run and clear what it will write afresh.

    A directory holding a run (a finished one, or native trajectories of a killed one) is
    refused unless ``overwrite`` (cleared) or ``resume`` (its fingerprint must be ``fp``).
    """
    from ragfast.runner.recording import check_resume

    if resume:
        check_resume(out_dir, fp)
    else:
        held = [n for n in ("states.jsonl", "native.jsonl") if (out_dir / n).exists() and (out_dir / n).stat().st_size]
        if held and not overwrite:
            raise ConfigError(f"{out_dir} already holds an S2G run ({held[0]}): pass --resume to continue it, "
                              "--overwrite to replace it, or another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in DERIVED + (() if resume else PASSES):
        (out_dir / name).unlink(missing_ok=True)


#: The :class:`~ragfast.runner.settings.RunSettings` fields ``study s2g`` reads, in ``--help`` order: the
#: same flags, aliases, help and defaults as ``ragfast run s2g`` (``--out`` aside: the study's files are
#: its own, so it names its directory).
STUDY_SETTINGS = ("reasoner", "data", "out", "index", "judge", "limit", "offset", "batch_size", "corpus", "encoder",
                  "device", "val_data", "val_offset", "val_limit", "threshold", "min_precision", "budget", "topk",
                  "seed", "max_new_tokens", "max_obs_tokens", "n_resamples", "dtype", "weights", "memory_budget",
                  "threads")


def study_settings(config: str | None = None, preset: str = "default", **given: Any) -> Any:
    """The :class:`~ragfast.runner.settings.RunSettings` of ``study s2g``: ``run s2g``'s, from the same flags
    (None = not given), ``--config`` file and preset.

    Raises
    ------
    ConfigError
        No ``--out`` on the command line or in ``--config``, or a setting ``run s2g`` refuses.
    """
    from ragfast.commands.methods import one_method_settings
    from ragfast.runner.config_file import load_yaml

    if given.get("out") is None and load_yaml(config).get("out") is None:
        raise ConfigError("--out is required (on the command line or in --config)")
    return one_method_settings("s2g", preset=preset, config=config, **given)


def study_command(**kw: Any) -> None:
    """Run S2G on Search-R1: native run, per-state judge scores and probes, threshold, live run, report."""
    from ragfast.infra.devices import resolve_device
    from ragfast.outputs.outdir import output_dir

    own = {k: kw.pop(k) for k in ("gap_queries", "no_live", "overwrite", "resume", "no_progress")}
    cfg = study_settings(**kw)
    with output_dir(cfg.out):
        run_s2g_command(model=cfg.reasoner, data=cfg.data, out=cfg.out, judge=cfg.judge, retriever=cfg.index,
                        threshold=cfg.threshold, val_data=cfg.val_data, val_limit=cfg.val_limit,
                        val_offset=cfg.val_offset, min_precision=cfg.min_precision, limit=cfg.limit, offset=cfg.offset,
                        batch_size=cfg.batch_size, max_turns=cfg.budget, topk=cfg.topk, seed=cfg.seed,
                        max_new_tokens=cfg.max_new_tokens, max_obs_tokens=cfg.max_obs_tokens,
                        gap_queries=own["gap_queries"], live=not own["no_live"], n_resamples=cfg.n_resamples,
                        corpus=cfg.corpus, encoder=cfg.encoder, device=resolve_device(cfg.device),
                        overwrite=own["overwrite"], resume=own["resume"], progress=not own["no_progress"],
                        dtype=cfg.dtype, weights=cfg.weights, memory_budget=cfg.memory_budget, threads=cfg.threads)


def _study_parameters() -> list[inspect.Parameter]:
    """``study s2g``'s own switches, then the running commands' (but ``--json``), then its settings' flags."""
    from ragfast.commands.methods import setting_flags, switches

    def own(name: str, option: Any) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=bool, default=option)

    shared = switches()
    return [own("gap_queries", typer.Option(False, "--gap-queries", help="Let the judge's gap items drive an extra "
                                                                          "search.")),
            own("no_live", typer.Option(False, "--no-live", help="Replay only: skip the live in-loop run.")),
            own("overwrite", typer.Option(False, "--overwrite", help="Replace a previous run in --out.")),
            *(shared[k] for k in ("resume", "no_progress", "preset", "config")),
            *setting_flags(STUDY_SETTINGS)]


#: ``ragfast study ...``: the replay studies, whose layout is the study's own (``ragfast run s2g``
#: is the registered method through the one runner, as ``ragfast bench --method s2g``).
study_app = typer.Typer(help="Replay studies of a method (native run, every state scored and probed, frozen "
                             "threshold, live run, report).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add ``study s2g`` (the S2G replay study; it was ``run s2g`` before the method registry)."""
    study_command.__signature__ = inspect.Signature(_study_parameters())  # type: ignore[attr-defined]  # typer reads it
    study_app.command("s2g")(study_command)
    app.add_typer(study_app, name="study")

"""S2G stopping as a registered :class:`~ragfast.methods.base.Method`: the threshold in
:meth:`S2GMethod.prepare`, the judge in the loop in :meth:`S2GMethod.run`, the threshold sweep
over the native test trajectories in :meth:`S2GMethod.after_run`."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ragfast.errors import ConfigError
from ragfast.methods.base import Method, RayPipeline, Recorder, Slots, register
from ragfast.methods.searchr1.method import searchr1_config
from ragfast.outputs.results import dumps as json_dumps
from ragfast.types import Question, Trajectory

log = logging.getLogger(__name__)

__all__ = ["S2GMethod", "select_s2g_threshold", "s2g_analysis", "select_questions", "THRESHOLD_FILE"]

#: The frozen threshold and how it was chosen (:func:`ragfast.methods.s2g.study.threshold_record`).
THRESHOLD_FILE = "s2g_threshold.json"


def select_questions(questions: list[Question], offset: int, limit: int | None) -> list[Question]:
    """``questions[offset:offset + limit]``; an offset past the end is refused (one line)."""
    if offset >= len(questions):
        raise ConfigError(f"--offset {offset} is past the {len(questions)} questions of the data")
    return questions[offset: offset + limit if limit else None]


def select_s2g_threshold(cfg: Any, slots: Slots, out: Path, console: Any = None) -> dict[str, Any]:
    """The frozen STOP threshold: given, or chosen on validation questions and written to disk.

    Selection follows the S2G study (:func:`ragfast.methods.s2g.study.choose_threshold`, the one
    definition ``study s2g`` and ``report s2g`` use too): run native Search-R1 on the validation
    questions, score their states 0..S-1 (``s2g_states.jsonl``), label a state right-to-stop when
    the answer-only probe from it is correct, and take the highest STOP recall at per-state
    precision ``>= min_precision`` with >= 10 STOP states; without one S2G never stops and the
    file says why. Validation and test questions never overlap (checked).
    """
    path = Path(out) / THRESHOLD_FILE
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    from ragfast.methods.s2g.study import json_clean, threshold_record

    judge_name = str(cfg.judge)
    if cfg.threshold is not None:
        info = threshold_record(None, judge=judge_name, source="given (--threshold)", given=float(cfg.threshold))
    else:
        from ragfast.data import load_qa
        from ragfast.methods.s2g.states import record_states
        from ragfast.methods.s2g.study import STATES_FILE, state_lines, write_state_lines
        from ragfast.methods.s2g.study_files import validation_threshold
        from ragfast.methods.searchr1.loop import SearchR1Loop
        from ragfast.infra.progress import TurnReporter, progress_task

        val = select_questions(load_qa(cfg.val_data), cfg.val_offset, cfg.val_limit)
        overlap = {q.id for q in val} & {q.id for q in slots.questions}
        if overlap:
            raise ConfigError(f"{len(overlap)} validation questions are also test questions; move --val-offset/--offset apart")
        msg = (f"S2G: choosing the STOP threshold on {len(val)} validation questions of {cfg.val_data}"
               f"[{cfg.val_offset}:{cfg.val_offset + len(val)}] (STOP precision >= {cfg.min_precision}; "
               f"--val-limit sets how many, --limit caps it too)")
        log.info(msg)  # on the console under the CLI (and in ragfast.log)
        gen = slots.make_generator()
        # The probes re-read prefixes of the runs' sessions: a generator that can keep ended
        # sessions' keys/values (HFGenerator.keep_ended) computes them once.
        keep = getattr(gen, "keep_ended", contextlib.nullcontext)
        with progress_task("S2G validation", len(val), unit="questions") as task, keep():
            t0 = time.perf_counter()
            trajs, failed = _validation_trajectories(SearchR1Loop(TurnReporter(gen, task, cfg.budget + 1),
                                                                  slots.retriever, searchr1_config(cfg)), val, task)
            t1 = time.perf_counter()
            task.set_status("judge + answer-only probe on every state")
            # make_generator() is the one shared model for a language-model reasoner (so the probes
            # find the runs' kept caches), a fresh scripted oracle otherwise, as before
            rec = record_states(trajs, slots.judge, slots.make_generator(), split=["val"] * len(trajs))
            task.set_status("")
            log.info("S2G validation: %d runs in %.1f s, judge and answer-only probes on their %d states in %.1f s",
                     len(trajs), t1 - t0, sum(t.searches + 1 for t in trajs), time.perf_counter() - t1)
        lines = state_lines(rec, judge_name, trajectories=trajs)
        write_state_lines(Path(out) / STATES_FILE, lines)
        info = validation_threshold(lines, judge_name, min_precision=cfg.min_precision, val_questions=len(trajs),
                                    source=f"{cfg.val_data}[{cfg.val_offset}:{cfg.val_offset + len(val)}]",
                                    n_resamples=min(cfg.n_resamples, 2000), seed=cfg.seed)
        info["val_failed"] = failed  # left out of the threshold's states (their components failed)
        if info.get("reason"):
            log.warning("S2G threshold: %s", info["reason"])
    path.write_text(json.dumps(json_clean(info), indent=2), encoding="utf-8")
    return json.loads(path.read_text(encoding="utf-8"))


def _validation_trajectories(loop: Any, val: list[Question], task: Any) -> tuple[list[Trajectory], int]:
    """The native trajectories of the validation questions, in their order, and how many failed:
    a question whose component fails is left out of the threshold's states, as a test question
    is recorded as failed (:func:`ragfast.outputs.failures.isolate`)."""
    from ragfast.outputs.failures import FailureStreak, isolate

    done: dict[str, Trajectory] = {}
    failed: set[str] = set()

    def finish(t: Trajectory) -> None:
        done[t.id] = t
        task.advance(1)

    def record(q: Question, exc: BaseException) -> None:
        failed.add(q.id)
        task.advance(1)

    isolate(lambda qs: loop.run(qs, on_finish=finish), val, done=lambda: set(done) | failed, record=record,
            forget=lambda ids: None, streak=FailureStreak("S2G validation"))
    return [done[q.id] for q in val if q.id in done], len(failed)


def s2g_analysis(cfg: Any, slots: Slots, native: Sequence[Mapping[str, Any]], threshold: float,
                 out: Path) -> dict[str, Any]:
    """Counterfactual threshold sweep, the study's figures and the judge's calibration on the
    native test trajectories.

    Every state of every native trajectory is scored by the judge and probed (answer-only
    generation from that state); :func:`ragfast.methods.s2g.analysis.threshold_sweep` replays the
    live first-crossing rule over thresholds without rerunning the reasoner. The test states
    join the validation states in ``s2g_states.jsonl``; ``s2g_judges.json`` is computed from
    that file, and the calibration figure is its test ECE-10 bins.
    """
    from ragfast.methods.s2g.analysis import threshold_sweep
    from ragfast.methods.s2g.states import record_states
    from ragfast.methods.s2g.study_files import add_test_states

    trajs = [Trajectory.from_dict(dict(r)) for r in native]
    gen = slots.make_generator()
    # The probes continue the native sessions, shelved by the runner when the native run was this
    # process's (on resume, or on another generator, each trajectory's longest state is computed).
    keep = getattr(gen, "keep_ended", None)
    with keep(reuse="searchr1") if keep is not None else contextlib.nullcontext():
        rec = record_states(trajs, slots.judge, gen, split=["test"] * len(trajs))
    an = threshold_sweep(rec, threshold)
    an.update(add_test_states(out, rec, trajs, str(cfg.judge), min_precision=cfg.min_precision,
                              n_resamples=cfg.n_resamples, seed=cfg.seed))
    return an


@register
class S2GMethod(Method):
    """Search-R1 with the judge in the loop: stop at the first state scoring >= the frozen threshold."""

    name = "s2g"
    slots = ("reasoner", "retriever", "judge")
    reads_sessions_of = ("searchr1",)
    validation = True  # the threshold is chosen on the validation questions

    def __init__(self, settings: Any):
        super().__init__(settings)
        self.threshold: float | None = None

    def config(self) -> Any:
        return searchr1_config(self.settings)

    def check(self) -> None:
        if self.settings.judge == "none":
            raise ConfigError("S2G needs a judge: drop --judge none, or leave s2g out with --method")

    def prepare(self, slots: Slots, out: Path, console: Any = None) -> None:
        # Chosen before the method's recorder opens, so a failed selection leaves no empty files.
        self.threshold = float(select_s2g_threshold(self.settings, slots, out, console)["threshold"])

    def run(self, questions: Sequence[Question], slots: Slots, recorder: Recorder) -> list[Any]:
        from ragfast.methods.s2g.loop import run_s2g

        return run_s2g(list(questions), slots.make_generator(), slots.retriever, slots.judge, self.threshold,
                       self.config(), ledger=recorder.ledger, on_finish=recorder.finish, skip_ids=recorder.done)

    def ray_pipeline(self) -> RayPipeline:
        from ragfast.methods.s2g.loop import run_s2g

        return RayPipeline(run_s2g, self.config(), {"judge": ("judge", self.settings.judge, {})},
                           {"threshold": self.threshold})

    def after_run(self, slots: Slots, records: Mapping[str, Sequence[Mapping[str, Any]]], out: Path,
                  progress: Any = None) -> None:
        """The threshold sweep over the native test trajectories, when native Search-R1 ran too
        (``s2g_analysis.json``; redone only when the number of native questions changed)."""
        if "searchr1" not in records or slots.judge is None:
            return
        path = Path(out) / "s2g_analysis.json"
        old = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        if old.get("n_questions") == len(records["searchr1"]):
            return
        task = progress.task("S2G analysis", None) if progress is not None else None
        if task is not None:
            task.set_status("scoring and probing every native state for the threshold sweep")
        th = float(json.loads((Path(out) / THRESHOLD_FILE).read_text(encoding="utf-8"))["threshold"])
        an = s2g_analysis(self.settings, slots, records["searchr1"], th, out)
        an["n_questions"] = len(records["searchr1"])
        path.write_text(json_dumps(an, indent=2), encoding="utf-8")
        if task is not None:
            task.update(total=1, completed=1)
            task.set_status("")
            task.done()

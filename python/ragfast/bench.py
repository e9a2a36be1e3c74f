"""``ragfast bench``: all four methods on the same questions, with every cost measured.

One run = one output directory::

    trajectories/<method>.jsonl   one line per finished question (written as it finishes)
    ledgers/<method>.jsonl        every cost record of that method (question-attributed ones are
                                  appended when their question finishes, so a crash loses none)
    s2g_threshold.json            the frozen STOP threshold and how it was chosen
    s2g_states.jsonl              the study's states 0..S-1 (validation and test), one line each
    s2g_judges.json               the study's S2G figures, computed from s2g_states.jsonl
    summary.json, summary.csv, report.md, report.html, *.png

``--resume`` re-reads what is on disk and runs only the questions each method has not finished;
a finished bench resumed does no new work.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.cost import COMPONENTS
from ragfast.errors import ConfigError, DataError
from ragfast.http import is_url
from ragfast.runner import slots as build
from ragfast.progress import TurnReporter, turn_reporting
from ragfast.runner.drive import MethodRecorder, check_resume, data_identity, fingerprint, load_ledger
from ragfast.outdir import LOCK_FILE
from ragfast.results import dumps as json_dumps
from ragfast.types import Question, Trajectory

log = logging.getLogger(__name__)

METHODS = ("searchr1", "s2g", "stepgap", "reloop")


@dataclass
class BenchConfig:
    """Every slot and setting of a bench run; the defaults are the bundled, offline ones.

    Parameters
    ----------
    data : str
        QA file or sample name (default: the bundled HotpotQA dev sample).
    corpus : list of str
        Corpus parts: ``"contexts"`` (the data's own context paragraphs), a sample name
        (``"wiki-sample"``) or a wiki-18 style jsonl path.
    reasoner : str
        ``scripted`` (the evidence oracle), ``tiny`` (a random-weight Qwen2), a local HF path,
        or an OpenAI-compatible URL.
    judge : str
        ``encoder`` (the bundled trained EncoderJudge), a local causal-LM path, or ``tiny``.
    nli : str
        ``tiny`` (a random-weight DeBERTa-v2 cross-encoder) or a local path.
    encoder : str
        Retrieval encoder: ``minilm`` (bundled) or a local path (``e5``/``bge`` checkpoints).
    encoder_backend : {"auto", "torch", "onnx"}
        ``auto``: ONNX Runtime on the CPU (measured faster than torch for MiniLM queries, see
        ``bench/bench_encoder_backends.py``; exported once and cached), torch elsewhere or when
        the export fails. The ledger charges the same analytic FLOPs either way.
    nli_backend : {"auto", "torch", "onnx"}
        The same choice for the NLI cross-encoder (ONNX Runtime measured 4.8x faster than torch
        on the tiny model, ``bench/bench_nli_backends.py``).
    index : str
        ``flat`` (ragfast's kernel), ``bm25``, ``faiss:<factory>`` (e.g. ``faiss:HNSW32``), a saved
        index path, or a ``/retrieve`` URL.
    budget, topk : int
        Search turns per question and documents per search.
    offset, limit : int
        Test questions are ``data[offset:offset + limit]``. By default the first 100 dev
        questions are the S2G validation split and the remaining 200 the test set (the S2G
        study's layout: validation 100-199, test 200-999).
    ray : str, optional
        Run searchr1, s2g and stepgap on Ray: ``"local"`` starts a local cluster, else a
        cluster address. Each worker actor holds its own reasoner (and judge / NLI); retrieval
        is one shared actor. RELOOP and the S2G threshold selection run in this process.
    threshold : float, optional
        The S2G STOP threshold; None selects it on validation questions
        (``val_data[val_offset:val_offset + val_limit]``) for STOP precision >= ``min_precision``
        and freezes it.
    device : str
        Where the local models run: ``auto`` (the GPU when there is one), ``cpu``, ``cuda`` or
        ``cuda:N``. ``devices`` overrides it per slot (``{"judge": "cpu"}``).
    served_model, reasoner_tokenizer, reasoner_config : str, optional
        For a URL reasoner: the served model's name (default: the server's only model), a local
        tokenizer (chat template and token counts) and a config (analytic FLOPs).
    """

    data: str = "hotpotqa-dev"
    corpus: list[str] = field(default_factory=lambda: ["contexts", "wiki-sample"])
    limit: int | None = None
    offset: int = 100
    reasoner: str = "scripted"
    judge: str = "encoder"
    nli: str = "tiny"
    encoder: str = "minilm"
    encoder_backend: str = "auto"
    nli_backend: str = "auto"
    index: str = "flat"
    budget: int = 4
    topk: int = 3
    threshold: float | None = None
    min_precision: float = 0.90
    val_data: str = "hotpotqa-dev"
    val_limit: int = 100
    val_offset: int = 0
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    batch_size: int = 64
    seed: int = 0
    n_resamples: int = 10000
    out: str = "ragfast-bench"
    ray: str | None = None
    ray_workers: int = 2
    device: str = "auto"
    devices: dict[str, str] = field(default_factory=dict)
    served_model: str | None = None
    reasoner_tokenizer: str | None = None
    reasoner_config: str | None = None

    def __post_init__(self) -> None:
        from ragfast.settings import check_types

        check_types(self)  # a YAML string for a number is one line here, not a TypeError deep inside
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        if self.budget < 0 or self.topk < 1:
            raise ConfigError(f"budget must be >= 0 and topk >= 1 (got budget={self.budget}, topk={self.topk})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        # Checked before --out exists (--val-limit 0 used to run searchr1 first, then fail).
        for name, lo in (("offset", 0), ("val_offset", 0), ("val_limit", 1), ("batch_size", 1), ("n_resamples", 1)):
            if getattr(self, name) < lo:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {lo}, got {getattr(self, name)}")
        if not 0 < self.min_precision <= 1:
            raise ConfigError(f"min_precision must be in (0, 1], got {self.min_precision}")
        if self.judge == "none" and "s2g" in self.methods:
            raise ConfigError("S2G needs a judge: drop --judge none, or leave s2g out with --method")
        for name in ("encoder_backend", "nli_backend"):
            if getattr(self, name) not in ("auto", "torch", "onnx"):
                raise ConfigError(f"--{name.replace('_', '-')} must be auto, torch or onnx, got {getattr(self, name)!r}")
        if self.ray_workers < 1:
            raise ConfigError(f"--ray-workers must be >= 1, got {self.ray_workers}")
        from ragfast.devices import slot_devices

        self.slot_device = slot_devices(self.device, self.devices)


# The S2G study's setting. Model and data files are the user's: they live under
# $RAGFAST_MODELS (default ./models) with these names, and every missing one is named.
PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": {
        "reasoner": "{models}/SearchR1-nq_hotpotqa_train-qwen2.5-7b-em-ppo-v0.2",
        "encoder": "{models}/e5-base-v2",
        "index": "{models}/e5_Flat.index",
        "corpus": ["{models}/wiki-18.jsonl"],
        "judge": "{models}/s2g-judge",
        "data": "{models}/hotpotqa_dev.jsonl",
        "val_data": "{models}/hotpotqa_dev.jsonl",
        "val_offset": 100,
        "val_limit": 100,
        "offset": 200,
        "limit": 800,
        "budget": 4,
        "topk": 3,
        "min_precision": 0.90,
    },
}


def make_config(preset: str = "default", yaml_path: str | None = None, **overrides: Any) -> BenchConfig:
    """Build a :class:`BenchConfig` from a preset, then a YAML file, then explicit overrides.

    Raises
    ------
    ConfigError
        Unknown preset, unreadable YAML, unknown keys.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    values: dict[str, Any] = {}
    models = os.environ.get("RAGFAST_MODELS", "models")
    for k, v in PRESETS[preset].items():
        if isinstance(v, str):
            v = v.format(models=models)
        elif isinstance(v, list):
            v = [x.format(models=models) if isinstance(x, str) else x for x in v]
        values[k] = v
    # The same file the run commands read: their names for bench settings are accepted, and
    # settings only they take (the loop's token caps) are left to them.
    from ragfast.settings import BENCH_NAMES, RUN_ONLY, load_yaml

    values.update({BENCH_NAMES.get(k, k): v for k, v in load_yaml(yaml_path).items() if k not in RUN_ONLY})
    values.update({k: v for k, v in overrides.items() if v is not None})
    if isinstance(values.get("corpus"), str):  # one part, as a flag or YAML scalar gives it
        values["corpus"] = [values["corpus"]]
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    return BenchConfig(**values)


def check_paths(cfg: BenchConfig) -> None:
    """Fail with one message naming every missing file or model directory of the config."""
    from ragfast.data import SAMPLES

    missing = []

    def need(label: str, value: str, builtins: Sequence[str] = ()) -> None:
        if value in builtins or value in SAMPLES or is_url(value):
            return
        v = value.split(":", 1)[1] if value.startswith("faiss:") else value
        if value.startswith("faiss:") and not Path(v).suffix:
            return  # a factory string, not a file
        if not Path(v).exists():
            missing.append(f"{label}: {v}")

    need("data", cfg.data)
    for c in cfg.corpus:
        need("corpus", c, ("contexts",))
    need("reasoner", cfg.reasoner, ("scripted", "tiny"))
    need("judge", cfg.judge, ("encoder", "head", "tiny", "none"))
    need("nli", cfg.nli, ("tiny",))
    need("encoder", cfg.encoder, ("minilm",))
    need("index", cfg.index, ("flat", "default", "bm25"))
    if "s2g" in cfg.methods and cfg.threshold is None:
        need("val_data", cfg.val_data)
    if missing:
        raise ConfigError("missing files for this bench configuration:\n  " + "\n  ".join(missing)
                          + "\n(put them there, or point the slot elsewhere with a flag or --config YAML)")
    from ragfast.retrieval.remote import check_reachable

    # A server that is not there fails now, before --out exists, not after the slots are built.
    if is_url(cfg.index):
        check_reachable(cfg.index, "--index server")
    if is_url(cfg.reasoner):
        check_reachable(cfg.reasoner.partition("#")[0], "--reasoner server")


# -- building the slots ----------------------------------------------------------------------
@dataclass
class Slots:
    """The components that fill each slot of a run, built once and shared by the methods."""

    questions: list[Question]
    corpus: Any
    retriever: Any
    make_generator: Callable[[], Any]
    generator_info: dict[str, Any]
    judge: Any
    nli: Any


def _select(questions: list[Question], offset: int, limit: int | None) -> list[Question]:
    if offset >= len(questions):
        raise ConfigError(f"offset {offset} is past the {len(questions)} questions of the data")
    return questions[offset: offset + limit if limit else None]


def build_slots(cfg: BenchConfig) -> Slots:
    """Load data and build every slot (encoder/index, reasoner, judge, NLI) once, through :mod:`ragfast.runner.slots`."""
    from ragfast.data import load_qa

    dev = cfg.slot_device
    all_q = load_qa(cfg.data)
    questions = _select(all_q, cfg.offset, cfg.limit)
    corpus = build.corpus(cfg.corpus, all_q)
    encoder = None if is_url(cfg.index) else build.encoder(cfg.encoder, backend=cfg.encoder_backend,
                                                           device=dev["encoder"])
    index = "default" if cfg.index == "flat" else cfg.index
    retriever = build.retriever(index, corpus, shared_encoder=encoder, device=dev["encoder"], check=False)
    make_gen, gen_info = _generator_factory(cfg)
    judge = (build.judge(cfg.judge, device=dev["judge"], shared_encoder=encoder, encoder_device=dev["encoder"],
                         check=False)
             if ("s2g" in cfg.methods or "reloop" in cfg.methods) else None)
    nli = build.nli(cfg.nli, backend=cfg.nli_backend, device=dev["nli"]) if "stepgap" in cfg.methods else None
    return Slots(questions, corpus, retriever, make_gen, gen_info, judge, nli)


def _generator_factory(cfg: BenchConfig) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The reasoner as a factory: a fresh scripted oracle per method (its state is per run), else one shared model."""
    from ragfast.results import slot_entry

    kw = _reasoner_kwargs(cfg)
    if cfg.reasoner == "scripted":
        def make() -> Any:
            return build.reasoner(cfg.reasoner, **kw)
    else:
        shared = build.reasoner(cfg.reasoner, check=False, **kw)

        def make() -> Any:
            return shared
    return make, slot_entry(make())


def _reasoner_kwargs(cfg: BenchConfig) -> dict[str, Any]:
    return dict(seed=cfg.seed, max_turns=cfg.budget, device=cfg.slot_device["reasoner"],
                served_model=cfg.served_model, tokenizer=cfg.reasoner_tokenizer, model_config=cfg.reasoner_config)


# -- the methods -----------------------------------------------------------------------------
def _searchr1_config(cfg: BenchConfig):
    from ragfast.methods.searchr1.loop import SearchR1Config

    return SearchR1Config(max_turns=cfg.budget, topk=cfg.topk, batch_size=cfg.batch_size, seed=cfg.seed)


def run_searchr1(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
                 progress: Callable[[int], None]) -> None:
    """Native Search-R1: the reasoner searches until it answers or the budget is spent."""
    from ragfast.methods.searchr1.loop import SearchR1Loop

    loop = SearchR1Loop(slots.make_generator(), slots.retriever, _searchr1_config(cfg), ledger=rec.ledger)

    def done(t: Trajectory) -> None:
        rec.finish(t)
        progress(1)

    loop.run(list(questions), on_finish=done, skip_ids=rec.done)


def select_s2g_threshold(cfg: BenchConfig, slots: Slots, out: Path, console: Any = None) -> dict[str, Any]:
    """The frozen STOP threshold: given, or chosen on validation questions and written to disk.

    Selection follows the S2G study (:func:`ragfast.methods.s2g.study.choose_threshold`, the one
    definition ``run s2g`` and ``report s2g`` use too): run native Search-R1 on the validation
    questions, score their states 0..S-1 (``s2g_states.jsonl``), label a state right-to-stop when
    the answer-only probe from it is correct, and take the highest STOP recall at per-state
    precision ``>= min_precision`` with >= 10 STOP states; without one S2G never stops and the
    file says why. Validation and test questions never overlap (checked).
    """
    path = out / "s2g_threshold.json"
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

        val = _select(load_qa(cfg.val_data), cfg.val_offset, cfg.val_limit)
        overlap = {q.id for q in val} & {q.id for q in slots.questions}
        if overlap:
            raise ConfigError(f"{len(overlap)} validation questions are also test questions; move --val-offset/--offset apart")
        msg = (f"S2G: choosing the STOP threshold on {len(val)} validation questions of {cfg.val_data}"
               f"[{cfg.val_offset}:{cfg.val_offset + len(val)}] (STOP precision >= {cfg.min_precision}; "
               f"--val-limit sets how many, --limit caps it too)")
        log.info(msg)  # on the console under the CLI (and in ragfast.log)
        from ragfast.progress import progress_task

        with progress_task("S2G validation", len(val), unit="questions") as task:
            gen = TurnReporter(slots.make_generator(), task, cfg.budget + 1)
            trajs = SearchR1Loop(gen, slots.retriever, _searchr1_config(cfg)).run(val, on_finish=lambda t: task.advance(1))
            task.set_status("judge + answer-only probe on every state")
            rec = record_states(trajs, slots.judge, slots.make_generator(), split=["val"] * len(trajs))
            task.set_status("")
        lines = state_lines(rec, judge_name, trajectories=trajs)
        write_state_lines(out / STATES_FILE, lines)
        info = validation_threshold(lines, judge_name, min_precision=cfg.min_precision, val_questions=len(val),
                                    source=f"{cfg.val_data}[{cfg.val_offset}:{cfg.val_offset + len(val)}]",
                                    n_resamples=min(cfg.n_resamples, 2000), seed=cfg.seed)
        if info.get("reason"):
            log.warning("S2G threshold: %s", info["reason"])
    path.write_text(json.dumps(json_clean(info), indent=2), encoding="utf-8")
    return json.loads(path.read_text(encoding="utf-8"))


def run_s2g(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
            progress: Callable[[int], None], threshold: float) -> None:
    """Search-R1 with the judge in the loop: stop at the first state scoring >= the threshold."""
    from ragfast.methods.s2g.loop import run_s2g as _run

    def done(t: Trajectory) -> None:
        rec.finish(t)
        progress(1)

    _run(list(questions), slots.make_generator(), slots.retriever, slots.judge, threshold, _searchr1_config(cfg),
         ledger=rec.ledger, on_finish=done, skip_ids=rec.done)


def run_stepgap(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
                progress: Callable[[int], None]) -> None:
    """Search-R1 with the StepGap checker after every turn and typed repairs.

    With the scripted reasoner there is no LLM to run stages A-C, so only the NLI stages D-E
    run (and the report says so); any real reasoner also serves as the checker's LLM.
    """
    from ragfast.methods.stepgap.loop import StepGapConfig, run_stepgap as _run

    gen = slots.make_generator()
    checker = None if cfg.reasoner == "scripted" else gen
    sg_cfg = StepGapConfig(searchr1=_searchr1_config(cfg), stages="ABCDE" if checker is not None else "DE")

    def done(t: Trajectory) -> None:
        rec.finish(t)
        progress(1)

    _run(list(questions), gen, slots.retriever, checker=checker, nli=slots.nli, config=sg_cfg, ledger=rec.ledger,
         on_finish=done, skip_ids=rec.done)


def run_reloop(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
               progress: Callable[[int], None]) -> None:
    """RELOOP over each question's own sources as one HSEQ: guided iterator, judge, evidence-pack head.

    The head is the reasoner when it is a real model; with the scripted reasoner it is RELOOP's
    extractive head (a span picker, not an LLM: marked not meaningful).
    """
    from ragfast.methods.reloop import ExtractiveHead, HeuristicSufficiency, ReloopConfig, run_text, text_workspace

    head = ExtractiveHead() if cfg.reasoner == "scripted" else slots.make_generator()
    encoder = getattr(slots.retriever, "encoder", None)
    if encoder is None:
        from ragfast.retrieval import Encoder

        encoder = Encoder(cfg.encoder)
    rl_cfg = ReloopConfig(planner="heuristic", max_steps=max(1, cfg.budget), k=max(1, min(cfg.topk, 8)))

    def done(row: dict[str, Any]) -> None:
        rec.finish(row)
        progress(1)

    judge = slots.judge if slots.judge is not None else HeuristicSufficiency(multi_doc=True)
    run_text([text_workspace(q) for q in questions], encoder=encoder, judge=judge, generator=head, cfg=rl_cfg,
             ledger=rec.ledger, on_result=done)


def run_method_on_ray(cfg: BenchConfig, method: str, slots: Slots, out: Path, resume: bool,
                      progress: Callable[[int], None], threshold: float | None = None) -> None:
    """One method on Ray: the driver writes trajectories (question order) and ledger records."""
    import functools

    from ragfast.data import load_qa
    from ragfast.runner.distributed import GENERATOR, PipelineLoop, run_on_ray
    from ragfast.results import finished_ids, repair_tail

    traj = out / "trajectories" / f"{method}.jsonl"
    ledger_path = out / "ledgers" / f"{method}.jsonl"
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    if resume and ledger_path.exists():
        repair_tail(ledger_path)
        done = finished_ids(traj) if traj.exists() else set()
        kept = load_ledger(ledger_path, done)
        with open(ledger_path, "w", encoding="utf-8") as f:
            for r in kept.records:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    config: Any = _searchr1_config(cfg)
    make_loop = None
    if method == "s2g":
        from ragfast.methods.s2g.loop import run_s2g as _s2g

        make_loop = PipelineLoop(_s2g, slots={"judge": functools.partial(build.judge, build.absolute(cfg.judge))},
                                 threshold=threshold)
    elif method == "stepgap":
        from ragfast.methods.stepgap.loop import StepGapConfig, run_stepgap as _sg

        scripted = cfg.reasoner == "scripted"
        config = StepGapConfig(searchr1=config, stages="DE" if scripted else "ABCDE")
        make_loop = PipelineLoop(_sg, slots={"nli": functools.partial(build.nli, build.absolute(cfg.nli),
                                                                      backend=cfg.nli_backend),
                                             **({} if scripted else {"checker": GENERATOR})})
    # one unit of work per worker at least, else workers sit idle
    bs = max(1, min(cfg.batch_size, -(-len(slots.questions) // cfg.ray_workers)))
    kw = {k: v for k, v in _reasoner_kwargs(cfg).items() if k != "device"}  # each actor picks its device
    make_gen = functools.partial(build.reasoner, build.absolute(cfg.reasoner), **kw)
    # The retriever actor builds from the on-disk embedding cache the driver already filled.
    make_ret = functools.partial(build.retriever_over, "default" if cfg.index == "flat" else build.absolute(cfg.index),
                                 load_qa(cfg.data), corpus_parts=[build.absolute(c) for c in cfg.corpus],
                                 encoder_spec=build.absolute(cfg.encoder), encoder_backend=cfg.encoder_backend,
                                 progress=False, check=False)
    res = run_on_ray(slots.questions, make_generator=make_gen, make_retriever=make_ret, config=config,
                     out_path=traj, address=cfg.ray, num_workers=cfg.ray_workers, resume=resume,
                     make_loop=make_loop, batch_size=bs, on_result=lambda r: progress(1))
    with open(ledger_path, "a", encoding="utf-8") as f:
        for r in res.ledger.records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


RUNNERS: dict[str, Callable[..., None]] = {"searchr1": run_searchr1, "s2g": run_s2g, "stepgap": run_stepgap,
                                           "reloop": run_reloop}


def s2g_analysis(cfg: BenchConfig, slots: Slots, native: Sequence[Mapping[str, Any]], threshold: float,
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
    rec = record_states(trajs, slots.judge, slots.make_generator(), split=["test"] * len(trajs))
    an = threshold_sweep(rec, threshold)
    an.update(add_test_states(out, rec, trajs, str(cfg.judge), min_precision=cfg.min_precision,
                              n_resamples=cfg.n_resamples, seed=cfg.seed))
    return an


# -- summary ---------------------------------------------------------------------------------
def in_question_order(records: Sequence[Mapping[str, Any]], questions: Sequence[Question]) -> list[Mapping[str, Any]]:
    """``records`` in the order of ``questions``, not the order they finished in.

    A resumed run writes its questions in another order than a clean one, and the bootstrap
    intervals resample by position: sorting makes them the same for the same results.
    """
    pos = {q.id: i for i, q in enumerate(questions)}
    return sorted(records, key=lambda r: pos.get(r["id"], len(pos)))


def _cost_row(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {"calls": 0.0, "tokens": 0.0, "flops": 0.0, "seconds": 0.0}
    for r in rows:
        out["calls"] += r.get("calls", 0)
        out["tokens"] += r.get("tokens", r.get("input_tokens", 0) + r.get("cached_tokens", 0) + r.get("output_tokens", 0))
        out["flops"] += r.get("flops", 0)
        out["seconds"] += r.get("seconds", 0)
        if r.get("unknown"):
            # calls whose compute a remote server did not report: FLOPs and tokens are a floor
            out["unknown"] = out.get("unknown", 0) + r["unknown"]
    return out


def question_cost(traj: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """component -> {calls, tokens, flops, seconds} of one trajectory record."""
    return {c: _cost_row([v]) for c, v in traj.get("cost", {}).items()}


def method_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """EM, F1, searches and per-component cost totals of one method's trajectory records."""
    n = len(records)
    per_comp: dict[str, list[dict[str, float]]] = {}
    for r in records:
        for c, v in question_cost(r).items():
            per_comp.setdefault(c, []).append(v)
    cost = {c: _cost_row(per_comp[c]) for c in COMPONENTS if c in per_comp}
    cost["total"] = _cost_row(list(cost.values()))
    return {
        "em": float(np.mean([r["em"] for r in records])) if n else float("nan"),
        "f1": float(np.mean([r["f1"] for r in records])) if n else float("nan"),
        "searches_per_question": float(np.mean([r["searches"] for r in records])) if n else float("nan"),
        "n_questions": n,
        "cost": cost,
    }


def _paired(a: np.ndarray, b: np.ndarray, cfg: BenchConfig) -> dict[str, float] | None:
    from ragfast.stats import paired_bootstrap

    if len(a) < 2:
        return None
    r = paired_bootstrap(a, b, n_resamples=cfg.n_resamples, seed=cfg.seed)
    return {"delta": float(r.delta), "low": float(r.low), "high": float(r.high)}


def method_cis(records: Sequence[Mapping[str, Any]], cfg: BenchConfig) -> dict[str, dict[str, float]]:
    """95% bootstrap CIs (over questions) of a method's EM and its total FLOPs / seconds per question."""
    from ragfast.stats import paired_bootstrap

    if len(records) < 2:
        return {}
    cols = {"em": [r["em"] for r in records],
            "flops_per_q": [sum(v["flops"] for v in question_cost(r).values()) for r in records],
            "seconds_per_q": [sum(v["seconds"] for v in question_cost(r).values()) for r in records]}
    out = {}
    for k, v in cols.items():
        b = paired_bootstrap(np.asarray(v, dtype=np.float64), n_resamples=min(cfg.n_resamples, 5000), seed=cfg.seed)
        out[k] = {"low": float(b.low), "high": float(b.high)}
    return out


def compare_to_native(records: Mapping[str, Sequence[Mapping[str, Any]]], cfg: BenchConfig) -> dict[str, dict[str, Any]]:
    """ΔEM, ΔFLOPs and Δseconds per question against native Search-R1, paired by question id."""
    if "searchr1" not in records:
        return {}
    base = {r["id"]: r for r in records["searchr1"]}
    out = {}
    for m, recs in records.items():
        if m == "searchr1":
            continue
        ids = [r["id"] for r in recs if r["id"] in base]
        if not ids:
            continue
        mine = {r["id"]: r for r in recs}

        def col(src: Mapping[str, Any], key: Callable[[Mapping[str, Any]], float]) -> np.ndarray:
            return np.array([key(src[i]) for i in ids], dtype=np.float64)

        def tot(field: str) -> Callable[[Mapping[str, Any]], float]:
            return lambda r: sum(v[field] for v in question_cost(r).values())

        out[m] = {
            "n_paired": len(ids),
            "delta_em": _paired(col(mine, lambda r: r["em"]), col(base, lambda r: r["em"]), cfg),
            "delta_searches": _paired(col(mine, lambda r: r["searches"]), col(base, lambda r: r["searches"]), cfg),
            "delta_flops": _paired(col(mine, tot("flops")), col(base, tot("flops")), cfg),
            "delta_seconds": _paired(col(mine, tot("seconds")), col(base, tot("seconds")), cfg),
        }
    return out


# -- the main job ----------------------------------------------------------------------------
def run_bench(cfg: BenchConfig, *, resume: bool = False, console: Any = None) -> dict[str, Any]:
    """Run every method of ``cfg`` on the same questions and write the report.

    Parameters
    ----------
    cfg : BenchConfig
    resume : bool
        Continue the run in ``cfg.out``: finished questions are read back, not run again.
    console : rich.console.Console, optional

    Returns
    -------
    dict
        The content of ``summary.json``.
    """
    from rich.console import Console

    from ragfast.logs import run_log

    console = console or Console(stderr=True)
    check_paths(cfg)
    out = Path(cfg.out)
    # The log of a run that failed before doing any work does not make the directory a run.
    if out.exists() and any(p.name not in ("ragfast.log", LOCK_FILE) for p in out.iterdir()) and not resume:
        raise DataError(f"{out} already holds a bench run; pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    with run_log(out):
        log.info("bench: %s -> %s (resume=%s)", cfg.data, out, resume)
        return _run_bench(cfg, out, resume, console)


def bench_fingerprint(cfg: BenchConfig, run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a bench's results (:func:`ragfast.runner.drive.fingerprint`): data hashes, test question ids, slots, settings."""
    from ragfast.data import load_qa

    data = {"test": data_identity(cfg.data)}
    if cfg.threshold is None:  # the validation split decides the S2G threshold (whichever methods run now)
        data["val"] = data_identity(cfg.val_data)
    specs = {k: run_cfg[k] for k in ("reasoner", "judge", "nli", "encoder", "index", "corpus", "served_model")}
    # limit/offset are in the question ids; data files in their hashes; methods may be added on resume.
    config = {k: v for k, v in run_cfg.items()
              if k not in specs and k not in ("data", "val_data", "methods", "limit", "offset")}
    return fingerprint(method="bench", data=data, questions=_select(load_qa(cfg.data), cfg.offset, cfg.limit),
                       slots=specs, config=config)


def _run_bench(cfg: BenchConfig, out: Path, resume: bool, console: Any) -> dict[str, Any]:
    from rich.console import Console

    from ragfast.progress import RunProgress
    from ragfast.results import finished_ids, read_results, write_manifest

    t0 = time.perf_counter()
    # How a run executes (Ray or not, where it writes, which methods) is not part of what it computes.
    run_cfg = {k: v for k, v in dataclasses.asdict(cfg).items()
               if k not in ("ray", "ray_workers", "out", "encoder_backend", "nli_backend")}
    fp = bench_fingerprint(cfg, run_cfg)
    if resume:
        check_resume(out, fp)  # before any model loads
    with RunProgress(console) as prog:
        setup = prog.task("loading slots", None)
        slots = build_slots(cfg)
        setup.update(total=1, completed=1)
        setup.set_status(f"{len(slots.questions)} questions, {len(slots.corpus)} passages")
        slot_info = {
            "reasoner": slots.generator_info,
            "retriever": _retriever_slot(slots.retriever),
            "judge": _slot_dict(slots.judge) if slots.judge is not None else {"name": "none", "meaningful": False},
            "nli": _slot_dict(slots.nli) if slots.nli is not None else {"name": "none", "meaningful": False},
        }
        # Where each local model ran (a URL slot runs wherever its server does).
        for slot, dev_slot in (("reasoner", "reasoner"), ("retriever", "encoder"), ("judge", "judge"), ("nli", "nli")):
            remote = slot_info[slot].get("class") in ("OpenAIGenerator", "RemoteRetriever", "RemoteJudge")
            slot_info[slot]["device"] = "remote" if remote else cfg.slot_device[dev_slot]
        write_manifest(out, pipeline="bench", slots=slot_info, config=run_cfg, seed=cfg.seed,
                       extra={"data": cfg.data, "n_questions": len(slots.questions), "corpus_size": len(slots.corpus),
                              "fingerprint": fp})
        for k, v in slot_info.items():
            label = v.get("answers_meaningful", v.get("meaningful"))
            if k == "judge" and label == "yes" and "s2g" in cfg.methods and cfg.threshold is None:
                label = "measured below (validation ranking vs counting documents)"
            prog.print(f"slot [bold]{k}[/]: {v.get('name')} on {v['device']}  (answers meaningful: {label})")
            log.debug("slot %s: %s", k, v)

        for m in cfg.methods:
            if cfg.ray and m != "reloop":
                done = finished_ids(out / "trajectories" / f"{m}.jsonl") if resume else set()
                th = float(select_s2g_threshold(cfg, slots, out, prog)["threshold"]) if m == "s2g" else None
                task = prog.task(m, len(slots.questions), completed=len(done & {q.id for q in slots.questions}),
                                 unit="questions")
                run_method_on_ray(cfg, m, slots, out, resume, task.advance, th)
                task.done()
                continue
            th = None
            if m == "s2g":
                # Chosen before the method's recorder opens, so a failed selection leaves no empty files.
                th = float(select_s2g_threshold(cfg, slots, out, prog)["threshold"])
            rec = MethodRecorder(out / "trajectories" / f"{m}.jsonl", out / "ledgers" / f"{m}.jsonl", resume)
            todo = [q for q in slots.questions if q.id not in rec.done]
            task = prog.task(m, len(slots.questions), completed=len(slots.questions) - len(todo), unit="questions")
            t_m = time.perf_counter()
            ok = False
            try:
                if todo:
                    gen_slots = dataclasses.replace(slots, make_generator=turn_reporting(slots.make_generator, task,
                                                                                         cfg.budget + 1))
                    args = (cfg, gen_slots, rec, todo, task.advance)
                    if m == "s2g":
                        RUNNERS[m](*args, threshold=th)
                    else:
                        RUNNERS[m](*args)
                ok = True
            finally:
                rec.close()
                task.set_status("")
                task.done(failed=not ok)  # an error is never printed as "done"
            log.info("%s: %d questions in %.1f s", m, len(todo), time.perf_counter() - t_m)
        if cfg.reasoner != "scripted":
            # the shared reasoner's entry after its calls (a URL one counts its calls and token sources)
            from ragfast.results import slot_entry

            slot_info["reasoner"].update(slot_entry(slots.make_generator()))
        judge_verdict(slot_info, out)
        records = {m: in_question_order(read_results(out / "trajectories" / f"{m}.jsonl"), slots.questions)
                   for m in cfg.methods}
        analysis_path = out / "s2g_analysis.json"
        if "s2g" in records and "searchr1" in records and slots.judge is not None:
            old = json.loads(analysis_path.read_text(encoding="utf-8")) if analysis_path.exists() else {}
            if old.get("n_questions") != len(records["searchr1"]):
                an_task = prog.task("S2G analysis", None)
                an_task.set_status("scoring and probing every native state for the threshold sweep")
                th = float(json.loads((out / "s2g_threshold.json").read_text(encoding="utf-8"))["threshold"])
                an = s2g_analysis(cfg, slots, records["searchr1"], th, out)
                an["n_questions"] = len(records["searchr1"])
                analysis_path.write_text(json_dumps(an, indent=2), encoding="utf-8")
                an_task.update(total=1, completed=1)
                an_task.set_status("")
                an_task.done()
    summary = summarise(cfg, records, slot_info, out)
    summary["run"] = run_info(cfg, slots, time.perf_counter() - t0)
    write_outputs(summary, out, records)
    from ragfast import report

    report.print_table(summary, Console())
    console.print(f"results in [bold]{out}[/]: summary.json, summary.csv, report.md, report.html, plots, "
                  f"trajectories/, ragfast.log")
    return summary


def run_info(cfg: BenchConfig, slots: Slots, wall_seconds: float) -> dict[str, Any]:
    """What a reader needs to reproduce the run: data, sizes, settings, versions, machine."""
    import platform

    import ragfast

    info: dict[str, Any] = {"data": cfg.data, "n_questions": len(slots.questions), "corpus_size": len(slots.corpus),
                            "budget": cfg.budget, "topk": cfg.topk, "wall_seconds": wall_seconds,
                            "val_limit": cfg.val_limit, "seed": cfg.seed, "ragfast": ragfast.__version__,
                            "python": platform.python_version(), "machine": platform.machine(),
                            "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    if hasattr(os, "getloadavg"):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    return info


def judge_verdict(slot_info: dict[str, Any], out: Path) -> None:
    """Set the judge slot's verdict from its measured validation ranking (s2g_threshold.json).

    Without a validation pass (a given --threshold, or no s2g method) the verdict says it was
    not measured; the judge's own description is never taken as the verdict.
    """
    from ragfast.results import answers_label

    judge = slot_info.get("judge")
    if not judge or judge.get("name") == "none":
        return
    path = out / "s2g_threshold.json"
    measured = json.loads(path.read_text(encoding="utf-8")).get("judge_vs_doc_count") if path.exists() else None
    if measured and measured.get("measured", True):
        judge["meaningful"] = bool(measured["meaningful"]) and judge.get("meaningful", True)
        judge["verdict"] = measured["label"] if judge["meaningful"] or measured["label"].startswith("NO") else \
            answers_label({k: v for k, v in judge.items() if k != "verdict"})
        judge["ranking_vs_doc_count"] = measured
    elif judge.get("meaningful", True):
        judge["verdict"] = (measured or {}).get("label") or "not measured in this run (no S2G validation pass)"
    judge["answers_meaningful"] = answers_label(judge)


def _retriever_slot(r: Any) -> dict[str, Any]:
    d = _slot_dict(r)
    enc, idx = d.get("encoder"), d.get("index")
    if isinstance(enc, Mapping) and isinstance(idx, Mapping):
        d["name"] = (f"{enc.get('name')} encoder ({enc.get('model')}) + {idx.get('backend')} index "
                     f"({idx.get('factory')}, {idx.get('storage')}) over {d.get('passages', idx.get('ntotal'))} passages")
    return d


def _slot_dict(component: Any) -> dict[str, Any]:
    from ragfast.results import slot_entry

    return slot_entry(component)


def summarise(cfg: BenchConfig, records: Mapping[str, Sequence[Mapping[str, Any]]], slot_info: Mapping[str, Any],
              out: Path) -> dict[str, Any]:
    """summary.json's content: per-method metrics and costs, deltas against native, slots."""
    methods = {m: method_summary(recs) for m, recs in records.items()}
    for m, recs in records.items():
        methods[m]["ci"] = method_cis(recs, cfg)
    for m, d in compare_to_native(records, cfg).items():
        methods[m].update(d)
    summary: dict[str, Any] = {"methods": methods, "slots": dict(slot_info)}
    for path in (out / "s2g_threshold.json", out / "s2g_analysis.json", out / "s2g_judges.json"):
        if path.exists():
            summary[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    if "searchr1" in records:
        for method, key in (("s2g", "break_even"), ("stepgap", "stepgap_balance")):
            if method in records:
                summary[key] = checker_balance(records["searchr1"], records[method], method, slot_info, cfg)
    return summary


def component_status(records: Sequence[Sequence[Mapping[str, Any]]], slot_info: Mapping[str, Any]) -> dict[str, str]:
    """measured / unknown / free per component: unknown where a server reported no cost, free
    for the scripted oracle (its tokens are a script's, not a model's compute)."""
    status = {c: "measured" for c in COMPONENTS}
    for recs in records:
        for r in recs:
            for c, v in (r.get("cost") or {}).items():
                if v.get("unknown"):
                    status[c] = "unknown"
    if (slot_info.get("reasoner") or {}).get("class") == "ScriptedGenerator":
        status["reasoner"] = "free"
    return status


def checker_balance(native: Sequence[Mapping[str, Any]], other: Sequence[Mapping[str, Any]], method: str,
                    slot_info: Mapping[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """Does the method's checker (S2G's judge, StepGap's NLI) pay for what its method saves?

    Paired by question, with bootstrap intervals (:func:`ragfast.savings.balance`); ``text``
    is the verdict a person reads.
    """
    from ragfast.savings import balance

    spender = "judge" if method == "s2g" else "nli"
    b = balance(native, other, spender=spender, components=component_status([native, other], slot_info),
                n_resamples=cfg.n_resamples, seed=cfg.seed)
    d = b.to_dict()
    d["text"] = f"{method} against native Search-R1, per question with 95% intervals:\n" + "\n".join(
        f"- {line}" for line in b.lines())
    return d


def write_outputs(summary: dict[str, Any], out: Path, records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """summary.json, summary.csv, the plots, report.md and report.html."""
    from ragfast import report

    plots, missing = report.write_plots(summary, out)
    summary["plots"] = plots
    summary["plots_missing"] = missing
    tmp = out / "summary.json.tmp"
    # NaN (an undefined statistic) as null: bare NaN is not JSON (JSON.parse refuses the file).
    tmp.write_text(json_dumps(summary, indent=2, default=str), encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    report.write_csv(summary, out / "summary.csv")
    report.write_markdown(summary, out, plots, missing)
    report.write_html(summary, out, plots, missing)


"""``ragfast bench``: all four methods on the same questions, with every cost measured.

One run = one output directory::

    trajectories/<method>.jsonl   one line per finished question (written as it finishes)
    ledgers/<method>.jsonl        every cost record of that method (question-attributed ones are
                                  appended when their question finishes, so a crash loses none)
    s2g_threshold.json            the frozen STOP threshold and how it was chosen
    summary.json, summary.csv, report.md, report.html, *.png

``--resume`` re-reads what is on disk and runs only the questions each method has not finished;
a finished bench resumed does no new work.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ragfast.cost import COMPONENTS, CostLedger, CostRecord
from ragfast.errors import ConfigError, DataError
from ragfast.types import Question, Trajectory

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
    index : str
        ``flat`` (ragfast's kernel), ``faiss:<factory>`` (e.g. ``faiss:HNSW32``), a saved
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
    """

    data: str = "hotpotqa-dev"
    corpus: list[str] = field(default_factory=lambda: ["contexts", "wiki-sample"])
    limit: int | None = None
    offset: int = 100
    reasoner: str = "scripted"
    judge: str = "encoder"
    nli: str = "tiny"
    encoder: str = "minilm"
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

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ConfigError(f"unknown method(s) {bad}; choose from {list(METHODS)}")
        if self.budget < 0 or self.topk < 1:
            raise ConfigError(f"budget must be >= 0 and topk >= 1 (got budget={self.budget}, topk={self.topk})")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if not 0 < self.min_precision <= 1:
            raise ConfigError(f"min_precision must be in (0, 1], got {self.min_precision}")
        if self.judge == "none" and "s2g" in self.methods:
            raise ConfigError("S2G needs a judge: drop --judge none, or leave s2g out with --method")
        if self.ray_workers < 1:
            raise ConfigError(f"--ray-workers must be >= 1, got {self.ray_workers}")


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
    if yaml_path:
        import yaml

        p = Path(yaml_path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({exc})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: expected a mapping of settings, got {type(loaded).__name__}")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
    return BenchConfig(**values)


def _is_url(s: str) -> bool:
    return s.startswith("http://") or s.startswith("https://")


def check_paths(cfg: BenchConfig) -> None:
    """Fail with one message naming every missing file or model directory of the config."""
    from ragfast.data import SAMPLES

    missing = []

    def need(label: str, value: str, builtins: Sequence[str] = ()) -> None:
        if value in builtins or value in SAMPLES or _is_url(value):
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
    need("index", cfg.index, ("flat",))
    if "s2g" in cfg.methods and cfg.threshold is None:
        need("val_data", cfg.val_data)
    if missing:
        raise ConfigError("missing files for this bench configuration:\n  " + "\n  ".join(missing)
                          + "\n(put them there, or point the slot elsewhere with a flag or --config YAML)")


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


def build_corpus(cfg: BenchConfig, all_questions: list[Question]):
    from ragfast.data import Corpus, corpus_from_contexts, load_corpus

    parts = []
    for c in cfg.corpus:
        parts.append(corpus_from_contexts(all_questions) if c == "contexts" else load_corpus(c))
    return parts[0] if len(parts) == 1 else Corpus.concat(parts)


def build_retriever(cfg: BenchConfig, corpus: Any):
    """The retrieval slot: ragfast's flat kernel, a faiss factory, a saved index, or a URL."""
    from ragfast.retrieval import DenseIndex, DenseRetriever, Encoder, build_default_retriever

    if _is_url(cfg.index):
        from ragfast.retrieval import RemoteRetriever

        return RemoteRetriever(cfg.index)
    if cfg.index == "flat":
        return build_default_retriever(corpus, encoder=cfg.encoder)
    enc = Encoder(cfg.encoder)
    if cfg.index.startswith("faiss:") and not Path(cfg.index[6:]).exists():
        base = build_default_retriever(corpus, encoder=enc)
        index = DenseIndex.build(np.asarray(base.index.vectors), backend="faiss", factory=cfg.index[6:])
        return DenseRetriever(enc, index, corpus)
    return DenseRetriever(enc, DenseIndex.load(cfg.index.removeprefix("faiss:")), corpus)


def _generator_factory(cfg: BenchConfig) -> tuple[Callable[[], Any], dict[str, Any]]:
    from ragfast.models.generator import HFGenerator, OpenAIGenerator, ScriptedGenerator

    if cfg.reasoner == "scripted":
        def make() -> Any:
            return ScriptedGenerator(seed=cfg.seed, max_searches=cfg.budget)
    elif cfg.reasoner == "tiny":
        from ragfast.models.tiny import tiny_path

        path = tiny_path("qwen2")
        shared = HFGenerator(path)

        def make() -> Any:
            return shared
    elif _is_url(cfg.reasoner):
        base, _, model = cfg.reasoner.partition("#")
        shared = OpenAIGenerator(base, model or "default")

        def make() -> Any:
            return shared
    else:
        shared = HFGenerator(cfg.reasoner)

        def make() -> Any:
            return shared
    g = make()
    from ragfast.results import slot_entry

    return make, slot_entry(g)


def build_slots(cfg: BenchConfig) -> Slots:
    """Load data and build every slot (encoder/index, reasoner, judge, NLI) once."""
    from ragfast.data import load_qa

    all_q = load_qa(cfg.data)
    questions = _select(all_q, cfg.offset, cfg.limit)
    corpus = build_corpus(cfg, all_q)
    retriever = build_retriever(cfg, corpus)
    make_gen, gen_info = _generator_factory(cfg)
    judge = build_judge(cfg) if ("s2g" in cfg.methods or "reloop" in cfg.methods) else None
    nli = build_nli(cfg) if "stepgap" in cfg.methods else None
    return Slots(questions, corpus, retriever, make_gen, gen_info, judge, nli)


def build_judge(cfg: BenchConfig):
    from ragfast.models.judge import CausalJudge, load_judge

    if cfg.judge == "none":
        return None
    if cfg.judge == "tiny":
        from ragfast.models.tiny import tiny_path

        return CausalJudge(tiny_path("qwen2"))
    # "encoder": the bundled doc-set judge; "head": the frozen-feature head; else a path.
    return load_judge(cfg.judge)


def build_nli(cfg: BenchConfig):
    from ragfast.models.nli import NLIScorer

    if cfg.nli == "tiny":
        from ragfast.models.tiny import tiny_path

        return NLIScorer(tiny_path("deberta-v2"))
    return NLIScorer(cfg.nli)


# -- recording -------------------------------------------------------------------------------
class MethodRecorder:
    """Writes a method's trajectories and ledger records as each question finishes."""

    def __init__(self, out_dir: Path, method: str, resume: bool):
        from ragfast.results import ResultsWriter, repair_tail

        self.method = method
        self.traj_path = out_dir / "trajectories" / f"{method}.jsonl"
        self.ledger_path = out_dir / "ledgers" / f"{method}.jsonl"
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        if self.ledger_path.exists() and not resume and self.ledger_path.stat().st_size:
            raise DataError(f"{self.ledger_path} already holds records; pass --resume or use a new --out")
        self.writer = ResultsWriter(self.traj_path, resume=resume)
        if resume and self.ledger_path.exists():
            # Drop records of questions that did not finish (they run again now), so a crash
            # between a question's ledger lines and its trajectory line never double counts.
            repair_tail(self.ledger_path)
            kept = load_ledger(self.ledger_path, self.writer.done)
            tmp = self.ledger_path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for r in kept.records:
                    f.write(json.dumps(dataclasses.asdict(r)) + "\n")
            os.replace(tmp, self.ledger_path)
        self.ledger = CostLedger()
        self._flushed = 0
        self._lf = open(self.ledger_path, "a", encoding="utf-8")

    @property
    def done(self) -> set[str]:
        return self.writer.done

    def finish(self, traj: Trajectory | Mapping[str, Any]) -> None:
        """Persist one finished question: its ledger records first, then its trajectory line.

        A crash between the two leaves ledger records of an unfinished question; they are
        dropped on resume, so totals never double count.
        """
        d = traj.to_dict() if isinstance(traj, Trajectory) else dict(traj)
        qid = d["id"]
        recs = [r for r in self.ledger.records if r.question_id == qid]
        for r in recs:
            self._lf.write(json.dumps(dataclasses.asdict(r)) + "\n")
        self._lf.flush()
        os.fsync(self._lf.fileno())
        self.writer.write(d)

    def close(self) -> None:
        # Records with no question (shared caches, set-up) are the method's overhead.
        for r in self.ledger.records:
            if r.question_id is None:
                self._lf.write(json.dumps(dataclasses.asdict(r)) + "\n")
        self._lf.close()
        self.writer.close()


def load_ledger(path: Path, finished: set[str]) -> CostLedger:
    """A method's ledger from disk, keeping records of finished questions (and shared ones)."""
    led = CostLedger()
    if not path.exists():
        return led
    names = {f.name for f in dataclasses.fields(CostRecord)}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
            if d.get("question_id") is None or d["question_id"] in finished:
                led.records.append(CostRecord(**{k: v for k, v in d.items() if k in names}))
    return led


# -- the methods -----------------------------------------------------------------------------
def _searchr1_config(cfg: BenchConfig):
    from ragfast.pipelines.searchr1 import SearchR1Config

    return SearchR1Config(max_turns=cfg.budget, topk=cfg.topk, batch_size=cfg.batch_size, seed=cfg.seed)


def run_searchr1(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
                 progress: Callable[[int], None]) -> None:
    """Native Search-R1: the reasoner searches until it answers or the budget is spent."""
    from ragfast.pipelines.searchr1 import SearchR1Loop

    loop = SearchR1Loop(slots.make_generator(), slots.retriever, _searchr1_config(cfg), ledger=rec.ledger)

    def done(t: Trajectory) -> None:
        rec.finish(t)
        progress(1)

    loop.run(list(questions), on_finish=done, skip_ids=rec.done)


def select_s2g_threshold(cfg: BenchConfig, slots: Slots, out: Path, console: Any = None) -> dict[str, Any]:
    """The frozen STOP threshold: given, or chosen on validation questions and written to disk.

    Selection follows the S2G study: run native Search-R1 on the validation questions, score
    every state with the judge, label a state right-to-stop when the answer-only probe from it
    is correct, and take the threshold that maximises STOP recall subject to STOP precision
    ``>= min_precision``, with the first-crossing rule per question. Validation questions never
    overlap the test questions when both come from the same file (checked).
    """
    path = out / "s2g_threshold.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    if cfg.threshold is not None:
        info = {"threshold": float(cfg.threshold), "source": "given (--threshold)"}
    else:
        from ragfast.data import load_qa
        from ragfast.pipelines.s2g import record_states
        from ragfast.pipelines.searchr1 import SearchR1Loop
        from ragfast.policy import select_threshold, stop_precision_recall
        from ragfast.stats import average_precision, brier, sigmoid

        val = _select(load_qa(cfg.val_data), cfg.val_offset, cfg.val_limit)
        overlap = {q.id for q in val} & {q.id for q in slots.questions}
        if overlap:
            raise ConfigError(f"{len(overlap)} validation questions are also test questions; move --val-offset/--offset apart")
        if console is not None:
            console.print(f"S2G: choosing the STOP threshold on {len(val)} validation questions of {cfg.val_data} "
                          f"(STOP precision >= {cfg.min_precision})")
        gen = slots.make_generator()
        trajs = SearchR1Loop(gen, slots.retriever, _searchr1_config(cfg)).run(val)
        rec = record_states(trajs, slots.judge, slots.make_generator())
        sc, lab, grp = rec.state_table()
        th = select_threshold(sc, lab, cfg.min_precision, groups=grp)
        prec, recall = (float("nan"), float("nan"))
        if np.isfinite(th):
            pr = stop_precision_recall(sc, lab, [th], groups=grp)
            prec, recall = float(np.asarray(pr[0])[0]), float(np.asarray(pr[1])[0])
        info = {"threshold": th, "source": f"{cfg.val_data}[{cfg.val_offset}:{cfg.val_offset + len(val)}]",
                "n_val_questions": len(val), "n_val_states": int(len(sc)), "min_precision": cfg.min_precision,
                "val_precision": prec, "val_recall": recall,
                "val_ap": float(average_precision(lab, sc)) if 0 < lab.sum() < len(lab) else float("nan"),
                "val_brier": float(brier(lab, sigmoid(sc))), "labels": "answer-only probe EM from the state"}
    path.write_text(json.dumps(info, indent=2), encoding="utf-8")
    return info


def run_s2g(cfg: BenchConfig, slots: Slots, rec: MethodRecorder, questions: Sequence[Question],
            progress: Callable[[int], None], threshold: float) -> None:
    """Search-R1 with the judge in the loop: stop at the first state scoring >= the threshold."""
    from ragfast.pipelines.s2g import run_s2g as _run

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
    from ragfast.pipelines.stepgap import StepGapConfig, run_stepgap as _run

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
    from ragfast.pipelines.reloop import ExtractiveHead, HeuristicSufficiency, ReloopConfig, run_text, text_workspace

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


# -- Ray: picklable slot factories, built inside the actors (never ship a loaded model) --------
def ray_generator(reasoner: str, seed: int, budget: int, device: str = "cpu") -> Any:
    """The reasoner slot of ``reasoner``, built in a Ray worker on ``device``."""
    from ragfast.models.generator import HFGenerator, OpenAIGenerator, ScriptedGenerator

    if reasoner == "scripted":
        return ScriptedGenerator(seed=seed, max_searches=budget)
    if reasoner == "tiny":
        from ragfast.models.tiny import tiny_path

        return HFGenerator(tiny_path("qwen2"), device=device)
    if _is_url(reasoner):
        base, _, model = reasoner.partition("#")
        return OpenAIGenerator(base, model or "default")
    return HFGenerator(reasoner, device=device)


def ray_retriever(cfg_dict: dict[str, Any]) -> Any:
    """The retrieval slot, built once in the shared retriever actor (embeddings come from the
    on-disk cache the driver already filled)."""
    from ragfast.data import load_qa

    cfg = BenchConfig(**cfg_dict)
    return build_retriever(cfg, build_corpus(cfg, load_qa(cfg.data)))


def ray_judge(spec: str, device: str = "cpu") -> Any:
    return build_judge(BenchConfig(judge=spec))


def ray_nli(spec: str, device: str = "cpu") -> Any:
    return build_nli(BenchConfig(nli=spec))


def run_method_on_ray(cfg: BenchConfig, method: str, slots: Slots, out: Path, resume: bool,
                      progress: Callable[[int], None], threshold: float | None = None) -> None:
    """One method on Ray: the driver writes trajectories (question order) and ledger records."""
    import functools

    from ragfast.distributed import GENERATOR, PipelineLoop, run_on_ray
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
        from ragfast.pipelines.s2g import run_s2g as _s2g

        make_loop = PipelineLoop(_s2g, slots={"judge": functools.partial(ray_judge, cfg.judge)}, threshold=threshold)
    elif method == "stepgap":
        from ragfast.pipelines.stepgap import StepGapConfig, run_stepgap as _sg

        scripted = cfg.reasoner == "scripted"
        config = StepGapConfig(searchr1=config, stages="DE" if scripted else "ABCDE")
        make_loop = PipelineLoop(_sg, slots={"nli": functools.partial(ray_nli, cfg.nli),
                                             **({} if scripted else {"checker": GENERATOR})})
    # one unit of work per worker at least, else workers sit idle
    bs = max(1, min(cfg.batch_size, -(-len(slots.questions) // cfg.ray_workers)))
    res = run_on_ray(slots.questions, make_generator=functools.partial(ray_generator, cfg.reasoner, cfg.seed, cfg.budget),
                     make_retriever=functools.partial(ray_retriever, dataclasses.asdict(cfg)), config=config,
                     out_path=traj, address=cfg.ray, num_workers=cfg.ray_workers, resume=resume,
                     make_loop=make_loop, batch_size=bs, on_result=lambda r: progress(1))
    with open(ledger_path, "a", encoding="utf-8") as f:
        for r in res.ledger.records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


RUNNERS: dict[str, Callable[..., None]] = {"searchr1": run_searchr1, "s2g": run_s2g, "stepgap": run_stepgap,
                                           "reloop": run_reloop}


def s2g_analysis(cfg: BenchConfig, slots: Slots, native: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, Any]:
    """Counterfactual threshold sweep and judge calibration on the native test trajectories.

    Every state of every native trajectory is scored by the judge and probed (answer-only
    generation from that state); replaying the first-crossing rule over 60 thresholds gives EM,
    searches and unsafe early stops per threshold without rerunning the reasoner.
    """
    from ragfast.pipelines.s2g import record_states
    from ragfast.policy import sweep
    from ragfast.stats import calibration_table, sigmoid, unsafe_stop_fraction

    rec = record_states(list(native), slots.judge, slots.make_generator())
    sc, lab, _ = rec.state_table()
    fin = sc[np.isfinite(sc)]
    if fin.size == 0:
        return {}
    ths = np.unique(np.quantile(fin, np.linspace(0, 1, 60)))
    if np.isfinite(threshold):
        ths = np.unique(np.r_[ths, threshold])
    idx = sweep(rec.scores, ths, rec.lengths)
    B = len(rec.ids)
    rows = np.arange(B)
    em, searches, unsafe = [], [], []
    for j in range(len(ths)):
        i = idx[:, j]
        stopped = i >= 0
        em.append(float(np.where(stopped, rec.probe_em[rows, np.where(stopped, i, 0)], rec.native_em).mean()))
        # stopping at state t means t searches were made
        searches.append(float(np.where(stopped, np.minimum(i, rec.native_searches), rec.native_searches).mean()))
        u = unsafe_stop_fraction(i, rec.probe_em, rec.native_searches.astype(np.int64))
        unsafe.append(float(u["unsafe_early_stops"]) / B)
    cal = calibration_table(lab, sigmoid(sc), n_bins=10)
    return {"sweep": {"thresholds": ths.tolist(), "em": em, "searches": searches, "unsafe": unsafe},
            "calibration": [r for r in cal["bins"]], "ece": cal["ece"], "n_states": int(len(sc)),
            "note": "unsafe = early stops whose answer-only probe is wrong, as a fraction of questions"}


# -- summary ---------------------------------------------------------------------------------
def _cost_row(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    out = {"calls": 0.0, "tokens": 0.0, "flops": 0.0, "seconds": 0.0}
    for r in rows:
        out["calls"] += r.get("calls", 0)
        out["tokens"] += r.get("tokens", r.get("input_tokens", 0) + r.get("cached_tokens", 0) + r.get("output_tokens", 0))
        out["flops"] += r.get("flops", 0)
        out["seconds"] += r.get("seconds", 0)
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ragfast.results import finished_ids, read_results, write_manifest

    console = console or Console(stderr=True)
    check_paths(cfg)
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise DataError(f"{out} already holds a bench run; pass --resume to continue it, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with console.status("loading data and building slots (first run embeds the corpus; later runs reuse the cache)"):
        slots = build_slots(cfg)
    slot_info = {
        "reasoner": slots.generator_info,
        "retriever": _retriever_slot(slots.retriever),
        "judge": _slot_dict(slots.judge) if slots.judge is not None else {"name": "none", "meaningful": False},
        "nli": _slot_dict(slots.nli) if slots.nli is not None else {"name": "none", "meaningful": False},
    }
    # How a run executes (Ray or not, where it writes) is not part of what it computes.
    run_cfg = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("ray", "ray_workers", "out")}
    write_manifest(out, pipeline="bench", slots=slot_info, config=run_cfg, seed=cfg.seed,
                   extra={"data": cfg.data, "n_questions": len(slots.questions), "corpus_size": len(slots.corpus)})
    for k, v in slot_info.items():
        console.print(f"slot [bold]{k}[/]: {v.get('name')}  (answers meaningful: {v.get('answers_meaningful', v.get('meaningful'))})")

    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as prog:
        for m in cfg.methods:
            if cfg.ray and m != "reloop":
                done = finished_ids(out / "trajectories" / f"{m}.jsonl") if resume else set()
                task = prog.add_task(m, total=len(slots.questions), completed=len(done & {q.id for q in slots.questions}))
                th = select_s2g_threshold(cfg, slots, out, console)["threshold"] if m == "s2g" else None
                run_method_on_ray(cfg, m, slots, out, resume, lambda n, t=task: prog.advance(t, n), th)
                continue
            rec = MethodRecorder(out, m, resume)
            todo = [q for q in slots.questions if q.id not in rec.done]
            task = prog.add_task(m, total=len(slots.questions), completed=len(slots.questions) - len(todo))
            try:
                if todo:
                    args = (cfg, slots, rec, todo, lambda n, t=task: prog.advance(t, n))
                    if m == "s2g":
                        RUNNERS[m](*args, threshold=select_s2g_threshold(cfg, slots, out, console)["threshold"])
                    else:
                        RUNNERS[m](*args)
            finally:
                rec.close()
    records = {m: read_results(out / "trajectories" / f"{m}.jsonl") for m in cfg.methods}
    analysis_path = out / "s2g_analysis.json"
    if "s2g" in records and "searchr1" in records and slots.judge is not None:
        old = json.loads(analysis_path.read_text(encoding="utf-8")) if analysis_path.exists() else {}
        if old.get("n_questions") != len(records["searchr1"]):
            with console.status("S2G analysis: scoring and probing every native state for the threshold sweep"):
                th = json.loads((out / "s2g_threshold.json").read_text(encoding="utf-8"))["threshold"]
                an = s2g_analysis(cfg, slots, records["searchr1"], th)
                an["n_questions"] = len(records["searchr1"])
            analysis_path.write_text(json.dumps(an, indent=2), encoding="utf-8")
    summary = summarise(cfg, records, slot_info, out)
    summary["run"] = {"data": cfg.data, "n_questions": len(slots.questions), "corpus_size": len(slots.corpus),
                      "budget": cfg.budget, "topk": cfg.topk, "wall_seconds": time.perf_counter() - t0}
    write_outputs(summary, out, records)
    from ragfast import report

    report.print_table(summary, Console())
    console.print(f"results in [bold]{out}[/]: summary.json, summary.csv, report.md, report.html, plots, trajectories/")
    return summary


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
    for m, d in compare_to_native(records, cfg).items():
        methods[m].update(d)
    summary: dict[str, Any] = {"methods": methods, "slots": dict(slot_info)}
    for path in (out / "s2g_threshold.json", out / "s2g_analysis.json"):
        if path.exists():
            summary[path.stem] = json.loads(path.read_text(encoding="utf-8"))
    if "s2g" in methods and "searchr1" in methods:
        summary["break_even"] = break_even(methods["searchr1"], methods["s2g"])
    return summary


def break_even(native: Mapping[str, Any], s2g: Mapping[str, Any]) -> dict[str, Any]:
    """Does the judge's compute pay for the reasoner and retrieval compute its early stops save?"""
    def comp(d: Mapping[str, Any], c: str, f: str) -> float:
        return float(d["cost"].get(c, {}).get(f, 0.0)) / max(1, d["n_questions"])

    saved = {f: sum(comp(native, c, f) - comp(s2g, c, f) for c in ("reasoner", "encoder", "search"))
             for f in ("flops", "seconds")}
    judge = {f: comp(s2g, "judge", f) for f in ("flops", "seconds")}
    pays = {f: judge[f] <= saved[f] for f in ("flops", "seconds")}
    text = (f"Per question, S2G's early stops saved {saved['flops'] / 1e9:.3f} GFLOPs and {saved['seconds'] * 1e3:.2f} ms "
            f"of reasoner + retrieval compute; the judge spent {judge['flops'] / 1e9:.3f} GFLOPs and "
            f"{judge['seconds'] * 1e3:.2f} ms. Break-even judge cost = the savings: the judge "
            f"{'pays' if pays['flops'] else 'does not pay'} for itself in FLOPs and "
            f"{'pays' if pays['seconds'] else 'does not pay'} in wall time.")
    return {"saved_per_question": saved, "judge_per_question": judge, "pays_for_itself": pays,
            "break_even_judge_flops": saved["flops"], "break_even_judge_seconds": saved["seconds"], "text": text}


def write_outputs(summary: dict[str, Any], out: Path, records: Mapping[str, Sequence[Mapping[str, Any]]]) -> None:
    """summary.json, summary.csv, the plots, report.md and report.html."""
    from ragfast import report

    plots = []
    plots.append(report.plot_pareto(summary, out / "pareto.png").name)
    plots.append(report.plot_cost_bars(summary, out / "cost_bars.png", "seconds").name)
    plots.append(report.plot_cost_bars(summary, out / "cost_bars_flops.png", "flops").name)
    an = summary.get("s2g_analysis")
    if an and an.get("sweep"):
        plots.append(report.plot_threshold_sweep(an["sweep"], out / "threshold_sweep.png",
                                                 summary.get("s2g_threshold", {}).get("threshold")).name)
    if an and an.get("calibration"):
        plots.append(report.plot_reliability(an["calibration"], out / "reliability.png").name)
    summary["plots"] = plots
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=_json_safe), encoding="utf-8")
    os.replace(tmp, out / "summary.json")
    report.write_csv(summary, out / "summary.csv")
    report.write_markdown(summary, out, plots)
    report.write_html(summary, out, plots)


def _json_safe(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)

"""The one runner: :func:`run_methods` runs registered methods on the same questions into one folder.

It owns everything a method does not: data selection, the run's fingerprint and ``--resume``,
building the slots once, the recorder of each method (trajectories and ledger written as each
question finishes), progress, and Ray. ``ragfast bench`` (every method) and ``ragfast run M``
(one) both call it, so they write the same layout::

    manifest.json                 slots, settings, fingerprint
    trajectories/<method>.jsonl   one line per finished question
    ledgers/<method>.jsonl        every cost record of that method
    s2g_threshold.json ...        what a method's prepare() / after_run() writes
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ragfast.http import is_url
from ragfast.methods.base import Method, Slots, get
from ragfast.methods.s2g.method import select_questions
from ragfast.progress import turn_reporting
from ragfast.runner import slots as build
from ragfast.runner.drive import MethodRecorder, check_resume, data_identity, fingerprint, load_ledger
from ragfast.runner.settings import RunSettings

log = logging.getLogger(__name__)

__all__ = ["RunOutcome", "run_methods", "build_slots", "run_fingerprint", "run_config", "slot_entries",
           "reasoner_kwargs", "in_question_order", "TRAJECTORIES", "LEDGERS"]

TRAJECTORIES = "trajectories"
LEDGERS = "ledgers"

#: How a run executes (Ray or not, where it writes, which backend) is not part of what it computes.
NOT_IN_CONFIG = ("ray", "ray_workers", "out", "encoder_backend", "nli_backend")


@dataclass
class RunOutcome:
    """What :func:`run_methods` leaves for the summary: every method's records in question order.

    Attributes
    ----------
    records : dict
        method -> its trajectory records (this run's and the resumed ones), in question order.
    slot_info : dict
        slot -> its manifest entry (with the device it ran on).
    slots : Slots
    fingerprint : dict
    """

    records: dict[str, list[Mapping[str, Any]]]
    slot_info: dict[str, Any]
    slots: Slots
    fingerprint: dict[str, Any]


def reasoner_kwargs(cfg: RunSettings) -> dict[str, Any]:
    """The reasoner factory's keyword arguments for the run's settings."""
    return dict(seed=cfg.seed, max_turns=cfg.budget, device=cfg.slot_device["reasoner"],
                served_model=cfg.served_model, tokenizer=cfg.reasoner_tokenizer, model_config=cfg.reasoner_config)


def _generator_factory(cfg: RunSettings) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The reasoner as a factory: a fresh scripted oracle per method (its state is per run), else one shared model."""
    from ragfast.results import slot_entry

    kw = reasoner_kwargs(cfg)
    if cfg.reasoner == "scripted":
        def make() -> Any:
            return build.reasoner(cfg.reasoner, **kw)
    else:
        shared = build.reasoner(cfg.reasoner, check=False, **kw)

        def make() -> Any:
            return shared
    return make, slot_entry(make())


def _needs(cfg: RunSettings, slot: str) -> bool:
    return any(slot in get(m).slots for m in cfg.methods)


def build_slots(cfg: RunSettings) -> Slots:
    """Load data and build every slot the run's methods ask for (encoder/index, reasoner, judge, NLI) once."""
    from ragfast.data import load_qa

    dev = cfg.slot_device
    all_q = load_qa(cfg.data)
    questions = select_questions(all_q, cfg.offset, cfg.limit)
    corpus = build.corpus(cfg.corpus, all_q)
    encoder = None if is_url(cfg.index) else build.encoder(cfg.encoder, backend=cfg.encoder_backend,
                                                           device=dev["encoder"])
    index = "default" if cfg.index == "flat" else cfg.index
    retriever = build.retriever(index, corpus, shared_encoder=encoder, device=dev["encoder"], check=False)
    make_gen, gen_info = _generator_factory(cfg)
    judge = (build.judge(cfg.judge, device=dev["judge"], shared_encoder=encoder, encoder_device=dev["encoder"],
                         check=False) if _needs(cfg, "judge") else None)
    nli = build.nli(cfg.nli, backend=cfg.nli_backend, device=dev["nli"]) if _needs(cfg, "nli") else None
    return Slots(questions, corpus, retriever, make_gen, gen_info, judge, nli)


def run_config(cfg: RunSettings) -> dict[str, Any]:
    """The settings that decide what a run computes (the manifest's ``config``)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_CONFIG}


def run_fingerprint(cfg: RunSettings, run_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What decides a run's results (:func:`ragfast.runner.drive.fingerprint`): data hashes, test question ids, slots, settings."""
    from ragfast.data import load_qa

    data = {"test": data_identity(cfg.data)}
    if cfg.threshold is None:  # the validation split decides the S2G threshold (whichever methods run now)
        data["val"] = data_identity(cfg.val_data)
    specs = {k: run_cfg[k] for k in ("reasoner", "judge", "nli", "encoder", "index", "corpus", "served_model")}
    # limit/offset are in the question ids; data files in their hashes; methods may be added on resume.
    config = {k: v for k, v in run_cfg.items()
              if k not in specs and k not in ("data", "val_data", "methods", "limit", "offset")}
    return fingerprint(method="bench", data=data, questions=select_questions(load_qa(cfg.data), cfg.offset, cfg.limit),
                       slots=specs, config=config)


def slot_entries(cfg: RunSettings, slots: Slots) -> dict[str, Any]:
    """slot -> its manifest entry, with the device it ran on (``remote`` for a URL slot)."""
    from ragfast.results import slot_entry

    def retriever_slot(r: Any) -> dict[str, Any]:
        d = slot_entry(r)
        enc, idx = d.get("encoder"), d.get("index")
        if isinstance(enc, Mapping) and isinstance(idx, Mapping):
            d["name"] = (f"{enc.get('name')} encoder ({enc.get('model')}) + {idx.get('backend')} index "
                         f"({idx.get('factory')}, {idx.get('storage')}) over {d.get('passages', idx.get('ntotal'))} "
                         "passages")
        return d

    info = {
        "reasoner": slots.generator_info,
        "retriever": retriever_slot(slots.retriever),
        "judge": slot_entry(slots.judge) if slots.judge is not None else {"name": "none", "meaningful": False},
        "nli": slot_entry(slots.nli) if slots.nli is not None else {"name": "none", "meaningful": False},
    }
    for slot, dev_slot in (("reasoner", "reasoner"), ("retriever", "encoder"), ("judge", "judge"), ("nli", "nli")):
        remote = info[slot].get("class") in ("OpenAIGenerator", "RemoteRetriever", "RemoteJudge")
        info[slot]["device"] = "remote" if remote else cfg.slot_device[dev_slot]
    return info


class _ProgressRecorder:
    """A :class:`MethodRecorder` whose ``finish`` also advances the method's progress bar."""

    def __init__(self, rec: MethodRecorder, advance: Callable[[int], None]):
        self._rec, self._advance = rec, advance
        self.ledger = rec.ledger

    @property
    def done(self) -> set[str]:
        return self._rec.done

    def finish(self, traj: Any) -> None:
        self._rec.finish(traj)
        self._advance(1)


def in_question_order(records: Sequence[Mapping[str, Any]], questions: Sequence[Any]) -> list[Mapping[str, Any]]:
    """``records`` in the order of ``questions``, not the order they finished in.

    A resumed run writes its questions in another order than a clean one, and the bootstrap
    intervals resample by position: sorting makes them the same for the same results.
    """
    pos = {q.id: i for i, q in enumerate(questions)}
    return sorted(records, key=lambda r: pos.get(r["id"], len(pos)))


def run_methods(cfg: RunSettings, methods: Sequence[str], out: Path, *, resume: bool = False,
                console: Any = None) -> RunOutcome:
    """Run ``methods`` (registered names) on the questions of ``cfg`` into ``out``.

    Parameters
    ----------
    cfg : RunSettings
    methods : sequence of str
        In the order they run; each one's files are ``trajectories/<m>.jsonl`` and ``ledgers/<m>.jsonl``.
    out : Path
        The results directory (it exists; the caller checked it may be written).
    resume : bool
        Read back what is on disk and run only the questions each method has not finished; a
        fingerprint other than the one on disk is refused before any model loads.
    console : rich.console.Console, optional

    Returns
    -------
    RunOutcome
        Every method's records in question order, the slots and their manifest entries.
    """
    from ragfast.progress import RunProgress
    from ragfast.results import finished_ids, read_results, slot_entry, write_manifest

    out = Path(out)
    run_cfg = run_config(cfg)
    fp = run_fingerprint(cfg, run_cfg)
    if resume:
        check_resume(out, fp)  # before any model loads
    with RunProgress(console) as prog:
        setup = prog.task("loading slots", None)
        slots = build_slots(cfg)
        setup.update(total=1, completed=1)
        setup.set_status(f"{len(slots.questions)} questions, {len(slots.corpus)} passages")
        slot_info = slot_entries(cfg, slots)
        write_manifest(out, pipeline="bench", slots=slot_info, config=run_cfg, seed=cfg.seed,
                       extra={"data": cfg.data, "n_questions": len(slots.questions), "corpus_size": len(slots.corpus),
                              "fingerprint": fp})
        for k, v in slot_info.items():
            label = v.get("answers_meaningful", v.get("meaningful"))
            if k == "judge" and label == "yes" and "s2g" in methods and cfg.threshold is None:
                label = "measured below (validation ranking vs counting documents)"
            prog.print(f"slot [bold]{k}[/]: {v.get('name')} on {v['device']}  (answers meaningful: {label})")
            log.debug("slot %s: %s", k, v)
        instances = {m: get(m)(cfg) for m in methods}
        for m, method in instances.items():
            pipeline = method.ray_pipeline() if cfg.ray else None
            if cfg.ray and pipeline is not None:
                done = finished_ids(out / TRAJECTORIES / f"{m}.jsonl") if resume else set()
                method.prepare(slots, out, prog)
                task = prog.task(m, len(slots.questions), completed=len(done & {q.id for q in slots.questions}),
                                 unit="questions")
                _run_on_ray(cfg, method, slots, out, resume, task.advance)
                task.done()
                continue
            # Prepared before the method's recorder opens, so a failed preparation leaves no empty files.
            method.prepare(slots, out, prog)
            rec = MethodRecorder(out / TRAJECTORIES / f"{m}.jsonl", out / LEDGERS / f"{m}.jsonl", resume)
            todo = [q for q in slots.questions if q.id not in rec.done]
            task = prog.task(m, len(slots.questions), completed=len(slots.questions) - len(todo), unit="questions")
            t_m = time.perf_counter()
            ok = False
            try:
                if todo:
                    gen_slots = dataclasses.replace(slots, make_generator=turn_reporting(slots.make_generator, task,
                                                                                         cfg.budget + 1))
                    method.run(todo, gen_slots, _ProgressRecorder(rec, task.advance))
                ok = True
            finally:
                rec.close()
                task.set_status("")
                task.done(failed=not ok)  # an error is never printed as "done"
            log.info("%s: %d questions in %.1f s", m, len(todo), time.perf_counter() - t_m)
        if cfg.reasoner != "scripted":
            # the shared reasoner's entry after its calls (a URL one counts its calls and token sources)
            slot_info["reasoner"].update(slot_entry(slots.make_generator()))
        records = {m: in_question_order(read_results(out / TRAJECTORIES / f"{m}.jsonl"), slots.questions)
                   for m in methods}
        for method in instances.values():
            method.after_run(slots, records, out, prog)
    return RunOutcome(records, slot_info, slots, fp)


def _run_on_ray(cfg: RunSettings, method: Method, slots: Slots, out: Path, resume: bool,
                progress: Callable[[int], None]) -> None:
    """One method on Ray: the driver writes trajectories (question order) and ledger records."""
    from ragfast.data import load_qa
    from ragfast.results import finished_ids, repair_tail
    from ragfast.runner.distributed import GENERATOR, PipelineLoop, run_on_ray

    m = method.name
    traj = out / TRAJECTORIES / f"{m}.jsonl"
    ledger_path = out / LEDGERS / f"{m}.jsonl"
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    if resume and ledger_path.exists():
        repair_tail(ledger_path)
        done = finished_ids(traj) if traj.exists() else set()
        kept = load_ledger(ledger_path, done)
        with open(ledger_path, "w", encoding="utf-8") as f:
            for r in kept.records:
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    pipe = method.ray_pipeline()
    make_loop = None
    if pipe.fn is not None:
        factories = {"judge": build.judge, "nli": build.nli}
        actor_slots = {k: GENERATOR if v == "reasoner" else
                       functools.partial(factories[v[0]], build.absolute(v[1]), **v[2])
                       for k, v in pipe.slots.items()}
        make_loop = PipelineLoop(pipe.fn, slots=actor_slots, **pipe.kwargs)
    # one unit of work per worker at least, else workers sit idle
    bs = max(1, min(cfg.batch_size, -(-len(slots.questions) // cfg.ray_workers)))
    kw = {k: v for k, v in reasoner_kwargs(cfg).items() if k != "device"}  # each actor picks its device
    make_gen = functools.partial(build.reasoner, build.absolute(cfg.reasoner), **kw)
    # The retriever actor builds from the on-disk embedding cache the driver already filled.
    make_ret = functools.partial(build.retriever_over, "default" if cfg.index == "flat" else build.absolute(cfg.index),
                                 load_qa(cfg.data), corpus_parts=[build.absolute(c) for c in cfg.corpus],
                                 encoder_spec=build.absolute(cfg.encoder), encoder_backend=cfg.encoder_backend,
                                 progress=False, check=False)
    res = run_on_ray(slots.questions, make_generator=make_gen, make_retriever=make_ret, config=pipe.config,
                     out_path=traj, address=cfg.ray, num_workers=cfg.ray_workers, resume=resume,
                     make_loop=make_loop, batch_size=bs, on_result=lambda r: progress(1))
    with open(ledger_path, "a", encoding="utf-8") as f:
        for r in res.ledger.records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")

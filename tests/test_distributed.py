"""Scale-out on Ray: a Ray run equals a single-process run, killed workers are retried without
losing or duplicating a result, and resume (the Ray-sharded index is tested in test_ray_index.py).

One local Ray cluster (2 CPUs) serves the whole module. Factories and the crash-injecting
generator live in this module, which Ray ships to its workers by value (tests/ is not a package
the workers could import).
"""
from __future__ import annotations

import functools
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from ragfast.errors import ConfigError, DataError  # noqa: E402
from ragfast.models.base import Generator  # noqa: E402
from ragfast.models.scripted import ScriptedGenerator  # noqa: E402
from ragfast.methods.searchr1.loop import SearchR1Config, SearchR1Loop  # noqa: E402
from ragfast.outputs.results import ResultsWriter, read_results, strip_timing  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_QUESTIONS = 12
BATCH = 3  # 4 batches over 2 workers: each worker runs several, so a crash hits work in flight


# -- factories (run inside the actors) ---------------------------------------------------------

def load_questions(n: int = N_QUESTIONS):
    from ragfast.data import load_qa, sample

    return load_qa(sample("hotpotqa-dev"))[:n]


def build_bm25(questions):
    from ragfast.data import corpus_from_contexts
    from ragfast.retrieval.bm25 import BM25Retriever

    return BM25Retriever.build(corpus_from_contexts(questions))


def scripted(device: str = "cpu"):
    assert device in ("cpu", "cuda")
    return ScriptedGenerator(seed=0, max_searches=4)


class CrashOnce(Generator):
    """The scripted oracle, except that actor lives die on purpose, once per event.

    ``events`` is a list of (marker file, mode). The first actor life to make its ``after``-th
    generate call claims the first unclaimed event (creating its marker) and dies there:
    ``"exit"`` exits the process (Ray restarts the actor and re-runs the batch), ``"kill"``
    kills the actor for good and ``"hang"`` never answers (both leave it to the driver to
    resubmit the batch to a fresh actor). A life claims at most one event.
    """

    name = "scripted evidence oracle (crashes on purpose)"
    meaningful = False

    def __init__(self, events, after: int):
        self.inner = ScriptedGenerator(seed=0, max_searches=4)
        self.events, self.after = list(events), after
        self.calls = 0

    def bind_questions(self, qs):
        self.inner.bind_questions(qs)

    def mark_final(self, ids):
        self.inner.mark_final(ids)

    def truncate_tokens(self, texts, n):
        return self.inner.truncate_tokens(texts, n)

    def start(self, ids, prompts):
        self.inner.start(ids, prompts)

    def append(self, ids, texts):
        self.inner.append(ids, texts)

    def end(self, ids):
        self.inner.end(ids)

    def _die(self, mode: str) -> None:
        if mode == "exit":
            os._exit(17)
        if mode == "kill":
            import ray as _ray

            _ray.kill(_ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(600)  # "hang"; after a kill, the kill lands first

    def generate(self, ids, *, stop, max_new_tokens, ledger=None):
        self.calls += 1
        if self.calls == self.after:
            for marker, mode in self.events:
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # claimed once, ever
                except FileExistsError:
                    continue
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                self._die(mode)
        return self.inner.generate(ids, stop=stop, max_new_tokens=max_new_tokens, ledger=ledger)


def crash_once(events, after: int):
    return CrashOnce(events, after)


def crashing_bm25(questions, marker: str, after: int):
    """BM25 whose first actor life exits on its ``after``-th search (once per marker file)."""
    from ragfast.retrieval.base import Retriever

    inner = build_bm25(questions)

    class Crashing(Retriever):
        name = inner.name
        calls = 0

        def describe(self):
            return inner.describe()

        def search(self, queries, k, **kw):
            Crashing.calls += 1
            if Crashing.calls == after:
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    os._exit(19)
                except FileExistsError:
                    pass
            return inner.search(queries, k, **kw)

    return Crashing()


# -- fixtures ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def questions():
    return load_questions()


@pytest.fixture(scope="module")
def config():
    return SearchR1Config(max_turns=4, topk=3, batch_size=BATCH)


@pytest.fixture(scope="module")
def single(questions, config, tmp_path_factory):
    """The reference: one process, SearchR1Loop, results written as questions finish."""
    out = tmp_path_factory.mktemp("single") / "results.jsonl"
    loop = SearchR1Loop(ScriptedGenerator(seed=0, max_searches=4), build_bm25(questions), config)
    with ResultsWriter(out) as w:
        loop.run(questions, on_finish=lambda t: w.write(t.to_dict()))
    recs = read_results(out)
    return {"records": {r["id"]: r for r in recs}, "ledger": loop.ledger}


def _run(questions, config, out, **kw):
    from ragfast.runner.distributed import run_on_ray

    kw.setdefault("make_generator", scripted)
    kw.setdefault("make_retriever", functools.partial(build_bm25, questions))
    kw.setdefault("worker_cpus", 0.5)
    return run_on_ray(questions, config=config, out_path=out, num_workers=2, retriever_cpus=0.5, **kw)


def _strip_ledger(led):
    return {c: {k: v for k, v in row.items() if k not in ("seconds", "device_seconds")}
            for c, row in led.totals().items()}


def _assert_same(result, out, single, questions, *, whole_ledger=True):
    recs = read_results(out)
    ids = [r["id"] for r in recs]
    assert ids == [q.id for q in questions]  # every question once, in question order
    assert {i: strip_timing(r) for i, r in zip(ids, recs)} == {i: strip_timing(r) for i, r in single["records"].items()}
    n = len(recs)
    ref = list(single["records"].values())
    # approx: the single-process file is in finish order, and float sums depend on the order.
    assert result.summary == pytest.approx({"questions": n, "em": sum(r["em"] for r in ref) / n,
                                            "f1": sum(r["f1"] for r in ref) / n,
                                            "searches_per_question": sum(r["searches"] for r in ref) / n},
                                           rel=1e-12)
    assert result.summary["questions"] == n
    if whole_ledger:
        # Costs of this run equal the single-process ones exactly (wall time aside): nothing
        # spent by an attempt that died is counted, nothing is counted twice.
        assert _strip_ledger(result.ledger) == _strip_ledger(single["ledger"])


# -- the runner ------------------------------------------------------------------------------

@pytest.mark.slow
def test_ray_run_equals_single_process(questions, config, single, tmp_path):
    # Runs first, before the module's cluster exists: address="local" starts its own cluster
    # and shuts it down afterwards.
    if ray.is_initialized():
        ray.shutdown()
    out = tmp_path / "results.jsonl"
    seen = []
    res = _run(questions, config, out, on_result=lambda r: seen.append(r["id"]), address="local", local_cpus=2)
    assert not ray.is_initialized()
    _assert_same(res, out, single, questions)
    assert sorted(seen) == sorted(q.id for q in questions)
    assert res.questions_done == N_QUESTIONS and res.batches == N_QUESTIONS // BATCH
    assert res.retried_batches == 0 and res.restarted_batches == 0
    assert len(res.workers) == 2 and len({w["pid"] for w in res.workers}) == 2
    assert all(w["device"] == "cpu" and w["meaningful"] is False for w in res.workers)
    assert res.retriever["name"] == "bm25"
    assert res.ledger.totals()["search"]["calls"] > 0


@pytest.mark.slow
def test_worker_and_retriever_exits_are_restarted_by_ray(cluster, questions, config, single, tmp_path):
    from ragfast.runner.distributed import PipelineLoop
    from ragfast.methods.searchr1.loop import run_searchr1

    marker, r_marker = tmp_path / "crashed", tmp_path / "retriever-crashed"
    out = tmp_path / "results.jsonl"
    # The loop comes through make_loop (a pipeline function), as S2G / StepGap runs do.
    res = _run(questions, config, out, make_generator=functools.partial(crash_once, [(str(marker), "exit")], 5),
               make_retriever=functools.partial(crashing_bm25, questions, str(r_marker), 4),
               make_loop=PipelineLoop(run_searchr1))
    assert marker.exists() and r_marker.exists()  # a worker and the shared retriever really died mid-run
    _assert_same(res, out, single, questions)
    assert res.restarted_batches >= 1  # finished by the actor Ray restarted
    assert res.retried_batches == 0


@pytest.mark.slow
def test_killed_and_hung_actors_batches_go_to_fresh_actors(cluster, questions, config, single, tmp_path):
    killed, hung = tmp_path / "killed", tmp_path / "hung"
    out = tmp_path / "results.jsonl"
    started = []
    # Every first life dies in its first batch (2nd generate call): one is killed for good,
    # the next hangs until the driver's batch timeout kills it.
    res = _run(questions, config, out, make_generator=functools.partial(crash_once, [(str(killed), "kill"),
                                                                                    (str(hung), "hang")], 2),
               batch_timeout_s=6.0, on_start=started.append)
    assert killed.exists() and hung.exists()
    _assert_same(res, out, single, questions)
    assert res.retried_batches == 2  # Ray could not restart either: the driver resubmitted both
    assert res.batches == N_QUESTIONS // BATCH
    assert len(started) == 1 and started[0]["retriever"]["name"] == "bm25" and started[0]["workers"] == 2


def test_resume_runs_only_the_rest(cluster, questions, config, single, tmp_path):
    out = tmp_path / "results.jsonl"
    first = questions[:6]
    # An interrupted earlier run: 6 questions done, then a torn last line.
    with ResultsWriter(out) as w:
        for q in reversed(first):
            w.write(single["records"][q.id])
    with open(out, "ab") as f:
        f.write(b'{"id": "torn", "em"')
    with pytest.raises(DataError, match="already holds results"):
        _run(questions, config, out)
    res = _run(questions, config, out, resume=True)
    assert res.questions_done == N_QUESTIONS - len(first)
    _assert_same(res, out, single, questions, whole_ledger=False)
    per_q = res.ledger.per_question()
    assert set(per_q) == {q.id for q in questions[6:]}  # only the questions run now were paid for
    again = _run(questions, config, out, resume=True)  # finished: no new work, no Ray needed
    assert again.questions_done == 0 and again.batches == 0 and not again.ledger.records
    _assert_same(again, out, single, questions, whole_ledger=False)


class ForceAnswer:
    """A hook: every trajectory answers right after its first search."""

    def __call__(self, ctx):
        ctx.force_answer(ctx.active, "forced")


def make_force_answer(device: str = "cpu"):
    return ForceAnswer()


def searchr1_with_hook(questions, generator, retriever, *, stopper, config, ledger):
    return SearchR1Loop(generator, retriever, config, ledger=ledger, hooks=[stopper]).run(questions)


def generator_is(questions, generator, retriever, *, me, config, ledger):
    assert me is generator
    return []


def test_pipeline_loop_builds_slots_once_and_runs_the_function(questions, config):
    from ragfast.runner.distributed import GENERATOR, PipelineLoop
    from ragfast.accounting.ledger import CostLedger

    ml = PipelineLoop(searchr1_with_hook, slots={"stopper": make_force_answer})
    ml = ray.cloudpickle.loads(ray.cloudpickle.dumps(ml))  # what a worker actor receives
    ret, led = build_bm25(questions), CostLedger()
    bound = ml(ScriptedGenerator(seed=0, max_searches=4), ret, config, led)
    trajs = bound.run(questions[:3])
    assert [t.id for t in trajs] == [q.id for q in questions[:3]]
    assert all(t.searches <= 1 for t in trajs) and any(t.stop_reason == "forced" for t in trajs)
    assert led.totals()["search"]["calls"] > 0
    stopper = bound.kwargs["stopper"]
    assert ml(ScriptedGenerator(), ret, config, led).kwargs["stopper"] is stopper  # built once per actor
    assert ray.cloudpickle.loads(ray.cloudpickle.dumps(ml))._built is None  # models never travel
    gen = ScriptedGenerator()
    PipelineLoop(generator_is, slots={"me": GENERATOR})(gen, ret, config, led).run(questions[:1])
    with pytest.raises(ConfigError, match="given twice"):
        PipelineLoop(searchr1_with_hook, slots={"stopper": make_force_answer}, stopper=1)
    with pytest.raises(ConfigError, match="factory or GENERATOR"):
        PipelineLoop(searchr1_with_hook, slots={"stopper": 3})


def test_bad_input_is_named(questions, config, tmp_path):
    from ragfast.runner.distributed import run_on_ray

    mk = functools.partial(build_bm25, questions)
    with pytest.raises(DataError, match="duplicate question id"):
        run_on_ray(questions[:2] + questions[:1], make_generator=scripted, make_retriever=mk, out_path=tmp_path / "a")
    with pytest.raises(ConfigError, match="num_workers"):
        run_on_ray(questions, make_generator=scripted, make_retriever=mk, out_path=tmp_path / "b", num_workers=0)
    import threading

    lock = threading.Lock()
    with pytest.raises(ConfigError, match="make_generator cannot be sent"):
        run_on_ray(questions, make_generator=lambda: lock, make_retriever=mk, out_path=tmp_path / "c")
    with pytest.raises(ConfigError, match="worker_gpus"):
        run_on_ray(questions, make_generator=scripted, make_retriever=mk, out_path=tmp_path / "d", worker_gpus="x")
    assert not (tmp_path / "b").exists() or (tmp_path / "b").stat().st_size == 0


def test_cluster_too_small_is_named(cluster, questions, config, tmp_path):
    with pytest.raises(ConfigError, match="cannot hold the retriever actor"):
        _run(questions, config, tmp_path / "r.jsonl", worker_cpus=4.0)


def test_gpus_per_worker_rule():
    from ragfast.runner.distributed import gpus_per_worker

    assert gpus_per_worker(0, 4) == 0.0
    assert gpus_per_worker(8, 4) == 1.0
    assert gpus_per_worker(2, 4) == 0.5  # four replicas share two GPUs
    assert gpus_per_worker(4, 4, retriever_gpus=1) == 0.75
    assert gpus_per_worker(1, 1, retriever_gpus=1) == 0.0

"""The runner: one factory (runner.slots), shared flags, defaults and --config (RunSettings), the driver pieces."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragfast.errors import ConfigError
from ragfast.runner import slots as build
from ragfast.runner.recording import check_resume, fingerprint


def test_specs_mean_the_same_everywhere(tmp_path):
    from ragfast.models.scripted import ScriptedGenerator

    g = build.reasoner("scripted", max_turns=2)
    assert isinstance(g, ScriptedGenerator)
    assert isinstance(build.reasoner({"spec": "scripted", "max_turns": 3}), ScriptedGenerator)
    with pytest.raises(ConfigError, match="not 'scripted', 'tiny'"):
        build.reasoner(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="'spec' key"):
        build.reasoner({"model": "scripted"})
    with pytest.raises(ConfigError, match="checker LLM 'x'"):
        build.checker("x")
    assert build.checker("reasoner", g) is None  # the oracle cannot answer the checker's JSON prompts
    assert build.checker("none") is None and build.nli("none") is None and build.judge("none") is None
    with pytest.raises(ConfigError, match="nli 'nowhere'"):
        build.nli("nowhere")
    with pytest.raises(ConfigError, match="retriever 'nowhere'"):
        build.retriever("nowhere", corpus=[{"id": "1", "contents": "a"}])
    with pytest.raises(ConfigError, match="cannot reach the retriever server"):
        build.retriever("http://127.0.0.1:9")
    assert build.judge("heuristic").__class__.__name__ == "HeuristicSufficiency"
    assert build.head(None).__class__.__name__ == "ExtractiveHead"


def test_default_corpus_is_the_benchs():
    from ragfast.comparison.pipeline import BenchConfig

    assert list(build.DEFAULT_CORPUS) == BenchConfig().corpus == build.DEFAULTS["corpus"]
    assert BenchConfig().batch_size == build.DEFAULTS["batch_size"]


def test_fingerprint_names_the_first_difference(tmp_path):
    class Q:
        def __init__(self, i):
            self.id = i

    def fp(**over):
        kw = dict(method="searchr1", data={"test": {"source": "a", "sha256": "1"}}, questions=[Q("a"), Q("b")],
                  slots={"retriever": "bm25"}, config={"topk": 3})
        kw.update(over)
        return fingerprint(**kw)

    (tmp_path / "manifest.json").write_text(json.dumps({"fingerprint": fp()}))
    check_resume(tmp_path, fp())  # the same run resumes
    for over, named in (({"slots": {"retriever": "default"}}, "slots.retriever"),
                        ({"questions": [Q("a"), Q("c")]}, "questions: the run on disk asked 2"),
                        ({"config": {"topk": 5}}, "config.topk")):
        with pytest.raises(ConfigError, match=r"--resume: " + named.replace(".", r"\.")):
            check_resume(tmp_path, fp(**over))
    check_resume(tmp_path, fp(questions=[Q("a"), Q("b"), Q("c")]))  # a larger --limit extends the run
    check_resume(tmp_path / "fresh", fp(slots={"retriever": "x"}))  # nothing on disk: nothing to compare


def test_config_yaml_is_shared_and_flags_win(tmp_path):
    from ragfast.comparison.pipeline import make_config
    from ragfast.commands.s2g import study_settings

    y = tmp_path / "c.yaml"
    # bench names (reasoner, budget) and run-command names (max-new-tokens) in one file
    y.write_text("offset: 5\nbatch-size: 8\ncorpus: contexts\nreasoner: tiny\nbudget: 2\nmax-new-tokens: 9\n"
                 "judge: head\n")
    # study s2g reads it as run s2g does: a flag typed (batch size 4) wins over the file
    s = study_settings(str(y), out=str(tmp_path / "o"), batch_size=4, offset=None)
    assert (s.offset, s.batch_size, s.corpus, s.device, s.reasoner, s.budget, s.max_new_tokens, s.topk, s.judge) == (
        5, 4, ["contexts"], "auto", "tiny", 2, 9, 3, "head")
    cfg = make_config(yaml_path=str(y))  # the bench reads the same file
    assert (cfg.offset, cfg.batch_size, cfg.reasoner, cfg.budget, cfg.judge) == (5, 8, "tiny", 2, "head")
    assert cfg.corpus == ["contexts"]
    y.write_text("nonsense: 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        study_settings(str(y), out=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="--offset must be"):
        study_settings(None, out=str(tmp_path / "o"), offset=-1)
    with pytest.raises(ConfigError, match="--out is required"):
        study_settings(None)


@pytest.mark.parametrize("command", [["run", "searchr1"], ["run", "s2g"], ["run", "stepgap"], ["run", "reloop"],
                                     ["bench"], ["study", "s2g"]])
def test_every_running_command_takes_the_shared_flags(command):
    from typer.testing import CliRunner

    from ragfast.cli import app

    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    for flag in ("--config", "--offset", "--limit", "--val-data", "--val-offset", "--device", "--data", "--out",
                 "--batch-size"):
        assert flag in res.output, (command, flag)


def _running_commands():
    """(name, click command) of every command that runs methods: bench, run M for each method, study s2g."""
    import typer

    from ragfast.cli import app
    from ragfast.methods.base import names

    group = typer.main.get_command(app)
    return [("bench", group.commands["bench"]), *((f"run {m}", group.commands["run"].commands[m]) for m in names()),
            ("study s2g", group.commands["study"].commands["s2g"])]


def test_no_two_running_commands_give_one_setting_different_defaults(tmp_path, monkeypatch):
    """One definition of every default: RunSettings'. Read from each command's click parameters (a setting's flag
    has no default of its own and RunSettings' spellings), then from what each command, run with no setting
    typed, hands its runner."""
    import dataclasses

    from typer.testing import CliRunner

    import ragfast.comparison.pipeline
    import ragfast.commands.s2g
    from ragfast.cli import app
    from ragfast.infra.devices import resolve_device
    from ragfast.runner.settings import RunSettings, flag_names

    default = RunSettings()
    fields = [f.name for f in dataclasses.fields(RunSettings) if f.init and f.name not in ("methods", "devices")]
    commands = _running_commands()
    assert len(commands) >= 6
    for name, cmd in commands:
        params = {p.name: p for p in cmd.params}
        for f in fields:
            if f not in params:
                continue
            p = params[f]
            assert p.default is None, (name, f, p.default)  # RunSettings' default (or --config) decides
            assert set(flag_names(f)) <= set(p.opts) | set(p.secondary_opts), (name, f, p.opts)
        for f in ("offset", "limit", "val_offset", "val_limit", "reasoner", "data", "batch_size", "budget", "topk"):
            assert f in params, (name, f)  # the settings every running command shares
    monkeypatch.chdir(tmp_path)  # the bench's default --out is relative
    got: dict[str, dict] = {}

    def bench(cfg, **kw):
        got[cmd_name] = {f: getattr(cfg, f) for f in fields}
        return {}

    study_names = {"model": "reasoner", "retriever": "index", "max_turns": "budget"}

    def study(**kw):
        got[cmd_name] = {study_names.get(k, k): v for k, v in kw.items()}

    monkeypatch.setattr(ragfast.comparison.pipeline, "run_bench", bench)
    monkeypatch.setattr(ragfast.commands.s2g, "run_s2g_command", study)
    for cmd_name, _ in commands:
        extra = ["--out", str(tmp_path / "study")] if cmd_name == "study s2g" else []
        res = CliRunner().invoke(app, [*cmd_name.split(), *extra])
        assert res.exit_code == 0, (cmd_name, res.output, res.exception)
    want = {f: getattr(default, f) for f in fields}
    want_study = {**want, "device": resolve_device(default.device), "out": str(tmp_path / "study")}
    for cmd_name, values in got.items():
        expected = want_study if cmd_name == "study s2g" else want
        differ = {f: (v, expected[f]) for f, v in values.items() if f in expected and v != expected[f]}
        assert not differ, (cmd_name, differ)
    assert got["study s2g"]["offset"] == 100 and got["study s2g"]["val_offset"] == 0  # the study's layout


def test_both_servers_share_their_connection_defaults():
    import typer

    from ragfast import serving
    from ragfast.cli import app

    group = typer.main.get_command(app)
    want = {"graceful_s": serving.DEFAULT_GRACEFUL_S, "head_timeout_s": serving.DEFAULT_HEAD_TIMEOUT_S,
            "keep_alive_s": serving.DEFAULT_KEEP_ALIVE_S, "max_connections": serving.DEFAULT_MAX_CONNECTIONS,
            "api_key": None}
    for name in ("serve-retriever", "serve-judge"):
        params = {p.name: p.default for p in group.commands[name].params}
        assert {k: params[k] for k in want} == want, name
    import inspect

    from ragfast.retrieval.server import serve

    sig = inspect.signature(serve).parameters
    assert {k: sig[k].default for k in want} == want


@pytest.mark.slow  # two end-to-end commands (33 s of the quick suite)
def test_run_searchr1_reuses_the_corpus_embeddings_bench_made(tmp_path):
    """The second of ``ragfast bench`` and ``ragfast run searchr1`` embeds nothing: same corpus, same cache key."""
    from ragfast.data import sample

    data = tmp_path / "dev6.jsonl"
    data.write_text("\n".join(sample("hotpotqa-dev").read_text(encoding="utf-8").splitlines()[:6]) + "\n")
    # Shipped vectors cover the bundled passages; renamed titles make passages they do not cover,
    # so the first command really embeds and the second must find its cache.
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    for r in rows:
        ctx = r.get("context")
        if isinstance(ctx, dict):
            ctx["title"] = [t + " (copy)" for t in ctx["title"]]
        elif isinstance(ctx, list):
            for c in ctx:
                c[0] = c[0] + " (copy)"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAGFAST_CACHE": str(tmp_path / "cache")}
    emb = tmp_path / "cache" / "emb"

    def entries():
        return sorted(p.name for p in emb.iterdir()) if emb.exists() else []

    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "bench", "--reasoner", "scripted", "--data", str(data),
                        "--val-data", str(data),
                        "--method", "searchr1", "--offset", "0", "--limit", "2", "--out", str(tmp_path / "b")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    made = entries()
    assert made, "bench embedded nothing: the test no longer exercises the cache"
    stamp = {p.name: p.stat().st_mtime_ns for p in emb.rglob("*")}
    r = subprocess.run([sys.executable, "-m", "ragfast.cli", "run", "searchr1", "--model", "scripted", "--data",
                        str(data), "--offset", "0", "--limit", "2", "--no-progress", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert entries() == made
    assert {p.name: p.stat().st_mtime_ns for p in emb.rglob("*")} == stamp  # read, never rewritten


def test_a_new_retriever_backend_is_one_table_entry(monkeypatch, tmp_path):
    """CONTRIBUTING.md's claim: a backend is its module plus one entry in ``slots.RETRIEVERS``;
    then the spec works in the one factory, in ``check_paths`` and in a whole run."""
    from ragfast.data import Corpus
    from ragfast.retrieval.base import Hit, Retriever
    from ragfast.runner.run_methods import run_methods
    from ragfast.runner.settings import check_paths, make_config

    calls = []

    class WordOverlap(Retriever):  # the "new module": shared lowercase words, ties by corpus order
        name = "word-overlap"

        def __init__(self, corpus):
            self.rows = [corpus.passage(i).to_row() for i in range(len(corpus))]
            self.words = [set(r["contents"].lower().split()) for r in self.rows]

        def search(self, queries, k, *, exclude=None, ledger=None, question_ids=None):
            calls.extend(queries)
            out = []
            for j, q in enumerate(queries):
                skip = set(exclude[j]) if exclude else set()
                qw = set(q.lower().split())
                scored = sorted(((-len(qw & w), i) for i, w in enumerate(self.words) if self.rows[i]["id"] not in skip))
                out.append([Hit(self.rows[i]["id"], float(-s), self.rows[i]) for s, i in scored[:k]])
            return out

    monkeypatch.setitem(build.RETRIEVERS, "overlap",
                        lambda corpus, *, make_encoder, device, progress: WordOverlap(corpus))
    corpus = Corpus.from_rows([{"id": "a", "contents": '"A"\nthe red fox'}, {"id": "b", "contents": '"B"\nred wine'},
                               {"id": "c", "contents": '"C"\nblue sky'}])
    r = build.retriever("overlap", corpus)
    assert isinstance(r, WordOverlap)
    assert [h.id for h in r.search(["red fox"], 2)[0]] == ["a", "b"]  # hand-computed: 2 and 1 shared words
    with pytest.raises(ConfigError, match="'overlap'"):  # the error lists the table's names
        build.retriever("nowhere", corpus)
    check_paths(make_config(index="overlap"))  # a name of the table is not a missing file
    with pytest.raises(ConfigError, match="index: nowhere"):
        check_paths(make_config(index="nowhere"))
    calls.clear()
    cfg = make_config(index="overlap", methods=["searchr1"], reasoner="scripted", offset=0, limit=2,
                      out=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    recs = run_methods(cfg, ["searchr1"], tmp_path / "run").records["searchr1"]
    searched = [t["content"] for r in recs for t in r["turns"] if t["action"] == "search"]
    assert len(recs) == 2 and searched and sorted(searched) == sorted(calls)  # every search went to the new backend

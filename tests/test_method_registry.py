"""Issue 25: one Method protocol, one runner, one settings object.

``ragfast run s2g`` and ``ragfast bench --method s2g`` must write the same trajectories,
threshold file, costs and summary; ``run s2g --resume`` must finish what a crash left; a fifth
method is one class plus its registration. The two small runs (4 test questions, 6 validation
questions, BM25) cost about 20 s of CPU each on this round's Intel Xeon.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ragfast.errors import ConfigError

# Wall-clock fields differ between any two runs; everything else must be equal.
TIMING = {"seconds", "device_seconds", "seconds_per_q", "delta_seconds", "wall_seconds", "started", "load_avg_1m",
          "judge_seconds", "nli_seconds", "checker_to_reasoner_seconds", "seconds_per_question"}
SMALL = ["--reasoner", "scripted", "--limit", "4", "--val-limit", "6", "--index", "bm25"]


def untimed(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: untimed(v) for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [untimed(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return "nan"
    return obj


def lines(path: Path) -> list[Any]:
    return [untimed(json.loads(x)) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def summary(out: Path) -> dict[str, Any]:
    s = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    s.pop("run")  # wall time, machine and start time describe the run, not its results
    return untimed(s)


def invoke(*args: str) -> None:
    from ragfast.cli import app

    res = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output[-3000:]


@pytest.fixture(scope="module")
def s2g_both(tmp_path_factory):
    d = tmp_path_factory.mktemp("s2g_both")
    invoke("run", "s2g", *SMALL, "--out", str(d / "run"))
    invoke("bench", "--method", "s2g", *SMALL, "--out", str(d / "bench"))
    return d / "run", d / "bench"


def test_run_s2g_and_bench_method_s2g_write_the_same_results(s2g_both):
    run, bench = s2g_both
    files = ("s2g_threshold.json", "s2g_states.jsonl", "trajectories/s2g.jsonl", "ledgers/s2g.jsonl")
    for name in files:
        assert (run / name).exists() and (bench / name).exists(), name
    thr = json.loads((run / "s2g_threshold.json").read_text())
    assert thr == json.loads((bench / "s2g_threshold.json").read_text())
    assert thr["val_questions"] == 6 and thr["source"] == "hotpotqa-dev[0:6]"
    traj = lines(run / "trajectories" / "s2g.jsonl")
    assert [t["id"] for t in traj] == [t["id"] for t in lines(bench / "trajectories" / "s2g.jsonl")]
    assert traj == lines(bench / "trajectories" / "s2g.jsonl")
    assert len(traj) == 4 and any("judge" in t["cost"] for t in traj)  # the judge ran in the loop
    assert lines(run / "s2g_states.jsonl") == lines(bench / "s2g_states.jsonl")
    assert lines(run / "ledgers" / "s2g.jsonl") == lines(bench / "ledgers" / "s2g.jsonl")
    assert summary(run) == summary(bench)
    assert set(summary(run)["methods"]) == {"s2g"} and summary(run)["methods"]["s2g"]["n_questions"] == 4
    # the manifests differ in nothing that decides the results (the methods list is the same too)
    mr, mb = (json.loads((p / "manifest.json").read_text()) for p in (run, bench))
    assert mr["fingerprint"] == mb["fingerprint"] and mr["config"] == mb["config"]


def test_run_s2g_resume_finishes_what_a_crash_left(s2g_both, tmp_path):
    import shutil

    run, _ = s2g_both
    out = tmp_path / "crashed"
    shutil.copytree(run, out)
    # a crash after two questions: the last two trajectory lines are gone, and the report with them
    traj = (out / "trajectories" / "s2g.jsonl").read_text().splitlines(keepends=True)
    (out / "trajectories" / "s2g.jsonl").write_text("".join(traj[:2]) + traj[2][:17])  # and a torn line
    for name in ("summary.json", "summary.csv", "report.md", "report.html"):
        (out / name).unlink()
    res = CliRunner().invoke(__import__("ragfast.cli").cli.app, ["run", "s2g", *SMALL, "--out", str(out)])
    assert res.exit_code != 0 and "--resume" in str(res.exception) + res.output  # no silent overwrite
    invoke("run", "s2g", *SMALL, "--out", str(out), "--resume")
    assert lines(out / "trajectories" / "s2g.jsonl") == lines(run / "trajectories" / "s2g.jsonl")
    assert lines(out / "ledgers" / "s2g.jsonl") == lines(run / "ledgers" / "s2g.jsonl")
    assert summary(out) == summary(run)
    # other settings on resume are refused before any model loads
    res = CliRunner().invoke(__import__("ragfast.cli").cli.app,
                             ["run", "s2g", *SMALL, "--topk", "2", "--out", str(out), "--resume"])
    assert res.exit_code != 0 and "topk" in str(res.exception) + res.output


def same_run(run: Path, bench: Path, method: str) -> None:
    """``run`` (``ragfast run METHOD``) and ``bench`` (``ragfast bench --method METHOD``) hold the same results."""
    for name in (f"trajectories/{method}.jsonl", f"ledgers/{method}.jsonl"):
        assert (run / name).exists() and (bench / name).exists(), name
    traj = lines(run / "trajectories" / f"{method}.jsonl")
    assert traj and traj == lines(bench / "trajectories" / f"{method}.jsonl")
    assert lines(run / "ledgers" / f"{method}.jsonl") == lines(bench / "ledgers" / f"{method}.jsonl")
    assert summary(run) == summary(bench) and set(summary(run)["methods"]) == {method}
    mr, mb = (json.loads((p / "manifest.json").read_text()) for p in (run, bench))
    assert mr["fingerprint"] == mb["fingerprint"] and mr["config"] == mb["config"]


#: Settings the hand-written ``run searchr1`` took and the bench dropped: both must pass them on.
LOOP = ["--max-new-tokens", "300", "--max-obs-tokens", "200", "--prompt-budget", "2048", "--refill"]


def test_run_searchr1_and_bench_method_searchr1_write_the_same_results(tmp_path):
    # the old spellings (--model, --retriever, --max-turns) and the new ones name the same settings
    invoke("run", "searchr1", "--model", "scripted", "--retriever", "bm25", "--max-turns", "3", "--limit", "4",
           *LOOP, "--no-progress", "--out", str(tmp_path / "run"))
    invoke("bench", "--method", "searchr1", "--reasoner", "scripted", "--index", "bm25", "--budget", "3",
           "--limit", "4", *LOOP, "--out", str(tmp_path / "bench"))
    same_run(tmp_path / "run", tmp_path / "bench", "searchr1")
    cfg = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]
    assert (cfg["max_new_tokens"], cfg["max_obs_tokens"], cfg["prompt_budget"], cfg["refill"], cfg["budget"],
            cfg["offset"]) == (300, 200, 2048, True, 3, 100)  # the bench's offset: 0-99 are S2G's validation
    traj = lines(tmp_path / "run" / "trajectories" / "searchr1.jsonl")
    assert len(traj) == 4 and all(t["searches"] <= 3 for t in traj)


def test_run_stepgap_and_bench_method_stepgap_write_the_same_results(tmp_path):
    # the hand-written run stepgap's flags (--model, --retriever, --max-turns, --entail, --contra,
    # --max-repairs, --checker-llm) are the settings' own names or their aliases
    invoke("run", "stepgap", "--model", "scripted", "--retriever", "bm25", "--max-turns", "3", "--limit", "4",
           "--entail", "0.4", "--contra", "0.6", "--max-repairs", "1", "--checker-llm", "none", "--no-progress",
           "--out", str(tmp_path / "run"))
    invoke("bench", "--method", "stepgap", "--reasoner", "scripted", "--index", "bm25", "--budget", "3", "--limit", "4",
           "--entail", "0.4", "--contra", "0.6", "--max-repairs", "1", "--checker-llm", "none",
           "--out", str(tmp_path / "bench"))
    same_run(tmp_path / "run", tmp_path / "bench", "stepgap")
    cfg = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]
    assert (cfg["entail"], cfg["contra"], cfg["max_repairs"], cfg["budget"], cfg["offset"]) == (0.4, 0.6, 1, 3, 100)
    traj = lines(tmp_path / "run" / "trajectories" / "stepgap.jsonl")
    # the report section is what run stepgap printed: labels, repairs, the checker's cost per question
    rep = summary(tmp_path / "run")["methods"]["stepgap"]["report"]
    n_labels = sum(len(t["extra"]["stepgap"]["labels"]) for t in traj)
    assert rep["stages"] == "DE" and rep["steps"] == n_labels > 0  # no LLM: only the NLI stages
    assert math.isclose(sum(rep["label_mix"].values()), 1.0)
    assert all(len(t["extra"]["stepgap"]["repairs"]) <= 1 for t in traj)
    nli_calls = sum(t["cost"].get("nli", {}).get("calls", 0) for t in traj) / len(traj)
    assert rep["checker_cost_per_question"]["nli_pairs"] == pytest.approx(nli_calls) and nli_calls > 0
    rewards = lines(tmp_path / "run" / "stepgap_rewards.jsonl")
    assert rewards == lines(tmp_path / "bench" / "stepgap_rewards.jsonl")
    assert len(rewards) == sum(len(t["extra"]["stepgap"]["rewards"]) for t in traj) > 0


def test_run_reloop_and_bench_method_reloop_write_the_same_results(tmp_path):
    # the hand-written run reloop's flags are aliases: --max-steps (budget), --k (topk),
    # --generator (head), --max-tokens (evidence_tokens)
    invoke("run", "reloop", "--reasoner", "scripted", "--max-steps", "3", "--k", "2", "--generator", "extractive", "--max-tokens", "300",
           "--window", "6", "--no-verify", "--encoder", "hashing", "--judge", "heuristic", "--limit", "4",
           "--no-progress", "--out", str(tmp_path / "run"))
    invoke("bench", "--method", "reloop", "--reasoner", "scripted", "--budget", "3", "--topk", "2", "--head", "extractive", "--evidence-tokens",
           "300", "--window", "6", "--no-verify", "--encoder", "hashing", "--judge", "heuristic", "--limit", "4",
           "--out", str(tmp_path / "bench"))
    same_run(tmp_path / "run", tmp_path / "bench", "reloop")
    cfg = json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]
    assert (cfg["budget"], cfg["topk"], cfg["evidence_tokens"], cfg["window"], cfg["verify"], cfg["offset"]) == (
        3, 2, 300, 6, False, 100)
    traj = lines(tmp_path / "run" / "trajectories" / "reloop.jsonl")
    assert len(traj) == 4 and all(t["steps"] <= 3 and t["evidence_tokens"] <= 300 and not t["refined"] for t in traj)
    rep = summary(tmp_path / "run")["methods"]["reloop"]["report"]
    assert rep["kind"] == "text" and rep["planner"] == "heuristic"
    assert rep["steps_per_question"] == pytest.approx(sum(t["steps"] for t in traj) / 4)


# -- a fifth method: one class and its registration ------------------------------------------------
from ragfast.methods.base import Method, register  # noqa: E402
from ragfast.methods.searchr1.loop import SearchR1Loop  # noqa: E402
from ragfast.methods.searchr1.method import searchr1_config  # noqa: E402


@register
class OneSearch(Method):
    """Search-R1 with one search turn, then an answer (a fifth method, defined in a test)."""

    name = "onesearch"
    slots = ("reasoner", "retriever")

    def config(self):
        return dataclasses.replace(searchr1_config(self.settings), max_turns=1)

    def run(self, questions, slots, recorder):
        loop = SearchR1Loop(slots.make_generator(), slots.retriever, self.config(), ledger=recorder.ledger)
        return loop.run(list(questions), on_finish=recorder.finish, skip_ids=recorder.done)


def test_a_fifth_method_is_one_class_and_its_registration(tmp_path):
    from ragfast.commands.methods import add_run_command
    from ragfast.commands.run import run_app
    from ragfast.methods.base import get, names

    assert get("onesearch") is OneSearch and names()[:4] == ("searchr1", "s2g", "stepgap", "reloop")
    add_run_command(run_app, "onesearch")  # what the CLI does for every method registered before it starts
    args = ["--reasoner", "scripted", "--limit", "3", "--index", "bm25", "--method", "searchr1"]
    invoke("bench", *args, "--method", "onesearch", "--out", str(tmp_path / "bench"))
    invoke("run", "onesearch", "--reasoner", "scripted", "--limit", "3", "--index", "bm25", "--out", str(tmp_path / "run"))
    one = lines(tmp_path / "run" / "trajectories" / "onesearch.jsonl")
    assert one == lines(tmp_path / "bench" / "trajectories" / "onesearch.jsonl")
    assert summary(tmp_path / "run")["methods"]["onesearch"] == {
        k: v for k, v in summary(tmp_path / "bench")["methods"]["onesearch"].items()
        if k not in ("n_paired", "n_failed_either", "delta_em", "delta_searches", "delta_flops")}
    native = lines(tmp_path / "bench" / "trajectories" / "searchr1.jsonl")
    assert len(one) == 3 and all(t["searches"] <= 1 for t in one)
    assert any(n["searches"] > 1 for n in native)  # the budget of one search is what differs
    assert summary(tmp_path / "bench")["methods"]["onesearch"]["n_paired"] == 3  # paired against native


def test_registry_refuses_what_it_cannot_run():
    from ragfast.methods.base import get

    with pytest.raises(ConfigError, match="unknown method 'magic'"):
        get("magic")

    class NoName(Method):
        pass

    with pytest.raises(ConfigError, match="must be a word"):
        register(NoName)

    class BadSlot(Method):
        name = "badslot"
        slots = ("reasoner", "oracle")

    with pytest.raises(ConfigError, match="unknown slot"):
        register(BadSlot)

    class Again(Method):
        name = "s2g"

    with pytest.raises(ConfigError, match="registered twice"):
        register(Again)


def test_every_setting_has_one_flag_and_help_and_the_old_spellings_work():
    from ragfast.cli import app
    from ragfast.runner.settings import HELP, RunSettings, flag_names

    fields = [f.name for f in dataclasses.fields(RunSettings) if f.init]
    assert set(HELP) == set(fields)
    assert flag_names("reasoner") == ("--reasoner", "--model")
    assert flag_names("budget") == ("--budget", "--max-turns", "--max-steps")  # RELOOP's step budget too
    assert flag_names("index") == ("--index", "--retriever")
    res = CliRunner().invoke(app, ["run", "s2g", "--help"], env={"COLUMNS": "240", "NO_COLOR": "1"})
    assert res.exit_code == 0
    for f in fields:
        if f not in ("methods", "devices"):
            for flag in flag_names(f):
                if flag.startswith("--"):
                    assert flag in res.output, flag
    # a bad value is one line naming the setting, before --out exists
    res = CliRunner().invoke(app, ["run", "s2g", "--topk", "0", "--out", "/nonexistent/x"])
    assert res.exit_code != 0 and "topk" in str(res.exception)


def test_repeated_flags_are_lists_and_old_spellings_fill_the_one_setting():
    import inspect

    import typer

    from ragfast.commands.methods import settings_parameters

    app, got = typer.Typer(), {}

    def probe(**kw):
        got.update(kw)

    probe.__signature__ = inspect.Signature(settings_parameters(with_methods=True))
    app.command("probe")(probe)
    app.command("other")(lambda: None)  # a group, so the command is named on the line
    res = CliRunner().invoke(app, ["probe", "--method", "searchr1", "-m", "s2g", "--corpus", "contexts", "--corpus",
                                   "wiki-sample", "--model", "tiny", "--max-turns", "2", "--retriever", "bm25"])
    assert res.exit_code == 0, res.output
    assert got["methods"] == ["searchr1", "s2g"] and got["corpus"] == ["contexts", "wiki-sample"]
    assert (got["reasoner"], got["budget"], got["index"]) == ("tiny", 2, "bm25")

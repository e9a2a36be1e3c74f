"""tools/mutation.py's sampling and its reported interval (the mutmut runs themselves are not in CI).

Oracles: the Wilson interval by its closed form written out here, and the textbook case
(Newcombe 1998, Table I: 81 of 263 -> 0.2553-0.3662); the sample by its defining properties.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "tools" / "mutation.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("ragfast_mutation_tool", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(81, 263), (0, 10), (10, 10), (271, 300), (1, 2)])
def test_wilson_interval_equals_the_closed_form(tool, k, n):
    assert tool.wilson_interval(k, n) == pytest.approx(_wilson(k, n), abs=1e-12)


def test_wilson_interval_textbook_case(tool):
    lo, hi = tool.wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)


def test_sample_is_deterministic_without_replacement_and_order_free(tool):
    names = [f"ragfast.m.x_f__mutmut_{i}" for i in range(1, 200)]
    a = tool.sample_names(names, 50, seed=3)
    assert a == tool.sample_names(list(reversed(names)), 50, seed=3)  # input order does not matter
    assert len(set(a)) == 50 and set(a) <= set(names)
    assert a != tool.sample_names(names, 50, seed=4)
    assert sorted(tool.sample_names(names, 500, seed=3)) == sorted(names)  # N above the population: all


def test_score_line_counts_and_interval(tool):
    statuses = {f"m{i}": "killed" for i in range(9)}
    statuses.update({"s": "survived", "n": "no tests", "x": "not checked", "y": "not checked"})
    line = tool.score_line(statuses)
    # no tests counts as a survivor, not checked is outside the score: 9 / 11
    assert line.startswith("9/11 killed (81.8%)") and "CI" not in line
    lo, hi = _wilson(9, 11)
    sampled = tool.score_line(statuses, population=13)
    assert f"a sample of 11 of 13 mutants: 95% CI {100 * lo:.1f}-{100 * hi:.1f}%" in sampled


def test_unknown_module_and_bad_sample_exit_2(tool, capsys):
    assert tool.main(["no_such_module"]) == 2
    assert "unknown module(s) no_such_module" in capsys.readouterr().err
    assert tool.main(["--sample", "0", "merge"]) == 2
    assert "--sample must be a positive number" in capsys.readouterr().err


def test_survivors_needs_a_previous_run(tool, tmp_path, capsys):
    assert tool.main(["--work", str(tmp_path), "--survivors", "merge"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"mutation: --survivors and --reuse need a previous run of merge in {tmp_path} (none there)")


def test_survivors_refuses_a_changed_test_list(tool, tmp_path, capsys, monkeypatch):
    # a tree as a run leaves it, whose config names other tests than the module's list now does
    tree = tmp_path / "merge"
    (tree / "mutants").mkdir(parents=True)
    (tree / "src" / "ragfast" / "retrieval").mkdir(parents=True)
    src = tool.ROOT / "python" / "ragfast" / "retrieval" / "merge.py"
    (tree / "src" / "ragfast" / "retrieval" / "merge.py").write_bytes(src.read_bytes())
    (tree / "pyproject.toml").write_text(tool.mutmut_config("merge"))
    monkeypatch.setitem(tool.CORE, "merge", ("retrieval/merge.py", ["tests/test_merge.py", "tests/test_stats.py"]))
    assert tool.main(["--work", str(tmp_path), "--survivors", "merge"]) == 2
    assert "merge's test list changed since the run" in capsys.readouterr().err


def test_check_tests_catches_a_test_that_fails_a_second_run(tool, tmp_path, monkeypatch, capsys):
    # mutmut's model: the tests run once in its process, then again in a forked child per mutant
    leaky = tmp_path / "test_leaky.py"
    leaky.write_text("SEEN = []\n\ndef test_once():\n    assert not SEEN\n    SEEN.append(1)\n")
    clean = tmp_path / "test_clean.py"
    clean.write_text("def test_always():\n    assert sum([1, 2]) == 3\n")
    monkeypatch.setattr(tool, "CORE", {"leaky": ("x.py", [str(leaky)]), "clean": ("x.py", [str(clean)])})
    assert tool.check_tests("clean") is True
    assert tool.check_tests("leaky") is False
    out = capsys.readouterr().out
    assert "mutation clean: tests pass" in out and "mutation leaky: tests FAIL a second run" in out

"""Mutation testing of ragfast's measurement core with mutmut, one module at a time.

mutmut 3 imports the mutated code from ``mutants/src`` (or ``mutants/.``) and names mutants by
module path with only a ``src.`` prefix stripped; this repository keeps its package under
``python/``. So each run stages a scratch tree ``<work>/src/ragfast`` (a copy of
``python/ragfast``, compiled ``_C`` and kernels included) with the tests and a ``pyproject.toml``
whose ``[tool.mutmut]`` names one module and the fast test files that cover it, and runs mutmut
there. The repository itself is never modified.

Usage (see docs/mutation.md)::

    nice -n 19 python tools/mutation.py merge            # one module
    nice -n 19 python tools/mutation.py metrics stats    # several, one after the other
    python tools/mutation.py --list                      # the module -> tests map
    nice -n 19 python tools/mutation.py --sample 300 --seed 0 s2g_study   # a random sample

Each module's results land in ``<work>/<module>/`` (``mutmut results``, ``mutmut show NAME``
work there) and a one-line score is printed: killed / (killed + survived + timeout + suspicious);
mutants no test reaches ("no tests") count as survivors.

``--sample N --seed S`` runs N mutants drawn uniformly without replacement (``random.Random(S)``
over the sorted mutant names, so the same code, N and S give the same sample) and reports the
sampled score with its 95% Wilson interval. mutmut has no "generate only" command, so the tool
first runs mutmut on a name no mutant has: that generates the mutants and records which tests
reach which function, then stops with mutmut's "nothing matches" (expected, its output is kept
in ``<work>/<module>/generate.log``). The second run, on the sampled names, reuses that record.
With ``--reuse`` a later sample (another N or seed) starts from the last run's mutants and record
and runs only the sampled mutants not yet killed; the score is over the sample alone.

``--check-tests`` runs a module's tests as mutmut does (once, then again in a forked child) and
fails if either run fails: such a test fails in every mutant's run and reads as a kill.

``--survivors`` re-runs only the mutants the last run of a module in ``--work`` left alive (survived,
no tests, timeout, suspicious), after copying ``tests/`` afresh, and keeps every other result: the
score after tests were added, without running the killed mutants again (adding tests cannot
revive them). mutmut traces the new tests first. The module's source and test list must be
unchanged since that run (both checked; the same holds for ``--reuse``).

"""
from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> (source file under python/ragfast, fast test files that cover it). Only quick tests:
# mutmut runs each covering test once per mutant.
CORE: dict[str, tuple[str, list[str]]] = {
    "merge": ("retrieval/merge.py", ["tests/test_merge.py"]),
    "metrics": ("scoring/metrics.py", ["tests/test_metrics.py"]),
    "stats": ("scoring/stats.py", ["tests/test_stats.py"]),
    "savings": ("accounting/savings.py", ["tests/test_savings.py"]),
    # test_flops checks the re-exported forward_flops against torch's FlopCounterMode.
    # Not test_openai_cost: its loopback server's request log carries state from mutmut's clean
    # run (same process) into the forked mutant runs, where
    # test_url_reasoner_costs_equal_the_local_model then fails whatever the mutant (Timer's CUDA
    # branch, dead code on a CPU, read as killed: the 456 of 465 "killed", 98.1%, was not real).
    # Not test_remote_cost either: run a second time in one process (as mutmut's forked runs
    # are), test_reported_cost_books_exactly_what_the_component_recorded_in_process books 12.2 s
    # for its 10 s (state kept from the first run).
    "cost": ("accounting/ledger.py", ["tests/test_cost_ledger.py", "tests/test_core.py", "tests/test_cost_determinism.py",
                         "tests/test_flops.py"]),
    # test_stats checks bootstrap_means against scipy and by hand
    "ops_policy": ("ops/policy.py", ["tests/test_ops_policy.py", "tests/test_policy.py", "tests/test_stats.py"]),
    "s2g_policy": ("methods/s2g/policy.py", ["tests/test_s2g_policy.py", "tests/test_policy.py", "tests/test_s2g.py"]),
    # the S2G study's definitions (AP, ECE, threshold ties, stop points): one implementation
    # (test_s2g checks the live loop against the study's system level on the same states)
    "s2g_study": ("methods/s2g/study.py", ["tests/test_s2g_definitions.py", "tests/test_s2g.py"]),
}


# Tests left out of a module's run: they exercise that module only through a subprocess, which
# imports the installed package, never the mutant (14 s per mutant for nothing).
DESELECT: dict[str, list[str]] = {
    "stats": ["tests/test_stats.py::test_cpp_bootstrap_deterministic_for_seed_and_thread_count"],
    "ops_policy": ["tests/test_stats.py::test_cpp_bootstrap_deterministic_for_seed_and_thread_count"],
}


def mutmut_config(module: str) -> str:
    """The repository's pyproject.toml with a ``[tool.mutmut]`` for one module and its tests."""
    src, tests = CORE[module]
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r"\n\[tool\.mutmut\][^\[]*", "\n", pyproject)
    sel = ", ".join(f'"{t}"' for t in tests if (ROOT / t).exists())
    desel = "".join(f', "--deselect", "{t}"' for t in DESELECT.get(module, []))
    return pyproject + (f'\n[tool.mutmut]\nsource_paths = ["src/ragfast"]\n'
                        f'only_mutate = ["src/ragfast/{src}"]\n'
                        f'pytest_add_cli_args_test_selection = [{sel}]\n'
                        f'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-m", "not slow"{desel}]\n'
                        # mutmut's limit is CPU seconds, 2 * multiplier * (the covering tests' time +
                        # constant), so the load of a shared box does not stretch it. 20x / 30 s let a
                        # mutant that turns a block loop into range(0, 2^24 // (T * M)) run for hours of
                        # wall time at load 15-20 (ops_policy, sweep_ref 40)
                        f'timeout_multiplier = 3.0\ntimeout_constant = 10.0\n'
                        f'use_git_change_detection = false\n')


def _stage(work: Path, module: str) -> Path:
    tree = work / module
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "src").mkdir(parents=True)
    shutil.copytree(ROOT / "python" / "ragfast", tree / "src" / "ragfast", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "pyproject.toml").write_text(mutmut_config(module))
    return tree


class UsageError(Exception):
    """A request the tool cannot serve as asked (exit code 2)."""


def _selection(pyproject: str) -> list[str]:
    return [ln for ln in pyproject.splitlines() if ln.startswith(("pytest_add_cli_args", "only_mutate"))]


def _refresh_tests(work: Path, module: str) -> Path:
    """Copy tests/ into the last run's tree; refuse if its source or its test list has changed."""
    src, _ = CORE[module]
    tree = work / module
    if not (tree / "mutants").is_dir():
        raise UsageError(f"--survivors and --reuse need a previous run of {module} in {work} (none there)")
    if (tree / "src" / "ragfast" / src).read_bytes() != (ROOT / "python" / "ragfast" / src).read_bytes():
        raise UsageError(f"python/ragfast/{src} changed since the run in {tree}: run it whole again")
    new = mutmut_config(module)
    # mutmut drops every verdict when the test selection changes
    if _selection((tree / "pyproject.toml").read_text()) != _selection(new):
        raise UsageError(f"{module}'s test list changed since the run in {tree}: run it whole again")
    shutil.rmtree(tree / "tests")
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    # a changed timeout resets only the timeouts
    (tree / "pyproject.toml").write_text(new)
    return tree


ALIVE = ("survived", "no tests", "timeout", "suspicious")

# mutmut runs a module's tests in its own process, then each mutant's tests in a child forked
# from it: a test that keeps state from the first run fails in every child and "kills" every
# mutant it covers. This runs the tests the same way, without a mutant.
_FORK_CHECK = """
import os, sys, pytest
args = sys.argv[1:]
first = int(pytest.main(args))
pid = os.fork()
if pid == 0:
    os._exit(int(pytest.main(args)))
second = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(f"first run: exit {first}; second run, in a forked child: exit {second}", flush=True)
sys.exit(0 if first == 0 and second == 0 else 1)
"""


def check_tests(module: str) -> bool:
    """Run the module's tests twice in one process, the second time in a forked child."""
    _, tests = CORE[module]
    desel = [a for t in DESELECT.get(module, []) for a in ("--deselect", t)]
    args = [*tests, "-q", "-p", "no:cacheprovider", "-m", "not slow", *desel]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    rc = subprocess.run([sys.executable, "-c", _FORK_CHECK, *args], cwd=ROOT, env=env).returncode
    print(f"mutation {module}: tests {'pass' if rc == 0 else 'FAIL'} a second run in a forked child", flush=True)
    return rc == 0


def _statuses(tree: Path) -> dict[str, str]:
    """Every mutant's name -> mutmut's status ("killed", "survived", "not checked", ...)."""
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=tree,
                         capture_output=True, text=True).stdout
    res: dict[str, str] = {}
    for line in out.splitlines():
        if ":" in line and "__mutmut_" in line:
            name, status = line.rsplit(":", 1)
            res[name.strip()] = status.strip()
    return res


def wilson_interval(killed: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``killed / n`` (scipy's ``binomtest``).

    The sample is drawn without replacement from a finite set of mutants, so this binomial
    interval is slightly wider than the exact (hypergeometric) one: conservative.
    """
    from scipy.stats import binomtest
    ci = binomtest(killed, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def score_line(statuses: dict[str, str], population: int | None = None) -> str:
    """killed / checked with the status counts; with ``population`` (a sample), the 95% interval."""
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    killed = counts.get("killed", 0)
    total = sum(v for k, v in counts.items() if k not in ("skipped", "not checked"))
    pct = 100.0 * killed / total if total else float("nan")
    line = f"{killed}/{total} killed ({pct:.1f}%)"
    if population is not None and 0 < total < population:
        lo, hi = wilson_interval(killed, total)
        line += f", a sample of {total} of {population} mutants: 95% CI {100 * lo:.1f}-{100 * hi:.1f}%"
    return f"{line} {dict(sorted(counts.items()))}"


def sample_names(names: list[str], n: int, seed: int) -> list[str]:
    """``n`` names drawn without replacement, the same for the same set of names, n and seed."""
    pool = sorted(names)
    return sorted(random.Random(seed).sample(pool, min(n, len(pool))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help=f"any of {', '.join(CORE)}")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ragfast-mutation",
                    help="scratch directory (default: $TMPDIR/ragfast-mutation)")
    ap.add_argument("--max-children", type=int, default=1,
                    help="parallel mutant workers (default 1: the machine is shared)")
    ap.add_argument("--sample", type=int, default=None, metavar="N",
                    help="run N mutants drawn at random (deterministic for --seed) instead of all")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    ap.add_argument("--survivors", action="store_true",
                    help="re-run only the last run's surviving mutants with the current tests/")
    ap.add_argument("--reuse", action="store_true",
                    help="with --sample: keep the module's mutants and test record from the last run in --work "
                         "(same source) and run only the sampled mutants not yet killed")
    ap.add_argument("--check-tests", action="store_true",
                    help="run each module's tests twice in one process, the second time in a forked child "
                         "(as mutmut does), and exit 1 if a run fails: such tests give false kills")
    ap.add_argument("--list", action="store_true", help="print the module -> tests map and exit")
    args = ap.parse_args(argv)
    if args.list or not args.modules:
        for m, (src, tests) in CORE.items():
            print(f"{m:12s} python/ragfast/{src:28s} {' '.join(tests)}")
        return 0
    bad = [m for m in args.modules if m not in CORE]
    if bad:
        print(f"mutation: unknown module(s) {', '.join(bad)}; choose from {', '.join(CORE)}", file=sys.stderr)
        return 2
    if args.sample is not None and args.sample < 1:
        print(f"mutation: --sample must be a positive number of mutants, got {args.sample}", file=sys.stderr)
        return 2
    # one thread per worker: mutmut forks its workers, and OpenMP pools do not survive a fork
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
    if args.check_tests:
        return 0 if all([check_tests(m) for m in args.modules]) else 1
    try:
        return _run_modules(args, run, env)
    except UsageError as e:
        print(f"mutation: {e}", file=sys.stderr)
        return 2


def _run_modules(args, run: list[str], env: dict[str, str]) -> int:
    for m in args.modules:
        if args.survivors:
            tree = _refresh_tests(args.work, m)
            allst = _statuses(tree)
            sample = tree / "sample.txt"
            scope = sample.read_text().split() if sample.exists() else list(allst)
            population = len(allst) if sample.exists() else None
            before = {n: allst[n] for n in scope}
            alive = sorted(n for n, st in before.items() if st in ALIVE)
            print(f"mutation {m}: before {score_line(before, population)}; re-running {len(alive)}", flush=True)
            if alive:
                subprocess.run(run + alive, cwd=tree, env=env)
            after = _statuses(tree)
            print(f"mutation {m}: {score_line({n: after[n] for n in scope}, population)}", flush=True)
            continue
        reuse = args.reuse and args.sample is not None and (args.work / m / "mutants").is_dir()
        tree = _refresh_tests(args.work, m) if reuse else _stage(args.work, m)
        if args.sample is None:
            subprocess.run(run, cwd=tree, env=env)
            print(f"mutation {m}: {score_line(_statuses(tree))}", flush=True)
            continue
        if not reuse:
            with open(tree / "generate.log", "w") as log:
                subprocess.run(run + ["ragfast.no_such_module.x_no_such_function__mutmut_0"], cwd=tree, env=env,
                               stdout=log, stderr=subprocess.STDOUT)
        statuses = _statuses(tree)
        names = list(statuses)
        if not names:
            print(f"mutation {m}: mutmut generated no mutants; see {tree / 'generate.log'}", file=sys.stderr)
            return 1
        chosen = sample_names(names, args.sample, args.seed)
        (tree / "sample.txt").write_text("".join(f"{n}\n" for n in chosen))
        # a mutant killed in an earlier run on the same source stays killed (tests only grow)
        todo = [n for n in chosen if statuses[n] != "killed"]
        print(f"mutation {m}: sampling {len(chosen)} of {len(names)} mutants (seed {args.seed}, "
              f"names in {tree / 'sample.txt'}); running {len(todo)}", flush=True)
        if todo:
            subprocess.run(run + todo, cwd=tree, env=env)
        after = _statuses(tree)
        print(f"mutation {m}: {score_line({n: after[n] for n in chosen}, population=len(names))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

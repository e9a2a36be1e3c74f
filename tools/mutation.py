"""Mutation testing of ragfast's measurement core with mutmut, one module at a time.

mutmut 3 imports the mutated code from ``mutants/src`` (or ``mutants/.``) and names mutants by
module path with only a ``src.`` prefix stripped; this repository keeps its package under
``python/``. So each run stages a scratch tree ``<work>/src/ragfast`` (a copy of
``python/ragfast``, compiled ``_C`` and kernels included) with the tests and a ``pyproject.toml``
whose ``[tool.mutmut]`` names one module and the fast test files that cover it, and runs mutmut
there. The repository itself is never modified.

Usage (see docs/mutation.md)::

    nice -n 10 python tools/mutation.py merge            # one module
    nice -n 10 python tools/mutation.py metrics stats    # several, one after the other
    python tools/mutation.py --list                      # the module -> tests map

Each module's results land in ``<work>/<module>/`` (``mutmut results``, ``mutmut show NAME``
work there) and a one-line score is printed: killed / (killed + survived + timeout + suspicious);
mutants no test reaches ("no tests") count as survivors.
"""
from __future__ import annotations

import argparse
import os
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
    "metrics": ("metrics.py", ["tests/test_metrics.py"]),
    "stats": ("stats.py", ["tests/test_stats.py"]),
    "savings": ("savings.py", ["tests/test_savings.py"]),
    "cost": ("cost.py", ["tests/test_cost_ledger.py", "tests/test_core.py", "tests/test_cost_determinism.py"]),
    "ops_policy": ("ops/policy.py", ["tests/test_policy.py"]),
    "s2g_policy": ("methods/s2g/policy.py", ["tests/test_policy.py", "tests/test_s2g.py"]),
    # the S2G study's definitions (AP, ECE, threshold ties, stop points): one implementation
    "s2g_study": ("methods/s2g/study.py", ["tests/test_s2g_definitions.py"]),
}


# Tests left out of a module's run: they exercise that module only through a subprocess, which
# imports the installed package, never the mutant (14 s per mutant for nothing).
DESELECT: dict[str, list[str]] = {
    "stats": ["tests/test_stats.py::test_cpp_bootstrap_deterministic_for_seed_and_thread_count"],
}


def _stage(work: Path, module: str) -> Path:
    src, tests = CORE[module]
    tree = work / module
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "src").mkdir(parents=True)
    shutil.copytree(ROOT / "python" / "ragfast", tree / "src" / "ragfast", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r"\n\[tool\.mutmut\][^\[]*", "\n", pyproject)
    sel = ", ".join(f'"{t}"' for t in tests if (ROOT / t).exists())
    desel = "".join(f', "--deselect", "{t}"' for t in DESELECT.get(module, []))
    pyproject += (f'\n[tool.mutmut]\nsource_paths = ["src/ragfast"]\n'
                  f'only_mutate = ["src/ragfast/{src}"]\n'
                  f'pytest_add_cli_args_test_selection = [{sel}]\n'
                  f'pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-m", "not slow"{desel}]\n'
                  # the shared 2-core box runs at load 10+: a generous constant keeps load spikes
                  # from reading as timeouts
                  f'timeout_multiplier = 20.0\ntimeout_constant = 30.0\n'
                  f'use_git_change_detection = false\n')
    (tree / "pyproject.toml").write_text(pyproject)
    return tree


def _score(tree: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=tree,
                         capture_output=True, text=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        if ":" in line and "__mutmut_" in line:
            status = line.rsplit(":", 1)[1].strip()
            counts[status] = counts.get(status, 0) + 1
    killed = counts.get("killed", 0)
    total = sum(v for k, v in counts.items() if k not in ("skipped", "not checked"))
    pct = 100.0 * killed / total if total else float("nan")
    return f"{killed}/{total} killed ({pct:.1f}%) {dict(sorted(counts.items()))}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help=f"any of {', '.join(CORE)}")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "ragfast-mutation",
                    help="scratch directory (default: $TMPDIR/ragfast-mutation)")
    ap.add_argument("--max-children", type=int, default=1,
                    help="parallel mutant workers (default 1: the machine is shared)")
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
    for m in args.modules:
        tree = _stage(args.work, m)
        # one thread per worker: mutmut forks its workers, and OpenMP pools do not survive a fork
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH="", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)],
                       cwd=tree, env=env)
        print(f"mutation {m}: {_score(tree)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

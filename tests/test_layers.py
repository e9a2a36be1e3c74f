"""The package's shape: imports only go down the floors, no import loops, no private names across modules.

Floors, bottom to top (DESIGN.md, refined): errors and argument checks -> ops -> records (with the
cost model, scoring, plumbing and a run's files) -> components -> methods -> runner -> the top (the
bench's pipeline and report in ``comparison``, commands, CLI). Read from the source with ``ast``, so
a function-level import counts as much as a module-level one.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ragfast

ROOT = Path(ragfast.__file__).parent

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    # the errors and argument checks every floor raises, the ops included
    ("base", ("ragfast.errors", "ragfast.checks")),
    ("ops", ("ragfast._C", "ragfast.ops", "ragfast.kernels")),
    ("records", ("ragfast.types", "ragfast.text", "ragfast.protocol", "ragfast.accounting",
                 "ragfast.scoring", "ragfast.infra", "ragfast.outputs")),
    ("components", ("ragfast.data", "ragfast.encoders", "ragfast.retrieval", "ragfast.models", "ragfast.judges",
                    "ragfast.serving")),
    ("methods", ("ragfast.methods",)),
    ("runner", ("ragfast.runner",)),
    ("top", ("ragfast.comparison", "ragfast.commands", "ragfast.cli", "ragfast.cli_help")),
]


def _floor(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    if best is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS in tests/test_layers.py")
    return best


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) of every ``ragfast`` import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ragfast"):
            for a in node.names:
                found.append((node.module, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("ragfast")]
    return found


MODULES = _modules()


def _target(module: str, name: str | None, known: dict[str, Path]) -> str:
    """``from ragfast.x import y`` imports module ragfast.x.y when that is a module, else ragfast.x."""
    return f"{module}.{name}" if name and f"{module}.{name}" in known else module


def test_every_module_is_on_a_floor():
    for m in MODULES:
        if m != "ragfast":
            _floor(m)


def test_imports_only_go_down():
    bad = []
    for m, path in MODULES.items():
        if m == "ragfast":  # the package's lazy public API re-exports every floor by design
            continue
        for mod, name, line in _imports(path):
            t = _target(mod, name, MODULES)
            if t == "ragfast" or t.startswith("ragfast._C"):
                continue
            if _floor(t) > _floor(m):
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} ({FLOORS[_floor(m)][0]}) imports {t} "
                           f"({FLOORS[_floor(t)][0]})")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = []
    for m, path in MODULES.items():
        for mod, name, line in _imports(path):
            if name == "_C" or mod.startswith("ragfast._C"):  # the compiled extension is the ops floor's own
                continue
            t = _target(mod, name, MODULES)
            private_module = any(part.startswith("_") and part != "_C" for part in t.split(".")[1:])
            private_name = name is not None and name.startswith("_") and t == mod and mod != m
            if (private_module or private_name) and t != m:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {mod}.{name or ''}")
    assert not bad, "\n".join(bad)


def test_no_import_loops():
    """No cycle among modules, counting every import (a loop is fragile even when it happens to load)."""
    graph = {m: {_target(mod, name, MODULES) for mod, name, _ in _imports(p)} & set(MODULES) - {m, "ragfast"}
             for m, p in MODULES.items() if m != "ragfast"}
    # A package __init__ that re-exports its own submodules is not a loop with them.
    for m in graph:
        graph[m] = {t for t in graph[m] if not (t.startswith(m + ".") and MODULES[m].name == "__init__.py")
                    and not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
    index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not loops, loops


def test_no_import_loops_between_packages():
    """No loop among ragfast's subpackages either (``retrieval`` and ``models`` used to import each
    other through the encoder: it now lives in ``encoders``, below both)."""
    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {}
    for m, p in MODULES.items():
        if m == "ragfast":
            continue
        for mod, name, _ in _imports(p):
            t = _target(mod, name, MODULES)
            if t in MODULES and t != "ragfast" and package(t) != package(m):
                graph.setdefault(package(m), set()).add(package(t))

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            x = todo.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                todo += graph.get(x, ())
        return False

    loops = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and reaches(b, a))
    assert not loops, loops


@pytest.mark.parametrize("limit", [800])
def test_no_product_module_is_huge(limit):
    """No module over 800 lines: one concern per module (issue 25)."""
    allowed: set[str] = set()
    big = {m: sum(1 for _ in p.open(encoding="utf-8")) for m, p in MODULES.items()}
    over = {m: n for m, n in big.items() if n > limit and m not in allowed}
    assert not over, over


def test_the_root_floor_holds_few_modules():
    """At most 12 modules at the package's root, ``__init__.py`` included (issue 39): a new module
    joins the package of its role (``accounting``, ``scoring``, ``infra``, ``outputs``, ``data``,
    ``comparison`` ...), so ``ls python/ragfast`` keeps reading as the data flow in CONTRIBUTING.md."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(root) <= 12, f"{len(root)} modules at python/ragfast/'s root: {root}"

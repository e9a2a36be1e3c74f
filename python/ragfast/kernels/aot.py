"""Ahead-of-time compile check of every Triton kernel configuration, for NVIDIA targets, on any
machine (no GPU needed): Triton lowers each kernel to PTX and ptxas (bundled with Triton) to a
cubin; ptxas's verbose report gives registers and spills, the compiled metadata the shared memory.

A configuration *fails* on a compile error, any spill (stores or loads to local memory), more
than 255 registers per thread or 64 Ki per block, or shared memory above the target's per-block
limit. Each kernel module lists the configurations its wrapper can launch (``aot_specs()``).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from ragfast.kernels.spec import KernelSpec

# Per-block shared-memory limit (opt-in maximum) and register file of each target, from NVIDIA's
# CUDA C Programming Guide, "Technical Specifications per Compute Capability": 8.0 (A100) 163 KB,
# 9.0 (H100/H200) 227 KB, 10.0 (B200) 227 KB; 64 Ki 32-bit registers per block, 255 per thread.
TARGETS: dict[int, dict[str, int]] = {
    80: {"smem_per_block": 163 * 1024, "regs_per_block": 65536, "regs_per_thread": 255},
    90: {"smem_per_block": 227 * 1024, "regs_per_block": 65536, "regs_per_thread": 255},
    100: {"smem_per_block": 227 * 1024, "regs_per_block": 65536, "regs_per_thread": 255},
}
REQUIRED = (80, 90)  # the goal; sm_100 is compiled when the bundled toolchain has it


@dataclass
class CompileReport:
    """Resources of one compiled configuration on one target."""

    kernel: str
    config: str
    target: int
    ok: bool
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack: int = -1
    shared: int = -1
    seconds: float = 0.0
    problems: list = field(default_factory=list)


def available_targets() -> list[int]:
    """Targets the bundled ptxas compiles for (sm_80 and sm_90 always; sm_100 with ptxas-blackwell)."""
    out = list(REQUIRED)
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        if os.path.exists(get_ptxas(100).path):
            out.append(100)
    except Exception:  # an older Triton without the Blackwell toolchain
        pass
    return out


_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_report(ptx: str, cc: int) -> tuple[int, int, int, int, str]:
    """(registers, spill stores, spill loads, stack bytes, raw log) from ``ptxas -v``, run with
    the options Triton itself passes (so the numbers are those of the cubin Triton built)."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(cc).path, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src,
               "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = max(int(x) for x in _RE_REGS.findall(log))
    stack, st, ld = (max(int(m[i]) for m in _RE_SPILL.findall(log)) for i in range(3))
    return regs, st, ld, stack, log


def compile_one(spec: KernelSpec, cc: int, limits: dict | None = None) -> CompileReport:
    """Compile ``spec`` for ``sm_{cc}`` and check it against the target's limits (``limits``
    replaces :data:`TARGETS`' entry). The kernel must be a compiled ``@triton.jit`` function,
    not the interpreter's (use :func:`check_all`, which compiles in fresh processes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rep = CompileReport(spec.kernel, spec.config, cc, ok=False)
    t0 = time.perf_counter()
    names = spec.fn.arg_names
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in spec.aligned}
    try:
        src = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
        regs, st, ld, stack, _ = _ptxas_report(k.asm["ptx"], cc)
    except Exception as exc:  # a compile error is a result of the check, reported in the table
        rep.problems.append(f"compile error: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}")
        rep.seconds = time.perf_counter() - t0
        return rep
    lim = limits or TARGETS[cc]
    rep.registers, rep.spill_stores, rep.spill_loads, rep.stack = regs, st, ld, stack
    rep.shared = int(k.metadata.shared)
    threads = 32 * spec.num_warps
    if st or ld:
        rep.problems.append(f"spills {st} B stores / {ld} B loads")
    if regs > lim["regs_per_thread"] or regs * threads > lim["regs_per_block"]:
        rep.problems.append(f"{regs} registers x {threads} threads")
    if rep.shared > lim["smem_per_block"]:
        rep.problems.append(f"shared memory {rep.shared} B > {lim['smem_per_block']} B")
    rep.ok = not rep.problems
    rep.seconds = time.perf_counter() - t0
    return rep


def all_specs() -> list[KernelSpec]:
    """Every configuration of every Triton kernel in ragfast."""
    from ragfast.kernels import prefix_attention, topk_scan

    return topk_scan.aot_specs() + prefix_attention.aot_specs()


def _no_interpreter() -> None:
    # Workers compile for real GPUs: TRITON_INTERPRET must be off before any kernel module is
    # imported there (the tests set it for the whole session).
    os.environ["TRITON_INTERPRET"] = "0"


def _job(args: tuple) -> CompileReport:
    i, cc, signature, limits = args
    spec = all_specs()[i]
    if signature:
        spec = dataclasses.replace(spec, signature={**spec.signature, **signature},
                                   config=spec.config + " (modified)")
    return compile_one(spec, cc, limits)


def check_all(targets: list[int] | None = None, progress: Callable[[CompileReport], None] | None = None,
              workers: int = 1, indices: list[int] | None = None, signature: dict | None = None,
              limits: dict | None = None) -> list[CompileReport]:
    """Compile :func:`all_specs` (or the ``indices`` among them) for every target.

    Compiles run in ``workers`` fresh processes (each compile is one CPU-bound Triton + LLVM +
    ptxas run of seconds), with the Triton interpreter off there whatever this process uses.
    ``signature`` overrides argument types and ``limits`` the targets' limits (the tests use
    both to check that a broken configuration is caught).

    Returns
    -------
    list of CompileReport
        One per (spec, target), targets outermost.
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    targets = targets or available_targets()
    idx = list(range(len(all_specs()))) if indices is None else list(indices)
    jobs = [(i, cc, signature, (limits or {}).get(cc)) for cc in targets for i in idx]
    out = []
    with ProcessPoolExecutor(max(1, workers), mp_context=mp.get_context("spawn"), initializer=_no_interpreter) as pool:
        for rep in pool.map(_job, jobs):
            out.append(rep)
            if progress is not None:
                progress(rep)
    return out


def format_table(reports: list[CompileReport]) -> str:
    """A fixed-width table: one line per configuration and target."""
    lines = [f"{'kernel':33s} {'config':30s} {'sm':>4s} {'regs':>5s} {'spill':>6s} {'smem B':>7s} {'s':>5s}  status"]
    for r in reports:
        spill = "-" if r.spill_stores < 0 else str(r.spill_stores + r.spill_loads)
        lines.append(f"{r.kernel:33s} {r.config:30s} {r.target:>4d} {r.registers:>5d} {spill:>6s} {r.shared:>7d} "
                     f"{r.seconds:>5.1f}  {'ok' if r.ok else 'FAIL: ' + '; '.join(r.problems)}")
    return "\n".join(lines)

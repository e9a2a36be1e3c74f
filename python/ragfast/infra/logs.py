"""Logging for the command line: the ``ragfast`` logger, -v/-q, and a log file per run.

- ragfast's messages go to the ``ragfast`` logger (``logging.getLogger("ragfast.<module>")``);
  the console shows INFO and above (``-v``: DEBUG, ``-q``: WARNING and above).
- Third-party loggers and Python warnings (onnxruntime, matplotlib, Ray, transformers...) are
  kept off the console and written to the run's log file only; ragfast's own warnings still
  reach the console.
- Until a run knows its results directory, records are buffered; :func:`attach_log_file`
  writes them, and everything after, to ``<out>/ragfast.log`` at DEBUG level.

Library use (``import ragfast``) configures nothing: only :func:`setup` does.
"""
from __future__ import annotations

import contextlib
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any, Iterator

__all__ = ["setup", "attach_log_file", "run_log", "quiet_third_party", "verbosity"]

_FMT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"
_STATE: dict[str, Any] = {"buffer": None, "file": None, "console": None, "verbosity": 0}


class _OwnWarnings(logging.Filter):
    """Let through ragfast's own log records and its own ``warnings.warn`` calls."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "ragfast" or record.name.startswith("ragfast."):
            return True
        if record.name == "py.warnings":
            return f"{os.sep}ragfast{os.sep}" in record.getMessage().split(":", 1)[0]
        return False


def verbosity() -> int:
    """-1 (quiet), 0 (default) or >= 1 (verbose), as set by :func:`setup`."""
    return int(_STATE["verbosity"])


def setup(verbose: int = 0, quiet: bool = False) -> None:
    """Configure logging for one CLI invocation.

    Parameters
    ----------
    verbose : int
        Number of ``-v`` flags: 1 shows DEBUG messages of ragfast on the console.
    quiet : bool
        ``-q``: warnings and errors only (progress bars stay, results tables stay).
    """
    from rich.logging import RichHandler

    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    _STATE["verbosity"] = -1 if quiet else int(verbose)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_ragfast", False):
            root.removeHandler(h)
    root.setLevel(logging.DEBUG)
    from rich.console import Console

    console = RichHandler(console=Console(stderr=True), show_time=False, show_path=False, markup=False,
                          rich_tracebacks=False)
    console.setLevel(level)
    console.addFilter(_OwnWarnings())
    console._ragfast = True  # type: ignore[attr-defined]
    buffer = logging.handlers.MemoryHandler(capacity=100000, flushLevel=logging.CRITICAL + 1)
    buffer.setLevel(logging.DEBUG)
    buffer._ragfast = True  # type: ignore[attr-defined]
    root.addHandler(console)
    root.addHandler(buffer)
    _STATE.update(buffer=buffer, console=console, file=None)
    # Re-arm the capture: a warnings.catch_warnings() block that ended since the last setup()
    # (pytest wraps every test in one) restored the old showwarning while logging still thinks
    # it is capturing, and captureWarnings(True) alone would then do nothing.
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    quiet_third_party()


def quiet_third_party() -> None:
    """Route the chattiest libraries into logging (the log file) instead of the console.

    Safe to call again after heavy imports: transformers' and onnxruntime's own handlers are
    only switched when those modules are loaded.
    """
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # bm25s and loaders draw tqdm bars over ragfast's own
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    for name in ("matplotlib", "PIL", "urllib3", "httpx", "ray", "faiss", "numexpr", "filelock", "onnxscript"):
        logging.getLogger(name).setLevel(logging.WARNING)
    tf = sys.modules.get("transformers")
    if tf is not None:
        try:
            tf.utils.logging.disable_default_handler()
            tf.utils.logging.enable_propagation()
            tf.utils.logging.disable_progress_bar()
        except Exception:  # an old transformers without these switches: leave it
            pass
    ort = sys.modules.get("onnxruntime")
    if ort is not None:
        try:
            ort.set_default_logger_severity(3)  # errors only; its warnings are C++ prints to stderr
        except Exception:
            pass


def attach_log_file(out_dir: str | os.PathLike, name: str = "ragfast.log") -> Path | None:
    """Write every record (DEBUG and up, third-party included) to ``out_dir/name``.

    The records buffered since :func:`setup` are written first. Does nothing (returns None)
    when :func:`setup` was not called, e.g. when ragfast is used as a library.
    """
    buffer = _STATE.get("buffer")
    if buffer is None:
        return None
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    old = _STATE.get("file")
    if old is not None:
        if Path(old.baseFilename) == path.resolve():
            return path
        root.removeHandler(old)
        old.close()
    fh = logging.FileHandler(path, encoding="utf-8")
    fh.setLevel(logging.DEBUG)
    fh.setFormatter(logging.Formatter(_FMT))
    fh._ragfast = True  # type: ignore[attr-defined]
    buffer.setTarget(fh)
    buffer.flush()
    root.removeHandler(buffer)
    root.addHandler(fh)
    _STATE.update(file=fh)
    quiet_third_party()
    return path


@contextlib.contextmanager
def run_log(out_dir: str | os.PathLike, name: str = "ragfast.log") -> Iterator[Path]:
    """A run's log file in ``out_dir``, for the duration of the run.

    Under the command line (:func:`setup` called) this is :func:`attach_log_file`: everything,
    third-party records included, and it stays attached. From library code, only the
    ``ragfast`` logger's records are written, and the handler is removed afterwards, so a
    caller's own logging set-up is left as it was. Appends on resume.
    """
    path = attach_log_file(out_dir, name)
    if path is not None:
        yield path
        return
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("ragfast")
    fh = logging.FileHandler(path, encoding="utf-8")
    fh.setLevel(logging.DEBUG)
    fh.setFormatter(logging.Formatter(_FMT))
    old_level = logger.level
    logger.addHandler(fh)
    if logger.getEffectiveLevel() > logging.DEBUG:
        logger.setLevel(logging.DEBUG)
    try:
        yield path
    finally:
        logger.removeHandler(fh)
        logger.setLevel(old_level)
        fh.close()

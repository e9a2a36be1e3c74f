"""An output directory that a command which fails early leaves as it found it.

A command that stops on bad input (an unreachable server, a missing model, a missing optional
package) after it made ``--out`` would otherwise leave an empty directory, or a manifest
beside an empty ``results.jsonl``, which the next run then refuses or mistakes for a started
run. :func:`output_dir` wraps a command: it refuses an ``--out`` that is an existing file, and
on failure removes what the command created, unless the command already finished some work
(a new or grown non-empty file other than run metadata), which is never thrown away.

It also holds an exclusive lock on the directory (:func:`lock_dir`) for the whole command, so
two writers (two runs, or a run and a ``--resume``) can never interleave lines in one file.
"""
from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ragfast.errors import ConfigError

__all__ = ["output_dir", "lock_dir", "LOCK_FILE", "METADATA_FILES"]

#: The lock file inside an output directory; it holds the pid of the process that has it.
LOCK_FILE = ".ragfast.lock"

#: Files that describe a run but hold no finished work: removed when the run fails before any.
METADATA_FILES = frozenset({"ragfast.log", "manifest.json", "summary.json", "build.json", "encoder.json",
                            "config.json",
                            "ledger.jsonl", LOCK_FILE})


def _files(root: Path) -> tuple[dict[str, int], set[str]]:
    """Sizes of the files under ``root`` and the directories there (relative paths)."""
    files: dict[str, int] = {}
    dirs: set[str] = set()
    for dirpath, dnames, names in os.walk(root):
        for n in dnames:
            dirs.add(str(Path(dirpath, n).relative_to(root)))
        for n in names:
            f = Path(dirpath, n)
            try:
                files[str(f.relative_to(root))] = f.stat().st_size
            except OSError:
                pass
    return files, dirs


@contextmanager
def output_dir(path: str | os.PathLike, option: str = "--out") -> Iterator[Path]:
    """Guard a command's output directory ``path`` (it may or may not exist yet).

    Parameters
    ----------
    path : path
        The directory the command writes into (it creates it itself).
    option : str
        How the user named it, for the error message.

    Raises
    ------
    ConfigError
        ``path`` exists and is not a directory.

    Notes
    -----
    On an exception (including Ctrl-C) the directory is tidied, then the exception goes on:
    if no file gained content apart from :data:`METADATA_FILES`, every file the command created
    is removed, then the directories it created, if empty. Files that were there before are
    never touched.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{option} {p} exists and is not a directory")
    # The top-most directory this command will create (mkdir(parents=True) may make several).
    top = None
    q = p.absolute()
    while not q.exists():
        top = q
        if q.parent == q:
            break
        q = q.parent
    existed = p.is_dir() and (p / LOCK_FILE).exists()
    # The lock first: what is on disk is looked at only once no other process can write there.
    with lock_dir(p, option):
        before = _files(p)
        if not existed:
            before[0].pop(LOCK_FILE, None)  # made by this command: tidied with the rest
        try:
            yield p
        except BaseException:
            _tidy(p, before, top)
            raise


@contextmanager
def lock_dir(path: str | os.PathLike, option: str = "--out") -> Iterator[Path]:
    """Hold an exclusive ``fcntl.flock`` on ``path/.ragfast.lock`` (creating ``path``) until the block ends.

    The lock is released by the kernel when the process dies (even on SIGKILL), so a crashed
    run never leaves a stale lock behind; the pid written into the file only names the holder.

    Raises
    ------
    ConfigError
        Another process holds the lock: ``"--out X is in use by another ragfast process (pid N)"``.
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    lock = p / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            raise ConfigError(f"{option} {p} is in use by another ragfast process (pid {holder}); wait for it "
                              "to finish or use another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield p
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _tidy(p: Path, before: tuple[dict[str, int], set[str]], top: Path | None) -> None:
    if not p.is_dir():
        return
    files, dirs = _files(p)
    old_files, old_dirs = before
    worked = any(size > old_files.get(f, 0) and Path(f).name not in METADATA_FILES for f, size in files.items())
    if worked:
        return  # finished work stays (--resume continues it)
    for f in files:
        if f not in old_files:
            try:
                (p / f).unlink()
            except OSError:
                pass
    # Directories the command made, deepest first, if empty; then --out and its new parents.
    made = [p / d for d in dirs if d not in old_dirs]
    if top is not None:
        d = p.absolute()
        while True:
            made.append(d)
            if d == top or d.parent == d:
                break
            d = d.parent
    for d in sorted(made, key=lambda x: -len(x.absolute().parts)):
        try:
            d.rmdir()
        except OSError:
            pass

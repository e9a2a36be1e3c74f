"""An output directory that a command which fails early leaves as it found it.

A command that stops on bad input (an unreachable server, a missing model, a missing optional
package) after it made ``--out`` would otherwise leave an empty directory, or a manifest
beside an empty ``results.jsonl``, which the next run then refuses or mistakes for a started
run. :func:`output_dir` wraps a command: it refuses an ``--out`` that is an existing file, and
on failure removes what the command created, unless the command already finished some work
(a new or grown non-empty file other than run metadata), which is never thrown away.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ragfast.errors import ConfigError

__all__ = ["output_dir", "METADATA_FILES"]

#: Files that describe a run but hold no finished work: removed when the run fails before any.
METADATA_FILES = frozenset({"ragfast.log", "manifest.json", "summary.json", "build.json", "encoder.json",
                            "config.json",
                            "ledger.jsonl"})


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
    before = _files(p) if p.is_dir() else ({}, set())
    try:
        yield p
    except BaseException:
        _tidy(p, before, top)
        raise


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

"""Atomic file replacement: a temporary file beside the target, fsync, rename, fsync the
directory. Standard library only: the recorder's zipapp packs this module too.

A reader sees the old file or the new one, never a part; a failure (a full or read-only
disk) leaves the old file as it was and no temporary file behind, and raises the
``OSError``, for the caller to word (the recorder names the path; the arbiter raises a
storage alert). :class:`FileOps` lets tests put a failing system call in.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEFAULT_OPS", "FileOps", "fsync_dir", "replacing", "write_all", "write_atomic"]

#: Suffix of the temporary files (``.NAME.RANDOM.tmp`` beside ``NAME``).
TMP_SUFFIX = ".tmp"


def _mkstemp(directory: str, prefix: str) -> tuple[int, str]:
    return tempfile.mkstemp(dir=directory, prefix=prefix, suffix=TMP_SUFFIX)


@dataclass(frozen=True, slots=True)
class FileOps:
    """The system calls the writers use; tests replace some to simulate a full disk."""

    write: Callable[[int, bytes], int] = os.write
    mkstemp: Callable[[str, str], tuple[int, str]] = field(default=_mkstemp)
    replace: Callable[[str, str], None] = os.replace


DEFAULT_OPS = FileOps()


def write_all(fd: int, data: bytes, ops: FileOps = DEFAULT_OPS) -> None:
    """Write all of ``data`` to ``fd`` (a write that makes no progress is an ``OSError``)."""
    view = memoryview(data)
    while view:
        n = ops.write(fd, view.tobytes())
        if n <= 0:
            raise OSError(0, "short write")
        view = view[n:]


def fsync_dir(directory: str | Path) -> None:
    """Flush a directory's entries (a rename in it) to disk; best effort."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


@contextlib.contextmanager
def replacing(path: Path, ops: FileOps = DEFAULT_OPS, mode: int = 0o644) -> Iterator[int]:
    """A descriptor of a new temporary file with ``mode``, beside ``path``; on a clean exit
    it is synced and renamed over ``path``. On any error, the temporary file is removed."""
    directory = str(path.parent)
    fd, tmp = ops.mkstemp(directory, f".{path.name}.")
    try:
        try:
            os.fchmod(fd, mode)
            yield fd
            os.fsync(fd)
        finally:
            os.close(fd)
        ops.replace(tmp, str(path))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_atomic(
    path: Path,
    data: bytes,
    ops: FileOps = DEFAULT_OPS,
    mode: int = 0o644,
    make_parents: bool = False,
) -> None:
    """Replace ``path`` with ``data`` (see the module); ``make_parents`` creates its directory
    first."""
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, ops, mode) as fd:
        write_all(fd, data, ops)

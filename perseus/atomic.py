"""Atomic file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _proc_umask() -> int | None:
    """The umask from /proc/self/status ("Umask:", Linux 4.7+), or None where it is missing."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _umask_at_import() -> int:
    # os.umask(x) sets the mask of every thread while it reads it, so it is called at most once,
    # here at import (before a program starts its threads), and only where /proc cannot say.
    # There a later umask change is not seen.
    mask = _proc_umask()
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


_IMPORT_UMASK = _umask_at_import()


def _umask() -> int:
    """The current umask, read without changing it where /proc allows (thread-safe)."""
    mask = _proc_umask()
    return _IMPORT_UMASK if mask is None else mask


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = True, mode: int | None = None) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path`.

    The file gets `mode` if given (0o600 for a secret: it is never readable wider, not even
    for a moment), else 0o666 less the umask, like open() would give it (mkstemp's 0600 would
    keep a plan or profile from the other users the umask allows). With `fsync`, the data and
    then the folder's entry reach the disk before this returns. On any error the temp file is
    removed, `path` is left as it was, and the error is raised."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(fd, (0o666 & ~_umask()) if mode is None else mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; skipped where the platform or file system cannot (Windows, some
    network file systems): the data itself is already on disk."""
    try:
        dfd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = True, mode: int | None = None) -> None:
    """Write `text` (UTF-8, newlines as given) atomically."""
    write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync, mode=mode)


def write_json_atomic(
    path: str | os.PathLike, doc: Any, *, indent: int | None = 1, fsync: bool = True, mode: int | None = None
) -> None:
    """Write `doc` as JSON atomically."""
    write_text_atomic(path, json.dumps(doc, indent=indent, sort_keys=True) + "\n", fsync=fsync, mode=mode)

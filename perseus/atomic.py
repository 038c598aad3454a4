"""Atomic file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Write `data` to a temp file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Write `text` (UTF-8, newlines as given) atomically."""
    write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)


def write_json_atomic(path: str | os.PathLike, doc: Any, *, indent: int | None = 1, fsync: bool = True) -> None:
    """Write `doc` as JSON atomically."""
    write_text_atomic(path, json.dumps(doc, indent=indent, sort_keys=True) + "\n", fsync=fsync)

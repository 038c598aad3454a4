"""Atomic file writes: a reader sees the old file or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = True) -> None:
    """Write `text` to a temp file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, doc: Any, *, indent: int | None = 1, fsync: bool = True) -> None:
    """Write `doc` as JSON atomically."""
    write_text_atomic(path, json.dumps(doc, indent=indent, sort_keys=True) + "\n", fsync=fsync)

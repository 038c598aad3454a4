"""A simulated GPU's small runtime record (its settings, its clock change in flight), shared by
every process that uses the GPU and rewritten in place.

Replacing a file by rename is what keeps readers from seeing half a write, but on ext4 a rename
over an existing file flushes the new file's data first (auto_da_alloc): 3-4 ms a write on a
disk under load, against microseconds in place. A clock change writes twice, and a controller
changes clocks dozens of times an iteration, so the simulated GPU spent its host's CPU and its
clock changes landed late. So a record is written in place instead, as one fixed-size write of
`SIZE` bytes: a CRC-32 of the JSON text, the text, padding. A reader that catches a write
halfway sees a checksum that does not match and reads again. The first write of a record
creates it whole by rename (no existing file, no flush). Writers of one GPU hold its state lock.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any

from perseus.atomic import write_bytes_atomic

SIZE = 512
#: Reads of a record caught mid-write before it counts as unreadable.
READ_TRIES = 50


def encode(doc: dict[str, Any]) -> bytes:
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    data = b"%08x " % zlib.crc32(text) + text
    if len(data) > SIZE:
        raise ValueError(f"runtime record of {len(data)} bytes is over its {SIZE}-byte slot: {doc!r}")
    return data.ljust(SIZE, b" ")


def decode(data: bytes) -> dict[str, Any] | None:
    """The record's document, or None when `data` is not a whole record (a write in progress)."""
    head, _, text = data.partition(b" ")
    text = text.rstrip(b" ")
    try:
        if len(head) != 8 or int(head, 16) != zlib.crc32(text):
            return None
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def write(path: str, doc: dict[str, Any], mode: int | None = None) -> None:
    """Write `doc` as the record at `path`: in place when it exists, else created whole; then
    stamp its mtime."""
    data = encode(doc)
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        write_bytes_atomic(path, data, fsync=False, mode=mode)  # runtime state: lost on reboot, like hardware's
    else:
        try:
            if os.pwrite(fd, data, 0) != SIZE:
                raise OSError(f"short write to {path}")
        finally:
            os.close(fd)
    # Readers cache a record on its (mtime, inode, size): a fine-grained mtime changes that key on
    # every write, even where the file system's own timestamps are coarser than back-to-back writes.
    stamp = time.time_ns()
    os.utime(path, ns=(stamp, stamp))


def read(path: str) -> dict[str, Any]:
    """The record at `path`. FileNotFoundError when there is none; ValueError when it stays
    unreadable (not a record, or no whole one in `READ_TRIES` reads)."""
    with open(path, "rb") as f:
        for _ in range(READ_TRIES):
            data = f.read()
            if data.startswith(b"{"):  # a whole JSON document (written by rename, by older versions)
                doc = json.loads(data)
                if not isinstance(doc, dict):
                    raise ValueError(f"{path} holds {type(doc).__name__}, not a record")
                return doc
            doc = decode(data)
            if doc is not None:
                return doc
            f.seek(0)
    raise ValueError(f"{path} is not a whole runtime record (checksum does not match)")

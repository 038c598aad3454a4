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

For the same reason the rest stays cheap too: raw file descriptors (os.open, pread, pwrite: a
few microseconds each, where opening a Python file object costs over 10), and split steps so
that callers can skip what they already know: `write` returns the stat key of what it wrote (a
writer caches its own write rather than reading it back), and `read_bytes` returns a whole
record undecoded (a reader holding the same bytes keeps what it decoded from them).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from typing import Any

from perseus.atomic import write_bytes_atomic

SIZE = 512
#: Bytes a read asks for: a record, or an older version's whole JSON file.
READ_MAX = 1 << 16
#: Reads of a record caught mid-write before it counts as unreadable.
READ_TRIES = 50

#: What a reader caches a record on: (mtime, inode, size), see `key`.
Key = tuple[int, int, int]

_ENCODER = json.JSONEncoder(separators=(",", ":"))


def encode(doc: dict[str, Any]) -> bytes:
    text = _ENCODER.encode(doc).encode("utf-8")
    data = b"%08x " % zlib.crc32(text) + text
    if len(data) > SIZE:
        raise ValueError(f"runtime record of {len(data)} bytes is over its {SIZE}-byte slot: {doc!r}")
    return data.ljust(SIZE, b" ")


def is_whole(data: bytes) -> bool:
    """Whether `data` is one whole record (its checksum matches), not a write in progress; an
    older version's JSON file (written by rename) always is."""
    if data.startswith(b"{"):
        return True
    head, _, text = data.partition(b" ")
    try:
        return len(head) == 8 and int(head, 16) == zlib.crc32(text.rstrip(b" "))
    except ValueError:
        return False


def parse(data: bytes) -> dict[str, Any]:
    """The document of a whole record (see `is_whole`). ValueError when it holds no JSON object."""
    doc = json.loads(data if data.startswith(b"{") else data.partition(b" ")[2])
    if not isinstance(doc, dict):
        raise ValueError(f"a runtime record holds {type(doc).__name__}, not an object")
    return doc


def decode(data: bytes) -> dict[str, Any] | None:
    """The record's document, or None when `data` is not a whole record (a write in progress)."""
    try:
        return parse(data) if is_whole(data) else None
    except ValueError:
        return None


def key(st: os.stat_result) -> Key:
    """(mtime, inode, size): every write changes it (see `write`), so a reader re-reads only then."""
    return st.st_mtime_ns, st.st_ino, st.st_size


def write(path: str, data: bytes, mode: int | None = None) -> Key:
    """Write the record `data` (from `encode`) at `path`: in place when it exists, else created
    whole; then stamp its mtime. Returns the written file's `key`."""
    if len(data) != SIZE:
        raise ValueError(f"a runtime record is {SIZE} bytes, not {len(data)}")
    # Readers cache a record on its key: a fine-grained mtime changes it on every write, even
    # where the file system's own timestamps are coarser than back-to-back writes.
    stamp = time.time_ns()
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        write_bytes_atomic(path, data, fsync=False, mode=mode)  # runtime state: lost on reboot, like hardware's
        os.utime(path, ns=(stamp, stamp))
        return key(os.stat(path))
    try:
        if os.pwrite(fd, data, 0) != SIZE:
            raise OSError(f"short write to {path}")
        os.utime(fd, ns=(stamp, stamp))
        return key(os.fstat(fd))
    finally:
        os.close(fd)


def read_bytes(path: str) -> bytes:
    """The whole record at `path`, undecoded. FileNotFoundError when there is none; ValueError
    when no read in `READ_TRIES` finds a whole one."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(READ_TRIES):
            data = os.pread(fd, READ_MAX, 0)
            if is_whole(data):
                return data
    finally:
        os.close(fd)
    raise ValueError(f"{path} is not a whole runtime record (checksum does not match)")


def read(path: str) -> dict[str, Any]:
    """The record at `path`; raises as `read_bytes` and `parse` do."""
    return parse(read_bytes(path))

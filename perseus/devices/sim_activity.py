"""The busy periods of one simulated GPU, shared by every process that uses it.

A real GPU's energy counter counts all work on it, whichever process issued it. So a simulated
GPU on the real clock appends each piece of work it runs as a fixed-size record (start, end,
busy power; times on the system-wide monotonic clock) to a log in the `activity` folder of
the runtime folder (beside the state files, which stay one per changed GPU), and
every SimGPU of that GPU, in any process, reads the records it has not seen yet: `perseus
monitor -- CMD` counts the energy of the simulated work CMD runs.

Bounded on disk: past MAX_BYTES the log is replaced by a new generation whose header carries
the running total of extra (busy minus idle) energy in all earlier generations, so a reader
that slept through whole generations still adds up what it missed. Appends are single
O_APPEND writes under a shared lock; replacement holds the exclusive lock, so a reader that
finds the log replaced drains its open descriptor of the old one completely.

A setgid activity folder (the perseus agent shares its GPUs' so: perseus.agent.sim_folder) is
shared by several users: the files made in it take its read and write bits.
"""

from __future__ import annotations

import fcntl
import math
import os
import stat
import struct

from perseus.atomic import write_bytes_atomic
from perseus.exceptions import DeviceError

RECORD = struct.Struct("<ddd")  # work: start_s, end_s, busy power W; header: generation, total J, NaN
MAX_BYTES = RECORD.size * 40_000  # about 1 MB
TAIL_RECORDS = 1_000  # what a new reader reads of an existing log: work that may still run
PATH_CHECK_S = 1.0

Record = tuple[float, float, float]


class ActivityLog:
    """Appends and reads one GPU's busy records. Not thread-safe: the owning SimGPU locks."""

    def __init__(self, path: str, idle_w: float) -> None:
        self.path = path
        self.idle_w = idle_w
        self._lock_path = os.path.join(os.path.dirname(path), ".lock")
        self._lock_fd: int | None = None
        self._mode: int | None = None  # of the files this object creates (None: the umask decides)
        self._fd: int | None = None  # the generation this reader is on
        self._ino = -1
        self._offset = 0
        # Header of the current generation; a reader that began before any log existed has
        # seen "generation -1" with nothing in it.
        self._generation = -1
        self._total_before_j = 0.0
        self._next_path_check = 0.0
        try:
            self._replace(self._writer_lock(), only_if_missing=True)
        except OSError:
            pass  # a read-only runtime folder: read what others log, if anything
        fd = self._open()
        if fd is not None:
            size = os.lseek(fd, 0, os.SEEK_END)
            tail = size - (size - RECORD.size) % RECORD.size - TAIL_RECORDS * RECORD.size
            self._offset = max(RECORD.size, tail)

    def append(self, start: float, end: float, busy_w: float) -> None:
        try:
            self._append(start, end, busy_w)
        except OSError as e:
            raise DeviceError(
                f"cannot log simulated GPU work to {self.path} ({e}); set PERSEUS_SIM_DIR to a writable folder"
            ) from e

    def _append(self, start: float, end: float, busy_w: float) -> None:
        lock = self._writer_lock()
        while True:
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            except FileNotFoundError:
                fcntl.flock(lock, fcntl.LOCK_UN)
                self._replace(lock)  # start generation 0
                continue
            try:
                os.write(fd, RECORD.pack(start, end, busy_w))
                full = os.fstat(fd).st_size >= MAX_BYTES
            finally:
                os.close(fd)
                fcntl.flock(lock, fcntl.LOCK_UN)
            if full:
                self._replace(lock)
            return

    def read_new(self, now: float) -> tuple[list[Record], float]:
        """(records appended since the last call, extra energy J of whole generations missed).

        `now` (time.monotonic) paces the look at the path for a log someone removed by hand:
        once a second. A generation is only replaced once full, which the size shows.
        """
        if self._fd is not None and now < self._next_path_check:
            size = os.lseek(self._fd, 0, os.SEEK_END)  # far cheaper than a stat
            if size < MAX_BYTES:
                return (self._read_to(size) if size > self._offset else []), 0.0
        self._next_path_check = now + PATH_CHECK_S
        try:
            st = os.stat(self.path)
        except OSError:  # removed (or its folder is gone): treat as absent
            st = None
        if st is not None and st.st_ino == self._ino:
            return (self._read_to(st.st_size) if st.st_size > self._offset else []), 0.0
        # The log was replaced (or removed): finish the old generation, then follow the new one.
        old_fd, old_generation, old_total = self._fd, self._generation, self._total_before_j
        records = self._read_to(os.fstat(old_fd).st_size) if old_fd is not None else []
        missed_j = 0.0
        if st is None:  # removed: the next log starts from nothing
            self._fd, self._ino, self._generation, self._total_before_j = None, -1, -1, 0.0
        elif (fd := self._open()) is not None:
            if self._generation != old_generation + 1:
                expected = old_total + (self._extra_j(_read_all(old_fd)) if old_fd is not None else 0.0)
                missed_j = max(0.0, self._total_before_j - expected)
            records += self._read_to(os.fstat(fd).st_size)
        if old_fd is not None:
            os.close(old_fd)
        return records, missed_j

    def _read_to(self, size: int) -> list[Record]:
        size -= (size - self._offset) % RECORD.size  # whole records only
        if self._fd is None or size <= self._offset:
            return []
        data = os.pread(self._fd, size - self._offset, self._offset)
        data = data[: len(data) - len(data) % RECORD.size]
        self._offset += len(data)
        return list(RECORD.iter_unpack(data))

    def _open(self) -> int | None:
        """Open the current generation and read its header; its fd (also kept as self._fd), None if there is none."""
        self._fd, self._ino, self._offset = None, -1, 0
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:  # none yet, or unreadable: nothing to count
            return None
        header = os.pread(fd, RECORD.size, 0)
        if len(header) < RECORD.size or not math.isnan(RECORD.unpack(header)[2]):
            os.close(fd)  # not a log of ours: ignore it
            return None
        generation, total_before_j, _ = RECORD.unpack(header)
        self._fd, self._ino, self._offset = fd, os.fstat(fd).st_ino, RECORD.size
        self._generation, self._total_before_j = int(generation), total_before_j
        return fd

    def _extra_j(self, records: list[Record]) -> float:
        idle = self.idle_w
        return sum((busy_w - idle) * (end - start) for start, end, busy_w in records)

    def _writer_lock(self) -> int:
        if self._lock_fd is None:
            folder = os.path.dirname(self.path)
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._mode = _shared_mode(folder)
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600 if self._mode is None else self._mode)
            if self._mode is not None and os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, self._mode)  # one this process made: past its umask
            self._lock_fd = fd
        return self._lock_fd

    def _replace(self, lock: int, only_if_missing: bool = False) -> None:
        """Start the next generation (or the first), unless another writer just did."""
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except FileNotFoundError:
                header = RECORD.pack(0.0, 0.0, math.nan)
            else:
                try:
                    if only_if_missing or os.fstat(fd).st_size < MAX_BYTES:
                        return
                    records = _read_all(fd)
                    generation, total_before_j, _ = RECORD.unpack(os.pread(fd, RECORD.size, 0))
                finally:
                    os.close(fd)
                header = RECORD.pack(generation + 1, total_before_j + self._extra_j(records), math.nan)
            write_bytes_atomic(self.path, header, fsync=False, mode=self._mode)  # a runtime log: lost on reboot
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None
        self._ino = -1

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


def _shared_mode(folder: str) -> int | None:
    """The mode of the files in a folder that processes of several users share (setgid, as the
    perseus agent makes its GPUs' activity folder): the folder's read and write bits, so each may
    append and start a new generation; None for a private folder."""
    mode = os.stat(folder).st_mode
    return mode & 0o666 if mode & stat.S_ISGID else None


def _read_all(fd: int) -> list[Record]:
    """Every work record of one generation (after its header)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size - RECORD.size, RECORD.size) if size > RECORD.size else b""
    return list(RECORD.iter_unpack(data[: len(data) - len(data) % RECORD.size]))

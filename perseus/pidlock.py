"""One process at a time: an exclusive lock on a file that holds the holder's pid, so the one
refused can say who holds it. The kernel drops the lock when its holder exits, however it exits."""

from __future__ import annotations

import fcntl
import os


def take_pid_lock(path: str) -> int | str:
    """The locked file's descriptor (this pid written in it; close it to release), or, where
    another process holds the lock, that process's pid as its file says it ("?" if unreadable).
    OSError if the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd

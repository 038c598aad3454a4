"""One process at a time: an exclusive lock on a file that holds the holder's pid, so the one
refused can say who holds it. The kernel drops the lock when its holder exits, however it exits.

A holder that ends cleanly removes the file (`release_pid_lock`), so refused and stopped
processes leave nothing behind. Removing a lock file races with a process that opened it just
before: that one then locks a file no longer at the path, so a lock counts only once the locked
file is still the one at the path (else take it again)."""

from __future__ import annotations

import fcntl
import os


def take_pid_lock(path: str) -> int | str:
    """The locked file's descriptor (this pid written in it; `release_pid_lock` it), or, where
    another process holds the lock, that process's pid as its file says it ("?" if unreadable).
    OSError if the file cannot be opened."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            return holder
        if _is_at(fd, path):
            break
        os.close(fd)  # its holder removed it as this process opened it: lock the one there now
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release_pid_lock(fd: int, path: str) -> None:
    """Remove the lock file (while still holding it, and only if it is the one at the path), then unlock."""
    try:
        if _is_at(fd, path):
            os.unlink(path)
    except OSError:
        pass  # left behind: the next holder reuses it
    finally:
        os.close(fd)


def _is_at(fd: int, path: str) -> bool:
    try:
        at = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (at.st_dev, at.st_ino)

"""The hand-off between a single-threaded loop and the thread that serves scrapes: the scrape
asks, the loop publishes an immutable snapshot at its next tick, the scrape reads it. The loop
does the work only when someone scrapes, and never waits for the scrape thread."""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class SnapshotBoard(Generic[T]):
    def __init__(self) -> None:
        self._wanted = threading.Event()
        self._published = threading.Condition()
        self._snapshot: T | None = None
        self._generation = 0

    @property
    def wanted(self) -> bool:
        """Whether a scrape waits for a fresh snapshot (the loop checks this at each tick)."""
        return self._wanted.is_set()

    def publish(self, snapshot: T) -> None:
        """The loop's side: the snapshot scrapes read from now on."""
        with self._published:
            self._snapshot = snapshot
            self._generation += 1
            self._wanted.clear()
            self._published.notify_all()

    def latest(self, timeout_s: float) -> T | None:
        """The scrape's side: a snapshot published after this call, or, if the loop does not tick
        within `timeout_s` (stopped, or busy), the last one (None before the first)."""
        with self._published:
            generation = self._generation
            self._wanted.set()
            self._published.wait_for(lambda: self._generation != generation, timeout_s)
            return self._snapshot

"""The busy periods of one simulated GPU on a virtual clock, shared by its SimGPUs in this process.

What perseus.devices.sim_activity's log is on the real clock, kept in memory: a virtual clock
exists in one process only, so the SimGPU objects of one GPU on one clock (e.g. the ranks of a
simulated job in one test) share its work here, and each counts all of it in its energy counter.
"""

from __future__ import annotations

import threading
import weakref

from perseus.clock import Clock
from perseus.devices.sim_activity import Record


class _Feed:
    """The work queued on one GPU on one virtual clock, shared by its SimGPUs in this process."""

    TRIM = 4096  # records kept before dropping those every reader has taken in

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.base = 0  # the sequence number of records[0]
        self.readers: weakref.WeakSet[SharedActivity] = weakref.WeakSet()


_feeds: weakref.WeakKeyDictionary[Clock, dict[str, _Feed]] = weakref.WeakKeyDictionary()
_feeds_lock = threading.Lock()


class SharedActivity:
    """One SimGPU's view of a `_Feed`: what ActivityLog is on the real clock, kept in memory."""

    def __init__(self, clock: Clock, path: str) -> None:
        with _feeds_lock:
            try:
                feed = _feeds.setdefault(clock, {}).setdefault(path, _Feed())
            except TypeError:  # a clock that cannot be weakly referenced: this object's own feed
                feed = _Feed()
        self._feed = feed
        with feed.lock:
            self._next = feed.base  # work still running when this object was made counts too
            feed.readers.add(self)

    def append(self, start: float, end: float, busy_w: float) -> None:
        feed = self._feed
        with feed.lock:
            feed.records.append((start, end, busy_w))
            if len(feed.records) >= 2 * feed.TRIM:
                done = min((r._next for r in feed.readers), default=feed.base + len(feed.records))
                drop = min(done - feed.base, len(feed.records) - feed.TRIM)
                if drop > 0:
                    del feed.records[:drop]
                    feed.base += drop

    def read_new(self, now: float) -> tuple[list[Record], float]:
        feed = self._feed
        with feed.lock:
            new = feed.records[max(0, self._next - feed.base) :]
            self._next = feed.base + len(feed.records)
        return new, 0.0

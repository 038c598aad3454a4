"""Run a reset callback on interpreter exit and on SIGTERM/SIGINT, then behave as before.

Each guard chains to whatever handler was installed before it, so several guards (and the
user's own handlers) compose; a signal whose previous handler was the default still ends
the process the default way after the reset.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# What signal.getsignal returns: a handler, SIG_DFL/SIG_IGN (ints), or None (not installed from Python).
_Handler = Callable[[int, FrameType | None], Any] | int | None


class ResetGuard:
    """Calls `reset` at exit and on SIGTERM/SIGINT until `close()`."""

    def __init__(self, reset: Callable[[], None], *, handle_signals: bool = True) -> None:
        self._reset = reset
        self._active = True
        self._previous: dict[int, _Handler] = {}
        atexit.register(self._at_exit)
        if not handle_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "Perseus was set up outside the main thread, so it cannot catch SIGTERM/SIGINT; "
                "clocks are still reset at exit and by the watchdog"
            )
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)

    def close(self) -> None:
        """Stop guarding; restore previous handlers where ours is still the installed one."""
        if not self._active:
            return
        self._active = False
        atexit.unregister(self._at_exit)
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._on_signal:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)

    def _at_exit(self) -> None:
        if self._active:
            self._reset_quietly()

    def _reset_quietly(self) -> None:
        try:
            self._reset()
        except Exception:
            logger.exception("resetting GPU clocks failed")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._active:
            self._reset_quietly()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:  # SIG_DFL, or a handler installed from C: die the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

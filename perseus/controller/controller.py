"""The frequency controller: sets each instruction's SM clock without stalling training.

The training thread only decides the target clock and, when it changes, drops it into a
one-element "latest target" slot; a worker thread makes the (slow) GPU call. Only the newest
target matters, so targets the worker has not reached yet are simply overwritten.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from perseus.devices.gpu import GPU
from perseus.exceptions import PlanError
from perseus.safety import ResetGuard, Watchdog

logger = logging.getLogger(__name__)

#: One instruction as the controller matches it: (kind value, microbatch, chunk).
InstructionKey = tuple[str, int, int]


@dataclass
class ControllerStats:
    """Counters for tests and logs (written by the training thread and the worker)."""

    instructions: int = 0
    requests: int = 0  # targets handed to the worker (changes only)
    applied: int = 0  # GPU calls the worker made
    errors: int = 0
    mismatches: int = 0


class FrequencyController:
    """Applies one GPU's per-instruction clock plan.

    Modes: `set_uniform(f)` (every instruction at `f`; None = default clocks) or
    `set_plan(order, frequencies)` (instruction i of each iteration at frequencies[i]; an
    instruction out of order drops the rank to default clocks until the next plan).
    Frequencies outside the GPU's supported list are refused with PlanError and never set.

    Clocks go back to default on `close()`, at interpreter exit, on SIGTERM/SIGINT
    (`handle_signals`), and, with `watchdog`, from a separate process if this one is SIGKILLed.
    """

    def __init__(self, gpu: GPU, *, handle_signals: bool = True, watchdog: bool = True) -> None:
        self.gpu = gpu
        self.stats = ControllerStats()
        self._supported = frozenset(gpu.supported_frequencies())
        self._enabled = gpu.can_change_clocks()
        if not self._enabled:
            logger.warning(
                "%r: this process may not change GPU clocks; Perseus only measures "
                "(run as root or grant CAP_SYS_ADMIN to apply plans)",
                gpu,
            )
        # Plan state (training thread only).
        self._uniform: int | None = None
        self._keys: tuple[InstructionKey, ...] | None = None
        self._freqs: tuple[int, ...] = ()
        self._plan_version = 0
        self._cursor = 0
        self._fallback = False
        # Training thread -> worker.
        self._requested: int | None = None
        self._slot: int | None = None
        self._seq = 0
        self._wake = threading.Event()
        # Worker state.
        self._gpu_lock = threading.RLock()  # serialises GPU writes with reset() from any thread
        self._applied: int | None = None
        self._done_seq = 0
        self._done = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"perseus-controller-{gpu.index}", daemon=True)
        self._worker.start()
        self._guard = ResetGuard(self.reset, handle_signals=handle_signals)
        # SM clocks only: the controller never sets a power limit, so it leaves one alone.
        self._watchdog = Watchdog.for_gpus([gpu], power_limit=False) if watchdog and self._enabled else None

    # Plans (set at iteration boundaries)
    def set_uniform(self, frequency: int | None) -> None:
        """Run every instruction at `frequency` (None: the GPU's default clocks)."""
        if frequency is not None:
            self._check([frequency])
        self._keys = None
        self._uniform = frequency
        self._fallback = False

    def set_plan(self, order: Sequence[InstructionKey], frequencies: Sequence[int], version: int = 0) -> None:
        """Run instruction `order[i]` at `frequencies[i]`, every iteration from the next one on."""
        if len(order) != len(frequencies):
            raise PlanError(
                f"plan v{version} has {len(frequencies)} frequencies for {len(order)} instructions; "
                "the planner and this rank disagree on the schedule (same schedule and microbatches?)"
            )
        self._check(frequencies)
        self._keys = tuple((str(k), int(m), int(c)) for k, m, c in order)
        self._freqs = tuple(int(f) for f in frequencies)
        self._plan_version = version
        self._cursor = 0
        self._fallback = False

    def begin_iteration(self) -> None:
        """A new iteration starts: the plan starts again from its first instruction."""
        self._cursor = 0

    @property
    def enabled(self) -> bool:
        """False when this process may not change the GPU's clocks (then nothing is applied)."""
        return self._enabled

    @property
    def fallen_back(self) -> bool:
        """True once an out-of-order instruction dropped this plan to default clocks."""
        return self._fallback

    # Hot path (training thread)
    def before_instruction(self, kind: str, microbatch: int, chunk: int = 0) -> None:
        """Set the clock for the instruction about to run. Never blocks on the GPU."""
        self.stats.instructions += 1
        keys = self._keys
        if keys is None:
            target = self._uniform
        elif self._fallback:
            target = None
        else:
            i = self._cursor
            if i < len(keys) and keys[i] == (kind, microbatch, chunk):
                target = self._freqs[i]
                self._cursor = i + 1
            else:
                self._mismatch(i, kind, microbatch, chunk)
                target = None
        if target != self._requested:
            self._request(target)

    def wait_applied(self, timeout: float = 1.0) -> bool:
        """Wait until the worker has applied the latest target (profiling needs exact clocks)."""
        seq = self._seq
        with self._done:
            return self._done.wait_for(lambda: self._done_seq >= seq or self._closed, timeout)

    def apply_now(self, frequency: int | None, timeout: float = 1.0) -> bool:
        """Request `frequency` outside any instruction and wait until it is applied."""
        if frequency is not None:
            self._check([frequency])
        if frequency != self._requested:
            self._request(frequency)
        return self.wait_applied(timeout)

    def _request(self, target: int | None) -> None:
        """Hand `target` to the worker (the newest target replaces any not yet applied)."""
        self._requested = target
        self._slot = target
        self._seq += 1
        self.stats.requests += 1
        self._wake.set()

    # Safety
    def reset(self) -> None:
        """Put the GPU back at default clocks now (safe from any thread and signal handlers)."""
        self._requested = None
        self._slot = None
        with self._gpu_lock:
            if self._enabled:
                try:
                    self.gpu.reset_sm_clock()
                except Exception:
                    logger.exception("%r: could not reset SM clocks", self.gpu)
            self._applied = None

    def close(self) -> None:
        """Stop the worker and reset clocks. Idempotent."""
        if self._closed:
            return
        with self._gpu_lock:
            self._closed = True
        self._wake.set()
        self._worker.join(timeout=5.0)
        self.reset()
        self._guard.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        with self._done:
            self._done.notify_all()

    def __enter__(self) -> FrequencyController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Internals
    def _check(self, frequencies: Sequence[int]) -> None:
        bad = sorted({int(f) for f in frequencies if f not in self._supported}, reverse=True)
        if bad:
            raise PlanError(
                f"{self.gpu!r} does not support SM clock(s) {', '.join(map(str, bad))} MHz; "
                f"supported: {min(self._supported)}-{max(self._supported)} MHz "
                "(was the plan made for another GPU model?)"
            )

    def _mismatch(self, index: int, kind: str, microbatch: int, chunk: int) -> None:
        self._fallback = True
        self.stats.mismatches += 1
        expected = self._keys[index] if self._keys is not None and index < len(self._keys) else None
        logger.warning(
            "%r: instruction %s (microbatch %d, chunk %d) at position %d does not match plan v%d "
            "(expected %s); running at default clocks until the next plan",
            self.gpu,
            kind,
            microbatch,
            chunk,
            index,
            self._plan_version,
            "nothing more this iteration"
            if expected is None
            else f"{expected[0]} mb {expected[1]} chunk {expected[2]}",
        )

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            seq = self._seq
            target = self._slot
            with self._gpu_lock:
                if self._closed:
                    break
                if target != self._applied:
                    self._apply(target)
            with self._done:
                self._done_seq = seq
                self._done.notify_all()

    def _apply(self, target: int | None) -> None:
        if not self._enabled:
            self._applied = target
            return
        if target is not None and target not in self._supported:
            logger.error("%r: refusing unsupported SM clock %s MHz", self.gpu, target)
            return
        try:
            if target is None:
                self.gpu.reset_sm_clock()
            else:
                self.gpu.lock_sm_clock(target)
            self._applied = target
            self.stats.applied += 1
        except Exception:
            self.stats.errors += 1
            if self.stats.errors == 1:
                logger.exception("%r: setting SM clock to %s failed; training continues", self.gpu, target)

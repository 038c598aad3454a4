"""The frequency controller: sets each instruction's SM clock without stalling training.

The training thread only decides the target clock and, when it changes, drops it into a
one-element "latest target" slot; a worker thread makes the (slow) GPU call. Only the newest
target matters, so targets the worker has not reached yet are simply overwritten.

A clock change comes into force a switch latency after the call (perseus.controller.latency);
work issued meanwhile runs at the old clock. So, running a plan, a change to a *higher* clock is
issued that long before the instruction needing it starts: the previous instruction's tail
runs faster (never slower than planned), and the instruction itself runs at its clock from its
start. When it starts is predicted from the previous iteration (the time from one instruction's
start to the next's); when the instruction before it is shorter than the switch takes, from an
earlier instruction of the same clock, and the instructions in between keep that clock's
request alone (`_hold`). A change to a lower clock is issued as the instruction starts: its first
moments run at the old, higher clock, again never slower than planned. On a GPU that tells
its clock in force (a simulated one) the controller counts, per iteration, the instructions
that did not run at their planned clock (`off_clock`): whose clock in force as they ended --
or, when the next instruction's change was issued early, just before it -- was another.

`settle()` waits until the clock last asked for is in force and says since when: what the
online profiler needs to time instructions at exactly one clock.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from perseus.controller.latency import SwitchLatency, early_lead_s, switch_latency
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.exceptions import PlanError
from perseus.safety import ResetGuard, Watchdog

logger = logging.getLogger(__name__)

#: One instruction as the controller matches it: (kind value, microbatch, chunk).
InstructionKey = tuple[str, int, int]
#: A clock change: (in force from, MHz).
ClockChange = tuple[float, int]


@dataclass
class ControllerStats:
    """Counters for tests and logs (written by the training thread and the worker)."""

    instructions: int = 0
    requests: int = 0  # targets handed to the worker (changes only)
    applied: int = 0  # GPU calls the worker made
    errors: int = 0
    mismatches: int = 0
    early: int = 0  # changes to a higher clock issued ahead of the instruction needing them


class FrequencyController:
    """Applies one GPU's per-instruction clock plan.

    Modes: `set_uniform(f)` (every instruction at `f`; None = default clocks) or
    `set_plan(order, frequencies)` (instruction i of each iteration at frequencies[i]; an
    instruction out of order drops the rank to default clocks until the next plan).
    Frequencies outside the GPU's supported list are refused with PlanError and never set.

    Clocks go back to default on `close()`, at interpreter exit, on SIGTERM/SIGINT
    (`handle_signals`), and, with `watchdog`, from a separate process if this one is SIGKILLed.
    `latency`: seconds a change to a clock takes to come into force (default: see
    perseus.controller.latency).
    """

    def __init__(
        self,
        gpu: GPU,
        *,
        handle_signals: bool = True,
        watchdog: bool = True,
        latency: SwitchLatency | None = None,
    ) -> None:
        self.gpu = gpu
        self.stats = ControllerStats()
        self.latency = latency or switch_latency(gpu)
        self._clock = gpu.clock
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
        self._next_change: tuple[int | None, ...] = ()  # see _next_changes
        self._hold = 0  # planned instructions still to come that leave an early change to a higher clock alone
        self._plan_version = 0
        self._cursor = 0
        self._fallback = False
        # Starts of the plan's instructions (clock time), this iteration and the last one.
        self._starts: list[float] = []
        self._last_starts: list[float] = []
        self._next_first: float | None = None  # the last iteration's end to this one's first start
        self._timer: object | None = None  # a virtual clock's pending early change
        # Off-clock counting (GPUs that tell their clock in force).
        self._tells_clock = isinstance(gpu, SimGPU)
        self._planned: int | None = None  # the current instruction's planned clock (when counting)
        self._early_for: int | None = None  # the request seq of the next instruction's early change
        self._before_early: tuple[int, int] | None = None  # (seq, clock in force) just before an early change
        self._off_clock = 0
        # Training thread -> worker.
        self._requested: int | None = None
        self._slot: tuple[int | None, int] = (None, 0)  # (target, seq): apply now
        self._early: tuple[int | None, float, int] | None = None  # (target, not before, seq): apply then
        self._seq = 0
        self._immediate_seq = 0
        self._wake = threading.Event()
        # Worker state.
        self._gpu_lock = threading.RLock()  # serialises GPU writes with reset() from any thread
        self._applied: int | None = None
        self._change: ClockChange | None = None
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
        self._hold = 0

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
        self._next_change = _next_changes(self._freqs)
        self._hold = 0
        self._plan_version = version
        self._cursor = 0
        self._fallback = False
        self._starts, self._last_starts, self._next_first = [], [], None

    def begin_iteration(self) -> None:
        """A new iteration starts: the plan starts again from its first instruction."""
        self._cursor = 0
        if self._keys is not None and len(self._starts) == len(self._keys):
            self._last_starts = self._starts
        self._starts = []
        self._off_clock = 0
        self._planned = None

    @property
    def off_clock(self) -> int | None:
        """This iteration's instructions (so far) that ran at a clock other than planned (see the
        module docstring). None unless running a plan on a GPU that tells its clock in force."""
        if self._keys is None or not self._tells_clock or not self._enabled:
            return None
        return self._off_clock

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
        position = None
        if keys is None:
            target = self._uniform
        elif self._fallback:
            target = None
        else:
            i = self._cursor
            if i < len(keys) and keys[i] == (kind, microbatch, chunk):
                target = self._freqs[i]
                self._cursor = position = i + 1
            else:
                self._mismatch(i, kind, microbatch, chunk)
                target = None
        holding = position is not None and self._hold > 0
        if holding:
            self._hold -= 1  # an early change to the next, higher clock is under way: leave it alone
        elif target != self._requested or self._early_pending():
            self._request(target)  # also makes an early change not yet applied apply now
        if position is not None:
            self._planned_start(position - 1, holding)

    def after_instruction(self) -> None:
        """The instruction ended: count it if it did not end at its planned clock (see the module docstring)."""
        planned, self._planned = self._planned, None
        if planned is None:
            return
        early, before = self._early_for, self._before_early
        if early is not None and before is not None and before[0] == early:
            clock = before[1]  # the next instruction's clock came in early: what ran just before it
        else:
            clock = self.gpu.sm_clock()
        if clock != planned:
            self._off_clock += 1

    def _planned_start(self, i: int, holding: bool) -> None:
        """Instruction `i` of the plan starts now: note when, check its clock, and issue the next
        change early if it raises the clock (unless an earlier instruction did: `holding`)."""
        now = self._clock.now()
        if not self._starts and self._last_starts:
            self._next_first = now - self._last_starts[-1]
        self._starts.append(now)
        self._early_for = None
        if self._tells_clock and self._enabled:
            self._planned = self._freqs[i]
        j = self._next_change[i]
        if holding or j is None or len(self._last_starts) != len(self._freqs):
            return
        target = self._freqs[j % len(self._freqs)]
        gap = self._predicted_gap(i, j)
        if target <= self._freqs[i] or gap is None:
            return
        lead = early_lead_s(self.latency(target))
        later = self._predicted_gap(i + 1, j) if i + 1 < j else None
        if later is not None and later > lead:
            return  # a later instruction of this clock issues it, nearer to when it is needed
        self._request(target, not_before=now + gap - lead if gap > lead else None)
        self._hold = j - i - 1
        self._early_for = self._seq
        self.stats.early += 1

    def _predicted_gap(self, i: int, j: int) -> float | None:
        """From instruction `i`'s start to instruction `j`'s (an index past the plan's length is the
        next iteration's instruction that much into it), as the last iteration ran them; None
        before that is known."""
        last, n = self._last_starts, len(self._freqs)
        if i >= n:
            return last[j - n] - last[i - n]
        if j < n:
            return last[j] - last[i]
        if self._next_first is None:
            return None
        return last[n - 1] - last[i] + self._next_first + last[j - n] - last[0]

    def wait_applied(self, timeout: float = 1.0) -> bool:
        """Wait until the worker has applied the latest target asked for now (not an early one)."""
        seq = self._immediate_seq
        with self._done:
            return self._done.wait_for(lambda: self._done_seq >= seq or self._closed, timeout)

    def settle(self, timeout: float = 1.0) -> ClockChange | None:
        """Wait until the latest target is applied and in force; the change that set it, as
        (in force from, MHz), or None if this process may not change clocks."""
        if not self._enabled:
            return None
        self.wait_applied(timeout)
        change = self._change
        if change is None:  # nothing applied yet: the default clock, in force all along
            return (-math.inf, self.gpu.max_frequency())
        left = change[0] - self._clock.now()
        if left > 0:
            self._clock.sleep(left)
        return change

    def apply_now(self, frequency: int | None, timeout: float = 1.0) -> bool:
        """Request `frequency` outside any instruction and wait until it is applied."""
        if frequency is not None:
            self._check([frequency])
        if frequency != self._requested:
            self._request(frequency)
        return self.wait_applied(timeout)

    def _request(self, target: int | None, not_before: float | None = None) -> None:
        """Hand `target` to the worker (the newest target replaces any not yet applied), to apply
        now or, with `not_before`, at that time of the GPU's clock."""
        self._cancel_timer()
        self._requested = target
        self._seq += 1
        self.stats.requests += 1
        if not_before is None:
            self._immediate_seq = self._seq
            self._slot = (target, self._seq)
        elif getattr(self._clock, "every", None) is not None:
            # A virtual clock: the change is made when the clock gets there, in the thread moving it.
            delay = max(not_before - self._clock.now(), 1e-9)
            seq = self._seq
            self._timer = self._clock.every(delay, lambda: self._fire(target, seq))  # type: ignore[attr-defined]
            return
        else:
            self._early = (target, not_before, self._seq)
        self._wake.set()

    def _early_pending(self) -> bool:
        """An early change is waiting for its time."""
        early = self._early
        return self._timer is not None or (early is not None and early[2] > self._done_seq)

    def _fire(self, target: int | None, seq: int) -> None:
        """A virtual clock reached an early change: apply it now (and wait, so time stays exact)."""
        self._cancel_timer()
        self._note_before_early(seq)
        self._seq += 1
        self._immediate_seq = self._seq
        self._slot = (target, self._seq)
        self._wake.set()
        self.wait_applied()

    def _cancel_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()  # type: ignore[attr-defined]

    # Safety
    def reset(self) -> None:
        """Put the GPU back at default clocks now (safe from any thread and signal handlers)."""
        self._cancel_timer()
        self._requested = None
        self._early = None
        self._slot = (None, self._slot[1])
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
        self._cancel_timer()
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
        self._hold = 0
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
            if self._closed:
                break
            target, seq = self._slot
            if seq > self._done_seq and not self._make(target, seq):
                break
            early = self._early
            if early is None or early[2] <= self._done_seq:
                continue
            wait = early[1] - self._clock.now()
            if wait > 0 and self._wake.wait(wait):
                continue  # a newer target came meanwhile: look again
            if self._early is not early:
                continue
            self._note_before_early(early[2])
            if not self._make(early[0], early[2]):
                break

    def _note_before_early(self, seq: int) -> None:
        """Read the clock in force just before early change `seq` (see `after_instruction`)."""
        if self._tells_clock and self._enabled:
            self._before_early = (seq, self.gpu.sm_clock())

    def _make(self, target: int | None, seq: int) -> bool:
        """Apply `target` (request `seq`) and tell waiters; False once closed."""
        with self._gpu_lock:
            if self._closed:
                return False
            if target != self._applied:
                self._apply(target)
        with self._done:
            self._done_seq = max(self._done_seq, seq)
            self._done.notify_all()
        return True

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
            frequency = self.gpu.max_frequency() if target is None else target
            self._change = (self._clock.now() + self.latency(target), frequency)
            self.stats.applied += 1
        except Exception:
            self.stats.errors += 1
            if self.stats.errors == 1:
                logger.exception("%r: setting SM clock to %s failed; training continues", self.gpu, target)


def _next_changes(freqs: Sequence[int]) -> tuple[int | None, ...]:
    """Per instruction i, the next instruction at another clock: its index, or len(freqs) plus its
    index when that is in the next iteration; None when the plan has one clock."""
    n = len(freqs)
    wrap = next((k for k in range(n) if freqs[k] != freqs[-1]), None) if n else None
    out: list[int | None] = [None] * n
    for i in range(n - 1, -1, -1):
        if i == n - 1:
            out[i] = None if wrap is None else n + wrap
        else:
            out[i] = i + 1 if freqs[i + 1] != freqs[i] else out[i + 1]
    return tuple(out)

"""Simulated GPUs: run, test and demo everything without a GPU.

A simulated GPU behaves like a real one where Perseus can tell:
- Work runs at the locked SM clock, slowed further when its power would exceed the power
  limit, taking the time and energy of perseus.devices.sim_work's model; the GPU models
  (clocks, power limits, power figures) are perseus.devices.sim_presets'.
- The energy counter (mJ) integrates idle power plus the busy power of the work issued
  through `execute`, analytically over the GPU's clock (real or virtual), so it never
  decreases and needs no background thread. Like NVML's, it can advance in steps (a read
  returns the energy at the last update instant), and power readings can be averaged, partly
  sampled and noisy; a clock change can take effect a while after the call, work issued
  meanwhile running at the old clock. How much of this a GPU does is its `realism`
  (perseus.devices.sim_realism): none for a SimGPU made directly, the default mode's for
  `sim_gpus` and `PERSEUS_GPU=sim:...`. Like hardware, a GPU counts the work of every
  SimGPU object for it: on the real clock, in any process (see perseus.devices.sim_activity;
  `perseus monitor -- CMD` measures the simulated work CMD runs); on a virtual clock, in this
  process, among the objects sharing that clock (perseus.devices.sim_shared_activity).
- `synchronize` is a device sync: it waits until all work queued on the GPU has finished,
  whichever SimGPU object (or, on the real clock, process) issued it.
- The locked SM clock, the power limit and a throttle factor (`slowdown`, a straggler whose
  work takes that many times longer) persist in a small record per GPU (perseus.devices.sim_record)
  in a runtime folder ($PERSEUS_SIM_DIR, default /tmp/perseus-sim-<uid>), shared by every process: a
  lock left by a killed process stays visible until `perseus reset` clears it. The file
  exists only while the GPU is away from its defaults; a clock change in flight is a second
  file beside it (perseus.devices.sim_switch).

Two SimGPUs running work on the same GPU at once both add their power (real GPUs would
time-share); the counter's origin is its last update before the SimGPU object was made.

Making a simulated GPU do work in your own script (e.g. what one training step would cost on
the GPU, so that the power limit and clocks change its time and energy):

    from perseus.devices import Work, emulate

    emulate(monitor.gpus, Work(0.05, alpha=0.3))  # 50 ms at full clock on each simulated GPU

`emulate` skips real GPUs, so the same script runs on both; `SimGPU.execute(work,
blocking=False)` queues work on one GPU as a CUDA kernel launch would.
"""

from __future__ import annotations

import bisect
import fcntl
import functools
import math
import os
import threading
import uuid as uuid_lib
from collections.abc import Iterable
from dataclasses import dataclass

from perseus.clock import REAL_CLOCK, Clock, RealClock
from perseus.devices import sim_record
from perseus.devices.gpu import GPU
from perseus.devices.sim_activity import ActivityLog
from perseus.devices.sim_presets import SimPreset, get_preset
from perseus.devices.sim_realism import IDEAL, SimRealism, sim_realism
from perseus.devices.sim_shared_activity import SharedActivity
from perseus.devices.sim_switch import ClockSwitch, SwitchFile, clock_token
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError, DeviceError, DevicePermissionError

SIM_DIR_ENV = "PERSEUS_SIM_DIR"


def sim_uuid(preset: str, index: int) -> str:
    """Simulated GPU `index` of model `preset`'s UUID: the same in every process and folder."""
    return "GPU-" + str(uuid_lib.uuid5(uuid_lib.NAMESPACE_URL, f"perseus-sim:{preset}:{index}"))


def sim_dir() -> str:
    """The runtime folder holding simulated GPU state files."""
    return os.environ.get(SIM_DIR_ENV) or f"/tmp/perseus-sim-{os.getuid()}"


@dataclass(frozen=True)
class _State:
    """What persists across processes, like settings on real hardware. None: the default."""

    sm_clock_mhz: int | None = None
    power_limit_mw: int | None = None
    slowdown: float = 1.0


_DEFAULT_STATE = _State()


class SimGPU(GPU):
    """A simulated GPU; see the module docstring for the model."""

    def __init__(
        self,
        preset: str | SimPreset,
        index: int = 0,
        clock: Clock | None = None,
        state_dir: str | None = None,
        realism: SimRealism | str | None = None,
    ) -> None:
        """realism: how this GPU departs from an ideal one (a SimRealism, or a mode, "ideal" or
        "realistic", for `sim_realism`); None: ideal, exact in every reading."""
        self.preset = get_preset(preset)
        self.index = index
        if isinstance(realism, str):
            realism = sim_realism(self.preset, realism)
        self.realism = realism or IDEAL
        self._clock = clock or REAL_CLOCK
        self._now = self._clock.now
        self._freqs = self.preset.frequencies
        self._ascending = sorted(self._freqs)
        self._idle_w = self.preset.idle_w
        self._path = os.path.join(state_dir or sim_dir(), f"{self.preset.name}-{index}.json")
        # (stat key, state) last read or written, and (record, state) last decoded or encoded: each
        # a pair assigned at once, as the controller's worker thread writes while others read.
        self._state_memo: tuple[sim_record.Key | None, _State] = (None, _DEFAULT_STATE)
        self._decoded = (b"", _DEFAULT_STATE)
        self._switch = SwitchFile(self._path[: -len(".json")] + ".switch.json", clock_token(self._clock))
        self._lock = threading.Lock()
        # Energy: idle power since _origin, plus the extra (busy - idle) energy of work finished
        # by the counter's last update, plus the part of pending work [(start, end, extra_w)]
        # done by then. Power readings look back over `_history_s`: folded work kept in _recent.
        # On the counter's grid (its last update before now), like every other SimGPU of this GPU: a
        # counter that starts between updates would read its first window against an exact
        # instant and every later one against an update, off by up to a step on that first window.
        self._origin = _grid_instant(self._clock.now(), self.realism.counter_period_s)
        self._extra_j = 0.0
        self._pending: list[tuple[float, float, float]] = []
        self._recent: list[tuple[float, float, float]] = []
        r = self.realism
        self._history_s = r.power_window_s + r.power_update_s
        self._busy_until = self._origin
        # Work is shared by every SimGPU of this GPU: on the real clock with other processes
        # through the activity log, on a virtual clock with this process's objects on that clock.
        self._activity: ActivityLog | SharedActivity
        if isinstance(self._clock, RealClock):
            log = os.path.join(os.path.dirname(self._path), "activity", f"{self.preset.name}-{index}.log")
            self._activity = ActivityLog(log, self._idle_w)
        else:
            self._activity = SharedActivity(self._clock, self._path)

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def state_path(self) -> str:
        return self._path

    # Reads
    def name(self) -> str:
        return f"{self.preset.product} (simulated)"

    def uuid(self) -> str:
        return sim_uuid(self.preset.name, self.index)

    def has_energy_counter(self) -> bool:
        return True

    def energy_counter_period_s(self) -> float:
        return self.realism.counter_period_s

    def energy_mj(self) -> float:
        """The energy counter: exact now on an ideal GPU; else the energy at its last update."""
        with self._lock:
            now = self._now()
            at = self._counter_instant(now)
            partial = self._settle(now, at)
            extra = self._extra_j
        return (self._idle_w * (at - self._origin) + extra + partial) * 1000.0

    def power_mw(self) -> float:
        """The power reading: instantaneous on an ideal GPU; else as `realism` says (refreshed on a
        grid, averaged over a window of which only part is sampled, with noise)."""
        r = self.realism
        with self._lock:
            now = self._now()
            self._settle(now, self._counter_instant(now))
            at = _grid_instant(now, r.power_update_s)
            if r.power_window_s == 0:
                extra_w = sum(x for start, end, x in (*self._recent, *self._pending) if start <= at < end)
            else:
                samples = _sampled_spans(at, r.power_window_s, r.power_update_s, r.power_coverage)
                extra_w = sum(self._extra_j_between(a, b) for a, b in samples) / sum(b - a for a, b in samples)
        return (self._idle_w + extra_w) * r.noise(self.index, at) * 1000.0

    def _counter_instant(self, now: float) -> float:
        """The energy counter's last update instant (now where it updates continuously)."""
        return max(self._origin, _grid_instant(now, self.realism.counter_period_s))

    def _settle(self, now: float, horizon: float) -> float:
        """Take in work issued since the last call (by any SimGPU of this GPU), fold work that
        finished by `horizon` (never decreasing, at most `now`) into the total, and return the
        energy (J) that work still pending had added by `horizon`. Call with the lock held."""
        records, missed_j = self._activity.read_new(now)
        if records or missed_j:
            self._extra_j += missed_j
            origin, idle = self._origin, self._idle_w
            seen_from = now - self._history_s
            for start, end, busy_w in records:
                if start < origin and end > seen_from and self._history_s:
                    # Before this counter began: no energy of its own, but power readings look back
                    # over it (an outsider's new process read idle power beside a busy GPU).
                    self._recent.append((start, min(end, origin), busy_w - idle))
                if end > origin:
                    self._pending.append((max(start, origin), end, busy_w - idle))
        if self._history_s:
            keep_from = now - self._history_s
            if self._recent and self._recent[0][1] < keep_from:
                self._recent = [s for s in self._recent if s[1] >= keep_from]
        if not self._pending:
            return 0.0
        partial = 0.0
        running = []
        for segment in self._pending:
            start, end, extra_w = segment
            if end <= horizon:
                self._extra_j += extra_w * (end - start)
                if self._history_s:
                    self._recent.append(segment)
            else:
                running.append(segment)
                if start < horizon:
                    partial += extra_w * (horizon - start)
        self._pending = running
        return partial

    def _extra_j_between(self, a: float, b: float) -> float:
        """Busy energy above idle (J) between `a` and `b`, from work this object still remembers."""
        total = 0.0
        for start, end, extra_w in (*self._recent, *self._pending):
            overlap = min(b, end) - max(a, start)
            if overlap > 0:
                total += extra_w * overlap
        return total

    def supported_frequencies(self) -> list[int]:
        return list(self._freqs)

    def max_frequency(self) -> int:
        return self._freqs[0]

    def sm_clock(self) -> int:
        """The SM clock in force now (a clock change in flight has not changed it yet)."""
        return self._clock_at(self._now(), self._state())

    def _clock_at(self, t: float, state: _State) -> int:
        switch = self._switch_in_flight(state)
        locked = switch.from_mhz if switch is not None and t < switch.at else state.sm_clock_mhz
        return self._freqs[0] if locked is None else locked

    def _switch_in_flight(self, state: _State) -> ClockSwitch | None:
        """The recorded change to the state's locked clock, if one was recorded (it may be done)."""
        switch = self._switch.read()
        return switch if switch is not None and switch.to_mhz == state.sm_clock_mhz else None

    def at_defaults(self) -> bool:
        """Whether this GPU runs at its default clock, power limit and speed now."""
        state = self._state()
        return state == _DEFAULT_STATE and self._clock_at(self._now(), state) == self._freqs[0]

    def power_limit_mw(self) -> int:
        limit = self._state().power_limit_mw
        return self.default_power_limit_mw() if limit is None else limit

    def power_limit_range_mw(self) -> tuple[int, int]:
        return round(self.preset.min_power_limit_w * 1000), round(self.preset.max_power_limit_w * 1000)

    def default_power_limit_mw(self) -> int:
        return round(self.preset.tdp_w * 1000)

    def slowdown(self) -> float:
        """Throttle factor: work takes this many times longer (1.0: healthy)."""
        return self._state().slowdown

    # Writes
    def lock_sm_clock(self, mhz: int) -> None:
        if mhz not in self._freqs:
            raise ConfigError(
                f"{self!r} does not support SM clock {mhz!r} MHz; nearest supported: "
                f"{self._nearest(mhz)} (supported: {self.preset.min_mhz}-{self.preset.max_mhz} MHz "
                f"in {self.preset.step_mhz} MHz steps)"
            )
        self._update(sm_clock_mhz=int(mhz))

    def reset_sm_clock(self) -> None:
        self._update(sm_clock_mhz=None)

    def clock_switch_latency_s(self, target_mhz: int | None = None) -> float:
        """Seconds from a change to `target_mhz` (None: the default clock) until it is in force."""
        return self.realism.switch_latency_for(self.preset, self._freqs[0] if target_mhz is None else target_mhz)

    def set_power_limit_mw(self, mw: int) -> None:
        self._update(power_limit_mw=self.check_power_limit_mw(mw))

    def reset_power_limit(self) -> None:
        self._update(power_limit_mw=None)

    def set_slowdown(self, factor: float) -> None:
        """Throttle this GPU (a straggler): its work takes `factor` (>= 1) times longer, for
        every process using it, until `reset_slowdown`."""
        if not factor >= 1.0:
            raise ConfigError(f"{self!r}: slowdown must be >= 1.0 (1.2 = 20% slower), got {factor!r}")
        self._update(slowdown=float(factor))

    def reset_slowdown(self) -> None:
        self._update(slowdown=1.0)

    def can_change_clocks(self) -> bool:
        """False in privilege mode: the state folder exists and this process may not write it
        (another user's, e.g. the perseus agent's), as a real GPU refuses unprivileged writes."""
        folder = os.path.dirname(self._path)
        return not os.path.isdir(folder) or os.access(folder, os.W_OK)

    # Work
    def predict(self, work: Work, frequency: int | None = None) -> tuple[float, float]:
        """(time_s, energy_j) of `work` at `frequency` (default: the SM clock in force now) under
        the current power limit and slowdown: the ground truth a GPU held at that clock measures."""
        state = self._state()
        if frequency is None:
            frequency = self._clock_at(self._now(), state)
        return self._cost(work, frequency, state)

    def _cost(self, work: Work, frequency: int, state: _State) -> tuple[float, float]:
        limit_mw = self.default_power_limit_mw() if state.power_limit_mw is None else state.power_limit_mw
        return predict(self.preset, work, frequency, limit_mw / 1000.0, state.slowdown)

    def execute(self, work: Work, blocking: bool = True) -> float:
        """Run `work` at the SM clock in force when it runs, under the power limit and slowdown
        read at issue time.

        Work queues behind earlier non-blocking work of this object, as on a CUDA stream. Work
        still running when a clock change comes into force runs the rest at the new clock. With
        `blocking`, wait on the GPU's clock until all work queued on the GPU has finished (see
        `synchronize`); without it, return at once, as a kernel launch does. Returns the
        work's duration in seconds. Its energy lands in the energy counter of every SimGPU of
        this GPU. To run work on several GPUs at once, see `emulate`.
        """
        state = self._state()
        with self._lock:
            start = max(self._now(), self._busy_until)
            segments = self._run(work, start, state)
            end = segments[-1][1] if segments else start
            self._busy_until = end
            warm = self.realism.thermal_factor(start - self._origin)
            for seg_start, seg_end, busy_w in segments:
                self._activity.append(seg_start, seg_end, busy_w * warm)
        if blocking:
            self.synchronize()
        return end - start

    def _run(self, work: Work, start: float, state: _State) -> list[tuple[float, float, float]]:
        """The (start, end, busy power) pieces of `work` started at `start`: one per clock it runs at."""
        switch = self._switch_in_flight(state)
        if switch is not None and start < switch.at:
            old = self._freqs[0] if switch.from_mhz is None else switch.from_mhz
            t_old, e_old = self._cost(work, old, state)
            if start + t_old > switch.at:  # still running when the new clock comes into force
                done = (switch.at - start) / t_old
                t_new, e_new = self._cost(work, self._clock_at(switch.at, state), state)
                rest = (1.0 - done) * t_new
                return [(start, switch.at, e_old / t_old)] + (
                    [(switch.at, switch.at + rest, e_new / t_new)] if rest > 0 else []
                )
            return [(start, start + t_old, e_old / t_old)] if t_old > 0 else []
        duration, energy_j = self._cost(work, self._clock_at(start, state), state)
        return [(start, start + duration, energy_j / duration)] if duration > 0 else []

    def synchronize(self) -> None:
        """Wait until all work queued on this GPU has finished, like a device sync: this
        object's, and that of every other SimGPU of the same GPU (in any process on the real
        clock; in this process, on the same clock, on a virtual one)."""
        with self._lock:
            now = self._now()
            self._settle(now, self._counter_instant(now))
            until = self._busy_until
            for segment in self._pending:  # unfinished at the counter's last update: may run past now
                if segment[1] > until:
                    until = segment[1]
        if until > now:
            self._clock.sleep(until - now)

    # Persistent state
    def _nearest(self, mhz: float) -> str:
        i = bisect.bisect_left(self._ascending, mhz)
        near = sorted({self._ascending[j] for j in (i - 1, i) if 0 <= j < len(self._ascending)})
        return " or ".join(f"{f} MHz" for f in near)

    def _state(self) -> _State:
        """The persisted state; cheap when unchanged (one stat, no read)."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            self._state_memo = (None, _DEFAULT_STATE)
            return _DEFAULT_STATE
        key = sim_record.key(st)  # taken before the read: a write meanwhile makes the next call read again
        known, state = self._state_memo
        if key != known:
            state = self._read_state()
            self._state_memo = (key, state)
        return state

    def _read_state(self) -> _State:
        """The state file's state, decoded only when it is not the record last read or written."""
        try:
            data = sim_record.read_bytes(self._path)
            known, state = self._decoded
            if data != known:
                raw = sim_record.parse(data)
                state = _State(
                    sm_clock_mhz=raw.get("sm_clock_mhz"),
                    power_limit_mw=raw.get("power_limit_mw"),
                    slowdown=float(raw.get("slowdown", 1.0)),
                )
                self._decoded = (data, state)
            return state
        except FileNotFoundError:
            return _DEFAULT_STATE
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise DeviceError(
                f"{self!r}: cannot read its state file {self._path} ({e}); "
                "delete it or run `perseus reset` to restore defaults"
            ) from e

    def _update(self, **changes: object) -> None:
        """Change persisted fields: read-modify-write under a file lock, each record written whole.
        The controller changes clocks dozens of times an iteration, so this stays cheap: the
        folder made only when missing, the state re-read under the lock but decoded only when
        another process changed it, records encoded once per state, own writes cached.

        A reset (every change back to its default) also replaces an unreadable state file, whose
        other settings cannot be known and so go back to defaults too: `perseus reset` always works.
        A change of the locked clock records the switch in flight for the GPU's switch latency.
        """
        resetting = all(getattr(_DEFAULT_STATE, field) == value for field, value in changes.items())
        try:
            if all(getattr(self._state(), field) == value for field, value in changes.items()):
                return  # already so: no write (the controller re-locks the same clock often)
        except DeviceError:
            pass  # unreadable: decided below, under the lock
        folder = os.path.dirname(self._path)
        try:
            lock = _open_lock(folder)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._state_memo = (None, _DEFAULT_STATE)  # unknown until written whole
                try:
                    old = self._read_state()
                except DeviceError:
                    if not resetting:
                        raise
                    old = _DEFAULT_STATE
                new = _State(
                    sm_clock_mhz=changes.get("sm_clock_mhz", old.sm_clock_mhz),  # type: ignore[arg-type]
                    power_limit_mw=changes.get("power_limit_mw", old.power_limit_mw),  # type: ignore[arg-type]
                    slowdown=changes.get("slowdown", old.slowdown),  # type: ignore[arg-type]
                )
                if new.sm_clock_mhz != old.sm_clock_mhz:
                    self._record_switch(old, new.sm_clock_mhz)
                if new == _DEFAULT_STATE:
                    try:
                        os.unlink(self._path)
                    except FileNotFoundError:
                        pass
                else:
                    self._write_state(new)
            finally:
                os.close(lock)
        except PermissionError as e:
            raise DevicePermissionError(
                f"{self!r}: only the owner of {folder} (uid {_owner(folder)}) may change this simulated GPU's clocks "
                f"and power limit, as only root may on a real one; go through the node's perseus agent "
                f"(PERSEUS_AGENT=SOCKET), or run as that user ({e})"
            ) from e
        except OSError as e:
            raise DeviceError(
                f"{self!r}: cannot write its state in {folder} ({e}); set {SIM_DIR_ENV} to a writable folder"
            ) from e

    def _record_switch(self, old: _State, target: int | None) -> None:
        """Record the change from `old`'s clock to `target`: in flight for the switch latency
        (the clock in force now stays until then), or in force at once. Under the state lock."""
        latency = self.clock_switch_latency_s(target)
        if latency == 0:
            self._switch.clear()
            return
        now = self._now()
        self._switch.write(ClockSwitch(self._clock_at(now, old), target, now + latency, clock_token(self._clock)))

    def _write_state(self, state: _State) -> None:
        data = _state_record(state)
        self._state_memo = (sim_record.write(self._path, data), state)  # under the lock: no other write since
        self._decoded = (data, state)


@functools.lru_cache(maxsize=256)
def _state_record(state: _State) -> bytes:
    """A state's record; a controller alternates among a few clocks, so each is encoded once."""
    doc = {"sm_clock_mhz": state.sm_clock_mhz, "power_limit_mw": state.power_limit_mw, "slowdown": state.slowdown}
    return sim_record.encode(doc)


def _open_lock(folder: str) -> int:
    """The descriptor of the state lock file of `folder`, made (with the folder) when missing."""
    path = os.path.join(folder, ".lock")
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    except FileNotFoundError:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)


def _owner(path: str) -> int | str:
    try:
        return os.stat(path).st_uid
    except OSError:
        return "?"


def emulate(gpus: GPU | Iterable[GPU], work: Work | float, blocking: bool = True) -> float:
    """Make every simulated GPU among `gpus` do `work` at once, as one data-parallel step would.

    work: a `Work`, or seconds at the highest clock (`Work(seconds)`: alpha 0.78, intensity 1).
    Each GPU runs it under its own power limit, clock and slowdown, so a GlobalPowerLimitOptimizer
    or Monitor measuring these GPUs sees what that work would cost there. Real GPUs are skipped
    (they do the real work), so the same script runs on both. With `blocking` (default), wait
    until all of it has finished. Returns the longest duration in seconds (0.0 without
    simulated GPUs).

        monitor = Monitor()                      # this rank's GPU(s)
        for batch in loader:
            train_step(batch)
            emulate(monitor.gpus, Work(0.05, alpha=0.3))
    """
    if not isinstance(work, Work):
        work = Work(float(work))
    simulated = [g for g in ([gpus] if isinstance(gpus, GPU) else gpus) if isinstance(g, SimGPU)]
    longest = max((g.execute(work, blocking=False) for g in simulated), default=0.0)
    if blocking:
        for gpu in simulated:
            gpu.synchronize()
    return longest


def sim_gpus(
    preset: str,
    count: int = 1,
    clock: Clock | None = None,
    realism: SimRealism | str | None = None,
    state_dir: str | None = None,
) -> list[SimGPU]:
    """`count` simulated GPUs of `preset`, indices 0..count-1, state in `state_dir` (default `sim_dir()`).

    realism: a SimRealism, or a mode ("ideal", "realistic"); None: `sim_realism(preset)`, the
    default mode with the environment's overrides (what `PERSEUS_GPU=sim:...` gets).
    """
    get_preset(preset)
    if count < 1:
        raise ConfigError(f"simulated GPU count must be >= 1, got {count}")
    if not isinstance(realism, SimRealism):
        realism = sim_realism(preset, realism)
    return [SimGPU(preset, i, clock, state_dir, realism) for i in range(count)]


def _grid_instant(now: float, period: float) -> float:
    """The last instant of a grid of `period` at or before `now` (now itself for period 0)."""
    if period == 0:
        return now
    return math.floor(now / period + 1e-9) * period


def _sampled_spans(at: float, window: float, period: float, coverage: float) -> list[tuple[float, float]]:
    """The spans a power reading refreshed at `at` averages: the last `coverage` of each
    refresh period within `window` before `at` (the whole window when it refreshes continuously)."""
    if period == 0:
        return [(at - window, at)]
    count = max(1, round(window / period))
    return [(end - coverage * period, end) for end in (at - k * period for k in range(count))]

"""Simulated GPUs: run, test and demo everything without a GPU.

A simulated GPU behaves like a real one where Perseus can tell:
- Work runs at the locked SM clock, slowed further when its power would exceed the power
  limit. For work of nominal time t0 at f_max with compute-bound fraction alpha,
  t(f) = t0 * (alpha * f_max / f + 1 - alpha) and busy power
  P(f) = P_floor + intensity * P_dyn * (f / f_max) ** gamma.
  Defaults are calibrated on the measured GPT-3 175B stage profiles on A100-SXM (1080 MHz
  takes about 1.24x the time and 0.74x the energy of 1410 MHz).
- The energy counter (mJ) integrates idle power plus the busy power of the work issued
  through `execute`, analytically over the GPU's clock (real or virtual), so it never
  decreases and needs no background thread. Like hardware, a GPU counts the work of every
  SimGPU object for it: on the real clock, in any process (see perseus.devices.sim_activity;
  `perseus monitor -- CMD` measures the simulated work CMD runs); on a virtual clock, in this
  process, among the objects sharing that clock.
- `synchronize` is a device sync: it waits until all work queued on the GPU has finished,
  whichever SimGPU object (or, on the real clock, process) issued it.
- The locked SM clock, the power limit and a throttle factor (`slowdown`, a straggler whose
  work takes that many times longer) persist in a small JSON file per GPU in a runtime
  folder ($PERSEUS_SIM_DIR, default /tmp/perseus-sim-<uid>), shared by every process: a
  lock left by a killed process stays visible until `perseus reset` clears it. The file
  exists only while the GPU is away from its defaults.

Two SimGPUs running work on the same GPU at once both add their power (real GPUs would
time-share); the counter's origin is when the SimGPU object was made.

Making a simulated GPU do work in your own script (e.g. what one training step would cost on
the GPU, so that the power limit and clocks change its time and energy):

    from perseus.devices.sim import Work, emulate

    emulate(monitor.gpus, Work(0.05, alpha=0.3))  # 50 ms at full clock on each simulated GPU

`emulate` skips real GPUs, so the same script runs on both; `SimGPU.execute(work,
blocking=False)` queues work on one GPU as a CUDA kernel launch would.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import os
import threading
import time
import uuid as uuid_lib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from perseus.atomic import write_json_atomic
from perseus.clock import REAL_CLOCK, Clock, RealClock
from perseus.devices.gpu import GPU
from perseus.devices.sim_activity import ActivityLog, Record
from perseus.exceptions import ConfigError, DeviceError

SIM_DIR_ENV = "PERSEUS_SIM_DIR"
FREQUENCY_STEP_MHZ = 15

# Calibration (see tests/devices/test_sim.py::test_calibration_against_measured_gpt3_profiles).
DEFAULT_ALPHA = 0.78
DEFAULT_GAMMA = 4.5
FLOOR_FRACTION = 0.40  # P_floor / TDP
DYNAMIC_FRACTION = 0.55  # P_dyn / TDP: intensity-1 work draws 0.95 x TDP at f_max


@dataclass(frozen=True)
class SimPreset:
    """One simulated GPU model. Power in W, frequency in MHz."""

    name: str
    product: str
    max_mhz: int
    min_mhz: int
    tdp_w: float  # default power limit
    min_power_limit_w: float
    max_power_limit_w: float
    idle_w: float  # power while idle or blocked on a peer
    gamma: float = DEFAULT_GAMMA
    clocks: tuple[int, ...] = ()  # supported SM clocks, highest first; empty: max_mhz down to min_mhz in 15 MHz

    def __post_init__(self) -> None:
        c = self.clocks
        if c and (c[0] != self.max_mhz or c[-1] != self.min_mhz or any(a <= b for a, b in zip(c, c[1:]))):
            raise ConfigError(
                f"simulated GPU preset {self.name!r}: clocks must fall from max_mhz ({self.max_mhz}) "
                f"to min_mhz ({self.min_mhz}), highest first"
            )

    @property
    def floor_w(self) -> float:
        return FLOOR_FRACTION * self.tdp_w

    @property
    def dynamic_w(self) -> float:
        return DYNAMIC_FRACTION * self.tdp_w

    @property
    def frequencies(self) -> tuple[int, ...]:
        """Supported SM clocks, highest first."""
        return self.clocks or tuple(range(self.max_mhz, self.min_mhz - 1, -FREQUENCY_STEP_MHZ))

    @property
    def step_mhz(self) -> int:
        """The step between supported clocks (the largest one, where they are uneven)."""
        f = self.frequencies
        return max((a - b for a, b in zip(f, f[1:])), default=0)


PRESETS: dict[str, SimPreset] = {
    p.name: p
    for p in (
        # Blocking power 83.64 W and 70.38 W: measured in the Perseus paper's artifact.
        SimPreset("a100-sxm", "NVIDIA A100-SXM4-40GB", 1410, 210, 400.0, 100.0, 400.0, 83.64),
        SimPreset("a100-pcie", "NVIDIA A100-PCIE-40GB", 1410, 210, 250.0, 150.0, 250.0, 55.0),
        SimPreset("h100-sxm", "NVIDIA H100 80GB HBM3", 1980, 345, 700.0, 200.0, 700.0, 115.0),
        SimPreset("a40", "NVIDIA A40", 1740, 210, 300.0, 100.0, 300.0, 70.38),
        # AMD Instinct. From AMD's public spec sheets: peak engine clock and board power (TBP), MI300X
        # 2100 MHz and 750 W; MI250X 1700 MHz and 500 W for the package (the air-cooled OAM; 560 W
        # liquid-cooled is not modelled), whose two GCDs appear as two GPUs: one GCD gets half, 250 W.
        # The clocks are the caps the amdsmi backend offers (perseus.devices.amd.clock_grid): 20 MHz
        # steps from the peak down to just above the 500 MHz floor of the GFX clock range, which is
        # amdgpu's and not on the spec sheets. Not published either, so estimates: the lowest power cap
        # (40% of TBP; a real GPU reports its own, amdsmi_get_power_cap_info) and idle power (about a
        # fifth of TBP, as the A100's measured 83.64 W is of 400 W); the power curve is the A100's.
        SimPreset(
            "mi300x", "AMD Instinct MI300X", 2100, 520, 750.0, 300.0, 750.0, 150.0, clocks=tuple(range(2100, 500, -20))
        ),
        SimPreset(
            "mi250x",
            "AMD Instinct MI250X (GCD)",
            1700,
            520,
            250.0,
            100.0,
            250.0,
            50.0,
            clocks=tuple(range(1700, 500, -20)),
        ),
    )
}


def get_preset(name: str | SimPreset) -> SimPreset:
    if isinstance(name, SimPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown simulated GPU preset {name!r}; available: {', '.join(PRESETS)} (e.g. PERSEUS_GPU=sim:a100-sxm:4)"
        ) from None


@dataclass(frozen=True)
class Work:
    """A piece of GPU work for a simulated GPU (`SimGPU.execute`, `emulate`).

    time_s: seconds it takes at the highest SM clock with no power cap.
    alpha: the compute-bound fraction, whose time scales with 1/clock (the rest, e.g. memory
    traffic, does not): 0.78 is a GPT-3 stage on an A100; lower is more memory-bound, whose
    time barely moves as the power limit drops.
    intensity: scales dynamic power (1.0: a large matmul-heavy training step).
    What it costs at a given clock and power limit: `predict` or `SimGPU.predict`.
    """

    time_s: float
    alpha: float = DEFAULT_ALPHA
    intensity: float = 1.0

    def __post_init__(self) -> None:
        if not self.time_s >= 0:
            raise ConfigError(f"Work.time_s must be >= 0 seconds, got {self.time_s!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"Work.alpha (compute-bound fraction) must be in [0, 1], got {self.alpha!r}")
        if not self.intensity >= 0:
            raise ConfigError(f"Work.intensity must be >= 0, got {self.intensity!r}")


def busy_power_w(preset: SimPreset, work: Work, frequency: float) -> float:
    """Busy power at SM clock `frequency` (before any power capping)."""
    return preset.floor_w + work.intensity * preset.dynamic_w * (frequency / preset.max_mhz) ** preset.gamma


def effective_frequency(preset: SimPreset, work: Work, frequency: float, power_limit_w: float) -> float:
    """The clock the work really runs at: `frequency`, lowered until power fits the limit.

    Never below the minimum supported clock (there the GPU draws what it draws).
    """
    if busy_power_w(preset, work, frequency) <= power_limit_w:
        return frequency
    headroom = (power_limit_w - preset.floor_w) / (work.intensity * preset.dynamic_w)
    if headroom <= 0:
        return float(preset.min_mhz)
    return max(float(preset.min_mhz), preset.max_mhz * headroom ** (1.0 / preset.gamma))


def predict(
    preset: str | SimPreset,
    work: Work,
    frequency: float,
    power_limit_w: float | None = None,
    slowdown: float = 1.0,
) -> tuple[float, float]:
    """(time_s, energy_j) of `work` with the SM clock at `frequency` and the given power limit.

    `power_limit_w` defaults to the preset's TDP; `slowdown` stretches time at the same power.
    """
    p = get_preset(preset)
    limit = p.tdp_w if power_limit_w is None else power_limit_w
    f = effective_frequency(p, work, frequency, limit)
    t = work.time_s * (work.alpha * p.max_mhz / f + 1.0 - work.alpha) * slowdown
    return t, busy_power_w(p, work, f) * t


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


class _Feed:
    """The work queued on one GPU on one virtual clock, shared by its SimGPUs in this process."""

    TRIM = 4096  # records kept before dropping those every reader has taken in

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.base = 0  # the sequence number of records[0]
        self.readers: weakref.WeakSet[_SharedActivity] = weakref.WeakSet()


_feeds: weakref.WeakKeyDictionary[Clock, dict[str, _Feed]] = weakref.WeakKeyDictionary()
_feeds_lock = threading.Lock()


class _SharedActivity:
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


class SimGPU(GPU):
    """A simulated GPU; see the module docstring for the model."""

    def __init__(
        self,
        preset: str | SimPreset,
        index: int = 0,
        clock: Clock | None = None,
        state_dir: str | None = None,
    ) -> None:
        self.preset = get_preset(preset)
        self.index = index
        self._clock = clock or REAL_CLOCK
        self._now = self._clock.now
        self._freqs = self.preset.frequencies
        self._ascending = sorted(self._freqs)
        self._idle_w = self.preset.idle_w
        self._path = os.path.join(state_dir or sim_dir(), f"{self.preset.name}-{index}.json")
        self._state_key: tuple[int, int, int] | None = None
        self._state_cache = _DEFAULT_STATE
        self._lock = threading.Lock()
        # Energy: idle power since _origin, plus the extra (busy - idle) energy of finished
        # work, plus the finished part of pending work [(start, end, extra_w)].
        self._origin = self._clock.now()
        self._extra_j = 0.0
        self._pending: list[tuple[float, float, float]] = []
        self._busy_until = self._origin
        # Work is shared by every SimGPU of this GPU: on the real clock with other processes
        # through the activity log, on a virtual clock with this process's objects on that clock.
        self._activity: ActivityLog | _SharedActivity
        if isinstance(self._clock, RealClock):
            log = os.path.join(os.path.dirname(self._path), "activity", f"{self.preset.name}-{index}.log")
            self._activity = ActivityLog(log, self._idle_w)
        else:
            self._activity = _SharedActivity(self._clock, self._path)

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
        return "GPU-" + str(uuid_lib.uuid5(uuid_lib.NAMESPACE_URL, f"perseus-sim:{self.preset.name}:{self.index}"))

    def has_energy_counter(self) -> bool:
        return True

    def energy_mj(self) -> float:
        with self._lock:
            now = self._now()
            partial = self._settle(now)
            extra = self._extra_j
        return (self._idle_w * (now - self._origin) + extra + partial) * 1000.0

    def power_mw(self) -> float:
        with self._lock:
            now = self._now()
            self._settle(now)
            extra_w = sum(x for start, end, x in self._pending if start <= now < end)
        return (self._idle_w + extra_w) * 1000.0

    def _settle(self, now: float) -> float:
        """Take in work issued since the last call (by any SimGPU of this GPU), fold finished
        work into the total, and return the energy (J) running work has added so far. Call
        with the lock held."""
        records, missed_j = self._activity.read_new(now)
        if records or missed_j:
            self._extra_j += missed_j
            origin, idle = self._origin, self._idle_w
            for start, end, busy_w in records:
                if end > origin:
                    self._pending.append((max(start, origin), end, busy_w - idle))
        if not self._pending:
            return 0.0
        partial = 0.0
        running = []
        for segment in self._pending:
            start, end, extra_w = segment
            if end <= now:
                self._extra_j += extra_w * (end - start)
            else:
                running.append(segment)
                if start < now:
                    partial += extra_w * (now - start)
        self._pending = running
        return partial

    def supported_frequencies(self) -> list[int]:
        return list(self._freqs)

    def max_frequency(self) -> int:
        return self._freqs[0]

    def sm_clock(self) -> int:
        locked = self._state().sm_clock_mhz
        return self._freqs[0] if locked is None else locked

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

    # Work
    def predict(self, work: Work, frequency: int | None = None) -> tuple[float, float]:
        """(time_s, energy_j) of `work` at `frequency` (default: the current SM clock) under
        the current power limit and slowdown."""
        state = self._state()
        if frequency is None:
            frequency = self._freqs[0] if state.sm_clock_mhz is None else state.sm_clock_mhz
        limit_mw = self.default_power_limit_mw() if state.power_limit_mw is None else state.power_limit_mw
        return predict(self.preset, work, frequency, limit_mw / 1000.0, state.slowdown)

    def execute(self, work: Work, blocking: bool = True) -> float:
        """Run `work` at the current SM clock, power limit and slowdown (read at issue time).

        Work queues behind earlier non-blocking work of this object, as on a CUDA stream. With
        `blocking`, wait on the GPU's clock until all work queued on the GPU has finished (see
        `synchronize`); without it, return at once, as a kernel launch does. Returns the
        work's duration in seconds. Its energy lands in the energy counter of every SimGPU of
        this GPU. To run work on several GPUs at once, see `emulate`.
        """
        duration, energy_j = self.predict(work)
        with self._lock:
            start = max(self._now(), self._busy_until)
            end = start + duration
            self._busy_until = end
            if duration > 0:
                self._activity.append(start, end, energy_j / duration)
        if blocking:
            self.synchronize()
        return duration

    def synchronize(self) -> None:
        """Wait until all work queued on this GPU has finished, like a device sync: this
        object's, and that of every other SimGPU of the same GPU (in any process on the real
        clock; in this process, on the same clock, on a virtual one)."""
        with self._lock:
            now = self._now()
            self._settle(now)
            until = self._busy_until
            for segment in self._pending:  # still running after _settle: end > now
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
            self._state_key = None
            self._state_cache = _DEFAULT_STATE
            return _DEFAULT_STATE
        key = (st.st_mtime_ns, st.st_ino, st.st_size)
        if key != self._state_key:
            self._state_cache = self._read_state()
            self._state_key = key
        return self._state_cache

    def _read_state(self) -> _State:
        try:
            with open(self._path, encoding="utf-8") as f:
                raw = json.load(f)
            return _State(
                sm_clock_mhz=raw.get("sm_clock_mhz"),
                power_limit_mw=raw.get("power_limit_mw"),
                slowdown=float(raw.get("slowdown", 1.0)),
            )
        except FileNotFoundError:
            return _DEFAULT_STATE
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise DeviceError(
                f"{self!r}: cannot read its state file {self._path} ({e}); "
                "delete it or run `perseus reset` to restore defaults"
            ) from e

    def _update(self, **changes: object) -> None:
        """Change persisted fields: read-modify-write under a file lock, written atomically.

        A reset (every change back to its default) also replaces an unreadable state file, whose
        other settings cannot be known and so go back to defaults too: `perseus reset` always works.
        """
        resetting = all(getattr(_DEFAULT_STATE, field) == value for field, value in changes.items())
        try:
            if all(getattr(self._state(), field) == value for field, value in changes.items()):
                return  # already so: no write (the controller re-locks the same clock often)
        except DeviceError:
            pass  # unreadable: decided below, under the lock
        folder = os.path.dirname(self._path)
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            with open(os.path.join(folder, ".lock"), "w") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
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
                if new == _DEFAULT_STATE:
                    try:
                        os.unlink(self._path)
                    except FileNotFoundError:
                        pass
                else:
                    self._write_state(new)
        except OSError as e:
            raise DeviceError(
                f"{self!r}: cannot write its state in {folder} ({e}); set {SIM_DIR_ENV} to a writable folder"
            ) from e
        self._state_key = None  # re-stat on the next read

    def _write_state(self, state: _State) -> None:
        doc = {"sm_clock_mhz": state.sm_clock_mhz, "power_limit_mw": state.power_limit_mw, "slowdown": state.slowdown}
        write_json_atomic(self._path, doc, indent=None, fsync=False)  # runtime state, like hardware's: lost on reboot
        # A fine-grained mtime makes the (mtime, inode, size) cache key change on every write,
        # even when the file system's own timestamps are coarser than back-to-back writes (and
        # an inode is reused); a reader that stats between the rename and this re-reads after it.
        stamp = time.time_ns()
        os.utime(self._path, ns=(stamp, stamp))


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


def sim_gpus(preset: str, count: int = 1, clock: Clock | None = None) -> list[SimGPU]:
    """`count` simulated GPUs of `preset`, indices 0..count-1, state in `sim_dir()`."""
    get_preset(preset)
    if count < 1:
        raise ConfigError(f"simulated GPU count must be >= 1, got {count}")
    return [SimGPU(preset, i, clock) for i in range(count)]

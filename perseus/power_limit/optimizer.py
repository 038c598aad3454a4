"""One power limit for every GPU of a data-parallel job, chosen while it trains.

    optimizer = GlobalPowerLimitOptimizer(selector=MaxSlowdownConstraint(1.1))  # this rank's GPU(s)
    for epoch in range(epochs):
        optimizer.on_epoch_begin()
        for batch in loader:
            optimizer.on_step_begin()
            train_step(batch)
            optimizer.on_step_end()
        optimizer.on_epoch_end()
    optimizer.close()

The optimizer sweeps power limits from the highest down in `pl_step_w` steps. Once
`wait_steps` steps have passed (at the start only), it lets `warmup_steps` steps pass at each
limit, then measures `profile_steps` steps (time and GPU energy), and more where those take
less than `MIN_COUNTER_STEPS` steps of the GPUs' energy counters (2 s on NVML GPUs: a window
of a few steps reads the counter's steps, not the energy); an epoch that ends first
discards that limit's warm-up and measurement (an epoch's end -- evaluation, a new data loader
-- would distort it) and the limit starts over next epoch. `sweep_steps` counts every step
taken while sweeping: `waited_steps` + warm-up and measured steps of each limit measured +
`cut_steps` (those discarded at epoch ends). The sweep stops as soon as the selector says no
lower limit could be chosen (`stop_sweep`: two limits in a row slower than
MaxSlowdownConstraint allows, energy or cost rising at 3 limits in a row); the limits left are
recorded in `skipped_mw` (`early_stop=False` measures them all). Then the selector
picks a limit, which stays (selectors that depend on the outside world, like CarbonCost,
pick again at every epoch).

Data parallelism: every rank measures its own GPUs -- without a `monitor`, a `Monitor()` over
this rank's GPU(s) under torchrun ($LOCAL_RANK), every visible GPU in a single process -- and
after each limit the ranks combine their figures through torch.distributed (energy summed,
time maxed), so all follow rank 0's one decision to go on, stop, or choose.

The choice reaches the user without any logging set-up: rank 0 prints one line to stderr
(the limit, its time and energy against the highest, the limits measured and skipped);
with logging at INFO that line and the whole sweep table go to the log instead
(perseus.notice). The default power limit comes back on `close()`, at interpreter exit, on
SIGTERM/SIGINT, and, with `watchdog`, from a separate process if the trainer is SIGKILLed.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import os
from typing import Any

from perseus.atomic import write_json_atomic
from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, PerseusError, ProfileError
from perseus.measurement.monitor import Monitor
from perseus.notice import logs_info, notice
from perseus.power_limit import distributed
from perseus.power_limit.selectors import (
    MaxSlowdownConstraint,
    PowerLimitMeasurement,
    PowerLimitSelector,
    SelectionContext,
)
from perseus.power_limit.zeus_names import alias, as_monitor
from perseus.probe.cache import energy_counter_period_s
from perseus.safety import ResetGuard, Watchdog

logger = logging.getLogger(__name__)

#: Energy-counter steps a limit's measurement spans at least: the counter steps every 100 ms on
#: NVML GPUs, and a window reads energy up to the last step at each end: off by up to one step, over 20 at most 5%.
MIN_COUNTER_STEPS = 20

PROFILE_FORMAT = "perseus.power_limit_profile"
PROFILE_VERSION = 1


class Phase(str, enum.Enum):
    WARMUP = "warmup"  # at a sweep limit, letting warm-up steps pass
    MEASURE = "measure"  # at a sweep limit, measuring
    DONE = "done"  # the selected limit is applied
    CLOSED = "closed"  # defaults restored; hooks do nothing


def sweep_power_limits(low_mw: int, high_mw: int, step_w: float) -> list[int]:
    """Power limits from `high_mw` down in `step_w` steps, ending at `low_mw`."""
    step_mw = round(step_w * 1000)
    limits = list(range(high_mw, low_mw - 1, -step_mw))
    if limits[-1] != low_mw:
        limits.append(low_mw)
    return limits


class GlobalPowerLimitOptimizer:
    """Finds and applies one power limit for the GPUs of `monitor` (see the module docstring).

    monitor: the GPUs to cap and measure (default: `Monitor(cpus=[])`, i.e. this rank's own
    GPU(s) under torchrun, else every visible GPU; closed with the optimizer). A Zeus
    `ZeusMonitor` is taken for its `gpu_indices`: a Perseus Monitor measures those GPUs.
    selector: how to choose (default MaxSlowdownConstraint(1.1): least energy, at most 10%
    slower). early_stop: stop the sweep once the selector says no lower limit could be chosen
    (default); False measures every limit. profile_path: a JSON file; written atomically when
    profiling ends, and when it exists at start, profiling is skipped and its choice applied at
    once. watchdog: start a process that restores the default limits if this one is SIGKILLed
    (it costs one Python start-up, a fraction of a second). verbose: rank 0 prints one line
    when it chooses (see the module docstring); False keeps it to the log at INFO.
    pl_step_w: the sweep's step between limits, in W (default 25).
    Zeus 0.16's names work too: `optimum_selector` (= selector), `pl_step` (= pl_step_w) and
    `wait_steps` (steps to let pass at the highest limit before the first warm-up; default 0).
    """

    def __init__(
        self,
        monitor: Monitor | None = None,
        selector: PowerLimitSelector | None = None,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step_w: float | None = None,
        profile_path: str | os.PathLike[str] | None = None,
        watchdog: bool = True,
        early_stop: bool = True,
        verbose: bool = True,
        *,
        wait_steps: int = 0,
        optimum_selector: PowerLimitSelector | None = None,
        pl_step: float | None = None,
    ) -> None:
        selector = alias("selector", selector, "optimum_selector", optimum_selector)
        pl_step_w = alias("pl_step_w", pl_step_w, "pl_step", pl_step)
        pl_step_w = 25 if pl_step_w is None else pl_step_w
        if not isinstance(wait_steps, int) or isinstance(wait_steps, bool) or wait_steps < 0:
            raise ConfigError(f"wait_steps must be an integer >= 0, got {wait_steps!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ConfigError(f"profile_steps must be an integer >= 1, got {profile_steps!r}")
        if isinstance(pl_step_w, bool) or not isinstance(pl_step_w, (int, float)) or not pl_step_w >= 1:
            raise ConfigError(f"pl_step_w must be at least 1 W, got {pl_step_w!r}")
        selector = MaxSlowdownConstraint(1.1) if selector is None else selector
        if not isinstance(selector, PowerLimitSelector):
            raise ConfigError(
                f"selector must be a PowerLimitSelector (Time(), Energy(), ZeusCost(eta), ...), got {selector!r}"
            )
        self._owns_monitor = not isinstance(monitor, Monitor)
        monitor = Monitor(cpus=[]) if monitor is None else as_monitor(monitor)
        self.monitor = monitor
        self.selector = selector
        self.early_stop = bool(early_stop)
        self.verbose = bool(verbose)
        self.gpus: list[GPU] = list(monitor.gpus)
        if not self.gpus:
            raise ConfigError("GlobalPowerLimitOptimizer needs a Monitor with at least one GPU")
        _warn_if_ranks_without_process_group()
        _warn_if_ranks_share_gpus(self.gpus)
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.profile_path = os.fspath(profile_path) if profile_path is not None else None
        self.min_power_limit_mw = max(g.power_limit_range_mw()[0] for g in self.gpus)
        self.max_power_limit_mw = min(g.power_limit_range_mw()[1] for g in self.gpus)
        if self.min_power_limit_mw > self.max_power_limit_mw:
            raise ConfigError(f"the GPUs {self.gpus} have no power limit in common; give the Monitor one GPU model")
        self.power_limits_mw = sweep_power_limits(self.min_power_limit_mw, self.max_power_limit_mw, pl_step_w)
        # The shortest measurement that spans MIN_COUNTER_STEPS steps of every GPU's energy counter.
        self.min_measure_s = MIN_COUNTER_STEPS * max(energy_counter_period_s(g) for g in self.gpus)
        self.measure_steps = profile_steps  # steps measured per limit: profile_steps, or more where they are short

        self.phase = Phase.WARMUP
        self.measurements: list[PowerLimitMeasurement] = []  # over all ranks, one per limit measured
        self.local_measurements: list[PowerLimitMeasurement] = []  # this rank's GPUs
        self.skipped_mw: list[int] = []  # sweep limits left unmeasured: no selector choice below
        self.sweep_steps = 0  # training steps taken while sweeping: waited + per limit measured + cut
        self.waited_steps = 0  # of those, the wait_steps at the start
        self.cut_steps = 0  # of those, steps at limits an epoch's end cut short (measured again after)
        self.selected_mw: int | None = None
        self.num_gpus = len(self.gpus)
        self._sweep_index = 0
        self._steps = 0  # in the current warm-up or measurement
        self._measure_began = 0.0  # the monitor's clock when the current measurement began
        self._limit_steps = 0  # at the current limit since its warm-up began
        self._wait = wait_steps  # steps still to pass before the first warm-up counts (Zeus' wait_steps)
        self._in_step = False  # on_step_begin came and its on_step_end has not (yet)
        self._begins_steps = False  # the loop calls on_step_begin (else only on_step_end)
        self._epoch_steps = 0
        self._last_epoch_steps: int | None = None
        self._warned_short_epoch = False
        self._window = f"perseus.power_limit.{id(self)}"
        self._guard = ResetGuard(self._reset_power_limits)
        self._watchdog = Watchdog.for_gpus(self.gpus, sm_clock=False) if watchdog else None

        try:
            if self._load_profile():
                self._select()
                self.phase = Phase.DONE
                self._tell(f"(from profile {self.profile_path})")
            else:
                self._apply(self.power_limits_mw[0])
        except BaseException:
            self.close()
            raise

    # Hooks
    def on_epoch_begin(self) -> None:
        self._epoch_steps = 0
        if self.phase is Phase.DONE and self.selector.reevaluate_each_epoch:
            before = self.selected_mw
            self._select()
            if self.selected_mw != before and self.selected_mw is not None and before is not None:
                why = type(self.selector).__name__
                intensity = getattr(self.selector, "last_intensity", None)
                if isinstance(intensity, float):
                    why += f" at {intensity:.0f} g/kWh"
                line = f"power limit {self.selected_mw / 1000:.0f} W from now on, was {before / 1000:.0f} W ({why})"
                if self.verbose or logs_info(logger):
                    notice(logger, line)

    def on_step_begin(self) -> None:
        """A step begins. A loop may call only this hook (as Zeus' Hugging Face wrapper does):
        then each step ends where the next begins."""
        if self.phase is Phase.CLOSED:
            return
        self._begins_steps = True
        if self._in_step:
            self._step_ended()
        self._step_begins()
        self._in_step = True

    def on_step_end(self) -> None:
        """A step ended. A loop may call only this hook: then each step begins where the last ended
        (the first step of all counts as warm-up: where it began is not known)."""
        if self.phase is Phase.CLOSED:
            return
        if not self._begins_steps:
            self._step_ended()
            if self.phase is not Phase.CLOSED:
                self._step_begins()
            return
        if self._in_step:
            self._in_step = False
            self._step_ended()

    def _step_begins(self) -> None:
        if self.phase is Phase.WARMUP and self._wait == 0 and self._steps >= self.warmup_steps:
            self.monitor.begin_window(self._window)
            self._measure_began = self.monitor.clock.now()
            self.phase = Phase.MEASURE
            self._steps = 0

    def _step_ended(self) -> None:
        self._epoch_steps += 1
        if self.phase not in (Phase.WARMUP, Phase.MEASURE):
            return
        self.sweep_steps += 1
        if self.phase is Phase.WARMUP and self._wait > 0:
            self._wait -= 1
            self.waited_steps += 1
            return
        self._steps += 1
        self._limit_steps += 1
        if self.phase is Phase.MEASURE and self._steps >= self.measure_steps and not self._lengthened():
            self._end_measurement()

    def _lengthened(self) -> bool:
        """Whether the measurement goes on: its steps took less than `min_measure_s` on the slowest
        rank, so `measure_steps` grows (for this limit and the slower ones after it) to span it.
        Every rank asks at the same step and follows the slowest rank's time, so all agree."""
        if self.min_measure_s <= 0:
            return False
        elapsed = distributed.all_reduce([self.monitor.clock.now() - self._measure_began], "max")[0]
        if elapsed >= self.min_measure_s or elapsed <= 0:
            return False
        wanted = math.ceil(1.1 * self._steps * self.min_measure_s / elapsed)
        room = self._room()
        if room is not None and room <= self._steps:
            return False  # epochs too short for more: as many as they hold
        before = self.measure_steps
        self.measure_steps = wanted if room is None else min(wanted, room)
        if before == self.profile_steps and (self.verbose or logs_info(logger)):
            notice(
                logger,
                f"profile_steps={self.profile_steps} take {elapsed:.2f} s, under {MIN_COUNTER_STEPS} steps of the "
                f"GPUs' energy counters ({self.min_measure_s:.1f} s): measuring {self.measure_steps} steps per "
                "limit, so that the counters' steps do not decide the choice",
            )
        return True

    def _room(self) -> int | None:
        """The most steps a limit's measurement can take in an epoch as long as the last one
        (None before an epoch ended): a longer one would be cut at every epoch's end."""
        if self._last_epoch_steps is None:
            return None
        return max(self.profile_steps, self._last_epoch_steps - self.warmup_steps)

    def on_epoch_end(self) -> None:
        if self.phase is Phase.CLOSED:
            return
        if self._in_step:  # a loop calling only on_step_begin: the epoch's last step ends here
            self._in_step = False
            self._step_ended()
        self._last_epoch_steps = self._epoch_steps
        room = self._room()
        if self.phase in (Phase.WARMUP, Phase.MEASURE) and room is not None and room < self.measure_steps:
            logger.warning(
                "epochs of %d steps leave room for %d measured steps per limit, fewer than the %d that span %d steps "
                "of the energy counters: each limit is read more coarsely",
                self._epoch_steps,
                room,
                self.measure_steps,
                MIN_COUNTER_STEPS,
            )
            self.measure_steps = room
        if self.phase in (Phase.WARMUP, Phase.MEASURE):
            if self.phase is Phase.MEASURE:
                self.monitor.end_window(self._window, cancel=True)
                logger.info(
                    "epoch ended while measuring %.0f W; it will be measured again",
                    self.power_limits_mw[self._sweep_index] / 1000,
                )
            if self._epoch_steps == 0 and not self._warned_short_epoch:
                self._warned_short_epoch = True
                logger.warning(
                    "an epoch ended with no step counted: call on_step_begin() or on_step_end() (or both) once "
                    "per training step"
                )
            elif self._epoch_steps < self.warmup_steps + self.profile_steps and not self._warned_short_epoch:
                self._warned_short_epoch = True
                logger.warning(
                    "epochs have %d steps, fewer than warmup_steps + profile_steps = %d: profiling cannot "
                    "finish; lower warmup_steps or profile_steps",
                    self._epoch_steps,
                    self.warmup_steps + self.profile_steps,
                )
            self.phase = Phase.WARMUP
            self._steps = 0
            self.cut_steps += self._limit_steps
            self._limit_steps = 0

    # Lifecycle
    def close(self) -> None:
        """Restore the default power limit and stop guarding. Idempotent."""
        if self.phase is Phase.CLOSED:
            return
        if self.phase is Phase.MEASURE:
            self.monitor.end_window(self._window, cancel=True)
        self.phase = Phase.CLOSED
        self._reset_power_limits()
        self._guard.close()
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._owns_monitor:
            self.monitor.close()

    def __enter__(self) -> GlobalPowerLimitOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def power_limit_mw(self) -> int:
        """The limit this optimizer has set now."""
        return self.gpus[0].power_limit_mw()

    # Internals
    def _apply(self, limit_mw: int) -> None:
        for gpu in self.gpus:
            gpu.set_power_limit_mw(limit_mw)

    def _reset_power_limits(self) -> None:
        for gpu in self.gpus:
            gpu.reset_power_limit()

    def _end_measurement(self) -> None:
        m = self.monitor.end_window(self._window, expect_short=True)  # lengthened, or capped with a warning
        self.phase = Phase.WARMUP  # no window open: whatever follows raises, close() has none to end
        energy_j = sum(m.gpu_energy_j[g.index] for g in self.gpus)
        limit = self.power_limits_mw[self._sweep_index]
        local = PowerLimitMeasurement(limit, m.time_s / self._steps, energy_j / self._steps)
        self.local_measurements.append(local)
        logger.debug("%.0f W: %.4f s, %.2f J per step on this rank", limit / 1000, local.time_s, local.energy_j)
        # Every rank, at the same step: the slowest rank's time, the energy of all GPUs.
        time_s = distributed.all_reduce([local.time_s], "max")[0]
        energy_all_j, num_gpus = distributed.all_reduce([local.energy_j, float(len(self.gpus))], "sum")
        self.num_gpus = int(num_gpus)
        self.measurements.append(PowerLimitMeasurement(limit, time_s, energy_all_j))
        self._sweep_index += 1
        self._steps = 0
        self._limit_steps = 0
        if self._sweep_index < len(self.power_limits_mw):
            if not (self.early_stop and self._stop_now()):
                self._apply(self.power_limits_mw[self._sweep_index])
                self.phase = Phase.WARMUP
                return
            self.skipped_mw = self.power_limits_mw[self._sweep_index :]
        if distributed.rank() == 0 and self.profile_path is not None:
            self._save_profile()
        self._select()
        self.phase = Phase.DONE
        self._tell(self._steps_taken())

    def _steps_taken(self) -> str:
        """What the sweep cost in training steps, with what is not warm-up and measurement per limit."""
        text = f"in {self.sweep_steps} steps"
        extra = []
        if self.waited_steps:
            extra.append(f"{self.waited_steps} waited")
        if self.cut_steps:
            extra.append(f"{self.cut_steps} discarded: an epoch ended before their limit was measured")
        return text + (f" ({', '.join(extra)})" if extra else "")

    def _context(self) -> SelectionContext:
        return SelectionContext(self.max_power_limit_mw, self.num_gpus, self._last_epoch_steps)

    def _stop_now(self) -> bool:
        """Rank 0 asks the selector whether the sweep can stop; every rank follows its answer."""
        answer = -1.0
        error: Exception | None = None
        if distributed.rank() == 0:
            try:
                answer = 1.0 if self.selector.stop_sweep(self.measurements, self._context()) else 0.0
            except Exception as e:  # tell the other ranks before raising, so none waits forever
                error = e
        answer = distributed.broadcast([answer])[0]
        if error is not None:
            raise error
        if answer < 0:
            raise PerseusError("rank 0 failed to decide whether the power-limit sweep can stop (see its log)")
        return answer > 0

    def _tell(self, source: str) -> None:
        """One line for the user about the choice (the sweep table too, where logging shows INFO)."""
        chosen = next((m for m in self.measurements if m.power_limit_mw == self.selected_mw), None)
        top = max(self.measurements, key=lambda m: m.power_limit_mw) if self.measurements else None
        assert self.selected_mw is not None
        line = f"power limit {self.selected_mw / 1000:.0f} W for {self.num_gpus} GPU(s) ({self.selector!r})"
        if chosen is not None and top is not None and chosen is not top:
            line += (
                f": per step {chosen.time_s / top.time_s - 1:+.1%} time, "
                f"{chosen.energy_j / top.energy_j - 1:+.1%} energy vs {top.power_limit_w:.0f} W"
            )
        line += f"; {len(self.measurements)} of {len(self.power_limits_mw)} limits measured {source}"
        if self.skipped_mw:
            line += f", {len(self.skipped_mw)} skipped: none below could be chosen"
        if not (self.verbose or logs_info(logger)):
            return
        detail = None
        if logs_info(logger):
            rows = [
                f"  {x.power_limit_w:6.0f} W  {x.time_s:.4f} s  {x.energy_j:10.2f} J"
                + ("  <- selected" if x.power_limit_mw == self.selected_mw else "")
                for x in self.measurements
            ]
            rows += [f"  {mw / 1000:6.0f} W  skipped" for mw in self.skipped_mw]
            detail = "  limit     time/step  energy/step (all GPUs)\n" + "\n".join(rows)
        notice(logger, line, detail)

    def _select(self) -> None:
        """Rank 0 selects; every rank applies rank 0's choice."""
        choice = -1.0
        error: Exception | None = None
        if distributed.rank() == 0:
            try:
                choice = float(self.selector.select(self.measurements, self._context()))
            except Exception as e:  # tell the other ranks before raising, so none waits forever
                error = e
        choice = distributed.broadcast([choice])[0]
        if error is not None:
            raise error
        if choice < 0:
            raise PerseusError("rank 0 failed to select a power limit (see its log)")
        limit = int(choice)
        if not self.min_power_limit_mw <= limit <= self.max_power_limit_mw:
            raise ConfigError(
                f"{self.selector!r} chose {limit / 1000:g} W, outside these GPUs' range "
                f"{self.min_power_limit_mw / 1000:g}-{self.max_power_limit_mw / 1000:g} W"
            )
        self.selected_mw = limit
        self._apply(limit)

    # Profile file
    def _load_profile(self) -> bool:
        """Whether a profile was found (rank 0 reads it; every rank learns the answer)."""
        if self.profile_path is None:
            return False
        num_gpus = int(distributed.all_reduce([float(len(self.gpus))], "sum")[0])
        status = 0.0  # rank 0 tells: 1 found, 0 absent, -1 unreadable (or not writable)
        error: PerseusError | None = None
        if distributed.rank() == 0 and not os.path.exists(self.profile_path):
            try:
                _check_writable(self.profile_path)
            except ConfigError as e:
                status, error = -1.0, e
        elif distributed.rank() == 0:
            try:
                self.measurements, self.num_gpus = read_profile(
                    self.profile_path,
                    (self.min_power_limit_mw, self.max_power_limit_mw),
                    gpus=(self.gpus[0].name(), num_gpus),
                    limits_mw=self.power_limits_mw,
                )
                status = 1.0
                logger.info("power-limit profile %s found: skipping profiling", self.profile_path)
                self._check_profile_sweep()
            except ProfileError as e:
                status, error = -1.0, e
        status = distributed.broadcast([status])[0]
        if error is not None:
            raise error
        if status < 0:
            raise ProfileError(f"rank 0 could not use the power-limit profile {self.profile_path} (see its log)")
        return status > 0

    def _check_profile_sweep(self) -> None:
        """Limits the profile left unmeasured are skipped; warn if this selector might want one."""
        lowest = min(m.power_limit_mw for m in self.measurements)
        self.skipped_mw = [mw for mw in self.power_limits_mw if mw < lowest]
        ordered = sorted(self.measurements, key=lambda m: -m.power_limit_mw)
        if self.skipped_mw and not self.selector.stop_sweep(ordered, self._context()):
            logger.warning(
                "power-limit profile %s stops at %.0f W (its sweep ended early for another selector); %r might "
                "choose a lower limit: delete the file to profile again",
                self.profile_path,
                lowest / 1000,
                self.selector,
            )

    def _save_profile(self) -> None:
        data = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "gpu_name": self.gpus[0].name(),
            "num_gpus": self.num_gpus,
            "warmup_steps": self.warmup_steps,
            "profile_steps": self.profile_steps,
            "measure_steps": self.measure_steps,
            "measurements": [
                {"power_limit_mw": m.power_limit_mw, "time_s": m.time_s, "energy_j": m.energy_j}
                for m in self.measurements
            ],
            # Not measured: the sweep stopped early because the selector could choose none of them.
            "skipped_power_limits_mw": list(self.skipped_mw),
        }
        assert self.profile_path is not None
        try:
            write_json_atomic(self.profile_path, data)
        except OSError as e:  # the choice stands; only the next run's shortcut is lost
            logger.error(
                "could not save the power-limit profile to %s (%s): the next run profiles again", self.profile_path, e
            )


def _warn_if_ranks_without_process_group() -> None:
    """torchrun started several ranks but torch.distributed is not initialised: each rank would
    choose alone (and may apply a different limit)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world > 1 and distributed.world_size() == 1:
        logger.warning(
            "WORLD_SIZE is %d but torch.distributed is not initialised: this rank chooses its power limit alone; "
            "create the optimizer after torch.distributed.init_process_group()",
            world,
        )


def _check_writable(path: str) -> None:
    """ConfigError unless a profile can be written at `path` (its folder may not exist yet):
    found when profiling ends, the error would stop training at its choice."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    fix = "pass a profile_path in a folder this process can write"
    if not os.path.isdir(folder):
        raise ConfigError(f"profile_path {path}: {folder} is a file, not a folder; {fix}")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"profile_path {path}: the folder {folder} is not writable by this process; {fix}")


def _warn_if_ranks_share_gpus(gpus: list[GPU]) -> None:
    """Two ranks measuring one GPU each count its whole energy, and the job's GPU count doubles
    (an outsider's 2 ranks on one simulated A100 read 557 W from a 400 W GPU): warn, naming them."""
    world = distributed.world_size()
    if world == 1:
        return
    per_rank = int(distributed.all_reduce([float(len(gpus))], "max")[0])
    table = [0.0] * (world * per_rank)
    for j, gpu in enumerate(gpus):  # each rank fills its own row; the sum is every rank's
        try:
            uuid = gpu.uuid()
        except PerseusError:  # a GPU that cannot tell: not compared (0), the collective still runs
            continue
        table[distributed.rank() * per_rank + j] = float(int(hashlib.sha256(uuid.encode()).hexdigest()[:12], 16))
    table = distributed.all_reduce(table, "sum")
    ranks: dict[float, list[int]] = {}
    for k, key in enumerate(table):
        if key:
            ranks.setdefault(key, []).append(k // per_rank)
    shared = [r for r in ranks.values() if len(set(r)) > 1]
    if shared and distributed.rank() == 0:
        logger.warning(
            "ranks %s measure and cap the same GPU: each counts all its energy, and the job's GPU count with it; "
            "give each rank its own GPU (a GPU per rank, or Monitor(gpu_indices=[...]))",
            " and ".join(map(str, sorted(set(shared[0])))),
        )


def read_profile(
    path: str,
    limit_range_mw: tuple[int, int] | None = None,
    *,
    gpus: tuple[str, int] | None = None,
    limits_mw: list[int] | None = None,
) -> tuple[list[PowerLimitMeasurement], int]:
    """(measurements, num_gpus) from a profile file written by the optimizer.

    Every field is checked; `limit_range_mw` also checks the limits fit the GPUs at hand,
    `gpus` (GPU name, how many) that it was recorded on them, `limits_mw` that its limits are
    this sweep's: a profile of other GPUs or another step would apply a choice made for them.
    """
    fix = "delete it to profile again"
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except OSError as e:
        raise ProfileError(f"cannot read power-limit profile {path}: {e}") from e
    except ValueError as e:
        raise ProfileError(f"power-limit profile {path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ProfileError(f'{path} is not a Perseus power-limit profile (no "format": "{PROFILE_FORMAT}"); {fix}')
    if data.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path}: profile version {data.get('version')!r} is not {PROFILE_VERSION}; {fix}")
    num_gpus = data.get("num_gpus")
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ProfileError(f"{path}: num_gpus must be a positive integer, got {num_gpus!r}; {fix}")
    rows = data.get("measurements")
    if not isinstance(rows, list) or not rows:
        raise ProfileError(f"{path}: 'measurements' must be a non-empty list; {fix}")
    measurements = []
    for i, row in enumerate(rows):
        where = f"{path}: measurements[{i}]"
        if not isinstance(row, dict):
            raise ProfileError(f"{where} must be an object with power_limit_mw, time_s, energy_j; {fix}")
        limit = row.get("power_limit_mw")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise ProfileError(f"{where}.power_limit_mw must be a positive integer (mW), got {limit!r}; {fix}")
        time_s, energy_j = (_positive(row.get(name), f"{where}.{name}", fix) for name in ("time_s", "energy_j"))
        if limit_range_mw is not None and not limit_range_mw[0] <= limit <= limit_range_mw[1]:
            raise ProfileError(
                f"{where}: {limit / 1000:g} W is outside these GPUs' power-limit range "
                f"{limit_range_mw[0] / 1000:g}-{limit_range_mw[1] / 1000:g} W (recorded on other GPUs?); {fix}"
            )
        measurements.append(PowerLimitMeasurement(limit, time_s, energy_j))
    if len({m.power_limit_mw for m in measurements}) != len(measurements):
        raise ProfileError(f"{path}: a power limit appears twice in 'measurements'; {fix}")
    fix += " (or give each setup a profile_path of its own)"
    if gpus is not None and (data.get("gpu_name"), num_gpus) != gpus:
        raise ProfileError(
            f"{path} was recorded on {num_gpus} x {data.get('gpu_name')!r}, this job runs {gpus[1]} x {gpus[0]!r}; "
            + fix
        )
    if limits_mw is not None and (
        off := sorted({m.power_limit_mw for m in measurements} - set(limits_mw), reverse=True)
    ):
        raise ProfileError(
            f"{path} measured {', '.join(f'{mw / 1000:g}' for mw in off)} W, not on this sweep's limits "
            f"({', '.join(f'{mw / 1000:g}' for mw in limits_mw)} W): it was recorded with another pl_step_w; {fix}"
        )
    return measurements, num_gpus


def _positive(value: object, where: str, fix: str) -> float:
    """A profile's positive, finite number (a JSON int or float, not a bool) as a float."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ProfileError(f"{where} must be a positive number, got {value!r}; {fix}")
    return float(value)

"""The GPU work an instrumented instruction stands for, run on a simulated GPU.

A simulated GPU does only the work it is given, so a training script on one (no GPU at hand)
says what each instruction would cost a real GPU: `perseus.instrument(stage, schedule=...,
emulate={"forward": Work(0.006), "backward": Work(0.012)})`, or a callable
`(kind, microbatch, chunk) -> Work | None` when chunks or microbatches differ. Each
instruction then launches its work as it begins (a kernel launch: the script's own CPU work runs
meanwhile) and waits for it as it ends. The work runs as short slices, each at the SM clock in
effect when it is queued, the way a real GPU's clock change lands mid-kernel: Perseus sets
clocks off the training thread, a moment after the instruction began. On real GPUs `emulate`
does nothing (they run the real kernels), so the same script runs on both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.schedules.instruction import Kind

#: What `emulate=` takes: work per instruction kind, or a function of (kind, microbatch, chunk).
WorkSpec = Mapping[str, Work] | Callable[[str, int, int], Work | None]

#: Nominal GPU time (at the highest clock) of one slice of an instruction's work.
SLICE_S = 0.002
#: The next slice is queued this long before the current one ends, so slices run back to back
#: even when the training thread wakes up late.
LEAD_S = 0.0015


def check_work_spec(spec: WorkSpec) -> WorkSpec:
    """ConfigError unless `spec` is a kind -> Work mapping over known kinds, or a callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"emulate= takes a mapping from instruction kind to perseus.devices.Work, or a function "
            f"(kind, microbatch, chunk) -> Work | None; got {type(spec).__name__}"
        )
    kinds = {k.value for k in Kind}
    out: dict[str, Work] = {}
    for kind, work in spec.items():
        name = kind.value if isinstance(kind, Kind) else kind
        if name not in kinds:
            raise ConfigError(f"emulate= names instruction kind {kind!r}; kinds are {', '.join(sorted(kinds))}")
        if not isinstance(work, Work):
            raise ConfigError(f"emulate[{name!r}] must be a perseus.devices.Work, got {type(work).__name__}")
        out[name] = work
    full, split = Kind.BACKWARD.value, (Kind.BACKWARD_INPUT.value, Kind.BACKWARD_WEIGHT.value)
    if full in out:  # zero-bubble schedules split the backward in two: half each, unless given
        half = Work(out[full].time_s / 2, out[full].alpha, out[full].intensity)
        for kind in split:
            out.setdefault(kind, half)
    elif all(kind in out for kind in split):  # a full backward does both halves' work
        i, w = (out[kind] for kind in split)
        total = i.time_s + w.time_s
        share = i.time_s / total if total > 0 else 0.5
        alpha = share * i.alpha + (1 - share) * w.alpha
        out[full] = Work(total, alpha, share * i.intensity + (1 - share) * w.intensity)
    return out


class InstructionWork:
    """Runs the emulated work of one rank's instructions on its simulated GPU (nothing on a real one)."""

    def __init__(self, gpu: GPU, spec: WorkSpec) -> None:
        self.spec = check_work_spec(spec)
        self.gpu = gpu if isinstance(gpu, SimGPU) else None
        self._work: Work | None = None
        self._left = 0
        self._end = 0.0

    @property
    def active(self) -> bool:
        """Whether work runs here (a simulated GPU)."""
        return self.gpu is not None

    def _work_of(self, kind: str, microbatch: int, chunk: int) -> Work | None:
        spec = self.spec
        if isinstance(spec, Mapping):
            return spec.get(kind)
        work = spec(kind, microbatch, chunk)
        if work is not None and not isinstance(work, Work):
            raise ConfigError(f"emulate({kind!r}, {microbatch}, {chunk}) returned {work!r}, not a perseus.devices.Work")
        return work

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Launch the instruction's work; returns at once."""
        gpu = self.gpu
        if gpu is None:
            return
        work = self._work_of(kind, microbatch, chunk)
        if work is None or work.time_s <= 0:
            self._work = None
            return
        self._left = max(1, round(work.time_s / SLICE_S))
        self._work = Work(work.time_s / self._left, work.alpha, work.intensity)
        self._end = gpu.clock.now()
        self._issue()

    def end(self) -> None:
        """Queue the rest of the work and wait until all of it has finished."""
        gpu = self.gpu
        if gpu is None or self._work is None:
            return
        clock = gpu.clock
        while self._left:
            ahead = self._end - LEAD_S - clock.now()
            if ahead > 0:
                clock.sleep(ahead)
            self._issue()
        gpu.synchronize()
        self._work = None

    def _issue(self) -> None:
        assert self.gpu is not None and self._work is not None
        now = self.gpu.clock.now()
        self._end = max(now, self._end) + self.gpu.execute(self._work, blocking=False)
        self._left -= 1

"""The GPU work an instrumented instruction stands for, run on a simulated GPU.

A simulated GPU does only the work it is given, so a training script on one (no GPU at hand)
says what each instruction would cost a real GPU: `perseus.instrument(stage, schedule=...,
emulate={"forward": Work(0.006), "backward": Work(0.012)})`, or a callable
`(kind, microbatch, chunk) -> Work | None` when chunks or microbatches differ. Each
instruction launches its work as it begins (a kernel launch) and waits for it as it ends.

Perseus sets each instruction's clock off the training thread, a moment after the instruction
began (or before it, see perseus.controller); work runs at the clock in force, as a real GPU's
kernels do once the change lands. So the work goes out in two pieces: a first slice at the
clock in force as the instruction begins, and, once the controller has applied the
instruction's clock (or three quarters of the slice have run, whichever comes first), the rest:
queued while the slice still runs, so the GPU does not idle between them. (Changing a simulated
GPU's clock takes its controller a millisecond or so of wall time on a busy host.) On real GPUs
`emulate` does nothing (they run the real kernels), so the same script runs on both.
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

#: GPU time (at the highest clock) of the first piece of an instruction's work.
SLICE_S = 0.003


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
    """Runs the emulated work of one rank's instructions on its simulated GPU (nothing on a real
    one). `clock_applied(timeout_s)` waits up to `timeout_s` until the controller has applied the
    latest clock and says whether it has (`FrequencyController.wait_applied`)."""

    def __init__(self, gpu: GPU, spec: WorkSpec, clock_applied: Callable[[float], bool]) -> None:
        self.spec = check_work_spec(spec)
        self.gpu = gpu if isinstance(gpu, SimGPU) else None
        self._clock_applied = clock_applied

    def _work_of(self, kind: str, microbatch: int, chunk: int) -> Work | None:
        spec = self.spec
        if isinstance(spec, Mapping):
            return spec.get(kind)
        work = spec(kind, microbatch, chunk)
        if work is not None and not isinstance(work, Work):
            raise ConfigError(f"emulate({kind!r}, {microbatch}, {chunk}) returned {work!r}, not a perseus.devices.Work")
        return work

    def begin(self, kind: str, microbatch: int, chunk: int) -> None:
        """Queue the instruction's work at the clock the controller sets for it."""
        gpu = self.gpu
        if gpu is None:
            return
        work = self._work_of(kind, microbatch, chunk)
        if work is None or work.time_s <= 0:
            return
        first = min(work.time_s, SLICE_S)
        took = gpu.execute(Work(first, work.alpha, work.intensity), blocking=False)
        if work.time_s > first:
            self._clock_applied(0.75 * took)  # the instruction's clock, while the first slice runs
            gpu.execute(Work(work.time_s - first, work.alpha, work.intensity), blocking=False)

    def end(self) -> None:
        """Wait until the instruction's work has finished."""
        if self.gpu is not None:
            self.gpu.synchronize()

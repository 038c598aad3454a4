"""One pipeline rank profiled online on a simulated GPU driven by a virtual clock, through
`PerseusRank` and an in-memory planner port that serves the service's sweep design."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import SimRealism
from perseus.devices.sim_work import Work
from perseus.profiler.profile import KINDS, Profile
from perseus.profiler.sweep import SweepPlan
from perseus.runtime import IterationRecord, PerseusRank, ProfilingSettings, Progress
from perseus.schedules import build_schedule
from perseus.service.sweep import design_steps
from perseus.wire.phases import Phase


class Assigned:
    """What `PlannerClient.assignment` returns (the PortAssignment fields)."""

    def __init__(self, phase: Phase, sweep: SweepPlan | None = None) -> None:
        self.phase, self.frequencies, self.sweep, self.plan_version, self.spans = phase, None, sweep, 0, False


class SweepPort:
    """The planner as one rank sees it: warm-up, then the service's sweep until the profile is in."""

    def __init__(self, frequencies, steps_per_frequency: int, warmup: int = 1) -> None:
        steps = design_steps(frequencies, steps_per_frequency)
        self.plan = SweepPlan(tuple(frequencies), steps_per_frequency, tuple(dict(zip(KINDS, s)) for s in steps))
        self.warmup = warmup
        self.profile: Profile | None = None

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        pass

    def assignment(self, iteration):
        if iteration < self.warmup:
            return Assigned(Phase.WARMUP)
        return Assigned(Phase.PLANNING) if self.profile is not None else Assigned(Phase.PROFILING, self.plan)

    def upload_profile(self, job_id, stage, profile):
        self.profile = profile

    def report_iteration(self, *args, **kwargs):
        pass

    def report_spans(self, spans):
        pass

    def close(self):
        pass


def profile_stage(
    works: Mapping[str, Work] | Callable[[str, int], Work],
    realism: SimRealism,
    state_dir: str,
    *,
    stage: int = 1,
    stages: int = 4,
    microbatches: int = 8,
    schedule_name: str = "1f1b",
    chunks: int = 1,
    gaps: tuple[float, float] = (0.0005, 0.02),
    sweep_step: int = 5,
    steps_per_frequency: int = 3,
    seed: int = 0,
    max_iterations: int = 400,
    gpu_class: type[SimGPU] = SimGPU,
    progress: Progress | None = None,
    after: int = 0,
) -> tuple[Profile, SimGPU, list[IterationRecord]]:
    """Train one rank of a pipeline until its stage's profile is uploaded. Each instruction runs
    `works[kind]` (or `works(kind, chunk)`) on the GPU; between instructions it waits on its
    peers (`gaps`: 0.5-20 ms, seeded), and between iterations an optimizer step's host time
    passes (30 ms). `gpu_class`: a SimGPU subclass (one timed by events, say). `progress`:
    rank 0's display; `after`: iterations to run once the profile is in."""
    clock = VirtualClock(1000.0)
    gpu = gpu_class("a100-sxm", 0, clock=clock, state_dir=state_dir, realism=realism)
    schedule = build_schedule(schedule_name, stages, microbatches, chunks)
    work = works if callable(works) else lambda kind, chunk: works[kind]
    port = SweepPort(gpu.supported_frequencies()[::sweep_step], steps_per_frequency)
    records: list[IterationRecord] = []
    rank = PerseusRank(
        gpu,
        schedule,
        stage,
        client=port,
        profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=steps_per_frequency),
        progress=progress or False,
        handle_signals=False,
        watchdog=False,
        startup_wait_s=30.0,
        on_iteration=records.append,
    )
    rank._registrar.join(30.0)  # registered before the first step, so the port answers from iteration 0
    rng = random.Random(seed)
    try:
        for _ in range(max_iterations):
            rank.on_step_begin()
            for ins in rank.order:
                rank.on_instruction_begin(ins.kind.value, ins.microbatch, ins.chunk)
                gpu.execute(work(ins.kind.value, ins.chunk), blocking=False)
                gpu.synchronize()
                rank.on_instruction_end(ins.kind.value, ins.microbatch, ins.chunk)
                clock.advance(rng.uniform(*gaps))
            rank.on_step_end()
            clock.advance(0.03)
            if port.profile is not None:
                if after == 0:
                    break
                after -= 1
    finally:
        rank.close()
    assert port.profile is not None, "the sweep never finished"
    return port.profile, gpu, records

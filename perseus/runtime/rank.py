"""One training rank under Perseus: hooks in, clocks out.

`PerseusRank` ties together the planner client (what to run), the online profiler (what the
stage costs) and the frequency controller (running it). A framework calls its four hooks:

    rank.on_step_begin()
    for each instruction:  rank.on_instruction_begin(kind, microbatch[, chunk]) ... on_instruction_end(...)
    rank.on_step_end()

Each iteration is reported to the planner with two times: `time_s`, from on_step_begin to
on_step_end (everything the step does, the optimizer step and the data-parallel gradient
synchronization included), and `compute_time_s`, from on_step_begin to when the GPU finished
the rank's last instruction of the iteration. The GPU's instruction timer tells that, and each
instruction's span in iterations that are profiled or whose spans the service asks for
(perseus.devices.instruction_timer): timing events on a GPU torch drives, resolved at the end
of the iteration, where the rank synchronises once, so the host keeps issuing work ahead; a
synchronisation per mark on a simulated GPU. The gradient synchronization makes every
data-parallel pipeline's `time_s` that of the slowest one, so the planner tells a straggler
pipeline by `compute_time_s`. It only excludes the synchronization when the framework runs it after the
last instruction (an all-reduce after the pipeline schedule's step, as Megatron-LM's
finalize_model_grads does without overlap_grad_reduce); a synchronization overlapped with the
last backward counts as compute.

Each iteration's `energy_j` is the GPU energy counter from the end of the previous iteration
(its on_step_end) to the end of this one, not from this one's on_step_begin: consecutive
iterations' energies tile the run, so their sum is one counter difference. A counter that
advances in steps (NVML's, every 100 ms or so; a realistic simulated GPU's) then misreads a run
of N iterations by at most a step at each end of the run, not at each end of every iteration; and
the energy between steps (a rank waiting in a collective after its last instruction, the host
loop) counts, as it does in the planner's predicted energy. The first iteration, and the first
after `pause()`, start at their own on_step_begin.

Nothing here may break training: every hook catches and logs its own failures, the planner is
only ever asked through a client that never blocks past its timeout, and with no planner the
rank simply runs at default clocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from perseus.controller import FrequencyController
from perseus.controller.latency import switch_latency
from perseus.devices.gpu import GPU
from perseus.devices.instruction_timer import Mark
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError, PlanError
from perseus.profiler.online import OnlineProfiler
from perseus.profiler.sweep import Sweep
from perseus.profiler.timeline import Span
from perseus.runtime import registration
from perseus.runtime.emulation import InstructionWork, WorkSpec
from perseus.runtime.port import PlannerPort, PortAssignment
from perseus.runtime.progress import Progress
from perseus.runtime.records import IterationRecord, ProfilingSettings
from perseus.runtime.spans import MAX_SPAN_REPORTS, SpanRecorder, WorkCheck, offsets_us
from perseus.schedules.instruction import Schedule
from perseus.wire.parallelism import Parallelism
from perseus.wire.phases import Phase
from perseus.wire.spans import ReportSpans
from perseus.wire.spec import DEFAULT_TOLERANCE, JobSpec, RankInfo

logger = logging.getLogger(__name__)


#: Phases whose iterations run a published plan (a reference window publishes maximum clocks).
_RUNS_PLAN = (Phase.PLANNED, Phase.REFERENCE)


class PerseusRank:
    """Perseus on one rank (one GPU, one pipeline stage, possibly several model chunks).

    `schedule` is the whole job's schedule (every stage's instruction order); this rank runs
    `schedule.stages[stage]`. `parallelism` (a `perseus.wire.Parallelism`) places the rank in
    a job with `dp` data-parallel pipelines and `tp` tensor-parallel ranks per stage: it is
    (`stage`, `dp_index`, `tp_index`) with global rank `rank`, and `rank_mapping` ("explicit",
    "megatron" or "torch", see perseus.wire.parallelism) tells the planner how global ranks map
    to those coordinates (a named mapping is checked). Instead of `parallelism`, pass `stage` and
    any of `rank`, `dp`, `dp_index`, `tp`, `tp_index`, `rank_mapping` (defaults: one pipeline, no
    tensor parallelism, explicit mapping; `rank` defaults to `stage` when dp = tp = 1, else to
    what a named mapping gives). Every rank offers its stage profile; the planner takes one per GPU
    model, stage and tensor-parallel index (from the lowest data-parallel index on that model).

    `client`: a `perseus.client.PlannerClient`, or anything with its `PlannerPort` methods
    (closed by `close()` when `close_client`), or None to run at default clocks and only measure.
    `wait_for_clock`: block each clock change until applied; only for emulated GPUs whose work
    reads the clock when issued (real kernels
    run long after the CPU issues them, and the training thread must not wait on the driver).
    `instruction_overhead_s` and `hop_latency_s`: optional overrides of what the service
    measures itself (see perseus.service.calibration): host work between this job's instructions
    and what one stage-to-stage hop takes beyond it; the planner adds them to the profile (see
    `Profile.with_overheads`). Default 0: the service fits them from the ranks' timelines.
    `emulate`: on a simulated GPU, the GPU work each instruction stands for (see
    perseus.runtime.emulation); ignored on real GPUs. `tolerance`: how much slower than the
    measured baseline (or a straggler's pace) the service lets a planned iteration run before it
    re-plans (default 1%; see perseus.service.verification).
    """

    def __init__(
        self,
        gpu: GPU,
        schedule: Schedule,
        stage: int | None = None,
        *,
        client: PlannerPort | None = None,
        parallelism: Parallelism | None = None,
        rank: int | None = None,
        dp: int | None = None,
        dp_index: int | None = None,
        tp: int | None = None,
        tp_index: int | None = None,
        rank_mapping: str | None = None,
        tag: str = "",
        profiling: ProfilingSettings | None = None,
        instruction_overhead_s: float = 0.0,
        hop_latency_s: float = 0.0,
        progress: Progress | bool | None = None,
        wait_for_clock: bool = False,
        handle_signals: bool = True,
        watchdog: bool = True,
        retry_s: float = 2.0,
        startup_wait_s: float = 3.0,
        close_client: bool = False,
        on_iteration: Callable[[IterationRecord], None] | None = None,
        emulate: WorkSpec | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        self.parallelism = registration.resolve_parallelism(
            schedule,
            stage,
            parallelism,
            rank=rank,
            dp=dp,
            dp_index=dp_index,
            tp=tp,
            tp_index=tp_index,
            rank_mapping=rank_mapping,
        )
        self.gpu = gpu
        self.schedule = schedule
        self.stage = stage = self.parallelism.stage
        self.rank: int = self.parallelism.rank  # type: ignore[assignment]  # always set by Parallelism
        self.tag = tag
        self.instruction_overhead_s, self.hop_latency_s = instruction_overhead_s, hop_latency_s
        self.tolerance = tolerance
        self.settings = profiling or ProfilingSettings()
        self.order = schedule.stages[stage]
        self._keys = tuple((ins.kind.value, ins.microbatch, ins.chunk) for ins in self.order)
        self._virtual = {ins.chunk: schedule.virtual_stage(ins) for ins in self.order}
        self._wait_for_clock = wait_for_clock
        self._on_iteration = on_iteration
        if progress is None:
            progress = self.rank == 0
        self._progress = Progress() if progress is True else (progress or None)

        self.sweep_frequencies = self.settings.frequencies or tuple(gpu.supported_frequencies())
        self.sweep = Sweep(stage, early_stop_rises=self.settings.early_stop_rises)
        self._sweep_round = 0  # the service's round of the sweep (Assignment.sweep_round) `sweep` follows
        if client is not None:
            self.job_spec()  # a bad field (the overheads, say) raises ConfigError here, not in the registration thread
        self.controller = FrequencyController(
            gpu,
            handle_signals=handle_signals,
            watchdog=watchdog,
            latency=switch_latency(gpu, self.settings.switch_latency_s),
        )
        self.profiler = OnlineProfiler(gpu, self.sweep, self.controller.settle, self.controller.latency)
        self._emulated = InstructionWork(gpu, emulate, self.controller.wait_applied) if emulate is not None else None

        self.iteration = -1
        self.phase = Phase.UNPLANNED
        self.plan_version = 0
        self.last_iteration: IterationRecord | None = None
        self._in_step = False
        self._profiling = False  # this iteration is measured by the profiler
        self._holds_plan = False  # the controller runs plan `plan_version` (or refused it)
        self._frequency: int | None = None
        self._step_start: tuple[float, float] = (0.0, 0.0)
        # (time, energy counter in mJ) at the end of the previous iteration, where this one's
        # energy starts (see the module docstring); None: at the first iteration, after a pause.
        self._last_end: tuple[float, float] | None = None
        self._done = 0  # instructions ended in this iteration
        self._timer = gpu.instruction_timer()  # spans, the profiler's and the compute part's end
        self._compute_mark: Mark | None = None  # the timer's mark of the iteration's last instruction's end
        self._record_spans = False  # the planner asked for this iteration's instruction spans
        self._spans: SpanRecorder | None = None  # this iteration's instructions, when profiled or asked for
        self._span_reports = 0
        self._work_check = WorkCheck(gpu.preset.idle_w) if isinstance(gpu, SimGPU) else None
        self._warned: set[str] = set()
        self._closed = False

        self._client = client
        self._close_client = close_client
        self._startup_wait_s = startup_wait_s
        self._job_id: str | None = None
        self._refused = False
        # The planner's tables count iterations from the rank's first one it could answer, so a
        # rank that reached the planner late still warms up and sweeps from the start.
        self._offset: int | None = None
        self._stop = threading.Event()
        self._registrar: threading.Thread | None = None
        if client is not None:
            self._registrar = threading.Thread(
                target=self._register, args=(retry_s,), name=f"perseus-register-{self.rank}", daemon=True
            )
            self._registrar.start()

    # This rank's place in the job (see `parallelism`)
    @property
    def dp(self) -> int:
        return self.parallelism.dp

    @property
    def dp_index(self) -> int:
        return self.parallelism.dp_index

    @property
    def tp(self) -> int:
        return self.parallelism.tp

    @property
    def tp_index(self) -> int:
        return self.parallelism.tp_index

    @property
    def rank_mapping(self) -> str:
        return self.parallelism.rank_mapping

    @property
    def in_step(self) -> bool:
        """Between on_step_begin and the end of that iteration."""
        return self._in_step

    # Hooks
    def on_step_begin(self) -> None:
        """An iteration starts (ends the previous one if the framework did not)."""
        if self._closed:
            return
        try:
            if self._in_step:
                self.on_step_end()
            self.iteration += 1
            self._in_step = True
            if self.iteration == 0 and self._client is not None:
                self._await_planner()
            self._begin_iteration()
            self._done, self._compute_mark = 0, None
            self._step_start = (self.gpu.clock.now(), self.gpu.energy_mj())
            if self._last_end is None:
                self._last_end = self._step_start  # nothing before it to tile with
            timed = self._record_spans or self._profiling
            self._spans = SpanRecorder(len(self.order)) if timed else None
        except Exception as e:
            self._warn_once(
                "step_begin", f"Perseus failed at the start of iteration {self.iteration}: {e!r}; training continues"
            )

    def on_instruction_begin(self, kind: str, microbatch: int, chunk: int = 0) -> None:
        """Right before an instruction's computation (kind: forward, backward, backward_input, backward_weight)."""
        if self._closed:
            self._emulate_closed(True, str(kind), microbatch, chunk)
            return
        try:
            if not self._in_step:
                self.on_step_begin()
            self.controller.before_instruction(str(kind), microbatch, chunk)
            if self._wait_for_clock:
                self.controller.wait_applied()
            if self._profiling:
                self.profiler.before_instruction()
            self._mark_begin(str(kind), chunk)
            if self._emulated is not None:
                self._emulated.begin(str(kind), microbatch, chunk)
        except Exception as e:
            self._warn_once(
                "instruction_begin", f"Perseus failed before {kind} {microbatch}: {e!r}; training continues"
            )

    def on_instruction_end(self, kind: str, microbatch: int, chunk: int = 0) -> None:
        """Right after an instruction's computation was issued."""
        if self._closed:
            self._emulate_closed(False, str(kind), microbatch, chunk)
            return
        if not self._in_step:
            return
        try:
            if self._emulated is not None:
                self._emulated.end()
            mark = self._mark_end()
            self.controller.after_instruction()
            self._done += 1
            if self._done == len(self.order):  # the last one: the compute part of the iteration ends
                self._compute_mark = mark if mark is not None else self._timer.mark()
        except Exception as e:
            self._warn_once("instruction_end", f"Perseus failed after {kind} {microbatch}: {e!r}; training continues")

    def on_step_end(self) -> None:
        """An iteration finished. Idempotent: extra calls without a new step do nothing."""
        self._finish_step(final=False)

    def _finish_step(self, final: bool) -> None:
        if self._closed or not self._in_step:
            return
        self._in_step = False
        try:
            self._end_iteration(final)
        except Exception as e:
            self._warn_once(
                "step_end", f"Perseus failed at the end of iteration {self.iteration}: {e!r}; training continues"
            )

    def pause(self) -> None:
        """Leave Perseus' control until the next step (e.g. evaluation): end the step, default clocks."""
        self.on_step_end()
        self._last_end = None  # what runs meanwhile is no training iteration's energy
        try:
            self.controller.apply_now(None, timeout=0.1)  # the plan itself stays for the next step
        except Exception as e:
            self._warn_once("pause", f"Perseus could not restore default clocks: {e!r}")

    def close(self) -> None:
        """Finish the current iteration, reset clocks, stop background work. Idempotent."""
        if self._closed:
            return
        if self._in_step:
            self._finish_step(final=True)
        else:
            self._say_closed()
        self._closed = True
        if self._client is not None and not self._refused and self._offset is None and self.iteration >= 0:
            # Said at the start too, but a long run's first lines scroll away (an outsider's did).
            self._warn_once(
                "never answered",
                f"the Perseus planner service never answered, or failed the job: all {self.iteration + 1} iterations "
                "ran at default clocks and no plan was made (see the log above); start `perseus serve` before the "
                "job, or check $PERSEUS_PLANNER",
            )
        self._stop.set()
        self.profiler.stop()
        self.controller.close()
        if self._registrar is not None:
            self._registrar.join(timeout=5.0)
        if self._client is not None and self._close_client:
            self._client.close()  # sends what is queued (final reports, the profile) first
        if self._progress is not None:
            self._progress.close()

    def _say_closed(self) -> None:
        """Tell the service this rank closed where no iteration was left to end (the script ended
        its last step itself): its last iteration's report again, as closing (no mean counts it)."""
        last, job_iteration = self.last_iteration, self.job_iteration
        if last is None or self._client is None or self._job_id is None or job_iteration is None:
            return
        try:
            self._client.report_iteration(
                self._job_id, self.rank, job_iteration, last.time_s, last.energy_j, closing=True
            )
        except Exception as e:  # never break training
            self._warn_once("close", f"Perseus could not tell the planner service this rank closed: {e!r}")

    def __enter__(self) -> PerseusRank:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Iteration logic
    def _begin_iteration(self) -> None:
        assignment = self._assignment() if self.controller.enabled else None  # else: measure only
        phase = Phase.UNPLANNED if assignment is None else Phase(assignment.phase)
        job_iteration = self.job_iteration  # set once the planner answered: so with any phase but UNPLANNED
        frequency = None
        self._profiling = False
        sweep = assignment.sweep if assignment is not None and phase is Phase.PROFILING else None
        if sweep is not None and job_iteration is not None:
            self._follow_round(int(getattr(assignment, "sweep_round", 0)))
        if sweep is not None and job_iteration is not None and not self.sweep.done:
            try:
                step = self.profiler.begin_iteration(sweep)
            except ConfigError as e:
                self._warn_once("sweep", f"{e}; not profiling")
                step = None
            if step is not None:
                # Each instruction at its kind's clock in this step; the profiler waits each change out.
                self.controller.set_plan(self._keys, [step[kind] for kind, _, _ in self._keys])
                frequency = self._step_frequency()
                self._profiling = True
            else:
                self.controller.set_uniform(None)
            self._holds_plan = False
        elif assignment is not None and phase in _RUNS_PLAN and assignment.frequencies is not None:
            if assignment.plan_version != self.plan_version or not self._holds_plan:
                self._apply_plan(assignment.frequencies, assignment.plan_version)
        else:
            self.controller.set_uniform(None)
            self._holds_plan = False
        if not self._profiling:
            self.profiler.stop()
        self.controller.begin_iteration()
        self.phase = phase
        self._frequency = frequency
        self._record_spans = (
            assignment is not None
            and bool(getattr(assignment, "spans", False))
            # Iterations at default clocks, not profiled: the baseline's, and verification's reference windows.
            and phase in (Phase.WARMUP, Phase.PLANNING, Phase.REFERENCE)
            and self._span_reports < MAX_SPAN_REPORTS
        )
        if self._progress is not None:
            # The sweep's count: the frequencies profiled so far, of those it will profile (at
            # most the service's plan until the main sweep stops, early or at its last frequency),
            # and once over, what it profiled while the job still profiles or plans.
            swept = self.sweep.done and phase in (Phase.PROFILING, Phase.PLANNING)
            done = len(self.sweep.profiled_frequencies) if self._profiling or swept else None
            total, known = self.sweep.frequency_count
            self._progress.update(
                self.iteration,
                phase,
                frequency,
                done,
                total if done is not None else None,
                plan_version=self.plan_version if self._holds_plan else 0,
                at_most=not known,
                waiting=self._unprofiled(assignment) if phase is Phase.PLANNING else (),
                repeats=self.sweep.repeats,
                job_iteration=self.job_iteration,
            )

    def _unprofiled(self, assignment: Any) -> tuple[int, ...]:
        """The other stages the plan still waits for, as the service last said (none if it did not).
        Not this rank's own: it is planning, so its sweep is done and its profile on the way (what
        the service said may predate the upload)."""
        profiled = getattr(assignment, "profiled_stages", None)
        if not profiled:
            return ()
        return tuple(s for s in range(len(self.schedule.stages)) if s not in profiled and s != self.stage)

    def _follow_round(self, sweep_round: int) -> None:
        """A new round of the service's sweep: the profile of the earlier one never reached it (it
        failed, or was lost) or no longer fits the workload, so this rank profiles its stage afresh."""
        if sweep_round == self._sweep_round:
            return
        self._sweep_round = sweep_round
        if self.sweep.plan is None:
            return  # nothing swept yet: this is the rank's first sweep
        logger.warning(
            "rank %d: the planner service asks stage %d to profile again (sweep round %d): its profile never "
            "reached the service, or no longer fits what the stage runs (`perseus status` says which)",
            self.rank,
            self.stage,
            sweep_round,
        )
        self.profiler.stop()
        self.sweep = Sweep(self.stage, early_stop_rises=self.settings.early_stop_rises)
        self.profiler = OnlineProfiler(self.gpu, self.sweep, self.controller.settle, self.controller.latency)

    def _emulate_closed(self, begins: bool, kind: str, microbatch: int, chunk: int) -> None:
        """After `close()`, Perseus no longer measures or sets clocks, but the model's emulated GPU
        work is the model's: it still runs (at default clocks)."""
        if self._emulated is None:
            return
        try:
            if begins:
                self._emulated.begin(kind, microbatch, chunk)
            else:
                self._emulated.end()
        except Exception as e:
            self._warn_once("emulate", f"emulating {kind} {microbatch}'s GPU work failed: {e!r}; training continues")

    def _mark_begin(self, kind: str, chunk: int) -> None:
        """An instruction begins: its span starts, in iterations profiled or the planner wants spans of."""
        if self._spans is not None:
            self._spans.begin((self._virtual.get(chunk, self.stage), kind), self._timer.mark())

    def _mark_end(self) -> Mark | None:
        """An instruction ends: the timer's mark of its end, if this iteration's instructions are timed."""
        if self._spans is None:
            return None
        mark = self._timer.mark()
        self._spans.end(mark)
        return mark

    def _check_gpu_work(self, record: IterationRecord, energy_span_s: float) -> None:
        """On a simulated GPU, warn once if this rank's first iterations ran no simulated work
        (`energy_span_s`: the time the record's energy covers, from the previous iteration's end)."""
        if self._work_check is None or record.iteration == 0:  # the first iteration: set-up and warm-up
            return
        if self._work_check.add(energy_span_s, record.energy_j):
            self._work_check = None
            logger.warning(
                "rank %d: its instructions ran no work on its simulated GPU (%s) in iterations 1-%d: Perseus "
                "profiles and plans GPU work, so there is nothing to plan. Give each instruction the work it stands "
                "for: perseus.instrument(..., emulate={'forward': Work(0.006), 'backward': Work(0.012)}), or "
                "perseus.devices.emulate(gpu, Work(seconds)) inside the stage (README: Emulating GPU work)",
                self.rank,
                self.gpu.name(),
                record.iteration,
            )
        elif self._work_check.done:
            self._work_check = None

    def _send_spans(self, recorded: SpanRecorder, spans: list[Span], job_iteration: int | None, step_s: float) -> None:
        """Send the iteration's instruction spans, if the planner asked for them and all were seen."""
        if not self._record_spans or not recorded.complete or self._client is None or self._job_id is None:
            return
        if job_iteration is None or self._span_reports >= MAX_SPAN_REPORTS:
            return
        begins, ends = offsets_us(spans, self._step_start[0])
        step_us = max(round(step_s * 1e6), ends[-1], 1)
        self._span_reports += 1
        self._client.report_spans(
            ReportSpans(
                self._job_id, self.rank, job_iteration, self.phase.value, self._frequency, step_us, begins, ends
            )
        )

    def _step_frequency(self) -> int | None:
        """The frequency the current profiling step profiles (the others run at one profiled before)."""
        plan, index = self.sweep.plan, self.profiler.step_index
        return None if plan is None or index is None else plan.frequencies[index // plan.steps_per_frequency]

    def _apply_plan(self, frequencies: Any, version: int) -> None:
        self.plan_version = version
        self._holds_plan = True
        try:
            self.controller.set_plan(self._keys, frequencies, version)
        except PlanError as e:
            logger.error("rank %d: refusing plan v%d (%s); running at default clocks", self.rank, version, e)
            self.controller.set_uniform(None)
            return
        logger.info("rank %d: applying plan v%d from iteration %d", self.rank, version, self.iteration)

    def _end_iteration(self, final: bool) -> None:
        """Measure the iteration that ended, and report it. The `final` one, ended by `close()`
        rather than by the next step, runs on to close() through whatever the script does after
        its last step (a checkpoint, a status query, a barrier): reported as closing, which tells
        the service the rank closed and keeps it out of its means and verification."""
        self.gpu.synchronize()
        t1, e1 = self.gpu.clock.now(), self.gpu.energy_mj()
        t0 = self._step_start[0]
        since, e0 = self._last_end if self._last_end is not None else self._step_start
        self._last_end = (t1, e1)
        times = self._timer.resolve()  # the GPU is drained: the marks' times are known
        recorded, self._spans = self._spans, None
        spans = recorded.spans(times) if recorded is not None else []
        # Only an iteration that ran exactly this rank's instructions has a compute part.
        last = self._compute_mark
        compute = times[last] - t0 if last is not None and self._done == len(self.order) else None
        record = IterationRecord(
            self.iteration,
            self.phase,
            self._frequency,
            self.plan_version,
            t1 - t0,
            (e1 - e0) / 1000.0,
            compute if compute is not None and compute > 0 else None,
            sweep_step=self.profiler.step_index if self._profiling else None,
            off_clock=self.controller.off_clock if self.phase is Phase.PLANNED else None,
        )
        self.last_iteration = record
        self._check_gpu_work(record, t1 - since)
        if self._profiling and self.profiler.end_iteration(spans):
            self._upload_profile()
        self._profiling = False
        job_iteration = self.job_iteration
        if recorded is not None and not final:
            self._send_spans(recorded, spans, job_iteration, t1 - t0)
        if self._client is not None and self._job_id is not None and job_iteration is not None:
            self._client.report_iteration(
                self._job_id,
                self.rank,
                job_iteration,
                record.time_s,
                record.energy_j,
                compute_time_s=record.compute_time_s,
                off_clock=record.off_clock,
                closing=final,
            )
        if self._on_iteration is not None:
            self._on_iteration(record)

    def _upload_profile(self) -> None:
        self.controller.set_uniform(None)
        try:
            profile = self.profiler.profile()
        except Exception as e:  # the sweep is over without a profile: the service asks for another
            logger.error(
                "rank %d: stage %d could not build its profile at the end of its sweep (%s); the planner service "
                "gets none, runs the job at default clocks and asks this stage to profile again once the profile "
                "is overdue (after a few failed sweeps the job fails: see perseus status)",
                self.rank,
                self.stage,
                e,
            )
            return
        logger.info(
            "rank %d: stage %d profiled at %d clocks (%s MHz)",
            self.rank,
            self.stage,
            len(self.sweep.profiled_frequencies),
            profile.meta.get("frequencies", ""),
        )
        if self._client is not None and self._job_id is not None:
            # Every replica offers it: the client sends it only if the planner's table names this
            # rank the uploader of its (GPU model, stage, tensor-parallel index).
            self._client.upload_profile(self._job_id, self.stage, profile)

    @property
    def job_iteration(self) -> int | None:
        """This iteration as the planner counts it (None until the planner first answered)."""
        return None if self._offset is None else self.iteration - self._offset

    def _assignment(self) -> PortAssignment | None:
        if self._client is None or self._job_id is None:
            return None
        try:
            if self._offset is None:
                first = self._client.assignment(0)
                if first.phase == Phase.UNPLANNED:
                    return first
                self._offset = self.iteration
            return self._client.assignment(self.iteration - self._offset)
        except Exception as e:
            self._warn_once(
                "assignment",
                f"asking the planner for iteration {self.iteration} failed ({e!r}); keeping the current clocks",
            )
            return None

    def _await_planner(self) -> None:
        """Before the first iteration, give the planner up to `startup_wait_s` to register this
        rank and answer, so that every rank starts its tables at the same iteration."""
        deadline = time.monotonic() + self._startup_wait_s
        if self._registrar is not None:
            self._registrar.join(max(0.0, deadline - time.monotonic()))
        while self._client is not None and self._job_id is not None and time.monotonic() < deadline:
            if self._client.assignment(0).phase != Phase.UNPLANNED:
                return
            self._stop.wait(0.01)

    # Registration (background: the planner may be late or down)
    def job_spec(self) -> JobSpec:
        """The job as rank 0 registers it (every rank builds it: its id names the job)."""
        return registration.job_spec(
            self.schedule,
            self.parallelism,
            self.gpu,
            self.settings,
            self.sweep_frequencies,
            tag=self.tag,
            instruction_overhead_s=self.instruction_overhead_s,
            hop_latency_s=self.hop_latency_s,
            tolerance=self.tolerance,
        )

    def rank_info(self) -> RankInfo:
        """This rank as it registers itself."""
        return registration.rank_info(self.rank, self.parallelism, self.gpu)

    def _register(self, retry_s: float) -> None:
        """The registration thread: see `perseus.runtime.registration.register`."""
        job_id = registration.register(
            self._client, self.rank, lambda: (self.job_spec(), self.rank_info()), self._stop, retry_s
        )
        if job_id is not None:
            self._job_id = job_id
        elif not self._stop.is_set():
            self._refused = True  # said in the log: the planner refused the job

    def _warn_once(self, where: str, message: str) -> None:
        if where not in self._warned:
            self._warned.add(where)
            logger.warning("rank %d: %s", self.rank, message)

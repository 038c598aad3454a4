"""`perseus.instrument(stage)`: Perseus hooks on torch.distributed.pipelining stages.

The stage object itself is instrumented (its `forward_one_chunk`, `backward_one_chunk`,
`backward_weight_one_chunk` and `clear_runtime_states` get instance-level wrappers) and
returned, so every torch schedule -- GPipe, 1F1B, Interleaved1F1B, the zero-bubble ones --
runs it unchanged, before or after the schedule object is built.

Step boundaries are automatic: every torch schedule's `step()` starts by calling
`clear_runtime_states()` on its stages, which Perseus takes as the start of an iteration; an
iteration ends where the next one starts (so its time and energy include the optimizer step),
or at `stage.perseus.on_step_end()` / `stage.perseus.close()` if you call them. `eval()` steps
(no backward) run at default clocks and are not counted.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from perseus.client.planner_client import PlannerClient
from perseus.devices import get_gpus
from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError
from perseus.runtime.port import PlannerPort
from perseus.runtime.rank import PerseusRank
from perseus.runtime.registration import resolve_parallelism
from perseus.schedules import Schedule, build_schedule, from_torch_pipeline_order
from perseus.schedules.instruction import Kind
from perseus.wire.limits import PLANNER_ENV
from perseus.wire.parallelism import Parallelism
from perseus.wire.security import Security

logger = logging.getLogger(__name__)

#: torch versions (major, minor), inclusive, whose PipelineStage methods these hooks match. Checked
#: release by release (2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0):
#: every schedule's step() calls clear_runtime_states() first and runs F, B, I and W through
#: forward_one_chunk(fwd_chunk_id, args, ...), backward_one_chunk(bwd_chunk_id, loss, full_backward,
#: ...) and backward_weight_one_chunk(bwd_chunk_id, ...). What later releases added around them --
#: OVERLAP_F_B (2.9: its sub-actions still call those methods), REDUCE_GRAD (2.10), WAIT_SEND_F/B and
#: WAIT_REDUCE_GRAD with start/wait_for_gradient_reduction (2.15) -- is communication, not an
#: instruction. A release past the last one checked is refused until it is checked.
SUPPORTED_TORCH = ((2, 6), (2, 15))
#: torch's single-stage schedules and the perseus builder that gives the order they run.
_SINGLE_STAGE_SCHEDULES = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}

_EXPECTED_PARAMS = {
    "forward_one_chunk": ("fwd_chunk_id", "args"),
    "backward_one_chunk": ("bwd_chunk_id", "loss", "full_backward"),
    "backward_weight_one_chunk": ("bwd_chunk_id",),
    "clear_runtime_states": (),
}


def check_torch_version(version: str | None = None) -> None:
    """Raise ConfigError unless torch (or `version`) is one these hooks support."""
    if version is None:
        import torch  # optional dependency (the torch extra): imported only when instrumenting

        version = torch.__version__
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise ConfigError(f"cannot parse the torch version {version!r}") from None
    low, high = SUPPORTED_TORCH
    if not low <= (major, minor) <= high:
        raise ConfigError(
            f"perseus.instrument supports torch {low[0]}.{low[1]} to {high[0]}.{high[1]}, found {version}; "
            f"install a supported torch (pip install 'torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}') or use "
            "the framework-neutral hooks (PerseusRank.on_instruction_begin/end)"
        )


def instrument(
    stage: Any,
    *,
    schedule: Any,
    num_microbatches: int | None = None,
    client: PlannerPort | str | Literal[False] | None = None,
    gpu: GPU | None = None,
    parallelism: Parallelism | None = None,
    rank: int | None = None,
    dp: int | None = None,
    dp_index: int | None = None,
    tp: int | None = None,
    tp_index: int | None = None,
    rank_mapping: str | None = None,
    security: Security | None = None,
    **options: Any,
) -> Any:
    """Instrument a `PipelineStage` (or this rank's list of stages, for multi-chunk schedules)
    and return it; `stage.perseus` is the `PerseusRank` (call `close()` when training ends; for a
    list of stages, every stage's `.perseus` is that one rank, e.g. `stages[0].perseus`).

    schedule: the torch schedule object built on these stages (its exact order is used), a
        `perseus.schedules.Schedule`, or a schedule name (`perseus.schedules.SCHEDULES`) with
        `num_microbatches`.
    client: a `PlannerClient`, a planner address, None for $PERSEUS_PLANNER or the default
        address, or False for no planner (default clocks; measuring only).
    gpu: this rank's GPU; default `get_gpus()[LOCAL_RANK]`.
    parallelism: this rank's place in the job, a `perseus.wire.Parallelism` (its `pp` and
        `stage` must be the pipeline group's size and this stage's group rank); or, instead:
    rank: this rank's global rank; default `torch.distributed.get_rank()` when initialized.
    dp, dp_index, tp, tp_index: the data- and tensor-parallel degrees and this rank's indices
        (default: one pipeline, no tensor parallelism). They are not guessed from process
        groups: pass them from what built your parallelism, and name its `rank_mapping`
        ("megatron", "torch", or "explicit"; default explicit) so the planner can check them.
        A torch DeviceMesh of shape (dp, pp, tp) with dims named "dp", "pp", "tp":
            perseus.instrument(stage, schedule=sched, dp=mesh["dp"].size(), dp_index=mesh["dp"].get_local_rank(),
                               tp=mesh["tp"].size(), tp_index=mesh["tp"].get_local_rank(), rank_mapping="torch")
        Megatron-LM (`from megatron.core import parallel_state as ps`):
            perseus.instrument(stage, schedule=sched, dp=ps.get_data_parallel_world_size(),
                               dp_index=ps.get_data_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
                               tp_index=ps.get_tensor_model_parallel_rank(), rank_mapping="megatron")
    security: for the client `instrument` creates (client None or an address): e.g.
        `perseus.wire.CurveClient.from_dir(DIR, NAME)` for a service started with
        --curve-keys; default from $PERSEUS_CURVE_KEYS, else plaintext. Pass it to your own
        `PlannerClient` instead when you give one.
    options: passed to `PerseusRank`, among them:
        tag: names the job beside its schedule and profile (a new tag starts a new job);
        profiling: the online sweep's settings, a `perseus.runtime.ProfilingSettings`;
        emulate: on simulated GPUs, the GPU work each instruction stands for, e.g.
            {"forward": Work(0.006), "backward": Work(0.012)} (perseus.runtime.emulation);
        tolerance: how much slower than the measured baseline a planned iteration may run before
            the service re-plans (default 0.01; perseus.service.verification);
        instruction_overhead_s, hop_latency_s: optional overrides of what the service fits from
            the ranks' own timelines (perseus.service.calibration): host work between a stage's
            instructions, and what a stage-to-stage hop takes beyond it, in seconds. With them
            the service neither calibrates nor has a measured baseline, so it does not verify
            the plan while it runs: leave them out unless you know better than the timeline;
        progress, wait_for_clock, handle_signals, watchdog, ...
    """
    stages = list(stage) if isinstance(stage, (list, tuple)) else [stage]
    if not stages:
        raise ConfigError("perseus.instrument needs at least one PipelineStage")
    check_torch_version()
    for s in stages:
        _check_stage(s)
    group_size = stages[0].group_size
    pp_rank = stages[0].group_rank
    plan = _resolve_schedule(schedule, num_microbatches, group_size, stages)
    if gpu is None:
        gpu = get_gpus()[int(os.environ.get("LOCAL_RANK", "0"))]
    if parallelism is None and rank is None:
        rank = _global_rank(pp_rank)
    layout = resolve_parallelism(
        plan,
        pp_rank,
        parallelism,
        rank=rank,
        dp=dp,
        dp_index=dp_index,
        tp=tp,
        tp_index=tp_index,
        rank_mapping=rank_mapping,
    )
    own_client = client is None or isinstance(client, str)
    if security is not None and not own_client:
        raise ConfigError(
            "perseus.instrument(security=...) configures the client it creates; with client=False or your own "
            "PlannerClient, pass security to PlannerClient(address, security=...) instead"
        )
    perseus_rank = PerseusRank(
        gpu, plan, parallelism=layout, client=_resolve_client(client, security), close_client=own_client, **options
    )
    hooks = _StageHooks(perseus_rank)
    for s in stages:
        hooks.install(s, chunk=s.stage_index // group_size)
    return stage


class _StageHooks:
    """The wrappers shared by every stage (model chunk) of one rank."""

    def __init__(self, rank: PerseusRank) -> None:
        self.rank = rank
        self.started = 0  # instructions begun in the current step

    def install(self, stage: Any, chunk: int) -> None:
        if getattr(stage, "perseus", None) is not None:
            raise ConfigError(f"pipeline stage {stage.stage_index} is already instrumented by Perseus")
        stage.perseus = self.rank

        clear = stage.clear_runtime_states

        @functools.wraps(clear)
        def clear_runtime_states(*args: Any, **kwargs: Any) -> Any:
            self.step_begins(stage)
            return clear(*args, **kwargs)

        def full_or_input(args: tuple, kwargs: dict) -> Kind:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return Kind.BACKWARD if full else Kind.BACKWARD_INPUT

        stage.clear_runtime_states = clear_runtime_states
        stage.forward_one_chunk = self.instruction(stage.forward_one_chunk, chunk, lambda a, k: Kind.FORWARD)
        stage.backward_one_chunk = self.instruction(stage.backward_one_chunk, chunk, full_or_input)
        stage.backward_weight_one_chunk = self.instruction(
            stage.backward_weight_one_chunk, chunk, lambda a, k: Kind.BACKWARD_WEIGHT
        )

    def instruction(
        self, run: Callable[..., Any], chunk: int, kind_of: Callable[[tuple, dict], Kind]
    ) -> Callable[..., Any]:
        """Wrap a stage's `*_one_chunk(microbatch, ...)` method: the rank sees each call begin
        and end as one instruction of kind `kind_of(args, kwargs)`."""
        rank = self.rank

        @functools.wraps(run)
        def wrapper(microbatch: int, *args: Any, **kwargs: Any) -> Any:
            kind = kind_of(args, kwargs)
            self.begin(kind, microbatch, chunk)
            try:
                return run(microbatch, *args, **kwargs)
            finally:
                rank.on_instruction_end(kind, microbatch, chunk)

        return wrapper

    def step_begins(self, stage: Any) -> None:
        try:
            if not stage.has_backward:
                self.rank.pause()  # eval(): not a training iteration
                self.started = -1
                return
            if self.started == 0 and self.rank.in_step:
                return  # another chunk of this rank, same step
            self.rank.on_step_begin()
            self.started = 0
        except Exception as e:  # never break training
            logger.warning("Perseus failed at a step boundary: %r", e)

    def begin(self, kind: Kind, microbatch: int, chunk: int) -> None:
        if self.started < 0:
            return  # evaluation step
        self.started += 1
        self.rank.on_instruction_begin(kind, microbatch, chunk)


def _check_stage(stage: Any) -> None:
    missing = []
    for name, params in _EXPECTED_PARAMS.items():
        method = getattr(stage, name, None)
        if method is None:
            missing.append(name)
            continue
        have = inspect.signature(method).parameters
        missing += [f"{name}({p})" for p in params if p not in have]
    for attr in ("stage_index", "group_size", "group_rank", "has_backward"):
        if not hasattr(stage, attr):
            missing.append(attr)
    if missing:
        raise ConfigError(
            f"perseus.instrument needs a torch.distributed.pipelining PipelineStage; {type(stage).__name__} "
            f"lacks {', '.join(missing)} (an unsupported torch version or a custom stage class?)"
        )


def _resolve_schedule(schedule: Any, num_microbatches: int | None, group_size: int, stages: Sequence[Any]) -> Schedule:
    if isinstance(schedule, Schedule):
        plan = schedule
    elif isinstance(schedule, str):
        if num_microbatches is None:
            raise ConfigError(f"schedule {schedule!r} given by name: also pass num_microbatches")
        plan = build_schedule(schedule, group_size, num_microbatches, num_chunks=len(stages))
    elif type(schedule).__name__ in _SINGLE_STAGE_SCHEDULES:
        # Their `pipeline_order` is a drawing aid, not what `step()` runs: use the builder.
        name = _SINGLE_STAGE_SCHEDULES[type(schedule).__name__]
        plan = build_schedule(name, group_size, schedule._n_microbatches)
    elif getattr(schedule, "pipeline_order", None) is not None and hasattr(schedule, "_stages"):
        plan = from_torch_pipeline_order(
            schedule.pipeline_order,
            schedule._n_microbatches,
            num_stages=stages[0].num_stages,
            name=type(schedule).__name__,
        )
    else:
        raise ConfigError(
            f"perseus.instrument(schedule=...) must be a torch pipelining schedule, a perseus Schedule or a "
            f"schedule name, got {schedule!r}"
        )
    if plan.num_stages != group_size:
        raise ConfigError(f"the schedule has {plan.num_stages} stages but the pipeline group has {group_size} ranks")
    if plan.num_chunks != len(stages):
        raise ConfigError(
            f"the schedule runs {plan.num_chunks} chunk(s) per rank but {len(stages)} stage(s) were instrumented; "
            "pass all of this rank's stages as a list"
        )
    return plan


def _resolve_client(
    client: PlannerPort | str | Literal[False] | None, security: Security | None = None
) -> PlannerPort | None:
    if client is False:
        return None
    if client is None or isinstance(client, str):
        address = client or os.environ.get(PLANNER_ENV) or None
        return PlannerClient(address, security=security) if address else PlannerClient(security=security)
    return client


def _global_rank(default: int) -> int:
    """torch.distributed's rank when its default process group is initialized, else `default`."""
    import torch.distributed as dist  # optional dependency, as in check_torch_version

    if not (dist.is_available() and dist.is_initialized()):
        return default
    try:
        return dist.get_rank()
    except (RuntimeError, ValueError) as e:  # the default group torn down meanwhile, or not usable
        logger.warning(
            "torch.distributed.get_rank() failed (%s); taking the pipeline rank %d as the global rank", e, default
        )
        return default

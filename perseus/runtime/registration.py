"""What a rank tells the planner: where it sits in the job (`resolve_parallelism`), the job as
rank 0 registers it (`job_spec`), the rank itself (`rank_info`), and registering both in the
background (`register`), since the planner may be late or down."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from perseus.devices.gpu import GPU
from perseus.exceptions import ConfigError, ServiceError
from perseus.runtime.port import PlannerPort
from perseus.runtime.records import ProfilingSettings
from perseus.schedules.instruction import Schedule
from perseus.wire.parallelism import Parallelism
from perseus.wire.spec import DEFAULT_TOLERANCE, JobSpec, RankInfo

logger = logging.getLogger(__name__)


def job_spec(
    schedule: Schedule,
    layout: Parallelism,
    gpu: GPU,
    settings: ProfilingSettings,
    sweep_frequencies: tuple[int, ...],
    *,
    tag: str,
    instruction_overhead_s: float,
    hop_latency_s: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> JobSpec:
    """The job as rank 0 registers it (every rank builds it: its id names the job)."""
    s = schedule
    return JobSpec(
        world_size=layout.world_size,
        pp=layout.pp,
        dp=layout.dp,
        tp=layout.tp,
        schedule_name=s.name,
        num_microbatches=s.num_microbatches,
        num_chunks=s.num_chunks,
        schedule_style=s.style,
        stage_orders=tuple(tuple((i.kind.value, i.microbatch, i.chunk) for i in row) for row in s.stages),
        overlapped=s.overlapped or None,
        tag=tag,
        gpu_model=gpu.name(),
        warmup_iterations=settings.warmup_iterations,
        iterations_per_frequency=settings.iterations_per_frequency,
        sweep_frequencies=sweep_frequencies,
        rank_mapping=layout.rank_mapping,
        instruction_overhead_s=instruction_overhead_s,
        hop_latency_s=hop_latency_s,
        tolerance=tolerance,
    )


def rank_info(rank: int, layout: Parallelism, gpu: GPU) -> RankInfo:
    """The rank as it registers itself (it sends instruction spans when asked: `timeline`)."""
    return RankInfo(
        rank,
        layout.stage,
        dp_index=layout.dp_index,
        tp_index=layout.tp_index,
        gpu_model=gpu.name(),
        frequencies=tuple(gpu.supported_frequencies()),
        timeline=True,
    )


def register(
    client: PlannerPort | None,
    rank: int,
    describe: Callable[[], tuple[JobSpec, RankInfo]],
    stop: threading.Event,
    retry_s: float,
) -> str | None:
    """Rank 0 registers the job, every rank itself (`describe` gives both); returns the job id, or
    None if the planner refused the job or `stop` was set first. The client retries an unreachable
    service in the background; this loop only covers clients that raise instead."""
    warned = False
    while client is not None and not stop.is_set():
        try:
            spec, info = describe()
            job_id = client.register_job(spec) if rank == 0 else spec.job_id()
            client.register_rank(job_id, info)
            return job_id
        except (ConfigError, ServiceError) as e:
            logger.error("rank %d: the Perseus planner refused this job (%s); running at default clocks", rank, e)
            return None
        except Exception as e:
            if not warned:
                logger.warning(
                    "rank %d: cannot reach the Perseus planner (%r); training runs at default clocks "
                    "and registration is retried every %g s",
                    rank,
                    e,
                    retry_s,
                )
                warned = True
        stop.wait(retry_s)
    return None


def resolve_parallelism(
    schedule: Schedule, stage: int | None, parallelism: Parallelism | None, **keywords: Any
) -> Parallelism:
    """This rank's `Parallelism`: `parallelism` as given (checked against the schedule and
    `stage`), or built from `stage` and the keywords (rank, dp, dp_index, tp, tp_index,
    rank_mapping) that are not None. ConfigError naming what to fix."""
    given = {name: value for name, value in keywords.items() if value is not None}
    pp = schedule.num_stages
    if parallelism is not None:
        if not isinstance(parallelism, Parallelism):
            raise ConfigError(f"parallelism must be a perseus.wire.Parallelism, got {type(parallelism).__name__}")
        if given:
            raise ConfigError(f"pass parallelism= or {', '.join(f'{n}=' for n in given)}, not both")
        if parallelism.pp != pp:
            raise ConfigError(f"parallelism.pp is {parallelism.pp} but the schedule has {pp} stages")
        if stage is not None and stage != parallelism.stage:
            raise ConfigError(f"this rank's pipeline stage is {stage} but parallelism.stage is {parallelism.stage}")
        return parallelism
    if stage is None:
        raise ConfigError("PerseusRank needs this rank's pipeline stage: pass stage= or parallelism=")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ConfigError(f"stage {stage} is outside the schedule's stages 0..{pp - 1}")
    return Parallelism(pp, stage, **given)

"""Which of the visible GPUs are this process's own, when it is one rank of a distributed job.

torchrun (and accelerate, DeepSpeed, most launchers) start one process per GPU on a node and
tell each its place in $LOCAL_RANK and $LOCAL_WORLD_SIZE. A rank that measured, or capped,
every visible GPU would count its neighbours' GPUs too: N ranks would each report N GPUs.
So `Monitor()` and `GlobalPowerLimitOptimizer()` default to `local_gpu_indices`.
"""

from __future__ import annotations

import logging
import os
import sys

from perseus.exceptions import ConfigError

logger = logging.getLogger(__name__)

LOCAL_RANK_ENV = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
_warned_no_local_rank = False


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {text!r}") from None
    if value < 0:
        raise ConfigError(f"${name} must be >= 0, got {value}")
    return value


def local_gpu_indices(
    count: int, local_rank: int | None = None, local_world_size: int | None = None
) -> list[int] | None:
    """Indices of this rank's own GPUs among `count` visible ones; None outside a distributed job
    (then every visible GPU is this process's own).

    local_rank (default $LOCAL_RANK) is this process's place among the ranks of its node and
    local_world_size (default $LOCAL_WORLD_SIZE) their number. One visible GPU is the rank's
    own (a launcher that gives each rank its own CUDA_VISIBLE_DEVICES). With k GPUs per rank
    (count = k x local_world_size), rank r owns GPUs r*k .. r*k+k-1; without a known
    local_world_size, GPU `local_rank`. A split that cannot be told (3 GPUs for 2 ranks) is a
    ConfigError saying to pass `gpu_indices`.
    """
    if local_rank is None:
        local_rank = _env_int(LOCAL_RANK_ENV)
    if local_rank is None:
        _warn_if_distributed_without_local_rank(count)
        return None
    if local_world_size is None:
        local_world_size = _env_int(LOCAL_WORLD_SIZE_ENV)
    if count == 1:
        return [0]
    fix = "pass the GPUs this rank uses, e.g. Monitor(gpu_indices=[...])"
    if local_world_size is None:
        if local_rank >= count:
            raise ConfigError(f"this is local rank {local_rank}, but only {count} GPUs are visible; {fix}")
        return [local_rank]
    if local_rank >= local_world_size:
        raise ConfigError(f"local rank {local_rank} is not below the local world size {local_world_size}; {fix}")
    if count % local_world_size:
        raise ConfigError(
            f"{count} visible GPUs do not split evenly among the {local_world_size} ranks on this node, "
            f"so local rank {local_rank} cannot tell which are its own; {fix}"
        )
    per_rank = count // local_world_size
    return list(range(local_rank * per_rank, (local_rank + 1) * per_rank))


def _warn_if_distributed_without_local_rank(count: int) -> None:
    """A process group of several ranks but no $LOCAL_RANK: each rank will use every GPU."""
    global _warned_no_local_rank
    dist = sys.modules.get("torch.distributed")
    if _warned_no_local_rank or count < 2 or dist is None:
        return
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _warned_no_local_rank = True
        logger.warning(
            "torch.distributed has %d ranks but $%s is not set, so each rank measures all %d visible GPUs; "
            "pass Monitor(gpu_indices=[...]) with this rank's GPUs (torchrun sets $%s)",
            dist.get_world_size(),
            LOCAL_RANK_ENV,
            count,
            LOCAL_RANK_ENV,
        )

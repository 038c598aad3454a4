"""What lets Zeus 0.16 code run on Perseus' power-limit optimizer unchanged: its argument names
where they mean the same, and its `ZeusMonitor` in place of a Perseus `Monitor`."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from perseus.exceptions import ConfigError
from perseus.measurement.monitor import Monitor

logger = logging.getLogger(__name__)

T = TypeVar("T")


def alias(name: str, value: T | None, zeus_name: str, zeus_value: T | None) -> T | None:
    """The value given under Perseus' `name` or under Zeus' `zeus_name` (not both)."""
    if value is not None and zeus_value is not None:
        raise ConfigError(f"{name}= and {zeus_name}= name the same setting (the second is Zeus' name): pass one")
    return value if value is not None else zeus_value


def as_monitor(monitor: Any) -> Monitor:
    """`monitor` itself if it is a Perseus Monitor; for a ZeusMonitor (or any object with
    `gpu_indices`, `begin_window` and `end_window`), a Perseus Monitor of the same GPUs.

    Both count indices among the visible GPUs (CUDA_VISIBLE_DEVICES order) and read the same
    energy counters; Perseus measures with its own so that simulated GPUs and AMD ones work too.
    """
    if isinstance(monitor, Monitor):
        return monitor
    indices = getattr(monitor, "gpu_indices", None)
    if not all(callable(getattr(monitor, m, None)) for m in ("begin_window", "end_window")) or indices is None:
        raise ConfigError(
            f"monitor must be a perseus.measurement.Monitor or a zeus ZeusMonitor (an object with gpu_indices, "
            f"begin_window and end_window), got {type(monitor).__name__}; e.g. Monitor(gpu_indices=[local_rank])"
        )
    try:
        gpu_indices = [int(i) for i in indices]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{type(monitor).__name__}.gpu_indices must be a list of GPU indices, got {indices!r}"
        ) from None
    if not gpu_indices:
        raise ConfigError(f"{type(monitor).__name__} monitors no GPU (gpu_indices is empty)")
    logger.info("measuring the GPUs %s of %s with a Perseus Monitor", gpu_indices, type(monitor).__name__)
    return Monitor(gpu_indices=gpu_indices, cpus=[])

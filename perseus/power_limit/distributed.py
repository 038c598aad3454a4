"""Agreement across data-parallel ranks through torch.distributed, when it is initialised.

Every function is a no-op in a single process; in a group every rank must call it at the
same point (as collective calls require).
"""

from __future__ import annotations

import sys
from typing import Any


def _dist() -> Any | None:
    """torch.distributed when a process group is initialised (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _device(dist: Any) -> Any:
    import torch

    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def all_reduce(values: list[float], op: str) -> list[float]:
    """Element-wise "sum" or "max" of `values` over all ranks."""
    dist = _dist()
    if dist is None:
        return list(values)
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=_device(dist))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def broadcast(values: list[float]) -> list[float]:
    """Rank 0's `values` on every rank (all ranks pass lists of the same length)."""
    dist = _dist()
    if dist is None:
        return list(values)
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=_device(dist))
    dist.broadcast(tensor, src=0)
    return tensor.tolist()

"""3D parallelism: where a rank sits (stage, data-parallel index, tensor-parallel index), and the
profile of a stage whose work is split over tensor-parallel ranks.

Rank mappings (`JobSpec.rank_mapping`):
  explicit  each rank states its own (stage, dp_index, tp_index) in RankInfo
  megatron  Megatron-LM's default order: tensor-parallel fastest, then data-parallel, then pipeline
            (rank = tp_index + tp * (dp_index + dp * stage))
  torch     a torch DeviceMesh of shape (dp, pp, tp), as torch.distributed.pipelining examples
            build it: tensor-parallel fastest, then pipeline, then data-parallel
            (rank = tp_index + tp * (stage + pp * dp_index))
With pp only (dp = tp = 1) every mapping gives rank = stage.
"""

from __future__ import annotations

from perseus.exceptions import ConfigError
from perseus.profiler.profile import Profile, ProfilePoint

RANK_MAPPINGS = ("explicit", "megatron", "torch")


def rank_coordinates(mapping: str, rank: int, pp: int, dp: int, tp: int) -> tuple[int, int, int]:
    """(stage, dp_index, tp_index) of `rank` under a named mapping."""
    if not 0 <= rank < pp * dp * tp:
        raise ConfigError(f"rank {rank} is outside 0..{pp * dp * tp - 1} (pp={pp}, dp={dp}, tp={tp})")
    tp_index, rest = rank % tp, rank // tp
    if mapping == "megatron":
        return rest // dp, rest % dp, tp_index
    if mapping == "torch":
        return rest % pp, rest // pp, tp_index
    raise ConfigError(f"rank mapping {mapping!r} has no formula; use one of megatron, torch (explicit: ranks state their coordinates)")


def rank_of(mapping: str, stage: int, dp_index: int, tp_index: int, pp: int, dp: int, tp: int) -> int:
    """The rank at (stage, dp_index, tp_index): the inverse of `rank_coordinates`."""
    if mapping == "megatron":
        return tp_index + tp * (dp_index + dp * stage)
    if mapping == "torch":
        return tp_index + tp * (stage + pp * dp_index)
    raise ConfigError(f"rank mapping {mapping!r} has no formula; use one of megatron, torch")


def merge_tensor_parallel(uploads: list[Profile]) -> Profile:
    """One stage's profile from its tensor-parallel ranks' profiles: per (stage, kind) and
    frequency, the slowest rank's time and the sum of their energies (the stage finishes when
    its last shard does, and every shard's GPU draws power). Frequencies not profiled on every
    rank are dropped; the blocking power is the sum (every GPU of the stage blocks)."""
    if not uploads:
        raise ConfigError("merge_tensor_parallel needs at least one profile")
    if len(uploads) == 1:
        return uploads[0]
    keys = set(uploads[0].points)
    for profile in uploads[1:]:
        if set(profile.points) != keys:
            raise ConfigError(
                f"tensor-parallel ranks of one stage uploaded different rows ({sorted(keys)} vs {sorted(profile.points)}); "
                "every rank of a stage must profile the same instruction kinds"
            )
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    for key in sorted(keys):
        by_freq = [{p.frequency: p for p in profile.points[key]} for profile in uploads]
        common = set(by_freq[0]).intersection(*by_freq[1:])
        if not common:
            raise ConfigError(f"tensor-parallel ranks share no profiled frequency for {key}; sweep the same frequencies on every rank")
        points[key] = [
            ProfilePoint(f, max(b[f].time for b in by_freq), sum(b[f].energy for b in by_freq)) for f in sorted(common, reverse=True)
        ]
    meta = {**uploads[0].meta, "tensor_parallel": str(len(uploads))}
    return Profile(points, sum(p.blocking_power_w for p in uploads), meta)

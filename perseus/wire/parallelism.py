"""3D parallelism: where a rank sits (stage, data-parallel index, tensor-parallel index), and the
profile of a stage whose work is split over tensor-parallel ranks.

`Parallelism` is one rank's place in its job (the degrees pp, dp, tp, its coordinates and global
rank, the rank mapping), checked once; the rank side passes it whole and builds its JobSpec and
RankInfo from it.

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

from dataclasses import KW_ONLY, dataclass

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
    raise ConfigError(
        f"rank mapping {mapping!r} has no formula; use one of megatron, torch (explicit: ranks state their coordinates)"
    )


def rank_of(mapping: str, stage: int, dp_index: int, tp_index: int, pp: int, dp: int, tp: int) -> int:
    """The rank at (stage, dp_index, tp_index): the inverse of `rank_coordinates`."""
    if mapping == "megatron":
        return tp_index + tp * (dp_index + dp * stage)
    if mapping == "torch":
        return tp_index + tp * (stage + pp * dp_index)
    raise ConfigError(f"rank mapping {mapping!r} has no formula; use one of megatron, torch")


@dataclass(frozen=True)
class Parallelism:
    """Where one rank sits in its job's 3D parallelism, checked on construction (ConfigError
    naming what to fix).

    The job runs `pp` pipeline stages, `dp` data-parallel pipelines and `tp` tensor-parallel
    ranks per stage; this rank is (`stage`, `dp_index`, `tp_index`) with global rank `rank`.
    `rank_mapping` (one of RANK_MAPPINGS, see the module docstring) tells the planner how
    global ranks map to coordinates; a named mapping is checked here. `rank` None: `stage`
    when dp = tp = 1, else what a named mapping gives (an explicit mapping needs it). After
    construction `rank` is always set.
    """

    pp: int
    stage: int = 0
    _: KW_ONLY
    dp: int = 1
    dp_index: int = 0
    tp: int = 1
    tp_index: int = 0
    rank_mapping: str = "explicit"
    rank: int | None = None

    def __post_init__(self) -> None:
        pp, stage = self.pp, self.stage
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ConfigError(f"pp must be a positive integer (the number of pipeline stages), got {pp!r}")
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
            raise ConfigError(f"stage {stage!r} is outside the pipeline's stages 0..{pp - 1}")
        object.__setattr__(
            self,
            "rank",
            _checked_rank(self.rank, stage, pp, self.dp, self.dp_index, self.tp, self.tp_index, self.rank_mapping),
        )

    @classmethod
    def from_rank(cls, rank: int, pp: int, dp: int = 1, tp: int = 1, rank_mapping: str = "megatron") -> Parallelism:
        """The coordinates of global rank `rank` under a named mapping ("megatron" or "torch")."""
        if rank_mapping not in RANK_MAPPINGS:
            raise ConfigError(f"rank_mapping must be one of {', '.join(RANK_MAPPINGS)}, got {rank_mapping!r}")
        for name, value in (("rank", rank), ("pp", pp), ("dp", dp), ("tp", tp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "rank" else 1):
                raise ConfigError(
                    f"{name} must be a {'non-negative' if name == 'rank' else 'positive'} integer, got {value!r}"
                )
        stage, dp_index, tp_index = rank_coordinates(rank_mapping, rank, pp, dp, tp)
        return cls(pp, stage, dp=dp, dp_index=dp_index, tp=tp, tp_index=tp_index, rank_mapping=rank_mapping, rank=rank)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(stage, dp_index, tp_index)."""
        return self.stage, self.dp_index, self.tp_index


def _checked_rank(
    rank: int | None, stage: int, pp: int, dp: int, dp_index: int, tp: int, tp_index: int, mapping: str
) -> int:
    """The global rank, after checking (stage, dp_index, tp_index) against the job and the
    rank mapping."""
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer (the data-/tensor-parallel degree), got {value!r}")
    for name, value, size in (("dp_index", dp_index, dp), ("tp_index", tp_index, tp)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ConfigError(f"{name} must be an integer in 0..{size - 1} ({name[:2]}={size}), got {value!r}")
    if mapping not in RANK_MAPPINGS:
        raise ConfigError(f"rank_mapping must be one of {', '.join(RANK_MAPPINGS)}, got {mapping!r}")
    if rank is None:
        if dp == tp == 1:
            return stage
        if mapping == "explicit":
            raise ConfigError(
                "with dp > 1 or tp > 1 pass rank= (the global rank) or a named rank_mapping ('megatron' or 'torch')"
            )
        return rank_of(mapping, stage, dp_index, tp_index, pp, dp, tp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp * dp * tp:
        raise ConfigError(
            f"rank must be an integer in 0..{pp * dp * tp - 1} (pp={pp} x dp={dp} x tp={tp}), got {rank!r}"
        )
    if mapping != "explicit":
        expected = rank_coordinates(mapping, rank, pp, dp, tp)
        if expected != (stage, dp_index, tp_index):
            raise ConfigError(
                f"under the {mapping} rank mapping rank {rank} is stage {expected[0]}, dp_index {expected[1]}, "
                f"tp_index {expected[2]}, not stage {stage}, dp_index {dp_index}, tp_index {tp_index}; "
                "fix the indices or use rank_mapping='explicit'"
            )
    return rank


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
                f"tensor-parallel ranks of one stage uploaded different rows ({sorted(keys)} vs "
                f"{sorted(profile.points)}); every rank of a stage must profile the same instruction kinds"
            )
    points: dict[tuple[int, str], list[ProfilePoint]] = {}
    for key in sorted(keys):
        by_freq = [{p.frequency: p for p in profile.points[key]} for profile in uploads]
        common = set(by_freq[0]).intersection(*by_freq[1:])
        if not common:
            raise ConfigError(
                f"tensor-parallel ranks share no profiled frequency for {key}; sweep the same frequencies on every rank"
            )
        points[key] = [
            ProfilePoint(f, max(b[f].time for b in by_freq), sum(b[f].energy for b in by_freq))
            for f in sorted(common, reverse=True)
        ]
    meta = {**uploads[0].meta, "tensor_parallel": str(len(uploads))}
    return Profile(points, sum(p.blocking_power_w for p in uploads), meta)

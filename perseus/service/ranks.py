"""A job's ranks: where each one sits (stage, data-parallel and tensor-parallel index), the GPU
model of each stage replica, and which rank uploads each stage's profile.

The data-parallel replicas of a stage on one GPU model share one profile, taken from the lowest
data-parallel index registered there: that rank is elected the stage's uploader.
"""

from __future__ import annotations

from perseus.exceptions import ServiceError
from perseus.wire.envelope import ErrorCode
from perseus.wire.parallelism import rank_coordinates
from perseus.wire.spec import JobSpec, RankInfo

Models = tuple[str, ...]  # the GPU model of each stage of a pipeline


def bad_field(message: str) -> ServiceError:
    """The refusal of a request whose fields do not fit the job (the client fixes and resends)."""
    return ServiceError(ErrorCode.BAD_FIELD.value, message)


class Roster:
    """The registered ranks of one job (`spec`)."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.job_id = spec.job_id()
        self.ranks: dict[int, RankInfo] = {}
        self._coords: dict[tuple[int, int, int], int] = {}  # (stage, dp_index, tp_index) -> rank
        self._group_model: dict[tuple[int, int], str] = {}  # (stage, pipeline) -> its GPU model
        # (GPU model, stage, tp_index) -> the lowest dp_index registered there: the rank that uploads.
        self._uploader: dict[tuple[str, int, int], int] = {}
        self._models: dict[int, Models] = {}  # pipeline -> models(pipeline), cached
        self._frequency_lists: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple shared by ranks of one GPU

    def check(self, info: RankInfo) -> None:
        """ServiceError (bad_field) unless `info` fits the job and the ranks registered so far."""
        spec = self.spec
        for name, value, limit, what in (
            ("rank", info.rank, spec.world_size, "world_size"),
            ("stage", info.stage, spec.pp, "pp"),
            ("dp_index", info.dp_index, spec.dp, "dp"),
            ("tp_index", info.tp_index, spec.tp, "tp"),
        ):
            if value >= limit:
                raise bad_field(
                    f"RankInfo.{name} is {value}, but job {self.job_id} has {what}={limit}; use 0..{limit - 1}"
                )
        coords = (info.stage, info.dp_index, info.tp_index)
        if spec.rank_mapping != "explicit":
            expected = rank_coordinates(spec.rank_mapping, info.rank, spec.pp, spec.dp, spec.tp)
            if coords != expected:
                raise bad_field(
                    f"under the {spec.rank_mapping} rank mapping rank {info.rank} is stage {expected[0]}, "
                    f"dp_index {expected[1]}, tp_index {expected[2]}, but it registered stage {info.stage}, "
                    f"dp_index {info.dp_index}, tp_index {info.tp_index}; "
                    "fix the RankInfo or register the job with rank_mapping='explicit'"
                )
        other = self._coords.get(coords)
        if other is not None and other != info.rank:
            raise bad_field(
                f"rank {info.rank} and rank {other} both claim stage {info.stage}, dp_index {info.dp_index}, "
                f"tp_index {info.tp_index}"
            )
        group = (info.stage, info.dp_index)
        peers = [r for r in self.ranks.values() if (r.stage, r.dp_index) == group and r.rank != info.rank]
        if peers and peers[0].gpu_model != info.gpu_model:
            raise bad_field(
                f"rank {info.rank} has GPU {info.gpu_model!r} but its tensor-parallel peer rank {peers[0].rank} "
                f"(stage {info.stage}, dp_index {info.dp_index}) has {peers[0].gpu_model!r}; "
                "the ranks of one stage replica must share a GPU model"
            )

    def add(self, info: RankInfo) -> bool:
        """Register (or move) a rank `check` accepted; True if a stage replica's GPU model changed."""
        object.__setattr__(info, "frequencies", self._frequency_lists.setdefault(info.frequencies, info.frequencies))
        old = self.ranks.get(info.rank)
        if old is not None:
            self._coords.pop((old.stage, old.dp_index, old.tp_index), None)
            self._models.pop(old.dp_index, None)
        self.ranks[info.rank] = info
        self._coords[(info.stage, info.dp_index, info.tp_index)] = info.rank
        key = (info.gpu_model, info.stage, info.tp_index)
        if old is not None and (old.gpu_model, old.stage, old.tp_index, old.dp_index) != (*key, info.dp_index):
            self._uploader = {}  # a rank moved (rare): recount every uploader
            for r in self.ranks.values():
                k = (r.gpu_model, r.stage, r.tp_index)
                self._uploader[k] = min(self._uploader.get(k, r.dp_index), r.dp_index)
        elif info.dp_index < self._uploader.get(key, info.dp_index + 1):
            self._uploader[key] = info.dp_index
        group = (info.stage, info.dp_index)
        if self._group_model.get(group) == info.gpu_model:
            return False
        self._group_model[group] = info.gpu_model
        self._models.pop(info.dp_index, None)
        return True

    def get(self, rank: int) -> RankInfo:
        """The rank's registration; ServiceError (unknown_rank) if it has none."""
        if rank not in self.ranks:
            raise ServiceError(
                ErrorCode.UNKNOWN_RANK.value,
                f"rank {rank} has not registered with job {self.job_id}; call register_rank first",
            )
        return self.ranks[rank]

    def models(self, pipeline: int) -> Models:
        """The GPU model of each stage of `pipeline` (the job's model where no rank registered yet)."""
        models = self._models.get(pipeline)
        if models is None:
            models = self._models[pipeline] = tuple(
                self._group_model.get((s, pipeline), self.spec.gpu_model) for s in range(self.spec.pp)
            )
        return models

    def uploads_profile(self, info: RankInfo) -> bool:
        """Whether `info`'s rank is the elected uploader of its stage's profile on its GPU model."""
        return self._uploader.get((info.gpu_model, info.stage, info.tp_index)) == info.dp_index

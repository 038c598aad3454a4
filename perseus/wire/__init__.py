"""What the rank side and the planner service share: the wire protocol's messages, the
parallel layout of a job's ranks, and the transport's security."""

from perseus.wire.protocol import DEFAULT_ADDRESS, JobPhase, JobSpec, JobStatus, Phase, PipelineStatus, RankInfo, Status
from perseus.wire.security import CurveClient, CurveServer

__all__ = ["DEFAULT_ADDRESS", "CurveClient", "CurveServer", "JobPhase", "JobSpec", "JobStatus", "Phase", "PipelineStatus", "RankInfo", "Status"]

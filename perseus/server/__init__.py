"""The planner service (`perseus serve`) and the client ranks use to talk to it."""

from perseus.server.client import Assignment, PlannerClient
from perseus.server.protocol import DEFAULT_ADDRESS, JobPhase, JobSpec, JobStatus, Phase, PipelineStatus, RankInfo, Status
from perseus.server.security import CurveClient, CurveServer
from perseus.server.service import PlannerService

__all__ = [
    "DEFAULT_ADDRESS",
    "Assignment",
    "CurveClient",
    "CurveServer",
    "JobPhase",
    "JobSpec",
    "JobStatus",
    "Phase",
    "PipelineStatus",
    "PlannerClient",
    "PlannerService",
    "RankInfo",
    "Status",
]

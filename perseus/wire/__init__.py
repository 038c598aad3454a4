"""What the rank side and the planner service share: the wire protocol and the parallel layout
of a job's ranks.

  limits       the protocol version, default address and every field bound
  phases       Phase (a rank's iteration) and JobPhase (a job at the service)
  fields       the field checks every message runs (Message, check_*)
  spec         JobSpec and RankInfo, what ranks register
  messages     requests, replies and statuses (REQUESTS: request type -> classes)
  spans        ReportSpans: a rank's instruction timeline of one iteration (for calibration)
  calibration  CalibrationStatus, StageFitStatus: how a job's model fits its measured baseline
  profiles     a stage profile's wire form
  envelope     framing: encode/decode of frames, ErrorCode, RequestRejected
  parallelism  Parallelism (a rank's place in a 3D job), rank mappings, tensor-parallel profile merging
  security     the transport's CURVE security
"""

from perseus.wire.envelope import ErrorCode, RequestRejected
from perseus.wire.limits import DEFAULT_ADDRESS, PROTOCOL_VERSION
from perseus.wire.messages import JobStatus, PipelineStatus, Status
from perseus.wire.parallelism import RANK_MAPPINGS, Parallelism
from perseus.wire.phases import JobPhase, Phase
from perseus.wire.security import CurveClient, CurveServer
from perseus.wire.spec import JobSpec, RankInfo

__all__ = [
    "DEFAULT_ADDRESS",
    "PROTOCOL_VERSION",
    "RANK_MAPPINGS",
    "CurveClient",
    "CurveServer",
    "ErrorCode",
    "JobPhase",
    "JobSpec",
    "JobStatus",
    "Parallelism",
    "Phase",
    "PipelineStatus",
    "RankInfo",
    "RequestRejected",
    "Status",
]

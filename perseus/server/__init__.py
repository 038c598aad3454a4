"""`perseus.server` was split by side in 0.2: importing it says where each part went."""

raise ImportError(
    "perseus.server was split by side: the rank-side client is perseus.client (PlannerClient, Assignment), "
    "the service is perseus.service (PlannerService, Budget), and what both share is perseus.wire (JobSpec, "
    "RankInfo, Phase, JobPhase, Parallelism, CurveClient, CurveServer, ...); import from those"
)

"""The rank side of Perseus: hooks that profile and control each instruction's clock.

`PerseusRank` is framework-neutral (on_step_begin/end, on_instruction_begin/end);
`instrument(stage, schedule=...)` installs it on torch.distributed.pipelining stages (torch is
imported only when it is called). A rank reaches the planner through a `PlannerPort`
(`perseus.client.PlannerClient` is the one `instrument` creates).
"""

from perseus.runtime.port import PlannerPort, PortAssignment
from perseus.runtime.progress import Progress
from perseus.runtime.rank import PerseusRank
from perseus.runtime.records import IterationRecord, ProfilingSettings
from perseus.runtime.torch_stage import SUPPORTED_TORCH, instrument

__all__ = [
    "SUPPORTED_TORCH",
    "IterationRecord",
    "PerseusRank",
    "PlannerPort",
    "PortAssignment",
    "ProfilingSettings",
    "Progress",
    "instrument",
]

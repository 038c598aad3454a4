"""GPUs whose writes go through the node's perseus agent, while their reads stay direct.

`through_agent(gpus, socket)` turns each GPU of a backend into its agent-served kind
(AgentSimGPU, AgentNVMLGPU, AgentAMDGPU): the same object state and reads, still an instance of
its backend class (so `emulate`, `gpu_backend` and every isinstance check treat it as before),
but locking clocks and setting power limits ask the agent, under a lease this process takes on
its first write. The agent restores the GPU's defaults when the process ends, however it ends,
so such a GPU needs no watchdog process of its own.
"""

from __future__ import annotations

import logging

from perseus.agent.client import AgentClient, shared_client
from perseus.agent.protocol import POWER_LIMIT, SM_CLOCK
from perseus.devices.amd import AMDGPU
from perseus.devices.gpu import GPU
from perseus.devices.nvml import NVMLGPU
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError

logger = logging.getLogger(__name__)


class AgentWrites(GPU):
    """The writes of an agent-served GPU; its backend class (next in the MRO) does the reads."""

    _agent: AgentClient
    _agent_uuid: str | None

    @property
    def agent(self) -> AgentClient:
        return self._agent

    def _agent_gpu_uuid(self) -> str:
        if self._agent_uuid is None:
            self._agent_uuid = self.uuid()
        return self._agent_uuid

    def lock_sm_clock(self, mhz: int) -> None:
        self._agent.write(self._agent_gpu_uuid(), SM_CLOCK, mhz)

    def reset_sm_clock(self) -> None:
        self._agent.write(self._agent_gpu_uuid(), SM_CLOCK, None)

    def set_power_limit_mw(self, mw: int) -> None:
        self._agent.write(self._agent_gpu_uuid(), POWER_LIMIT, self.check_power_limit_mw(mw))

    def reset_power_limit(self) -> None:
        self._agent.write(self._agent_gpu_uuid(), POWER_LIMIT, None)

    def can_change_clocks(self) -> bool:
        """Whether the agent serves this GPU and no other process holds its lease (takes none)."""
        may, why = self._agent.may_control(self._agent_gpu_uuid())
        if not may:
            logger.warning("%r: cannot change clocks through the agent: %s", self, why)
        return may

    def agent_restores_on_exit(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]} via {self._agent.path}>"


class AgentSimGPU(AgentWrites, SimGPU):
    """A simulated GPU written through the agent."""


class AgentNVMLGPU(AgentWrites, NVMLGPU):
    """An NVIDIA GPU written through the agent."""


class AgentAMDGPU(AgentWrites, AMDGPU):
    """An AMD GPU written through the agent."""


_AGENT_KINDS: dict[type[GPU], type[AgentWrites]] = {
    SimGPU: AgentSimGPU,
    NVMLGPU: AgentNVMLGPU,
    AMDGPU: AgentAMDGPU,
}


def through_agent(gpus: list[GPU], socket_path: str) -> list[GPU]:
    """`gpus` with their writes sent to the agent at `socket_path` (connected on the first write)."""
    client = shared_client(socket_path)
    served: list[GPU] = []
    for gpu in gpus:
        kind = _AGENT_KINDS.get(type(gpu))
        if kind is None:
            raise ConfigError(f"{gpu!r} ({type(gpu).__name__}) cannot be served by the perseus agent")
        agent_gpu = kind.__new__(kind)
        agent_gpu.__dict__.update(gpu.__dict__)  # the same GPU: its handle, state file, counters
        agent_gpu._agent = client
        agent_gpu._agent_uuid = None
        served.append(agent_gpu)
    return served

"""GPUs whose writes go through the node's perseus agent, while their reads stay direct.

`through_agent(gpus, socket)` turns each GPU of a backend into its agent-served kind
(AgentSimGPU, AgentNVMLGPU, AgentAMDGPU): the same object state and reads, still an instance of
its backend class (so `emulate`, `gpu_backend` and every isinstance check treat it as before),
but locking clocks and setting power limits ask the agent, under a lease this process takes on
its first write. The agent restores the GPU's defaults when the process ends, however it ends,
so such a GPU needs no watchdog process of its own.

Reads are direct, so they must read the very GPU the agent writes: before its first write (and
again after the agent restarts) a GPU checks that the agent serves its backend and its UUID, and
for a simulated GPU the same state folder -- two folders would be two sets of GPUs, the agent
changing one while this process reads the other. Selected without $PERSEUS_SIM_DIR, simulated
GPUs take the agent's folder (`sim_dir_through`).
"""

from __future__ import annotations

import logging
import os

from perseus.agent.client import AgentClient, shared_client
from perseus.agent.protocol import POWER_LIMIT, SM_CLOCK, Welcome
from perseus.devices.amd import AMDGPU
from perseus.devices.gpu import GPU
from perseus.devices.nvml import NVMLGPU
from perseus.devices.select import gpu_backend
from perseus.devices.sim import SIM_DIR_ENV, SimGPU, sim_dir, sim_uuid
from perseus.devices.sim_presets import PRESETS
from perseus.exceptions import ConfigError, PerseusError

logger = logging.getLogger(__name__)

_KINDS = {"nvml": "NVIDIA", "amd": "AMD", "sim": "simulated", "mixed": "several kinds of"}


class AgentWrites(GPU):
    """The writes of an agent-served GPU; its backend class (next in the MRO) does the reads."""

    _agent: AgentClient
    _agent_uuid: str | None
    _checked: Welcome | None  # the agent's hello reply this GPU was checked against

    @property
    def agent(self) -> AgentClient:
        return self._agent

    def _agent_gpu_uuid(self) -> str:
        """This GPU's UUID, once the agent is known to serve this very GPU; ConfigError if not."""
        served = self._agent.served()
        if self._agent_uuid is None:
            self._agent_uuid = self.uuid()
        if served is not self._checked:
            problem = serving_problem(self, self._agent_uuid, served, self._agent.where)
            if problem is not None:
                raise ConfigError(problem)
            self._checked = served
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
        try:
            uuid = self._agent_gpu_uuid()
        except PerseusError as e:
            logger.warning("%r: cannot change clocks through the agent: %s", self, e)
            return False
        may, why = self._agent.may_control(uuid)
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
        agent_gpu._checked = None
        served.append(agent_gpu)
    return served


def sim_dir_through(socket_path: str) -> str:
    """The folder of the simulated GPUs this process uses with the agent at `socket_path`:
    $PERSEUS_SIM_DIR where set, else the agent's, so that it reads the GPUs the agent writes."""
    chosen = os.environ.get(SIM_DIR_ENV) or None
    client = shared_client(socket_path)
    try:
        served = client.served()
    except PerseusError as e:
        logger.warning(
            "could not ask %s which simulated GPUs it serves (%s); this process uses those in %s",
            client.where,
            e,
            sim_dir(),
        )
        return sim_dir()
    if served.sim_dir is None:
        return sim_dir()  # the first write names the GPUs the agent serves instead
    if chosen is None:
        logger.info("simulated GPUs in %s, those %s serves", served.sim_dir, client.where)
        return served.sim_dir
    if not _same_folder(chosen, served.sim_dir):
        logger.warning("%s", _folder_problem(chosen, served.sim_dir, client.where))
    return chosen


def serving_problem(gpu: GPU, uuid: str, served: Welcome, where: str) -> str | None:
    """Why the agent that sent `served` does not write the GPU `gpu` reads (None: it does)."""
    kind = gpu_backend([gpu])
    if served.backend not in (kind, "mixed"):
        return (
            f"{where} serves {_KINDS[served.backend]} GPUs; this process's GPU {gpu.index} is {_KINDS[kind]} "
            f"({gpu!r}): run the agent on the GPUs this process uses (its --gpu, or PERSEUS_GPU), or set "
            "PERSEUS_AGENT=off to write directly"
        )
    if isinstance(gpu, SimGPU):
        mine = os.path.dirname(gpu.state_path)
        if served.sim_dir is None or not _same_folder(mine, served.sim_dir):
            return _folder_problem(mine, served.sim_dir, where)
    if uuid not in served.uuids and isinstance(gpu, SimGPU):
        mine_spec = f"sim:{gpu.preset.name}"
        theirs = _sim_spec(served.uuids)
        if theirs is not None:
            select = f"select the GPUs it serves (PERSEUS_GPU={theirs})"
        else:
            indices = _sim_indices(gpu.preset.name, served.uuids)
            theirs = f"{mine_spec} GPU {', '.join(map(str, indices))}" if indices else ", ".join(served.uuids[:8])
            select = "use only those of this process's GPUs" if indices else "select the GPUs it serves"
        return (
            f"{where} does not serve this process's GPU {gpu.index} ({uuid}, {mine_spec} GPU {gpu.index}); "
            f"it serves {theirs or 'none'}: {select}, or run the agent on this process's (its --gpu and --gpu-indices)"
        )
    if uuid not in served.uuids:
        shown = ", ".join(served.uuids[:8]) + (f" and {len(served.uuids) - 8} more" if len(served.uuids) > 8 else "")
        return (
            f"{where} does not serve this process's GPU {gpu.index} ({uuid}); it serves {shown or 'none'}: run the "
            "agent on every GPU of the node (its --gpu and --gpu-indices), or set PERSEUS_AGENT=off to write "
            "directly (needs root)"
        )
    return None


def _sim_indices(preset: str, uuids: tuple[str, ...]) -> list[int]:
    """The indices of model `preset`'s simulated GPUs with these UUIDs, if all are its (else [])."""
    index = {sim_uuid(preset, i): i for i in range(max(64, len(uuids)))}
    return sorted(index[u] for u in uuids) if uuids and all(u in index for u in uuids) else []


def _sim_spec(uuids: tuple[str, ...]) -> str | None:
    """The simulated GPUs with these UUIDs as a GPU spec (`sim:a100-sxm:2`), if they are the first
    GPUs of one model."""
    for name in PRESETS:
        if _sim_indices(name, uuids) == list(range(len(uuids))):
            return f"sim:{name}:{len(uuids)}"
    return None


def _folder_problem(mine: str, theirs: str | None, where: str) -> str:
    return (
        f"this process's simulated GPUs are in {mine}, those {where} serves in {theirs}: two sets of GPUs, the "
        f"agent would change the one while this process reads the other. Every process on a node must use the same "
        f"simulated GPUs: unset {SIM_DIR_ENV} (a process then uses the agent's) or set {SIM_DIR_ENV}={theirs}"
    )


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)

"""Where the node's perseus agent listens, and whether a process's GPUs go through it.

`PERSEUS_AGENT=/path/to/socket` sends the writes of every selected GPU through the agent there;
`PERSEUS_AGENT=off` never does. Unset, real GPUs (NVML, amdsmi) use the agent when its socket
exists at DEFAULT_SOCKET (the deployment in deploy/ puts it there); simulated GPUs only when
PERSEUS_AGENT names one, so tests and scripts on simulated GPUs never reach a node's real agent.
A process that changes simulated GPUs itself while an agent serves simulated GPUs is told so
(`note_direct_sim_gpus`): each agent leaves a marker in its GPUs' folder naming its socket and
the GPUs it serves there (agents on disjoint GPUs of one folder each leave their own).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import socket
import stat
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AGENT_ENV = "PERSEUS_AGENT"
DEFAULT_SOCKET = "/run/perseus/agent.sock"
OFF = "off"
MARKERS = "agent-*.json"  # in the folder of the simulated GPUs agents serve, one per agent's socket
USERS_SIM_DIRS = "/tmp/perseus-sim-*"  # perseus.devices.sim.sim_dir()'s default, one per user

_told: set[str] = set()


def configured_socket() -> str | None:
    """$PERSEUS_AGENT as given (None when unset, empty or `off`)."""
    value = os.environ.get(AGENT_ENV, "").strip()
    return None if value in ("", OFF) else value


def agent_socket(simulated: bool) -> str | None:
    """The socket of the agent this process's GPUs write through, or None: write directly."""
    value = os.environ.get(AGENT_ENV, "").strip()
    if value == OFF:
        return None
    if value:
        return value
    if simulated:
        return None
    return DEFAULT_SOCKET if is_socket(DEFAULT_SOCKET) else None


def is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def listening(path: str) -> bool:
    """Whether an agent answers on `path` (a killed agent leaves its socket file behind)."""
    if not is_socket(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except PermissionError:
            return True  # an agent that does not admit this user
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Marker:
    """What an agent serving simulated GPUs of a folder leaves in it: its socket, its pid, and the
    indices of the GPUs it serves."""

    socket: str
    pid: int
    gpus: tuple[int, ...]

    def to_json(self) -> dict[str, object]:
        return {"socket": self.socket, "pid": self.pid, "gpus": list(self.gpus)}

    @classmethod
    def from_text(cls, text: str) -> Marker | None:
        doc = json.loads(text)
        if not (isinstance(doc, dict) and isinstance(doc.get("socket"), str) and type(doc.get("pid")) is int):
            return None
        gpus = doc.get("gpus")
        if not (isinstance(gpus, list) and all(type(i) is int for i in gpus)):
            return None
        return cls(doc["socket"], doc["pid"], tuple(gpus))

    def served(self) -> str:
        return ("GPU " if len(self.gpus) < 2 else "GPUs ") + ", ".join(map(str, self.gpus))


def marker_path(folder: str, socket_path: str) -> str:
    """The marker of the agent on `socket_path` (the same for every agent started there)."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return os.path.join(folder, f"agent-{digest}.json")


def read_marker(path: str) -> Marker | None:
    try:
        with open(path, encoding="utf-8") as f:
            return Marker.from_text(f.read(4096))
    except (OSError, ValueError):
        return None


def live_markers(folder: str) -> list[Marker]:
    """The markers in `folder` of agents that answer (a killed agent leaves its marker behind)."""
    found = (read_marker(path) for path in sorted(glob.glob(os.path.join(folder, MARKERS))))
    return sorted((m for m in found if m is not None and listening(m.socket)), key=lambda m: m.gpus)


def note_direct_sim_gpus(folder: str, chosen: bool) -> None:
    """Warn a process that changes the simulated GPUs in `folder` itself (PERSEUS_AGENT unset)
    while a perseus agent serves those, or (the folder not `chosen` with PERSEUS_SIM_DIR) others:
    every process on a node must use the same simulated GPUs, as they would the same real ones."""
    if os.environ.get(AGENT_ENV, "").strip() == OFF:
        return
    own = live_markers(folder)
    if len(own) == 1:
        _tell(
            f"the simulated GPUs in {folder} are served by the perseus agent at {own[0].socket}, but this process "
            f"changes them itself ({AGENT_ENV} is unset): set {AGENT_ENV}={own[0].socket} so that the agent leases "
            "them to it and restores them when it ends"
        )
        return
    if own:
        agents = "; ".join(f"{m.served()} by the one at {m.socket}" for m in own)
        _tell(
            f"the simulated GPUs in {folder} are served by perseus agents ({agents}), but this process changes "
            f"them itself ({AGENT_ENV} is unset): set {AGENT_ENV} to the socket of the agent that serves the GPUs "
            "this process uses, so that it leases them to it and restores them when it ends"
        )
        return
    if chosen:
        return
    others = []
    for other in sorted({os.path.dirname(p) for p in glob.glob(os.path.join(USERS_SIM_DIRS, MARKERS))}):
        if os.path.realpath(other) == os.path.realpath(folder):
            continue
        for marker in live_markers(other):
            others.append(marker.socket)
            _tell(
                f"this process uses simulated GPUs of its own, in {folder}, while the perseus agent at {marker.socket} "
                f"serves those in {other}: set {AGENT_ENV}={marker.socket} to use the agent's (every process on a "
                f"node must use the same simulated GPUs), or {AGENT_ENV}={OFF} to keep your own and silence this"
            )
    if DEFAULT_SOCKET not in others and listening(DEFAULT_SOCKET):
        _tell(
            f"this process uses simulated GPUs of its own, in {folder}, while a perseus agent listens on "
            f"{DEFAULT_SOCKET}: if it serves simulated GPUs, set {AGENT_ENV}={DEFAULT_SOCKET} to use them (every "
            f"process on a node must use the same simulated GPUs), or {AGENT_ENV}={OFF} to keep your own and "
            "silence this"
        )


def _tell(message: str) -> None:
    """Log a warning once per process (GPUs are selected more than once)."""
    if message not in _told:
        _told.add(message)
        logger.warning("%s", message)

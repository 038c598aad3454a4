"""Where the node's perseus agent listens, and whether a process's GPUs go through it.

`PERSEUS_AGENT=/path/to/socket` sends the writes of every selected GPU through the agent there;
`PERSEUS_AGENT=off` never does. Unset, real GPUs (NVML, amdsmi) use the agent when its socket
exists at DEFAULT_SOCKET (the deployment in deploy/ puts it there); simulated GPUs only when
PERSEUS_AGENT names one, so tests and scripts on simulated GPUs never reach a node's real agent.
A process that changes simulated GPUs itself while an agent serves simulated GPUs is told so
(`note_direct_sim_gpus`): the agent leaves a marker in its GPUs' folder naming its socket.
"""

from __future__ import annotations

import glob
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
MARKER = "agent.json"  # in the folder of the simulated GPUs an agent serves
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
    """What the agent serving a folder's simulated GPUs leaves in it."""

    socket: str
    pid: int

    def to_json(self) -> dict[str, object]:
        return {"socket": self.socket, "pid": self.pid}

    @classmethod
    def from_text(cls, text: str) -> Marker | None:
        doc = json.loads(text)
        if isinstance(doc, dict) and isinstance(doc.get("socket"), str) and type(doc.get("pid")) is int:
            return cls(doc["socket"], doc["pid"])
        return None


def read_marker(folder: str) -> Marker | None:
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            return Marker.from_text(f.read(4096))
    except (OSError, ValueError):
        return None


def note_direct_sim_gpus(folder: str, chosen: bool) -> None:
    """Warn a process that changes the simulated GPUs in `folder` itself (PERSEUS_AGENT unset)
    while a perseus agent serves those, or (the folder not `chosen` with PERSEUS_SIM_DIR) others:
    every process on a node must use the same simulated GPUs, as they would the same real ones."""
    if os.environ.get(AGENT_ENV, "").strip() == OFF:
        return
    own = read_marker(folder)
    if own is not None and listening(own.socket):
        _tell(
            f"the simulated GPUs in {folder} are served by the perseus agent at {own.socket}, but this process "
            f"changes them itself ({AGENT_ENV} is unset): set {AGENT_ENV}={own.socket} so that the agent leases "
            "them to it and restores them when it ends"
        )
        return
    if chosen:
        return
    others = []
    for marker_path in sorted(glob.glob(os.path.join(USERS_SIM_DIRS, MARKER))):
        other = os.path.dirname(marker_path)
        marker = read_marker(other)
        if marker is not None and os.path.realpath(other) != os.path.realpath(folder) and listening(marker.socket):
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

"""Where the node's perseus agent listens, and whether a process's GPUs go through it.

`PERSEUS_AGENT=/path/to/socket` sends the writes of every selected GPU through the agent there;
`PERSEUS_AGENT=off` never does. Unset, real GPUs (NVML, amdsmi) use the agent when its socket
exists at DEFAULT_SOCKET (the deployment in deploy/ puts it there); simulated GPUs only when
PERSEUS_AGENT names one, so tests and scripts on simulated GPUs never reach a node's real agent.
"""

from __future__ import annotations

import os
import stat

AGENT_ENV = "PERSEUS_AGENT"
DEFAULT_SOCKET = "/run/perseus/agent.sock"
OFF = "off"


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

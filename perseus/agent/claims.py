"""One agent per GPU: each GPU an agent serves is claimed with a pid lock, node-wide.

The socket's lock stops a second agent on the same socket; this stops one on another socket (or
with another lease file) from serving, or resetting at start, GPUs the first serves. Simulated
GPUs are claimed in their own folder (it is their node); real ones in the default socket's folder,
which every agent of a node shares (systemd's RuntimeDirectory, the daemonset's host path).
"""

from __future__ import annotations

import os
import re

from perseus.agent.location import DEFAULT_SOCKET
from perseus.exceptions import ConfigError
from perseus.pidlock import release_pid_lock, take_pid_lock

CLAIMS_DIR = os.path.dirname(DEFAULT_SOCKET)


def claim_path(folder: str, uuid: str) -> str:
    return os.path.join(folder, f"agent-{re.sub(r'[^A-Za-z0-9._-]', '_', uuid)}.lock")


def claim_gpus(gpus: dict[str, tuple[int, str]]) -> list[tuple[int, str]]:
    """Claim every GPU of `gpus` (uuid -> (index, claims folder)), or none: the locks (descriptor, path)
    to `release`, else ConfigError naming the GPU, the agent that serves it and the fix."""
    taken: list[tuple[int, str]] = []
    try:
        for uuid, (index, folder) in gpus.items():
            path = claim_path(folder, uuid)
            try:
                os.makedirs(folder, mode=0o755, exist_ok=True)
                fd = take_pid_lock(path)
            except OSError as e:
                raise ConfigError(
                    f"cannot claim GPU {index} ({uuid}) in {path}: {e.strerror or e}; run the agent as the user "
                    f"that owns {folder} (root for real GPUs)"
                ) from None
            if isinstance(fd, str):
                raise ConfigError(
                    f"GPU {index} ({uuid}) is served by another perseus agent (pid {fd}, its claim in {path}); "
                    "one agent serves a GPU: stop that one, or give this one other GPUs (--gpu-indices) with its own "
                    "--socket and --state-file"
                )
            taken.append((fd, path))
    except ConfigError:
        release(taken)
        raise
    return taken


def release(claims: list[tuple[int, str]]) -> None:
    for fd, path in claims:
        release_pid_lock(fd, path)
    claims.clear()

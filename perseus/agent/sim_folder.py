"""The folder of the simulated GPUs an agent serves, shared the way a real GPU node shares its GPUs.

Only the agent changes clocks and power limits: the folder and its state files are the agent's
user's, readable by all (simulated GPUs' privilege mode). Running work is open to every process
the agent admits, as on hardware: the `activity` folder, where each process logs the work it
runs (perseus.devices.sim_activity), gets the socket's group and the socket's write permissions
(a setgid folder, so logs a client starts keep that group; their files take the folder's read and
write bits). A marker file names the agent's socket and GPUs, so that a process which uses simulated GPUs
of its own while this agent serves others is told (perseus.agent.location).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

from perseus.agent.location import Marker, marker_path, read_marker
from perseus.atomic import write_json_atomic
from perseus.exceptions import ConfigError

logger = logging.getLogger(__name__)

ACTIVITY = "activity"


def activity_mode(socket_mode: int) -> int:
    """The activity folder's mode: readable by all, writable by the owner and by those the socket's
    mode lets connect (group, others), setgid."""
    return stat.S_ISGID | 0o755 | (socket_mode & 0o022)


def share(folder: str, socket_mode: int, group: int) -> None:
    """Make `folder` the agent's (0755) and its activity folder writable as `socket_mode` and
    `group` say; ConfigError if the folder is another user's."""
    try:
        os.makedirs(folder, mode=0o755, exist_ok=True)
        if os.stat(folder).st_uid != os.geteuid():
            raise ConfigError(
                f"the simulated GPUs' folder {folder} belongs to uid {os.stat(folder).st_uid}, not to the agent's "
                f"user (uid {os.geteuid()}): only the agent may own their state; remove it or set PERSEUS_SIM_DIR"
            )
        os.chmod(folder, 0o755)
        activity = os.path.join(folder, ACTIVITY)
        os.makedirs(activity, exist_ok=True)
        os.chown(activity, -1, group)
        mode = activity_mode(socket_mode)
        os.chmod(activity, mode)
    except OSError as e:
        raise ConfigError(f"cannot prepare the simulated GPUs' folder {folder} ({e}); set PERSEUS_SIM_DIR") from e
    for name in os.listdir(activity):  # made before: by the GPUs' construction, or an earlier agent
        path = os.path.join(activity, name)
        try:
            os.chown(path, -1, group)
            os.chmod(path, mode & 0o666)
        except OSError as e:
            logger.warning("cannot share %s with the agent's clients (%s): their work there is not logged", path, e)


def write_marker(folder: str, socket_path: str, gpus: list[int]) -> None:
    write_json_atomic(
        marker_path(folder, socket_path),
        Marker(os.path.abspath(socket_path), os.getpid(), tuple(sorted(gpus))).to_json(),
        fsync=False,
        mode=0o644,
    )


def remove_marker(folder: str, socket_path: str) -> None:
    """Remove the marker if it is still this agent's (a newer agent on the socket keeps its own)."""
    path = marker_path(folder, socket_path)
    marker = read_marker(path)
    if marker is not None and marker.pid == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(path)

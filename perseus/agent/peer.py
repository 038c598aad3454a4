"""The credentials of the process at the other end of a Unix socket, as the kernel vouches for them."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class PeerCredentials:
    """pid (0 when the peer's pid namespace is not visible from ours), uid and gid at connect time."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """SO_PEERCRED of a connected Unix socket (Linux): a client cannot forge them."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF)

"""Transport security of the service socket. Plaintext for now; CURVE keys plug in here later.

A `Security` configures the service's ROUTER before bind and each client's DEALER before
connect; `authenticated` tells the service whether peers are authenticated, which decides
whether binding a non-loopback address is safe.
"""

from __future__ import annotations

import ipaddress
from typing import Protocol

import zmq


class Security(Protocol):
    authenticated: bool

    def configure_server(self, socket: zmq.Socket) -> None: ...

    def configure_client(self, socket: zmq.Socket) -> None: ...


class Plaintext:
    """No encryption, no authentication: anyone who can reach the port can talk to the service."""

    authenticated = False

    def configure_server(self, socket: zmq.Socket) -> None:
        pass

    def configure_client(self, socket: zmq.Socket) -> None:
        pass


PLAINTEXT = Plaintext()


def is_local_endpoint(endpoint: str) -> bool:
    """True for ipc://, inproc:// and TCP endpoints on a loopback address."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or a host name: assume reachable from elsewhere

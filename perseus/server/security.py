"""Transport security of the service socket: plaintext (loopback) or ZeroMQ CURVE.

A `Security` configures the service's ROUTER before bind and each client's DEALER before
connect; `authenticated` tells the service whether peers are authenticated, which decides
whether binding a non-loopback address is allowed without --insecure.

CURVE keys (`perseus keys --dir DIR`, written by `create_keys`):
    DIR/server/server.key, server.key_secret      the service's key pair
    DIR/clients/<name>.key, <name>.key_secret     one pair per client (a node, a job, an operator)
The service accepts exactly the clients whose public key (`<name>.key`) is in DIR/clients,
read again at every handshake, so adding or deleting a file takes effect without a restart.
Secret key files are mode 0600. Ranks find their keys through PERSEUS_CURVE_KEYS=DIR (and
PERSEUS_CURVE_CLIENT=<name>, default "client") when no `security` is passed to PlannerClient.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from perseus.exceptions import ConfigError

log = logging.getLogger(__name__)

SERVER_NAME = "server"
DEFAULT_CLIENT = "client"
KEYS_ENV = "PERSEUS_CURVE_KEYS"
CLIENT_ENV = "PERSEUS_CURVE_CLIENT"

# Handshake failures the service logs as refusals (the peer's address is not in these events).
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed: the client does not speak CURVE with this key (no keys, or the wrong server key)",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not accepted",
}


REFUSAL_LOG_INTERVAL_S = 10.0  # a refused client retries every second: one line per reason per interval


class _Refusals:
    """Logs refusals at WARNING, at most once per reason per interval, counting the rest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(reason, -REFUSAL_LOG_INTERVAL_S) < REFUSAL_LOG_INTERVAL_S:
                self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
                return
            self._last[reason] = now
            more = self._suppressed.pop(reason, 0)
        log.warning("%s%s", reason, f" ({more} more like it in the last {REFUSAL_LOG_INTERVAL_S:.0f} s)" if more else "")


class Security(Protocol):
    authenticated: bool

    def configure_server(self, socket: zmq.Socket) -> None: ...

    def configure_client(self, socket: zmq.Socket) -> None: ...

    def close(self) -> None: ...


class Plaintext:
    """No encryption, no authentication: anyone who can reach the port can talk to the service."""

    authenticated = False

    def configure_server(self, socket: zmq.Socket) -> None:
        pass

    def configure_client(self, socket: zmq.Socket) -> None:
        pass

    def close(self) -> None:
        pass


PLAINTEXT = Plaintext()


def _secret_pair(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the CURVE key pair {path}: {e}; create keys with `perseus keys --dir DIR`") from None
    if secret is None:
        raise ConfigError(f"{path} holds no secret key; pass the <name>.key_secret file `perseus keys` wrote")
    return public, secret


def _public_key(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the CURVE public key {path}: {e}; create keys with `perseus keys --dir DIR`") from None
    return public


class _AllowList:
    """ZAP credentials provider: a client key is accepted iff its public key file is in `folder`."""

    def __init__(self, folder: Path, refusals: _Refusals) -> None:
        self.folder = folder
        self.refusals = refusals

    def callback(self, domain: str, key: bytes) -> bool:
        try:
            allowed = key in zmq.auth.load_certificates(self.folder)
        except (OSError, ValueError) as e:
            log.error("cannot read the accepted client keys in %s: %s; refusing every client", self.folder, e)
            return False
        if not allowed:
            self.refusals.log(f"refused a client: its CURVE public key {key.decode(errors='replace')} is not in {self.folder}")
        return allowed


class CurveServer:
    """CURVE for the service: its key pair from DIR/server, clients allowed from DIR/clients.
    Refusals are logged (unknown key: with the key; no or mismatched keys: the handshake failure)."""

    authenticated = True

    def __init__(self, keys_dir: str | os.PathLike) -> None:
        root = Path(keys_dir).expanduser()
        self.clients = root / "clients"
        if not self.clients.is_dir():
            raise ConfigError(f"{root} has no clients/ folder of accepted client keys; create keys with `perseus keys --dir {root}`")
        self.public, self.secret = _secret_pair(root / "server" / f"{SERVER_NAME}.key_secret")
        self._refusals = _Refusals()
        self._auth: ThreadAuthenticator | None = None
        self._monitor: threading.Thread | None = None
        self._socket: zmq.Socket | None = None

    def configure_server(self, socket: zmq.Socket) -> None:
        self._auth = ThreadAuthenticator(socket.context, log=log.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(self.clients, self._refusals))
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True
        address = f"inproc://perseus-monitor-{id(self)}"
        socket.monitor(address, sum(_REFUSALS))
        self._socket = socket
        self._monitor = threading.Thread(target=self._watch, args=(socket.context, address), name="perseus-curve-monitor", daemon=True)
        self._monitor.start()

    def _watch(self, context: zmq.Context, address: str) -> None:
        sock = context.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while True:
                event = recv_monitor_message(sock)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                reason = _REFUSALS.get(event["event"])
                if reason is not None:
                    self._refusals.log(f"refused a connection on {event['endpoint'].decode(errors='replace')}: {reason}")
        except zmq.ZMQError:
            return  # the context is closing
        finally:
            sock.close(linger=0)

    def configure_client(self, socket: zmq.Socket) -> None:
        raise ConfigError("CurveServer configures the service socket; clients use CurveClient")

    def close(self) -> None:
        if self._socket is not None and not self._socket.closed:
            try:
                self._socket.disable_monitor()
            except zmq.ZMQError:
                pass
        if self._monitor is not None:
            self._monitor.join(1.0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class CurveClient:
    """CURVE for a client: its own key pair (a `<name>.key_secret` file) and the service's public key."""

    authenticated = True

    def __init__(self, client_secret_file: str | os.PathLike, server_public_file: str | os.PathLike) -> None:
        self.public, self.secret = _secret_pair(Path(client_secret_file).expanduser())
        self.server = _public_key(Path(server_public_file).expanduser())

    @classmethod
    def from_dir(cls, keys_dir: str | os.PathLike, name: str = DEFAULT_CLIENT) -> CurveClient:
        """Client `name`'s keys from a `perseus keys` folder."""
        root = Path(keys_dir).expanduser()
        return cls(root / "clients" / f"{name}.key_secret", root / "server" / f"{SERVER_NAME}.key")

    def configure_server(self, socket: zmq.Socket) -> None:
        raise ConfigError("CurveClient configures client sockets; the service uses CurveServer")

    def configure_client(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server

    def close(self) -> None:
        pass


def security_from_env() -> Security:
    """CurveClient from PERSEUS_CURVE_KEYS (and PERSEUS_CURVE_CLIENT) if set, else plaintext."""
    keys = os.environ.get(KEYS_ENV)
    if not keys:
        return PLAINTEXT
    return CurveClient.from_dir(keys, os.environ.get(CLIENT_ENV) or DEFAULT_CLIENT)


def create_keys(keys_dir: str | os.PathLike, clients: list[str], *, force: bool = False) -> list[Path]:
    """Create the service key pair (unless present, or `force`) and one pair per client name
    (an existing client is an error unless `force`). Secret keys are mode 0600. Returns the
    files written."""
    root = Path(keys_dir).expanduser()
    written: list[Path] = []
    for name in clients:
        if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
            raise ConfigError(f"client name {name!r} must be letters, digits, '-', '_' or '.' (it names the key files)")
    try:
        for folder in (root / "server", root / "clients"):
            folder.mkdir(parents=True, exist_ok=True)
        server_secret = root / "server" / f"{SERVER_NAME}.key_secret"
        todo = [] if server_secret.exists() and not force else [(root / "server", SERVER_NAME)]
        for name in clients:
            if (root / "clients" / f"{name}.key").exists() and not force:
                raise ConfigError(f"client {name!r} already has keys in {root / 'clients'}; pick another name or pass --force")
            todo.append((root / "clients", name))
        old_umask = os.umask(0o077)  # the secret file never exists with wider permissions
        try:
            for folder, name in todo:
                public, secret = zmq.auth.create_certificates(folder, name)
                os.chmod(secret, 0o600)
                os.chmod(public, 0o644)
                written += [Path(public), Path(secret)]
        finally:
            os.umask(old_umask)
    except OSError as e:
        raise ConfigError(f"cannot write keys under {root}: {e.strerror or e}; pass a writable --dir") from None
    return written


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

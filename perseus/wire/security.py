"""Transport security of the service socket: plaintext (loopback) or ZeroMQ CURVE.

A `Security` configures the service's ROUTER before bind and each client's DEALER before
connect; `authenticated` tells the service whether peers are authenticated, which decides
whether binding a non-loopback address is allowed without --insecure.

CURVE keys (`perseus keys --dir DIR`, written by `create_keys`):
    DIR/server/server.key, server.key_secret      the service's key pair
    DIR/clients/<name>.key, <name>.key_secret     one pair per client (a node, a job, an operator)
The service accepts exactly the clients whose public key (`<name>.key`) is in DIR/clients,
read again at every handshake, so adding or deleting a file takes effect without a restart.
A handshake happens once per connection, so the service also asks `authorized(peer_key(frame))`
for each message: a deleted key is refused within a second (DIR/clients' mtime, or at once
after `reload()`, which `perseus serve` calls on SIGHUP), and `drop_connection` ends the
connection it came on. Secret key files are mode 0600 (a wider one is warned about). Ranks find
their keys through PERSEUS_CURVE_KEYS=DIR (and PERSEUS_CURVE_CLIENT=<name>, default "client")
when no `security` is passed to PlannerClient.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Protocol, cast

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from perseus.atomic import write_text_atomic
from perseus.exceptions import ConfigError

log = logging.getLogger(__name__)

SERVER_NAME = "server"
DEFAULT_CLIENT = "client"
KEYS_ENV = "PERSEUS_CURVE_KEYS"
CLIENT_ENV = "PERSEUS_CURVE_CLIENT"

# Handshake failures the service logs as refusals (the peer's address is not in these events).
_REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "handshake failed: the client does not speak CURVE with this key (no keys, or the wrong server key)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not accepted",
}


REFUSAL_LOG_INTERVAL_S = 10.0  # a refused client retries every second: one line per reason per interval
KEYS_CHECK_INTERVAL_S = 1.0  # how often an allowed client's message makes the service stat DIR/clients
DROP_DELAY_S = 0.2  # drop_connection waits this long, for the error reply sent before it to go out


class _Refusals:
    """Logs refusals at WARNING, at most once per reason per interval, counting the rest."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a SIGHUP reload may log while the loop it interrupted does
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
        log.warning(
            "%s%s", reason, f" ({more} more like it in the last {REFUSAL_LOG_INTERVAL_S:.0f} s)" if more else ""
        )


class Security(Protocol):
    authenticated: bool

    def configure_server(self, socket: zmq.Socket) -> None: ...

    def configure_client(self, socket: zmq.Socket) -> None: ...

    def authorized(self, user_id: str | None) -> bool: ...

    def reload(self) -> int | None: ...

    def close(self) -> None: ...


class Plaintext:
    """No encryption, no authentication: anyone who can reach the port can talk to the service."""

    authenticated = False

    def configure_server(self, socket: zmq.Socket) -> None:
        pass

    def configure_client(self, socket: zmq.Socket) -> None:
        pass

    def authorized(self, user_id: str | None) -> bool:
        """Every message is: there are no keys to revoke."""
        return True

    def reload(self) -> None:
        """Nothing to reload (None: no client keys)."""
        return None

    def close(self) -> None:
        pass


PLAINTEXT = Plaintext()


def peer_key(frame: zmq.Frame) -> str | None:
    """The z85 CURVE public key a message's sender authenticated with (the frame's "User-Id",
    set by the handshake; recv with copy=False), or None on a socket without CURVE."""
    try:
        # pyzmq types Frame.get as int | str; a named property such as "User-Id" is a str
        return cast(str, frame.get("User-Id"))
    except zmq.ZMQError:
        return None


_dropping: set[tuple[int, int]] = set()
_dropping_lock = threading.Lock()


def drop_connection(frame: zmq.Frame, delay_s: float = DROP_DELAY_S) -> bool:
    """End the TCP or IPC connection `frame` arrived on, `delay_s` from now so that a reply
    sent before this still goes out. ZeroMQ cannot close one peer of a ROUTER, so this shuts
    down that connection's socket (the frame's source fd); libzmq sees the peer leave, and a
    client that reconnects meets the handshake's key check again. The socket is told apart by
    its inode, so an fd number reused by another connection meanwhile is left alone. False when
    there is no socket to shut down (inproc, or the connection is already gone)."""
    try:
        fd = frame.get(zmq.SRCFD)
        st = os.fstat(fd)
    except (zmq.ZMQError, OSError, AttributeError):
        return False
    if not stat.S_ISSOCK(st.st_mode):
        return False
    key = (fd, st.st_ino)
    with _dropping_lock:
        if key in _dropping:
            return True  # already on its way out
        _dropping.add(key)
    timer = threading.Timer(delay_s, _shutdown, key)
    timer.daemon = True
    timer.start()
    return True


def _shutdown(fd: int, inode: int) -> None:
    try:
        dup = os.dup(fd)  # ours to close; libzmq closes its own fd when it sees the peer leave
    except OSError:
        dup = -1
    try:
        if dup >= 0 and os.fstat(dup).st_ino == inode:
            sock = socket.socket(fileno=dup)
            dup = -1
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already disconnected
            finally:
                sock.close()
    finally:
        if dup >= 0:
            os.close(dup)
        with _dropping_lock:
            _dropping.discard((fd, inode))


def _secret_pair(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read the CURVE key pair {path}: {e}; create keys with `perseus keys --dir DIR`"
        ) from None
    if secret is None:
        raise ConfigError(f"{path} holds no secret key; pass the <name>.key_secret file `perseus keys` wrote")
    _warn_if_shared(path)
    return public, secret


def _warn_if_shared(path: Path) -> None:
    """A secret key other users can read lets them pose as its owner: say so, and the fix."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        log.warning(
            "the secret key %s is mode %04o, open to other users (who could pose as its owner): run chmod 600 %s",
            path,
            mode,
            path,
        )


def _read_client_keys(folder: Path, refusals: _Refusals) -> frozenset[bytes]:
    """The public keys of the `*.key` files in `folder`. A file that cannot be read allows no
    one (and is logged); a folder that cannot be listed raises OSError."""
    if not folder.is_dir():
        raise OSError(f"{folder} is not a folder")
    keys = set()
    for path in sorted(folder.glob("*.key")):
        try:
            keys.add(zmq.auth.load_certificate(path)[0])
        except FileNotFoundError:
            continue  # deleted since the listing
        except (OSError, ValueError) as e:
            refusals.log(f"ignoring the client key file {path}: {e}")
    return frozenset(keys)


def _public_key(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read the CURVE public key {path}: {e}; create keys with `perseus keys --dir DIR`"
        ) from None
    return public


class _AllowList:
    """ZAP credentials provider: a client key is accepted iff its public key file is in the
    server's clients folder, read again at each handshake (which refreshes `authorized` too)."""

    def __init__(self, server: CurveServer) -> None:
        self.server = server

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key in self.server._load()
        if not allowed:
            self.server._refusals.log(
                f"refused a client: its CURVE public key {key.decode(errors='replace')} is not in {self.server.clients}"
            )
        return allowed


class CurveServer:
    """CURVE for the service: its key pair from DIR/server, clients allowed from DIR/clients.
    Refusals are logged (unknown key: with the key; no or mismatched keys: the handshake failure)."""

    authenticated = True

    def __init__(self, keys_dir: str | os.PathLike) -> None:
        root = Path(keys_dir).expanduser()
        self.clients = root / "clients"
        if not self.clients.is_dir():
            raise ConfigError(
                f"{root} has no clients/ folder of accepted client keys; create keys with `perseus keys --dir {root}`"
            )
        self.public, self.secret = _secret_pair(root / "server" / f"{SERVER_NAME}.key_secret")
        self._refusals = _Refusals()
        self._auth: ThreadAuthenticator | None = None
        self._monitor: threading.Thread | None = None
        self._socket: zmq.Socket | None = None
        # (stamp of DIR/clients when read, the keys read): replaced whole, never changed, so the
        # service loop, the ZAP thread and a SIGHUP handler can all reload without a lock (a
        # lock taken in a signal handler could deadlock the loop it interrupted).
        self._keys: tuple[tuple[int, int] | None, frozenset[bytes]] = (None, frozenset())
        self._next_check = 0.0
        self._load()

    def reload(self) -> int:
        """Read DIR/clients again now; returns how many client keys are allowed. Messages of a
        key no longer there are refused from now on (`authorized`)."""
        return len(self._load())

    def authorized(self, user_id: str | None) -> bool:
        """Whether a message's sender (`peer_key(frame)`) is still allowed. DIR/clients is read
        again when it changed: checked at most once a second for allowed keys, at each refused
        message (so a key just added, which the handshake accepted, is never refused)."""
        if user_id is None:
            return False
        key = user_id.encode()
        stamp, allowed = self._keys
        now = time.monotonic()
        if key in allowed and now < self._next_check:
            return True
        self._next_check = now + KEYS_CHECK_INTERVAL_S
        if stamp is None or stamp != self._stamp():
            allowed = self._load()
        return key in allowed

    def _stamp(self) -> tuple[int, int] | None:
        """DIR/clients' (inode, mtime): it changes when a key file is added, deleted or renamed
        (not when one is edited in place: reload() for that). None, so the next check reads the
        folder, when it is missing or changed in the last 2 s: file times have coarse ticks
        (milliseconds, or seconds on some file systems), and a second change within the tick of
        a read would not change the stamp."""
        try:
            st = os.stat(self.clients)
        except OSError:
            return None
        if time.time_ns() - st.st_mtime_ns < 2_000_000_000:
            return None
        return st.st_ino, st.st_mtime_ns

    def _load(self) -> frozenset[bytes]:
        stamp = self._stamp()  # before reading: a change during the read shows as a new stamp
        try:
            allowed = _read_client_keys(self.clients, self._refusals)
        except OSError as e:
            log.error("cannot read the accepted client keys in %s: %s; refusing every client", self.clients, e)
            allowed = frozenset()
        self._keys = (stamp, allowed)
        return allowed

    def configure_server(self, socket: zmq.Socket) -> None:
        self._auth = ThreadAuthenticator(socket.context, log=log.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=_AllowList(self))
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True
        address = f"inproc://perseus-monitor-{id(self)}"
        socket.monitor(address, sum(_REFUSALS))
        self._socket = socket
        self._monitor = threading.Thread(
            target=self._watch, args=(socket.context, address), name="perseus-curve-monitor", daemon=True
        )
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
                    self._refusals.log(
                        f"refused a connection on {event['endpoint'].decode(errors='replace')}: {reason}"
                    )
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
        secret = root / "clients" / f"{name}.key_secret"
        if not root.is_dir():
            raise ConfigError(
                f"no CURVE keys folder at {root}: pass the folder `perseus keys --dir` made for the service "
                f"(--curve-keys, {KEYS_ENV} for ranks)"
            )
        if not secret.exists():
            names = sorted(p.name.removesuffix(".key_secret") for p in (root / "clients").glob("*.key_secret"))
            raise ConfigError(
                f"{root} has no client key named {name!r} (it has {', '.join(names) or 'none'}): pass --client NAME "
                f"({CLIENT_ENV} for ranks), or add one with `perseus keys --dir {root} --client {name}`"
            )
        return cls(secret, root / "server" / f"{SERVER_NAME}.key")

    def configure_server(self, socket: zmq.Socket) -> None:
        raise ConfigError("CurveClient configures client sockets; the service uses CurveServer")

    def configure_client(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server

    def authorized(self, user_id: str | None) -> bool:
        """A client checks its peer's key in the handshake (the service's public key)."""
        return True

    def reload(self) -> None:
        return None

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
    (an existing client is an error unless `force`). Returns the files written.

    Each file is written atomically (the service, reading DIR/clients at each handshake, never
    sees half a key) with its mode set from the start: 0600 for secrets, 0644 for public keys,
    whatever the umask."""
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
                raise ConfigError(
                    f"client {name!r} already has keys in {root / 'clients'}; pick another name or pass --force"
                )
            todo.append((root / "clients", name))
        for folder, name in todo:
            public, secret = zmq.curve_keypair()
            # The secret first: a public key in clients/ admits its client, which needs the pair.
            write_text_atomic(folder / f"{name}.key_secret", _certificate(public, secret), mode=0o600)
            write_text_atomic(folder / f"{name}.key", _certificate(public), mode=0o644)
            written += [folder / f"{name}.key", folder / f"{name}.key_secret"]
    except OSError as e:
        raise ConfigError(f"cannot write keys under {root}: {e.strerror or e}; pass a writable --dir") from None
    return written


def _certificate(public: bytes, secret: bytes | None = None) -> str:
    """A ZeroMQ certificate file, as zmq.auth.create_certificates writes it."""
    kind = "**Secret**" if secret else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now()} by perseus keys  ****",
        f"#   ZeroMQ CURVE {kind} Certificate",
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
        if secret
        else "#   Exchange securely, or use a secure mechanism to verify the contents of this file after exchange.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


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

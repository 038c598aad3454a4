"""Security hardening: a revoked CURVE client key stops working on its open connection
(refused, then disconnected), `perseus serve` reloads keys on SIGHUP, secret keys open to
other users are warned about, and key files are private whatever the umask.

The revocation test runs a small ROUTER loop here that checks each message the way the planner
service does (`authorized(peer_key(frame))`, error reply, `drop_connection`). About 3 s."""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time

import pytest
import zmq
from server_helpers import request, wait_until
from zmq.utils.monitor import recv_monitor_message

from perseus.exceptions import ConfigError
from perseus.wire import security as security_module
from perseus.wire.security import PLAINTEXT, CurveClient, CurveServer, create_keys, drop_connection, peer_key


class _Router:
    """A CURVE ROUTER in a thread, answering b"ok" to allowed senders; a revoked one gets
    b"refused" and its connection is dropped: the loop the planner service runs."""

    def __init__(self, security: CurveServer) -> None:
        self.security = security
        self.ready = threading.Event()
        self.stopping = threading.Event()
        self.dropped: list[bool] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self.security.configure_server(sock)
        self.endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ready.set()
        try:
            while not self.stopping.is_set():
                if not sock.poll(20):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                if self.security.authorized(peer_key(frames[-1])):
                    sock.send_multipart([frames[0], b"ok"])
                else:
                    sock.send_multipart([frames[0], b"refused"])
                    self.dropped.append(drop_connection(frames[-1]))
        finally:
            sock.close(linger=0)
            self.security.close()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)


class _Dealer:
    """A CURVE client on one connection, with a monitor that sees it disconnected."""

    def __init__(self, endpoint: str, curve: CurveClient) -> None:
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.configure_client(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)

    def ask(self, timeout_s: float = 2.0) -> bytes | None:
        self.sock.send(b"hello")
        return self.sock.recv() if self.sock.poll(int(timeout_s * 1000)) else None

    def disconnected(self, timeout_s: float = 3.0) -> bool:
        return (
            bool(self.monitor.poll(int(timeout_s * 1000)))
            and recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
        )

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


@pytest.mark.parametrize("notice", ["reload", "mtime"])
def test_a_revoked_key_is_refused_and_disconnected_on_its_open_connection(tmp_path, monkeypatch, notice):
    monkeypatch.setattr(security_module, "KEYS_CHECK_INTERVAL_S", 0.1)
    keys = tmp_path / "keys"
    create_keys(keys, ["rank", "other"])
    past = time.time_ns() - 60 * 10**9
    os.utime(keys / "clients", ns=(past, past))  # an old folder: its stamp is trusted, and compared
    router = _Router(CurveServer(keys))
    assert router.security._keys[0] is not None
    rank, other = (_Dealer(router.endpoint, CurveClient.from_dir(keys, name)) for name in ("rank", "other"))
    try:
        assert rank.ask() == b"ok" and other.ask() == b"ok"
        (keys / "clients" / "rank.key").unlink()
        if notice == "reload":
            assert router.security.reload() == 1  # what SIGHUP does in `perseus serve`
        else:
            time.sleep(0.2)  # past the (shortened) interval: the folder's change is noticed
        assert rank.ask() == b"refused"  # the error reply goes out before the connection is dropped
        assert wait_until(lambda: router.dropped, 2.0) == [True]
        assert rank.disconnected()
        assert rank.ask(timeout_s=1.0) is None  # reconnecting, the handshake refuses the key
        assert other.ask() == b"ok" and not other.disconnected(timeout_s=0.1)  # another client is untouched
    finally:
        rank.close()
        other.close()
        router.stop()


def test_authorized_follows_the_clients_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(security_module, "KEYS_CHECK_INTERVAL_S", 0.05)
    create_keys(tmp_path, ["a"])
    server = CurveServer(tmp_path)
    a = (tmp_path / "clients" / "a.key").read_text().split('public-key = "')[1].split('"')[0]
    assert server.authorized(a) and not server.authorized(None)
    assert PLAINTEXT.authorized(None) and PLAINTEXT.reload() is None

    # A key just added is allowed at its first message (it is read again before refusing).
    create_keys(tmp_path, ["b"])
    b = (tmp_path / "clients" / "b.key").read_text().split('public-key = "')[1].split('"')[0]
    assert server.authorized(b)

    (tmp_path / "clients" / "a.key").unlink()
    time.sleep(0.1)
    assert not server.authorized(a) and server.authorized(b)

    # An unreadable key file allows no one and spoils nothing else; a missing folder allows no one.
    (tmp_path / "clients" / "junk.key").write_text("not a key\n")
    assert server.reload() == 1 and server.authorized(b)
    (tmp_path / "clients" / "junk.key").unlink()
    (tmp_path / "clients" / "b.key").rename(tmp_path / "b.key")
    (tmp_path / "clients" / "b.key_secret").unlink()
    (tmp_path / "clients" / "a.key_secret").unlink()
    (tmp_path / "clients").rmdir()
    assert server.reload() == 0 and not server.authorized(b)


def test_drop_connection_without_a_socket_is_a_no_op():
    ctx = zmq.Context.instance()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind("inproc://perseus-drop-test")
        dealer.connect("inproc://perseus-drop-test")
        dealer.send(b"x")
        assert router.poll(2000)
        frames = router.recv_multipart(copy=False)
        assert peer_key(frames[-1]) is None
        assert drop_connection(frames[-1]) is False
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def test_secret_keys_open_to_other_users_are_warned_about(tmp_path, caplog):
    create_keys(tmp_path, ["rank"])
    server_secret, client_secret = tmp_path / "server" / "server.key_secret", tmp_path / "clients" / "rank.key_secret"
    with caplog.at_level(logging.WARNING, logger="perseus.wire.security"):
        CurveServer(tmp_path).close()
        CurveClient.from_dir(tmp_path, "rank")
    assert not caplog.records  # 0600: nothing to say
    os.chmod(server_secret, 0o640)
    os.chmod(client_secret, 0o604)
    with caplog.at_level(logging.WARNING, logger="perseus.wire.security"):
        CurveServer(tmp_path).close()
        CurveClient.from_dir(tmp_path, "rank")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert f"chmod 600 {server_secret}" in warnings[0] and "0640" in warnings[0]
    assert f"chmod 600 {client_secret}" in warnings[1]


@pytest.mark.parametrize("mask", [0, 0o077])
def test_key_files_get_fixed_modes_whatever_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        written = create_keys(tmp_path, ["rank"])
    finally:
        os.umask(old)
    assert {p.name for p in written} == {"server.key", "server.key_secret", "rank.key", "rank.key_secret"}
    for path in written:
        assert stat.S_IMODE(os.stat(path).st_mode) == (0o600 if path.name.endswith("_secret") else 0o644)
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == ["rank.key", "rank.key_secret"]  # no temp files
    CurveClient.from_dir(tmp_path, "rank")  # readable as a ZeroMQ certificate


def _wait_for_log(served, text: str, timeout_s: float = 5.0) -> None:
    wait_until(lambda: text in served.log(), timeout_s)


def test_serve_reloads_client_keys_on_sighup(serve, tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys, ["rank", "other"])
    served = serve(extra=("--curve-keys", str(keys)))
    served.proc.send_signal(signal.SIGHUP)
    _wait_for_log(served, f"reloaded the client keys in {keys}: 2 allowed")
    (keys / "clients" / "other.key").unlink()
    served.proc.send_signal(signal.SIGHUP)
    _wait_for_log(served, f"reloaded the client keys in {keys}: 1 allowed")
    assert served.proc.poll() is None  # SIGHUP does not end the service
    assert served.stop() == 0


def test_sighup_without_keys_is_logged_and_harmless(serve):
    served = serve()
    served.proc.send_signal(signal.SIGHUP)
    _wait_for_log(served, "no client keys to reload")
    assert request(served.endpoint, "ping") is not None
    assert served.stop() == 0


def test_a_client_name_without_keys_names_the_ones_there_and_the_fix(tmp_path):
    create_keys(tmp_path, ["node1", "node2"])
    with pytest.raises(ConfigError, match="has no client key named 'node3' .it has node1, node2.: pass --client NAME"):
        CurveClient.from_dir(tmp_path, "node3")
    assert CurveClient.from_dir(tmp_path, "node2").secret
    with pytest.raises(ConfigError, match=f"no CURVE keys folder at {tmp_path}/none: pass the folder"):
        CurveClient.from_dir(tmp_path / "none", "node2")

"""CURVE authentication against a real `perseus serve --curve-keys` process: the right key is
served; a wrong client key, a wrong server key and no key are refused (the client sees no
answer, the service logs the refusal). About 4 s: each refused client waits out its timeout."""

from __future__ import annotations

import os
import signal
import stat
import time

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from perseus.cli.main import main
from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ConfigError
from perseus.wire.security import PLAINTEXT, CurveClient, create_keys, security_from_env


def _answers(endpoint: str, security, timeout_s: float = 0.8) -> bool:
    with PlannerClient(endpoint, timeout_s=timeout_s, security=security) as client:
        return client.status() is not None


def _wait_for_log(served, text: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in served.log():
        assert time.monotonic() < deadline, f"{text!r} not in the service log:\n{served.log()}"
        time.sleep(0.05)


def test_only_clients_with_an_accepted_key_are_served(serve, tmp_path, capsys, monkeypatch):
    keys, other = tmp_path / "keys", tmp_path / "other"
    assert main(["keys", "--dir", str(keys), "--client", "rank"]) == 0
    assert "server.key_secret (secret" in capsys.readouterr().out
    create_keys(other, ["intruder"])
    for secret in (keys / "server" / "server.key_secret", keys / "clients" / "rank.key_secret"):
        assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(keys / "clients" / "rank.key").st_mode) == 0o644

    # CURVE makes a non-loopback bind acceptable without --insecure.
    served = serve(bind="tcp://0.0.0.0:0", extra=("--curve-keys", str(keys)))
    endpoint = "tcp://127.0.0.1:" + served.endpoint.rsplit(":", 1)[1]
    assert "WITHOUT authentication" not in served.log()

    assert _answers(endpoint, CurveClient.from_dir(keys, "rank"))
    intruder = CurveClient(other / "clients" / "intruder.key_secret", keys / "server" / "server.key")
    assert not _answers(endpoint, intruder)
    _wait_for_log(served, "refused a client: its CURVE public key")
    assert not _answers(endpoint, PLAINTEXT)
    _wait_for_log(served, "refused a connection")
    wrong_server = CurveClient(keys / "clients" / "rank.key_secret", other / "server" / "server.key")
    assert not _answers(endpoint, wrong_server)

    # Accepted keys are read at each handshake: adding the intruder's public key admits it.
    (keys / "clients" / "intruder.key").write_bytes((other / "clients" / "intruder.key").read_bytes())
    assert _answers(endpoint, intruder, timeout_s=2.0)

    # Ranks pick their keys from the environment.
    monkeypatch.setenv("PERSEUS_CURVE_KEYS", str(keys))
    monkeypatch.setenv("PERSEUS_CURVE_CLIENT", "rank")
    assert _answers(endpoint, None, timeout_s=2.0)
    assert served.stop() == 0 and "planner service stopped" in served.log()  # the authenticator stops too


def test_key_files_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="perseus keys"):
        CurveClient.from_dir("/nonexistent/keys", "rank")
    monkeypatch.delenv("PERSEUS_CURVE_KEYS", raising=False)
    assert security_from_env() is PLAINTEXT
    monkeypatch.setenv("PERSEUS_CURVE_KEYS", "/nonexistent/keys")
    with pytest.raises(ConfigError, match="rank|client"):
        security_from_env()


def test_keys_refuses_to_overwrite_a_client_and_bad_names(tmp_path):
    create_keys(tmp_path, ["a"])
    before = (tmp_path / "server" / "server.key").read_bytes()
    with pytest.raises(ConfigError, match="already has keys"):
        create_keys(tmp_path, ["a"])
    with pytest.raises(ConfigError, match="client name"):
        create_keys(tmp_path, ["../x"])
    create_keys(tmp_path, ["b"])
    assert (tmp_path / "server" / "server.key").read_bytes() == before  # the service's pair is kept
    assert sorted(p.name for p in (tmp_path / "clients").iterdir()) == [
        "a.key",
        "a.key_secret",
        "b.key",
        "b.key_secret",
    ]


def test_serve_refuses_a_keys_folder_without_clients(serve, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="clients/"):
        serve(extra=("--curve-keys", str(tmp_path / "empty")))


def test_a_revoked_key_is_refused_and_disconnected_on_its_open_connection(serve, tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys, ["rank", "other"])
    served = serve(extra=("--curve-keys", str(keys)))
    ctx = zmq.Context.instance()
    sockets = []

    def dealer(name: str):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        CurveClient.from_dir(keys, name).configure_client(sock)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(served.endpoint)
        sockets.extend((monitor, sock))
        return sock, monitor

    def ping(sock, request_id: int, timeout_s: float = 5.0):
        sock.send(msgpack.packb({"v": 1, "id": request_id, "type": "ping"}))
        return msgpack.unpackb(sock.recv(), raw=False) if sock.poll(int(timeout_s * 1000)) else None

    (rank, rank_monitor), (other, other_monitor) = dealer("rank"), dealer("other")
    try:
        assert ping(rank, 1)["ok"] and ping(other, 2)["ok"]
        (keys / "clients" / "rank.key").unlink()
        served.proc.send_signal(signal.SIGHUP)
        _wait_for_log(served, f"reloaded the client keys in {keys}: 1 allowed")
        reply = ping(rank, 3)  # the open connection is refused, with the request's id so the client sees why
        assert reply is not None and not reply["ok"] and reply["id"] == 3 and reply["error"]["code"] == "unauthorized"
        _wait_for_log(served, "no longer in the accepted keys")
        # ...then closed; reconnecting, the handshake refuses the key.
        assert rank_monitor.poll(10_000) and recv_monitor_message(rank_monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert ping(rank, 4, timeout_s=1.0) is None
        assert ping(other, 5)["ok"] and not other_monitor.poll(0)  # the other client keeps its connection
    finally:
        for sock in sockets:
            sock.close(linger=0)
    assert served.stop() == 0

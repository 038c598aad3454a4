"""The agent serving real Unix sockets in this process: leases, writes, heartbeats, revocation,
restarts, and what a GPU selected with PERSEUS_AGENT does with it."""

from __future__ import annotations

import os
import socket
import stat
import threading

import msgpack
import pytest
from agent_helpers import DEFAULT_LIMIT_MW, MAX_MHZ, PRESET, ThreadAgent, at_defaults, wait_for

from perseus.agent.client import AgentClient
from perseus.agent.leases import FILE_VERSION
from perseus.agent.protocol import (
    POWER_LIMIT,
    SM_CLOCK,
    Acquire,
    AgentError,
    Done,
    Granted,
    Hello,
    LeaseHeldError,
    Welcome,
    Write,
    decode_reply,
    encode_reply,
    encode_request,
    recv_frame,
)
from perseus.atomic import write_json_atomic
from perseus.controller import FrequencyController
from perseus.devices import emulate, get_gpus
from perseus.devices.agent_gpu import AgentSimGPU
from perseus.devices.select import gpu_backend
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError, DevicePermissionError, PerseusError
from perseus.safety import Watchdog


def raw_connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    return sock


def call(sock: socket.socket, request_id: int, message, reply_type, buffer: bytearray | None = None):
    try:
        sock.sendall(encode_request(request_id, message))
    except BrokenPipeError:
        pass  # refused before the agent read it (too many connections): its reason is waiting
    payload = recv_frame(sock, bytearray() if buffer is None else buffer)
    assert payload is not None
    return decode_reply(payload, request_id, reply_type, "agent")


def lease_and_lock(sock: socket.socket, uuid: str, mhz: int) -> None:
    """A hand-made client: hello, lease, lock (what AgentClient does), then nothing more."""
    assert isinstance(call(sock, 1, Hello("raw test client", os.getpid()), Welcome), Welcome)
    call(sock, 2, Acquire((uuid,)), Granted)
    call(sock, 3, Write(uuid, SM_CLOCK, mhz), Done)


def test_writes_go_through_the_agent_and_end_with_the_connection(node, thread_agent):
    thread_agent()
    gpu = node.gpu(0)
    client = AgentClient(node.socket)
    client.write(gpu.uuid(), SM_CLOCK, 990)
    client.write(gpu.uuid(), POWER_LIMIT, 250_000)
    assert gpu.sm_clock() == 990 and gpu.power_limit_mw() == 250_000
    state = client.status().gpu(gpu.uuid())
    assert state is not None and state.yours and state.holder is not None
    assert (state.holder.pid, state.holder.uid) == (os.getpid(), os.getuid())  # from SO_PEERCRED
    assert state.sm_clock_mhz == 990
    client.close()
    wait_for(lambda: at_defaults(gpu), "the agent to reset GPU 0 after the connection closed")


def test_a_second_client_is_refused_naming_the_holder(node, thread_agent):
    thread_agent()
    uuid = node.gpu(1).uuid()
    first, second = AgentClient(node.socket), AgentClient(node.socket)
    try:
        first.write(uuid, SM_CLOCK, 1005)
        with pytest.raises(LeaseHeldError, match=f"GPU 1 .* is leased to pid {os.getpid()}") as refused:
            second.write(uuid, SM_CLOCK, 210)
        assert refused.value.holder_pid == os.getpid()
        assert node.gpu(1).sm_clock() == 1005
        may, why = second.may_control(uuid)
        assert not may and f"pid {os.getpid()}" in why
        assert first.may_control(uuid) == (True, "")
        first.close()
        wait_for(lambda: at_defaults(node.gpu(1)), "GPU 1 back at defaults")
        second.write(uuid, SM_CLOCK, 210)  # free now
        assert node.gpu(1).sm_clock() == 210
    finally:
        first.close()
        second.close()


def test_silence_ends_the_lease(node, thread_agent):
    """Heartbeats stop (a hung or stopped process): after the timeout the agent resets the GPU."""
    thread_agent(timeout_s=1.0)
    uuid = node.gpu(0).uuid()
    sock = raw_connect(node.socket)
    try:
        lease_and_lock(sock, uuid, 705)
        assert node.gpu(0).sm_clock() == 705
        wait_for(lambda: at_defaults(node.gpu(0)), "the silent client's GPU reset")
        assert recv_frame(sock, bytearray()) is None  # and its connection closed
    finally:
        sock.close()


def test_a_holder_killed_with_a_reply_unread_is_logged_as_exited_or_killed(node, thread_agent, caplog):
    """A process killed with a reply waiting in its socket closes it with a reset, not an end of
    file; the agent says the same about it (a multi-node test that killed a node saw either)."""
    caplog.set_level("INFO", logger="perseus.agent.daemon")
    thread_agent()
    uuid = node.gpu(0).uuid()
    sock = raw_connect(node.socket)
    try:
        lease_and_lock(sock, uuid, 705)
        sock.sendall(encode_request(4, Write(uuid, SM_CLOCK, 720)))
        assert sock.recv(1, socket.MSG_PEEK)  # the reply arrived; it is never read
    finally:
        sock.close()
    wait_for(lambda: at_defaults(node.gpu(0)), "the closed client's GPU reset")
    line = wait_for(
        lambda: next((r.getMessage() for r in caplog.records if "reset to defaults" in r.getMessage()), None),
        "the agent to log the reset",
    )
    assert "the holder exited or was killed (its connection closed)" in line


def test_the_log_says_what_the_reset_changed_on_a_gpu_slow_to_switch(node, thread_agent, caplog, monkeypatch):
    """A realistic simulated GPU takes milliseconds to switch clocks: the reset is reported once the
    default is in force (the log said `already at defaults` while it unlocked 990 MHz)."""
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    caplog.set_level("INFO", logger="perseus.agent.daemon")
    thread_agent()
    uuid = node.gpu(0).uuid()
    client = AgentClient(node.socket)
    client.write(uuid, SM_CLOCK, 990)
    wait_for(lambda: node.gpu(0).sm_clock() == 990, "the locked clock in force")
    client.close()
    line = wait_for(
        lambda: next((r.getMessage() for r in caplog.records if "reset to defaults" in r.getMessage()), None),
        "the agent to log the reset",
    )
    assert "reset to defaults: SM clock unlocked (990 -> 1410 MHz)" in line


def test_the_client_sends_heartbeats_while_it_holds_a_lease(node):
    """Against a stand-in agent that says: heartbeat every 10 ms; the client's thread then sends
    them with no request from the caller."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(node.socket)
    listener.listen(1)
    client = AgentClient(node.socket)
    served = threading.Thread(target=client.write, args=("GPU-x", SM_CLOCK, 990), daemon=True)
    served.start()
    conn, _ = listener.accept()
    conn.settimeout(30)
    buffer = bytearray()
    try:
        for reply in (Welcome(1, 0.01, 0.04, "nvml", None, ("GPU-x",)), Granted(("GPU-x",)), Done()):
            payload = recv_frame(conn, buffer)
            request_id = msgpack.unpackb(payload)["id"]
            conn.sendall(encode_reply(request_id, reply))
        served.join(timeout=30)
        kinds = [msgpack.unpackb(recv_frame(conn, buffer))["type"] for _ in range(5)]
        assert kinds == ["heartbeat"] * 5
    finally:
        client.close()
        conn.close()
        listener.close()


def test_revoke_ends_a_lease_and_the_holder_cannot_take_it_back(node, thread_agent):
    thread_agent()
    uuid = node.gpu(0).uuid()
    holder, admin = AgentClient(node.socket), AgentClient(node.socket)
    try:
        holder.write(uuid, SM_CLOCK, 990)
        assert admin.revoke((uuid,)) == (uuid,)
        assert at_defaults(node.gpu(0))
        with pytest.raises(AgentError, match="an administrator revoked this process's lease on GPU 0") as lost:
            holder.write(uuid, SM_CLOCK, 990)
        assert lost.value.code == "not_leased"
        with pytest.raises(DevicePermissionError, match="revoked"):
            holder.write(uuid, SM_CLOCK, 990)
        assert at_defaults(node.gpu(0))
    finally:
        holder.close()
        admin.close()


def test_a_revoked_lease_stays_revoked_when_the_agent_restarts(node, thread_agent):
    """The holder's client reconnects to a restarted agent on its own and asks for its leases back."""
    first = thread_agent()
    uuid = node.gpu(0).uuid()
    holder, admin = AgentClient(node.socket), AgentClient(node.socket)
    try:
        holder.write(uuid, SM_CLOCK, 990)
        assert admin.revoke((uuid,)) == (uuid,)
        admin.close()
        first.stop()
        second = thread_agent()
        with pytest.raises(PerseusError):
            holder.write(uuid, SM_CLOCK, 990)
        with pytest.raises(DevicePermissionError, match="revoked"):
            holder.write(uuid, SM_CLOCK, 990)
        assert second.agent.leases.lease(uuid) is None and at_defaults(node.gpu(0))
        other = AgentClient(node.socket)  # another process's (here: connection's) lease is not revoked
        other.write(node.gpu(1).uuid(), SM_CLOCK, 990)
        other.close()
    finally:
        holder.close()
        admin.close()


def test_revoke_is_for_administrators(node, thread_agent):
    thread_agent(admin_uids=frozenset({12345}))
    client = AgentClient(node.socket)
    try:
        with pytest.raises(DevicePermissionError, match="only root or the agent's user"):
            client.revoke((node.gpu(0).uuid(),))
    finally:
        client.close()


def test_refused_values_and_unknown_gpus(node, thread_agent):
    thread_agent()
    client = AgentClient(node.socket)
    try:
        uuid = node.gpu(0).uuid()
        with pytest.raises(ConfigError, match="does not support SM clock 991 MHz"):
            client.write(uuid, SM_CLOCK, 991)
        with pytest.raises(ConfigError, match="power limit 9000 W is outside"):
            client.write(uuid, POWER_LIMIT, 9_000_000)
        with pytest.raises(ConfigError, match="write.value"):
            client.write(uuid, SM_CLOCK, True)  # checked before it is sent
        with pytest.raises(AgentError, match="serves no GPU GPU-nope"):
            client.write("GPU-nope", SM_CLOCK, 990)
        assert at_defaults(node.gpu(0))
    finally:
        client.close()


def test_requests_before_hello_are_refused(node, thread_agent):
    thread_agent()
    sock = raw_connect(node.socket)
    try:
        with pytest.raises(AgentError, match="send hello first"):
            call(sock, 1, Acquire((node.gpu(0).uuid(),)), Granted)
    finally:
        sock.close()


def test_restart_resets_what_a_stopped_agent_left_leased(node, thread_agent):
    os.makedirs(node.sim_dir, mode=0o755)
    node.gpu(1).lock_sm_clock(510)
    node.gpu(1).set_power_limit_mw(200_000)
    node.gpu(0).lock_sm_clock(900)  # set outside any lease: left alone
    lease = {"uuid": node.gpu(1).uuid(), "index": 1, "pid": 4242, "uid": 1000, "gid": 1000}
    lease |= {"client": "python train.py", "client_pid": 7, "since": 1.0}
    write_json_atomic(node.leases, {"version": FILE_VERSION, "agent_pid": 1, "written": 1.0, "leases": [lease]})
    thread_agent()
    assert at_defaults(node.gpu(1))
    assert node.gpu(0).sm_clock() == 900
    with open(node.leases) as f:
        assert '"leases": []' in f.read()


def test_a_damaged_lease_file_resets_every_gpu(node, thread_agent, caplog):
    os.makedirs(node.sim_dir, mode=0o755)
    for gpu in node.sim_gpus():
        gpu.lock_sm_clock(510)
    with open(node.leases, "w") as f:
        f.write("{not json")
    thread_agent()
    assert all(at_defaults(gpu) for gpu in node.sim_gpus())
    assert (
        f"is damaged: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
        f"({node.leases}.damaged)" in caplog.text
    )
    with open(node.leases + ".damaged") as f:
        assert f.read() == "{not json"  # kept for whoever looks into it


def test_one_agent_per_socket(node, thread_agent):
    thread_agent()
    with pytest.raises(ConfigError, match="another perseus agent .* serves"):
        ThreadAgent(node)


def test_a_stopped_agent_leaves_no_lock_behind(node, thread_agent):
    def locks() -> list[str]:  # not the simulated GPUs' activity lock (theirs, not the agent's)
        names = [name for _, _, names in os.walk(node.root) for name in names]
        return [name for name in names if name.endswith(".lock") and name != ".lock"]

    agent = thread_agent()
    assert len(locks()) == 2 + len(node.sim_gpus())  # its socket's, its lease file's, a claim per GPU
    agent.stop()
    assert not locks()
    thread_agent().stop()  # and the next one starts as the first did


def test_one_agent_per_lease_file(node, thread_agent):
    """Two agents on other GPUs and sockets, one lease file: the second would rewrite the first's
    leases away, and a GPU the first leased would stay locked after a crash."""
    thread_agent(gpus=node.sim_gpus()[:1])
    node.socket = os.path.join(node.root, "other.sock")
    with pytest.raises(ConfigError, match=f"keeps its leases in {node.leases}; give this one its own --state-file"):
        ThreadAgent(node, gpus=node.sim_gpus()[1:])
    assert not os.path.exists(node.socket)
    assert not os.path.exists(node.socket + ".lock")  # the refused agent leaves nothing behind


def test_a_socket_folder_the_agent_cannot_create_is_a_clear_error(node, thread_agent):
    with open(os.path.join(node.root, "file"), "w"):
        pass
    node.socket = os.path.join(node.root, "file", "agent.sock")  # a folder where a file is
    with pytest.raises(ConfigError, match="beside the agent's socket: .*; give --socket a path in a folder"):
        thread_agent()


def test_the_socket_gets_its_mode_and_group(node, thread_agent):
    thread_agent(mode=0o660, group=65534)
    st = os.stat(node.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534


def test_a_socket_open_to_every_user_is_warned_of(node, thread_agent, caplog):
    thread_agent(mode=0o666)
    assert "the socket's mode 666 lets every user of this node connect" in caplog.text


def test_too_many_connections_are_refused_clearly(node, thread_agent):
    thread_agent(max_connections=1)
    first = raw_connect(node.socket)
    try:
        call(first, 1, Hello("first", 1), Welcome)  # admitted
        second = raw_connect(node.socket)
        try:
            with pytest.raises(AgentError, match="too many connections"):
                call(second, 1, Hello("second", 2), Welcome)
        finally:
            second.close()
    finally:
        first.close()


def test_selected_gpus_write_through_the_agent_and_stay_what_they_were(node, thread_agent, monkeypatch):
    thread_agent()
    monkeypatch.setenv("PERSEUS_AGENT", node.socket)
    gpus = get_gpus(f"sim:{PRESET}:2")
    assert all(isinstance(g, AgentSimGPU) and isinstance(g, SimGPU) for g in gpus)
    assert gpu_backend(gpus) == "sim"
    assert gpus[0].can_change_clocks()
    assert Watchdog.for_gpus(gpus) is None  # the agent resets them when this process ends
    with FrequencyController(gpus[0], handle_signals=False) as controller:
        assert controller.apply_now(1005, timeout=10)
        assert node.gpu(0).sm_clock() == 1005
        duration = emulate(gpus, 0.01)  # simulated work still runs at the agent-set clock
        assert duration > 0.01
    assert node.gpu(0).sm_clock() == MAX_MHZ  # the controller's own reset, through the agent
    gpus[1].set_power_limit_mw(300_000)
    assert node.gpu(1).power_limit_mw() == 300_000
    gpus[1].reset_power_limit()
    assert node.gpu(1).power_limit_mw() == DEFAULT_LIMIT_MW


def test_without_the_variable_simulated_gpus_write_directly(node, monkeypatch):
    monkeypatch.delenv("PERSEUS_AGENT", raising=False)
    monkeypatch.setenv("PERSEUS_SIM_DIR", node.sim_dir)
    assert not any(isinstance(g, AgentSimGPU) for g in get_gpus(f"sim:{PRESET}:2"))
    monkeypatch.setenv("PERSEUS_AGENT", "off")
    assert not any(isinstance(g, AgentSimGPU) for g in get_gpus(f"sim:{PRESET}:2"))


def test_an_unreachable_agent_is_a_clear_error(node, monkeypatch):
    monkeypatch.setenv("PERSEUS_AGENT", node.socket)
    gpu = get_gpus(f"sim:{PRESET}:1")[0]
    assert gpu.can_change_clocks() is False
    with pytest.raises(AgentError, match="no perseus agent socket at .* start the agent"):
        gpu.lock_sm_clock(990)


def test_a_socket_nothing_listens_on_and_a_file_that_is_no_socket_say_what_to_do(node):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(node.socket)  # an agent killed with SIGKILL leaves its socket so
    stale.close()
    plain = os.path.join(node.root, "passwd")
    open(plain, "w").close()
    for path, words in (
        (node.socket, "the socket of a perseus agent that stopped"),
        (plain, "is not a Unix socket .no perseus agent listens there."),
    ):
        client = AgentClient(path)
        with pytest.raises(AgentError, match=f"{words}: start the agent .*, point PERSEUS_AGENT at its socket"):
            client.status()
        client.close()

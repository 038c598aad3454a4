"""`perseus agent`, `perseus agent status|revoke` and `perseus reset` through an agent, as commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from agent_helpers import PRESET, Child, at_defaults, sleep_forever, wait_for

from perseus.devices import get_gpus


def perseus(node, *args: str, agent: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PERSEUS_GPU": f"sim:{PRESET}:2", "PERSEUS_SIM_DIR": node.sim_dir}
    env["PERSEUS_AGENT"] = node.socket if agent else "off"
    return subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", *args], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.fixture
def agent(node):
    proc = node.process().start()
    yield proc
    proc.stop()


@pytest.fixture
def holder(node, agent, monkeypatch):
    """A process holding GPU 0 at 990 MHz through the agent."""
    monkeypatch.setenv("PERSEUS_AGENT", node.socket)
    monkeypatch.setenv("PERSEUS_SIM_DIR", node.sim_dir)

    def body(report) -> None:
        get_gpus(f"sim:{PRESET}:2")[0].lock_sm_clock(990)
        report({"pid": os.getpid()})
        sleep_forever()

    child = Child(body)
    yield child.next()["pid"]
    child.close()


def test_status_shows_gpus_clocks_and_holders(node, holder):
    shown = perseus(node, "agent", "status")
    assert shown.returncode == 0, shown.stderr
    assert f"on {node.socket}: 1 other connection(s)" in shown.stdout  # the holder's, not the command's own
    assert "SM clock 990 MHz (max 1410 MHz); power limit 400 W (default 400 W); leased to pid " in shown.stdout
    assert f"leased to pid {holder} (uid 0" in shown.stdout and "free" in shown.stdout
    doc = json.loads(perseus(node, "agent", "status", "--json").stdout)
    assert doc["socket"] == node.socket
    assert [g["holder"]["pid"] if g["holder"] else None for g in doc["gpus"]] == [holder, None]


def test_reset_goes_through_the_agent_and_names_the_holder_once(node, holder):
    reset = perseus(node, "reset")
    assert reset.returncode == 1
    through = f"(NVIDIA A100-SXM4-40GB (simulated)) through the perseus agent at {node.socket}"
    assert reset.stdout.splitlines() == [
        f"GPU 0 {through}: SM clock NOT reset; power limit NOT reset",
        f"GPU 1 {through}: already at defaults",
    ]
    assert reset.stderr.count(f"GPU 0 ({node.gpu(0).uuid()}) is leased to pid {holder}") == 1
    assert "perseus agent revoke --gpu-index 0" in reset.stderr
    assert node.gpu(0).sm_clock() == 990


def test_reset_through_the_agent_reports_what_it_changed(node, agent):
    node.gpu(1).lock_sm_clock(1005)  # left by a process that wrote directly, as root
    reset = perseus(node, "reset")
    assert reset.returncode == 0, reset.stderr
    assert reset.stdout.splitlines()[1].endswith(": SM clock unlocked (1005 -> 1410 MHz)")
    assert at_defaults(node.gpu(1))


def test_revoke_ends_the_lease(node, holder):
    assert "needs --gpu-index" in perseus(node, "agent", "revoke").stderr
    assert "the agent serves GPUs 0, 1" in perseus(node, "agent", "revoke", "--gpu-index", "5").stderr
    revoked = perseus(node, "agent", "revoke", "--gpu-index", "0")
    assert revoked.returncode == 0, revoked.stderr
    assert f"GPU 0 ({node.gpu(0).uuid()}): lease of pid {holder} (uid 0" in revoked.stdout
    assert at_defaults(node.gpu(0))
    assert "no GPU is leased" in perseus(node, "agent", "revoke", "--all").stdout
    wait_for(lambda: "lease revoked by pid" in node.log_text(), "the revocation in the agent's log")


def test_info_says_which_gpus_this_process_may_change(node, holder):
    info = json.loads(perseus(node, "info", "--json").stdout)
    assert [g["can_change_clocks"] for g in info["gpus"]] == [False, True]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--mode", "999"), "--mode '999': give the socket's permissions in octal"),
        (("--group", "no-such-group-here"), "--group 'no-such-group-here': no such group"),
        (("--heartbeat-timeout", "0"), "the heartbeat timeout must be 0.05 to 3600 s"),
        (("--socket", "/tmp/" + "x" * 120), "a Unix socket's path may have at most 107"),
    ],
)
def test_bad_agent_options_are_named(node, args, words):
    started = perseus(node, "agent", "--state-file", node.leases, "--socket", node.socket, *args, agent=False)
    assert started.returncode == 1 and words in started.stderr


def test_a_second_agent_on_the_same_socket_is_refused(node, agent):
    second = perseus(node, "agent", "--state-file", node.leases, "--socket", node.socket, agent=False)
    assert second.returncode == 1
    assert f"another perseus agent (pid {agent.pid}) serves {node.socket}" in second.stderr


def test_a_second_agent_on_another_socket_is_refused_before_it_touches_a_gpu(node, agent, holder):
    """Another socket and a damaged lease file of its own (which resets every GPU it serves): the
    claims stop it first, and the first agent's holder keeps its clock."""
    other = os.path.join(node.root, "other.json")
    with open(other, "w") as f:
        f.write("{damaged")
    second = perseus(node, "agent", "--state-file", other, "--socket", os.path.join(node.root, "o.sock"), agent=False)
    assert second.returncode == 1
    assert f"GPU 0 ({node.gpu(0).uuid()}) is served by another perseus agent (pid {agent.pid}" in second.stderr
    assert "stop that one, or give this one other GPUs (--gpu-indices)" in second.stderr
    assert node.gpu(0).sm_clock() == 990
    assert not [name for name in os.listdir(node.root) if name.startswith("o.sock")]  # its socket, its lock


def test_status_without_an_agent_says_how_to_start_one(node):
    shown = perseus(node, "agent", "status")
    assert shown.returncode == 1 and f"no perseus agent socket at {node.socket}: start the agent" in shown.stderr


def test_an_agent_that_cannot_write_its_lease_file_does_not_start(node):
    blocker = os.path.join(node.root, "file")
    open(blocker, "w").close()
    state = os.path.join(blocker, "leases.json")
    started = perseus(node, "agent", "--state-file", state, "--socket", node.socket, agent=False)
    assert started.returncode == 1 and f"cannot write the lease file {state}" in started.stderr
    assert not os.path.exists(node.socket)

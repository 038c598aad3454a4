"""A process reads the very GPUs its agent writes: simulated ones in the agent's folder (taken when
PERSEUS_SIM_DIR is unset, refused with both folders named when it says otherwise), real ones only
those the agent serves; the agent's simulated GPUs' activity folder is open to the socket's group;
a process that changes simulated GPUs itself while an agent serves simulated GPUs is told."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile

import pytest
from agent_helpers import MAX_MHZ, PRESET, Node, ThreadAgent, at_defaults

from perseus.agent.client import shared_client
from perseus.agent.location import marker_path, read_marker
from perseus.devices import Work, get_gpus
from perseus.devices.agent_gpu import AgentSimGPU, through_agent
from perseus.devices.nvml import nvml_gpus
from perseus.exceptions import ConfigError
from perseus.testing.fake_nvml import FakeGPU, installed


@pytest.fixture
def served(node, thread_agent, monkeypatch):
    """An agent serving the node's simulated GPUs; this process's PERSEUS_AGENT names it."""
    agent = thread_agent()
    monkeypatch.setenv("PERSEUS_AGENT", node.socket)
    return agent


def test_without_perseus_sim_dir_a_process_uses_the_agents_gpus(node, served, monkeypatch):
    monkeypatch.delenv("PERSEUS_SIM_DIR")
    gpus = get_gpus(f"sim:{PRESET}:2")
    assert [os.path.dirname(g.state_path) for g in gpus] == [node.sim_dir] * 2
    gpus[1].lock_sm_clock(810)
    assert gpus[1].sm_clock() == 810 == node.gpu(1).sm_clock()  # what it set is what it reads
    gpus[1].reset_sm_clock()
    assert at_defaults(node.gpu(1))


def test_another_sim_folder_is_refused_naming_both(node, served, monkeypatch, caplog, tmp_path):
    mine = str(tmp_path / "mine")
    monkeypatch.setenv("PERSEUS_SIM_DIR", mine)
    with caplog.at_level(logging.WARNING):
        gpu = get_gpus(f"sim:{PRESET}:2")[0]
    words = f"this process's simulated GPUs are in {mine}, those the perseus agent at {node.socket} serves in "
    assert words + node.sim_dir in caplog.text  # said at selection ...
    assert gpu.can_change_clocks() is False
    with pytest.raises(ConfigError, match="two sets of GPUs") as refused:  # ... and refused at the first write
        gpu.lock_sm_clock(810)
    assert words + node.sim_dir in str(refused.value)
    assert f"unset PERSEUS_SIM_DIR (a process then uses the agent's) or set PERSEUS_SIM_DIR={node.sim_dir}" in str(
        refused.value
    )
    assert served.agent.leases.lease(gpu.uuid()) is None and at_defaults(node.gpu(0))


@pytest.mark.parametrize(
    ("spec", "index", "words"),
    [
        ("sim:h100-sxm:1", 0, "does not serve this process's GPU 0"),  # another model: other UUIDs
        (f"sim:{PRESET}:3", 2, "does not serve this process's GPU 2"),  # the agent serves 2
    ],
)
def test_simulated_gpus_the_agent_does_not_serve_are_refused(node, served, spec, index, words):
    gpu = get_gpus(spec)[index]
    with pytest.raises(ConfigError, match=words) as refused:
        gpu.lock_sm_clock(1005)
    assert f"it serves sim:{PRESET}:2: select the GPUs it serves (PERSEUS_GPU=sim:{PRESET}:2)" in str(refused.value)


def test_a_simulated_gpu_another_agent_serves_is_named_by_index(node, thread_agent, monkeypatch):
    """The agent serves GPU 1 only (`--gpu-indices 1`); the process selects both."""
    thread_agent(gpus=node.sim_gpus()[1:])
    monkeypatch.setenv("PERSEUS_AGENT", node.socket)
    first, second = get_gpus(f"sim:{PRESET}:2")
    second.lock_sm_clock(1005)
    with pytest.raises(ConfigError, match="does not serve this process's GPU 0") as refused:
        first.lock_sm_clock(1005)
    assert f"it serves sim:{PRESET} GPU 1: use only those of this process's GPUs, or run the agent" in str(
        refused.value
    )


def test_real_gpus_the_agent_does_not_serve_are_refused(node, thread_agent):
    """The agent serves NVIDIA GPU 0 only (as with `--gpu-indices 0`); the process has GPU 1 too."""
    with installed([FakeGPU(), FakeGPU()]) as nvml:
        first, second = nvml_gpus()
        thread_agent(gpus=[first])
        ours, other = through_agent([first, second], node.socket)
        ours.lock_sm_clock(1005)
        assert nvml.gpus[0].locked_clocks == (1005, 1005)
        with pytest.raises(ConfigError, match=f"does not serve this process's GPU 1 \\({second.uuid()}\\)"):
            other.lock_sm_clock(1005)
        assert nvml.gpus[1].locked_clocks is None
        ours.reset_sm_clock()
        shared_client(node.socket).close()


def test_a_gpu_of_another_kind_is_refused_naming_both(node, served):
    with installed([FakeGPU()]):
        (gpu,) = through_agent(list(nvml_gpus()), node.socket)
        with pytest.raises(ConfigError, match="serves simulated GPUs; this process's GPU 0 is NVIDIA"):
            gpu.lock_sm_clock(1005)


def test_the_activity_folder_is_open_to_the_sockets_group_and_the_state_is_not(node, thread_agent):
    thread_agent(mode=0o660)
    activity = os.path.join(node.sim_dir, "activity")
    st = os.stat(activity)
    assert stat.S_IMODE(st.st_mode) == 0o2775 and st.st_gid == os.getegid()
    logs = [os.path.join(activity, name) for name in os.listdir(activity)]
    assert logs and all(stat.S_IMODE(os.stat(p).st_mode) == 0o664 for p in logs)
    assert stat.S_IMODE(os.stat(node.sim_dir).st_mode) == 0o755
    # Work a client logs in a new generation keeps the folder's sharing, past its umask.
    old = os.umask(0o077)
    try:
        gpu = node.gpu(0)
        os.unlink(gpu._activity.path)
        gpu.execute(Work(0.001))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(gpu._activity.path).st_mode) == 0o664


def test_a_socket_open_to_all_opens_the_activity_folder_to_all(node, thread_agent):
    thread_agent(mode=0o666)
    assert stat.S_IMODE(os.stat(os.path.join(node.sim_dir, "activity")).st_mode) == 0o2777


def test_the_agent_marks_its_folder_while_it_serves(node, thread_agent):
    agent = thread_agent()
    marker = read_marker(marker_path(node.sim_dir, node.socket))
    assert marker is not None and marker.socket == node.socket and marker.pid == os.getpid() and marker.gpus == (0, 1)
    agent.stop()
    assert not os.path.exists(marker_path(node.sim_dir, node.socket))


def test_agents_on_disjoint_gpus_of_a_folder_are_each_named(node, thread_agent, monkeypatch, caplog):
    first = node.socket
    thread_agent(gpus=node.sim_gpus()[:1])
    node.socket, node.leases = os.path.join(node.root, "second.sock"), os.path.join(node.root, "second.json")
    thread_agent(gpus=node.sim_gpus()[1:])
    monkeypatch.delenv("PERSEUS_AGENT", raising=False)
    with caplog.at_level(logging.WARNING):
        get_gpus(f"sim:{PRESET}:2")
    said = f"served by perseus agents (GPU 0 by the one at {first}; GPU 1 by the one at {node.socket})"
    assert said in caplog.text and "set PERSEUS_AGENT to the socket of the agent that serves the GPUs" in caplog.text


def test_changing_the_agents_simulated_gpus_directly_is_told(node, served, monkeypatch, caplog):
    monkeypatch.delenv("PERSEUS_AGENT")
    with caplog.at_level(logging.WARNING):
        get_gpus(f"sim:{PRESET}:2")
    assert f"the simulated GPUs in {node.sim_dir} are served by the perseus agent at {node.socket}" in caplog.text
    assert f"set PERSEUS_AGENT={node.socket}" in caplog.text
    caplog.clear()
    monkeypatch.setenv("PERSEUS_AGENT", "off")  # a deliberate choice: nothing said
    with caplog.at_level(logging.WARNING):
        get_gpus(f"sim:{PRESET}:2")
    assert caplog.text == ""


def test_own_simulated_gpus_while_an_agent_serves_others_is_told(monkeypatch, caplog):
    """The user's default folder (PERSEUS_SIM_DIR unset) while an agent serves a folder where users'
    default folders are: the outsider's `sudo perseus agent` and an unprivileged process without
    PERSEUS_AGENT."""
    root = tempfile.mkdtemp(prefix="pagent-", dir="/tmp")
    agent_folder = tempfile.mkdtemp(prefix="perseus-sim-test-", dir="/tmp")
    node = Node(root)
    node.sim_dir = agent_folder
    agent = ThreadAgent(node)
    try:
        monkeypatch.delenv("PERSEUS_AGENT", raising=False)
        monkeypatch.delenv("PERSEUS_SIM_DIR", raising=False)
        own = f"/tmp/perseus-sim-{os.getuid()}"
        with caplog.at_level(logging.WARNING):
            gpus = get_gpus(f"sim:{PRESET}:1")
        assert not isinstance(gpus[0], AgentSimGPU) and gpus[0].sm_clock() == MAX_MHZ
        said = (
            f"this process uses simulated GPUs of its own, in {own}, while the perseus agent at {node.socket} "
            f"serves those in {agent_folder}: set PERSEUS_AGENT={node.socket} to use the agent's"
        )
        assert said in caplog.text
    finally:
        agent.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(agent_folder, ignore_errors=True)

"""A cluster in network namespaces: two GPU "nodes", each with its own perseus agent and simulated
GPUs, run one torchrun job with the multi-node c10d rendezvous (gloo over a veth bridge), planned by
`perseus serve` on a third node, bound on its non-loopback address with CURVE. Mid-run, one node's
process group is SIGKILLed: its GPUs go back to defaults (its agent), the other node's ranks fail
clearly (and their GPUs go back too), and the service keeps serving.

Needs root and iproute2 (`ip netns add`); skipped with the reason where namespaces cannot be made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import shutil
import signal
import subprocess
import sys

import pytest
from agent_helpers import PRESET, make_root, wait_for

pytest.importorskip("torch")

from perseus.agent.client import AgentClient
from perseus.agent.process import AgentProcess
from perseus.atomic import write_json_atomic
from perseus.demo.launcher import DemoOptions, demo_config
from perseus.devices.sim import SimGPU

SUBNET = "10.77.0"
NODES = {"a": 1, "b": 2, "s": 3}  # two GPU nodes and the service's, by their address's last byte
PORT = 7787
RDZV_PORT = 29400
GPUS_PER_NODE = 2


class Network:
    """Namespaces <name>a, <name>b, <name>s, each with one veth on a bridge in <name>w."""

    def __init__(self) -> None:
        self.name = f"pn{os.getpid() % 100000}"
        self.made: list[str] = []

    def ns(self, node: str) -> str:
        return self.name + node

    def ip(self, *args: str) -> None:
        done = subprocess.run(["ip", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise OSError(f"ip {' '.join(args)}: {done.stderr.strip()}")

    def create(self) -> None:
        switch = self.ns("w")
        for node in [*NODES, "w"]:
            self.ip("netns", "add", self.ns(node))
            self.made.append(self.ns(node))
        self.ip("-n", switch, "link", "add", "br0", "type", "bridge")
        self.ip("-n", switch, "link", "set", "br0", "up")
        for node, last in NODES.items():
            veth, port = f"veth{node}", f"port{node}"
            self.ip("link", "add", veth, "netns", self.ns(node), "type", "veth", "peer", "name", port, "netns", switch)
            self.ip("-n", switch, "link", "set", port, "master", "br0")
            self.ip("-n", switch, "link", "set", port, "up")
            self.ip("-n", self.ns(node), "addr", "add", f"{SUBNET}.{last}/24", "dev", veth)
            self.ip("-n", self.ns(node), "link", "set", veth, "up")
            self.ip("-n", self.ns(node), "link", "set", "lo", "up")

    def delete(self) -> None:
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def run_in(self, node: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.ns(node))


@pytest.fixture
def network():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed, so no network namespaces can be made")
    net = Network()
    try:
        net.create()
    except OSError as e:
        net.delete()
        pytest.skip(f"cannot make network namespaces here ({e}); this test needs root and iproute2")
    try:
        yield net
    finally:
        net.delete()


def read_line(proc: subprocess.Popen, what: str, timeout_s: float = 120.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().decode() if ready else ""
    assert line, f"{what} printed nothing in {timeout_s:g} s (exit code {proc.poll()})"
    return line


def locked_below_max(gpus: list[SimGPU]) -> bool:
    return any(os.path.exists(g.state_path) and g.sm_clock() < g.max_frequency() for g in gpus)


def at_defaults(gpus: list[SimGPU]) -> bool:
    return not any(os.path.exists(g.state_path) for g in gpus)


def descendants(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(child) for child in f.read().split()]
        except FileNotFoundError:
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def kill_node(pid: int) -> None:
    """SIGKILL a node's training as its cgroup's kill does: torchrun's process group and every
    process under it (torchrun starts each rank in a session of its own)."""
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(target, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)


def log_of(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.mark.slow
def test_a_node_killed_mid_run_leaves_no_gpu_locked_and_the_service_serving(network):
    root = make_root()
    procs: list[subprocess.Popen] = []
    agents: dict[str, AgentProcess] = {}
    python = sys.executable
    try:
        keys = os.path.join(root, "keys")
        made = subprocess.run(
            [python, "-m", "perseus.cli.main", "keys", "--dir", keys, "--client", "nodea", "--client", "nodeb"]
            + ["--client", "probe"],
            capture_output=True,
            text=True,
        )
        assert made.returncode == 0, made.stderr
        address = f"tcp://{SUBNET}.{NODES['s']}:{PORT}"
        service_log = open(os.path.join(root, "service.log"), "wb")
        service = subprocess.Popen(
            [*network.run_in("s"), python, "-m", "perseus.cli.main", "serve", "--bind", address]
            + ["--curve-keys", keys, "--state-dir", os.path.join(root, "state")],
            stdout=subprocess.PIPE,
            stderr=service_log,
        )
        procs.append(service)
        assert address in read_line(service, "perseus serve")

        sims = {node: os.path.join(root, node, "sim") for node in ("a", "b")}
        gpus = {node: [SimGPU(PRESET, i, state_dir=sims[node]) for i in range(GPUS_PER_NODE)] for node in sims}
        for node in sims:
            os.makedirs(os.path.join(root, node), exist_ok=True)
            agents[node] = AgentProcess(
                os.path.join(root, node, "agent.sock"),
                os.path.join(root, node, "leases.json"),
                f"sim:{PRESET}:{GPUS_PER_NODE}",
                os.path.join(root, node, "agent.log"),
                env={"PERSEUS_SIM_DIR": sims[node]},
                prefix=network.run_in(node),
            ).start()

        out_dir = os.path.join(root, "ranks")
        os.makedirs(out_dir)
        options = DemoOptions(ranks=4, microbatches=4, sweep_step=8, iterations_per_frequency=3, time_scale=0.05)
        config = dataclasses.replace(demo_config(options, out_dir, address), max_iterations=10_000)
        config_path = os.path.join(root, "config.json")
        write_json_atomic(config_path, config.to_json())
        jobs: dict[str, subprocess.Popen] = {}
        for node in sims:
            env = {
                **os.environ,
                "PERSEUS_GPU": f"sim:{PRESET}:{GPUS_PER_NODE}",
                "PERSEUS_SIM_DIR": sims[node],
                "PERSEUS_AGENT": agents[node].socket_path,
                "PERSEUS_CURVE_KEYS": keys,
                "PERSEUS_CURVE_CLIENT": f"node{node}",
                "GLOO_SOCKET_IFNAME": f"veth{node}",
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
            with open(os.path.join(root, node, "torchrun.log"), "wb") as log:
                jobs[node] = subprocess.Popen(
                    [*network.run_in(node), python, "-m", "torch.distributed.run", "--nnodes", "2"]
                    + ["--nproc-per-node", str(GPUS_PER_NODE), "--rdzv-backend", "c10d"]
                    + ["--rdzv-endpoint", f"{SUBNET}.{NODES['a']}:{RDZV_PORT}", "--rdzv-id", "agent-multinode"]
                    # Node a hosts the rendezvous store, and each node gives its own address: torchrun's
                    # guesses go by the hostname, which every namespace shares.
                    + ["--rdzv-conf", f"is_host={'true' if node == 'a' else 'false'}"]
                    + ["--local-addr", f"{SUBNET}.{NODES[node]}"]
                    + ["--max-restarts", "0", "-m", "perseus.demo.worker", config_path],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # the node's whole training: torchrun and its ranks
                )
            procs.append(jobs[node])

        def profiling() -> bool:
            for node, job in jobs.items():
                assert job.poll() is None, (
                    f"node {node}'s job ended early:\n{log_of(os.path.join(root, node, 'torchrun.log'))}"
                )
            return locked_below_max(gpus["b"])

        try:
            wait_for(profiling, "node b's ranks to lock their GPUs below the maximum clock (profiling)", 600)
        except AssertionError as e:
            logs = {n: log_of(os.path.join(root, n, "torchrun.log"))[-3000:] for n in jobs}
            raise AssertionError(f"{e}\nnode a:\n{logs['a']}\nnode b:\n{logs['b']}") from None
        holders = AgentClient(agents["b"].socket_path)
        try:
            wait_for(lambda: all(g.holder for g in holders.status().gpus), "both of node b's ranks to hold their GPUs")
        finally:
            holders.close()

        kill_node(jobs["b"].pid)  # node b goes down: torchrun and both ranks, at once
        jobs["b"].wait()
        wait_for(lambda: at_defaults(gpus["b"]), "node b's GPUs back at defaults", 60)
        ended = "exited or was killed (its connection closed); reset to defaults"
        wait_for(
            lambda: log_of(agents["b"].log_path).count(ended) >= GPUS_PER_NODE, "node b's agent to log both resets"
        )

        survivor = jobs["a"].wait(timeout=300)
        survivor_log = log_of(os.path.join(root, "a", "torchrun.log"))
        assert survivor != 0, survivor_log
        # Its ranks name the lost peer (gloo), torchrun the failed job.
        assert re.search(r"RuntimeError: .*Connection (reset|closed) by peer", survivor_log), survivor_log
        assert "ChildFailedError" in survivor_log and "perseus.demo.worker FAILED" in survivor_log, survivor_log
        wait_for(lambda: at_defaults(gpus["a"]), "node a's GPUs back at defaults", 60)

        assert service.poll() is None, "the service died"
        probe = subprocess.run(
            [*network.run_in("a"), python, "-c", STATUS_PROBE, address],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PERSEUS_CURVE_KEYS": keys, "PERSEUS_CURVE_CLIENT": "probe"},
        )
        assert probe.returncode == 0 and probe.stdout.split()[0] == "jobs", probe.stdout + probe.stderr
        assert int(probe.stdout.split()[1]) >= 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_node(proc.pid)
            proc.wait()
        for agent in agents.values():
            agent.stop()
        shutil.rmtree(root, ignore_errors=True)


# Asks the service, over CURVE, for every job's status: it must still answer after the kill.
STATUS_PROBE = """
import sys
from perseus.client.planner_client import PlannerClient
client = PlannerClient(sys.argv[1], timeout_s=10.0)
status = client.status()
client.close()
assert status is not None, "the service did not answer"
print("jobs", len(status.jobs))
"""

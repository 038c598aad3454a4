"""Fixtures: a node's folder, and agents serving it in this process (agent_helpers has the rest)."""

from __future__ import annotations

import shutil

import pytest
from agent_helpers import Node, ThreadAgent, make_root

from perseus.agent.client import shared_client


@pytest.fixture(autouse=True)
def ideal_sims(monkeypatch):
    """Simulated GPUs without a clock switch latency, here and in the agents and ranks started:
    these tests read a clock right after setting it (tests/devices cover the realistic ones)."""
    monkeypatch.setenv("PERSEUS_SIM_MODE", "ideal")


@pytest.fixture
def node():
    root = make_root()
    try:
        yield Node(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def thread_agent(node, monkeypatch):
    """A factory of in-process agents on `node`; every one started is stopped at the end, and this
    process's shared client for the node's socket closed."""
    started: list[ThreadAgent] = []
    monkeypatch.setenv("PERSEUS_SIM_DIR", node.sim_dir)

    def start(**kwargs) -> ThreadAgent:
        agent = ThreadAgent(node, **kwargs)
        started.append(agent)
        return agent

    yield start
    shared_client(node.socket).close()
    for agent in started:
        agent.stop()

"""A real `perseus agent` process and real client processes: an unprivileged rank (dropped to uid
65534) changes clocks through the agent and fails clearly without it; a SIGKILLed process group,
a stopped process and a killed agent never leave a GPU locked; a second client is refused.

The agent serves simulated GPUs in privilege mode: their state folder is the agent's (root's),
0755, so other users read the settings but only the agent writes them.
"""

from __future__ import annotations

import os
import signal

import pytest
from agent_helpers import PRESET, Child, at_defaults, sleep_forever, wait_for

# Imported before any fork: after the uid drop the child may not read the interpreter's files.
import perseus.devices.agent_gpu  # get_gpus imports it lazily; used below too
from perseus.agent.client import AgentClient
from perseus.agent.protocol import LeaseHeldError
from perseus.controller import FrequencyController
from perseus.devices import Work, emulate, get_gpus
from perseus.devices.sim import SimGPU
from perseus.exceptions import DevicePermissionError
from perseus.measurement import Monitor

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping a rank to another uid needs root")

NOBODY = 65534  # uid and gid of nobody/nogroup
TIMEOUT_S = 2.0


@pytest.fixture
def agent(node):
    """A `perseus agent` process as root; the socket admits group 65534 (the ranks'). A 2 s
    heartbeat timeout: a loaded machine may starve a rank's heartbeat thread for a while."""
    proc = node.process("--group", str(NOBODY), "--heartbeat-timeout", str(TIMEOUT_S)).start()
    yield proc
    proc.stop()


def rank_env(node, agent: bool = True) -> dict[str, str]:
    return {
        "PERSEUS_GPU": f"sim:{PRESET}:2",
        "PERSEUS_SIM_DIR": node.sim_dir,
        "PERSEUS_AGENT": node.socket if agent else "off",
    }


def hold(index: int, mhz: int, limit_mw: int | None = None, fork_worker: bool = False):
    """A rank's body: lock GPU `index` (and its power limit) through the agent, report, then train on
    (sleep) until killed. With `fork_worker`, it first forks a data-loader-like child that outlives it."""

    def body(report) -> None:
        gpu = get_gpus()[index]
        gpu.lock_sm_clock(mhz)
        if limit_mw is not None:
            gpu.set_power_limit_mw(limit_mw)
        worker = os.fork() if fork_worker else None
        if worker == 0:
            sleep_forever()
        report({"pid": os.getpid(), "uid": os.getuid(), "clock": gpu.sm_clock(), "worker": worker})
        sleep_forever()

    return body


def test_an_unprivileged_rank_controls_clocks_through_the_agent(node, agent):
    def body(report) -> None:
        gpu = get_gpus()[0]
        may = gpu.can_change_clocks()
        with FrequencyController(gpu, handle_signals=False) as controller:
            applied = controller.apply_now(990, timeout=30)
            report({"uid": os.getuid(), "may": may, "applied": applied, "clock": gpu.sm_clock()})
            controller.set_uniform(None)
            controller.apply_now(None, timeout=30)

    child = Child(body, uid=NOBODY, env=rank_env(node))
    try:
        report = child.next()
        assert report == {"uid": NOBODY, "may": True, "applied": True, "clock": 990}
        assert child.wait() == 0
    finally:
        child.close()
    wait_for(lambda: at_defaults(node.gpu(0)), "GPU 0 back at defaults")


def test_an_unprivileged_rank_runs_work_on_the_agents_gpus_and_measures_it(node, agent):
    """PERSEUS_GPU and PERSEUS_AGENT only, as the README says: the rank takes the agent's folder
    (not one of its own), its clock is what the agent set, and the work it runs is logged in the
    agent's activity folder, which its Monitor and everyone else's count."""
    own = f"/tmp/perseus-sim-{NOBODY}"
    had_own = os.path.exists(own)
    work = Work(0.2, alpha=0.6)
    view = node.gpu(0)  # another user's view of the same GPU
    began = view.clock.now()
    before_mj = view.energy_mj()
    began_late = view.clock.now()

    def body(report) -> None:
        os.environ.pop("PERSEUS_SIM_DIR", None)
        gpu = get_gpus()[0]
        gpu.lock_sm_clock(810)
        time_s, energy_j = gpu.predict(work)
        with Monitor(gpus=[gpu], cpu_indices=[]) as monitor:
            monitor.begin_window("step")
            emulate(gpu, work)
            measured = monitor.end_window("step")
        report(
            {
                "folder": os.path.dirname(gpu.state_path),
                "clock": gpu.sm_clock(),
                "work_s": time_s,
                "work_j": energy_j,
                "window_s": measured.time_s,
                "window_j": measured.gpu_energy_j[0],
            }
        )

    child = Child(body, uid=NOBODY, env=rank_env(node))
    try:
        got = child.next()
        assert child.wait() == 0
    finally:
        child.close()
    idle_w = view.preset.idle_w
    assert got["folder"] == node.sim_dir and got["clock"] == 810
    assert got["work_s"] == pytest.approx(view.predict(work, 810)[0])  # the work ran at 810 MHz
    assert got["window_s"] >= got["work_s"]
    expected_j = got["work_j"] + idle_w * (got["window_s"] - got["work_s"])
    assert got["window_j"] == pytest.approx(expected_j, rel=1e-3)
    # Seen by root too. The counter is read between two clock readings on each side (a loaded host
    # can pause between them), so the idle energy it holds lies between those intervals' worth.
    ended_early = view.clock.now()
    energy_j = (view.energy_mj() - before_mj) / 1000
    ended = view.clock.now()
    busy_j = got["work_j"] - idle_w * got["work_s"]
    slack = 1e-3 * busy_j
    assert (
        energy_j - idle_w * (ended - began) - slack <= busy_j <= energy_j - idle_w * (ended_early - began_late) + slack
    )
    assert had_own or not os.path.exists(own)  # no simulated GPUs of its own were made
    wait_for(lambda: at_defaults(node.gpu(0)), "GPU 0 back at defaults")


def test_without_the_agent_the_unprivileged_rank_fails_clearly(node, agent):
    def body(report) -> None:
        gpu = get_gpus()[0]
        assert isinstance(gpu, SimGPU) and not isinstance(gpu, perseus.devices.agent_gpu.AgentWrites)
        with FrequencyController(gpu, handle_signals=False) as controller:
            enabled = controller.enabled
        try:
            gpu.lock_sm_clock(990)
            refusal = ""
        except DevicePermissionError as e:
            refusal = str(e)
        report({"may": gpu.can_change_clocks(), "enabled": enabled, "refusal": refusal})

    child = Child(body, uid=NOBODY, env=rank_env(node, agent=False))
    try:
        report = child.next()
    finally:
        child.close()
    assert report["may"] is False and report["enabled"] is False
    assert f"only the owner of {node.sim_dir} (uid 0) may change" in report["refusal"]
    assert "perseus agent (PERSEUS_AGENT=SOCKET)" in report["refusal"]
    assert at_defaults(node.gpu(0))


def test_a_user_outside_the_sockets_group_may_not_connect(node, agent):
    def body(report) -> None:
        try:
            get_gpus()[0].lock_sm_clock(990)
            report({"refused": ""})
        except DevicePermissionError as e:
            report({"refused": str(e)})

    child = Child(body, uid=NOBODY, gid=12345, env=rank_env(node))
    try:
        refused = child.next()["refused"]
    finally:
        child.close()
    assert f"may not connect to the perseus agent at {node.socket} as uid {NOBODY}" in refused
    assert "add this user to that group" in refused


def test_sigkill_of_the_ranks_process_group_resets_its_gpu(node, agent):
    child = Child(hold(1, 990, 250_000, fork_worker=True), uid=NOBODY, env=rank_env(node))
    try:
        report = child.next()
        assert report["clock"] == 990 and node.gpu(1).power_limit_mw() == 250_000
        child.kill_group()  # the rank and its worker, as scancel or a deleted pod does
        wait_for(lambda: at_defaults(node.gpu(1)), "the killed rank's GPU back at defaults")
    finally:
        child.close()
    line = f"GPU 1 ({node.gpu(1).uuid()}) of pid {report['pid']} (uid {NOBODY}"
    log = wait_for(lambda: line in node.log_text() and node.log_text(), "the agent to log the reset")
    assert "exited or was killed" in log and "SM clock unlocked (990 -> 1410 MHz)" in log
    assert "power limit 250 -> 400 W" in log


def test_a_forked_worker_does_not_keep_a_killed_ranks_lease(node, agent):
    """Only the rank dies; the worker it forked lives on (it closed its copy of the connection at fork)."""
    child = Child(hold(0, 705, fork_worker=True), uid=NOBODY, env=rank_env(node))
    try:
        report = child.next()
        os.kill(report["pid"], signal.SIGKILL)
        wait_for(lambda: at_defaults(node.gpu(0)), "the GPU reset while the rank's worker still runs")
        os.kill(report["worker"], 0)  # still alive
    finally:
        child.close()


def test_a_second_client_is_refused_naming_the_holders_pid(node, agent):
    holder = Child(hold(0, 1005), uid=NOBODY, env=rank_env(node))

    def second(report) -> None:
        try:
            get_gpus()[0].lock_sm_clock(210)
            report({"holder_pid": None, "message": "not refused"})
        except LeaseHeldError as e:
            report({"holder_pid": e.holder_pid, "message": str(e)})

    try:
        holder_pid = holder.next()["pid"]
        other = Child(second, uid=NOBODY, env=rank_env(node))
        try:
            refused = other.next()
        finally:
            other.close()
        assert refused["holder_pid"] == holder_pid
        assert f"GPU 0 ({node.gpu(0).uuid()}) is leased to pid {holder_pid} (uid {NOBODY}" in refused["message"]
        assert node.gpu(0).sm_clock() == 1005
    finally:
        holder.close()
    wait_for(lambda: at_defaults(node.gpu(0)), "GPU 0 back at defaults")


def test_a_stopped_rank_loses_its_lease_and_takes_it_back_when_continued(node, agent):
    """SIGSTOP: its heartbeats stop, the agent resets the GPU; SIGCONT: its client reconnects and
    re-applies the clock."""
    child = Child(hold(0, 810), uid=NOBODY, env=rank_env(node))
    try:
        pid = child.next()["pid"]
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: at_defaults(node.gpu(0)), "the stopped rank's GPU reset")
        wait_for(lambda: "heartbeats stopped" in node.log_text(), "the agent to log the lost heartbeats")
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: node.gpu(0).sm_clock() == 810, "the continued rank to re-apply its clock")
    finally:
        child.close()
    wait_for(lambda: at_defaults(node.gpu(0)), "GPU 0 back at defaults")


def test_an_agent_killed_and_restarted_resets_stale_locks(node, agent):
    child = Child(hold(1, 510, 200_000), uid=NOBODY, env=rank_env(node))
    try:
        pid = child.next()["pid"]
        agent.kill()  # the agent crashes ...
        child.kill_group()  # ... and the rank dies while no agent runs: nobody resets the GPU
        child.wait()
        assert node.gpu(1).sm_clock() == 510 and node.gpu(1).power_limit_mw() == 200_000
        restarted = node.process("--group", str(NOBODY), "--heartbeat-timeout", str(TIMEOUT_S)).start()
        try:
            assert at_defaults(node.gpu(1))  # reset before it serves
        finally:
            restarted.stop()
    finally:
        child.close()
    assert f"GPU 1 ({node.gpu(1).uuid()}) of pid {pid} (uid {NOBODY}" in node.log_text()
    assert "the previous agent stopped while it was leased" in node.log_text()


def test_a_live_rank_gets_its_settings_back_from_a_restarted_agent(node, agent):
    child = Child(hold(0, 615, 300_000), uid=NOBODY, env=rank_env(node))
    try:
        pid = child.next()["pid"]
        agent.kill()
        restarted = node.process("--group", str(NOBODY), "--heartbeat-timeout", str(TIMEOUT_S)).start()
        watcher = AgentClient(node.socket)
        try:

            def restored() -> bool:
                state = watcher.status().gpus[0]
                held = state.holder is not None and state.holder.pid == pid
                return held and state.sm_clock_mhz == 615 and state.power_limit_mw == 300_000

            wait_for(restored, "the rank to take its lease back and re-apply its clock and power limit")
            child.kill_group()
            wait_for(lambda: at_defaults(node.gpu(0)), "GPU 0 reset after the rank's kill")
        finally:
            watcher.close()
            restarted.stop()
    finally:
        child.close()

"""PerseusRank's framework-neutral hooks against a real `perseus serve` process on loopback.

Two ranks of a 2-stage 1F1B pipeline run as threads of this process (a plain training loop,
no torch), each on its own simulated A100 whose work sleeps for real: warm-up, a short online
sweep, the service plans, both ranks apply the plan, then keep it when the service dies.
Several seconds each: `perseus serve` takes seconds to start (it imports the solver stack).

Nothing here may depend on how fast the machine is: loops wait for conditions with a generous
deadline (DEADLINE_S), and a wait the code must not make is told apart from a slow machine by
giving the client a long timeout (CLIENT_TIMEOUT_S), which such a wait would take whole.
"""

from __future__ import annotations

import select
import socket
import subprocess
import sys
import threading
import time

import pytest

from perseus.client import PlannerClient
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.runtime import PerseusRank, ProfilingSettings
from perseus.schedules import build_schedule

MICROBATCHES = 4
SWEEP = (1410, 1200, 1005, 810)
# Waits end as soon as what they wait for happens; this only bounds a broken run.
DEADLINE_S = 120.0
# A rank's client timeout where a test checks that a step never waits on the service: a step
# that did would wait this long, far beyond any scheduling stall (STALL_S) of a loaded machine.
CLIENT_TIMEOUT_S = 2.0
STALL_S = 1.0
# Stage 1 does more work, so stage 0 has slack the plan can slow down into.
WORKS = {
    0: {"forward": Work(0.002), "backward": Work(0.004)},
    1: {"forward": Work(0.003), "backward": Work(0.006)},
}


def serve(state_dir, bind: str = "tcp://127.0.0.1:0") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "perseus.cli.main", "serve", "--bind", bind, "--state-dir", str(state_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline() if ready else ""
    assert "listening on" in line, line
    return proc, line.split()[-1]


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


@pytest.fixture
def service(tmp_path):
    proc, endpoint = serve(tmp_path / "state")
    yield proc, endpoint
    proc.terminate()
    proc.wait(10)


def train(rank: PerseusRank, gpu: SimGPU, until, log: list) -> None:
    """Run iterations until `until(rank)` (or DEADLINE_S passed); log (phase, clocks, seconds
    on_step_begin took, the plan version it ran)."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        rank.on_step_begin()
        began = time.monotonic() - t0
        clocks = []
        for ins in rank.order:
            rank.on_instruction_begin(ins.kind.value, ins.microbatch)
            clocks.append(gpu.sm_clock())
            gpu.execute(WORKS[rank.stage][ins.kind.value])
            rank.on_instruction_end(ins.kind.value, ins.microbatch)
        rank.on_step_end()
        log.append((rank.phase, clocks, began, rank.plan_version))
        if until(rank):
            return


def run_ranks(ranks, gpus, until, logs) -> None:
    threads = [threading.Thread(target=train, args=(r, g, until, log)) for r, g, log in zip(ranks, gpus, logs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S + 30)
        assert not t.is_alive(), "a rank never finished"


@pytest.mark.slow
def test_two_ranks_profile_get_planned_and_keep_the_plan_when_the_service_dies(service):
    proc, endpoint = service
    schedule = build_schedule("1f1b", 2, MICROBATCHES)
    gpus = [SimGPU("a100-sxm", i) for i in range(2)]
    clients = [PlannerClient(endpoint, timeout_s=CLIENT_TIMEOUT_S, poll_interval_s=0.05) for _ in range(2)]
    ranks = [
        PerseusRank(
            gpus[s],
            schedule,
            s,
            client=clients[s],
            close_client=True,
            progress=False,
            profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=1, frequencies=SWEEP),
            wait_for_clock=True,
            handle_signals=False,
            watchdog=False,
            startup_wait_s=DEADLINE_S,
            # The two threads exchange nothing, so their timelines are no pipeline's for the service
            # to calibrate on: the overheads are stated instead (perseus.service.calibration).
            instruction_overhead_s=0.0001,
        )
        for s in range(2)
    ]
    logs: list[list] = [[], []]
    run_ranks(ranks, gpus, lambda r: sum(phase == "planned" for phase, *_ in logs[r.stage]) >= 2, logs)
    with PlannerClient(endpoint, timeout_s=DEADLINE_S) as client:
        status = client.status()
    proc.terminate()  # the service goes away mid-run...
    proc.wait(10)
    after: list[list] = [[], []]
    run_ranks(ranks, gpus, lambda r: len(after[r.stage]) >= 5, after)
    for r in ranks:
        r.close()

    assert status is not None
    for s, rank in enumerate(ranks):
        phases = [phase for phase, *_ in logs[s]]
        assert phases[0] == "warmup" and phases[1:5] == ["profiling"] * 4 and phases[-1] == "planned"
        assert [clocks[0] for _, clocks, *_ in logs[s][1:5]] == list(SWEEP)
        assert rank.sweep.profiled_frequencies == list(SWEEP)
        assert rank.plan_version >= 1 and not rank.controller.fallen_back
        plan = logs[s][-1][1]
        assert all(c in gpus[s].supported_frequencies() for c in plan)
        # ...and each rank keeps its plan, never waiting on the dead service (a step that did
        # would take the client's whole timeout).
        # Verification may have published, before the kill, a plan that starts a few iterations
        # ahead: switched to once, and kept. (The clocks themselves may differ between iterations
        # of one plan: a change to a higher clock is issued early by the previous iteration's
        # timing, see perseus.controller.)
        versions = [version for *_, version in after[s]]
        assert sum(a != b for a, b in zip(versions, versions[1:])) <= 1, versions
        assert versions[0] >= logs[s][-1][3]
        runs = [clocks for _, clocks, *_ in after[s]]
        assert all(c in gpus[s].supported_frequencies() for clocks in runs for c in clocks)
        assert max(began for _, _, began, _ in after[s]) < STALL_S < CLIENT_TIMEOUT_S
        assert gpus[s].sm_clock() == gpus[s].max_frequency()  # reset on close
    # The lighter stage 0 has slack: the plan slows some of its instructions down.
    assert min(logs[0][-1][1]) < 1410


def rank_without_planner(gpu: SimGPU, startup_wait_s: float) -> tuple[PerseusRank, int]:
    """A one-stage rank whose planner address has no service behind it (yet), and that port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = PlannerClient(f"tcp://127.0.0.1:{port}", timeout_s=CLIENT_TIMEOUT_S, poll_interval_s=0.05)
    rank = PerseusRank(
        gpu,
        build_schedule("1f1b", 1, 2),
        0,
        client=client,
        close_client=True,
        progress=False,
        handle_signals=False,
        watchdog=False,
        startup_wait_s=startup_wait_s,
    )
    return rank, port


def test_planner_down_at_start_then_up(tmp_path, caplog):
    """Unreachable planner: default clocks, no step waits on the network, one warning; once
    the service starts, the rank registers and enters the warm-up/profiling phases."""
    gpu = SimGPU("a100-sxm", 0)
    startup_wait_s = 1.0
    rank, port = rank_without_planner(gpu, startup_wait_s)
    first = longest = 0.0
    proc = None
    deadline = time.monotonic() + DEADLINE_S
    try:
        it = 0
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            rank.on_step_begin()
            took = time.monotonic() - t0
            if it == 0:
                first = took  # the one bounded wait for the planner, at start-up
            else:
                longest = max(longest, took)
            for ins in rank.order:
                rank.on_instruction_begin(ins.kind.value, ins.microbatch)
                rank.on_instruction_end(ins.kind.value, ins.microbatch)
            rank.on_step_end()
            if it < 20:
                assert rank.phase == "unplanned" and gpu.sm_clock() == gpu.max_frequency()
                time.sleep(0.02)  # a step's length, not a wait for anything
            elif proc is None:
                proc, _ = serve(tmp_path / "state", f"tcp://127.0.0.1:{port}")
            elif rank.phase in ("warmup", "profiling"):
                break
            else:
                time.sleep(0.01)
            it += 1
        assert rank.phase in ("warmup", "profiling")
        assert rank.job_iteration < rank.iteration  # the planner counts from when it first answered
        # The first step waits startup_wait_s (a deadline: never less), not the client's timeout
        # on top; later steps never wait on the network (one that did would take the whole
        # client timeout, beyond any scheduling stall).
        assert 0.9 * startup_wait_s < first < startup_wait_s + STALL_S <= CLIENT_TIMEOUT_S
        assert longest < STALL_S, f"a step waited {longest:.3f} s on the planner"
    finally:
        rank.close()
        if proc is not None:
            proc.terminate()
            proc.wait(10)


def test_a_planner_that_never_answers_is_said_again_at_close(caplog):
    """The start-up warning scrolls away in a long run: close() says no plan was made, and why."""
    rank, _ = rank_without_planner(SimGPU("a100-sxm", 0), startup_wait_s=0.1)
    try:
        for _ in range(3):
            rank.on_step_begin()
            for ins in rank.order:
                rank.on_instruction_begin(ins.kind.value, ins.microbatch)
                rank.on_instruction_end(ins.kind.value, ins.microbatch)
            rank.on_step_end()
    finally:
        rank.close()
    assert "planner service never answered, or failed the job: all 3 iterations ran at default clocks" in caplog.text
    assert "start `perseus serve` before the job, or check $PERSEUS_PLANNER" in caplog.text

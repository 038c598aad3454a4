"""PerseusRank's framework-neutral hooks against a real `perseus serve` process on loopback.

Two ranks of a 2-stage 1F1B pipeline run as threads of this process (a plain training loop,
no torch), each on its own simulated A100 whose work sleeps for real: warm-up, a short online
sweep, the service plans, both ranks apply the plan. About 3-5 s (service start-up, planning).
"""

from __future__ import annotations

import select
import subprocess
import sys
import threading

import pytest

from perseus.devices.sim import SimGPU, Work
from perseus.runtime import PerseusRank, ProfilingSettings
from perseus.schedules import build_schedule
from perseus.server import PlannerClient

MICROBATCHES = 4
SWEEP = (1410, 1200, 1005, 810)
# Stage 1 does more work, so stage 0 has slack the plan can slow down into.
WORKS = {
    0: {"forward": Work(0.002), "backward": Work(0.004)},
    1: {"forward": Work(0.003), "backward": Work(0.006)},
}


@pytest.fixture
def service(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "perseus.cli.main", "serve", "--bind", "tcp://127.0.0.1:0",
         "--state-dir", str(tmp_path / "state")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 30.0)
    line = proc.stdout.readline() if ready else ""
    assert "listening on" in line, line
    yield line.split()[-1]
    proc.terminate()
    proc.wait(10)


def train(rank: PerseusRank, gpu: SimGPU, iterations: int, planned_clocks: list) -> None:
    for _ in range(iterations):
        rank.on_step_begin()
        clocks = []
        for ins in rank.order:
            rank.on_instruction_begin(ins.kind.value, ins.microbatch)
            clocks.append(gpu.sm_clock())
            gpu.execute(WORKS[rank.stage][ins.kind.value])
            rank.on_instruction_end(ins.kind.value, ins.microbatch)
        rank.on_step_end()
        if rank.phase == "planned":
            planned_clocks.append(clocks)
        if len(planned_clocks) >= 2:
            return


def test_two_ranks_profile_get_planned_and_apply_the_plan(service):
    schedule = build_schedule("1f1b", 2, MICROBATCHES)
    gpus = [SimGPU("a100-sxm", i) for i in range(2)]
    clients = [PlannerClient(service, timeout_s=1.0, poll_interval_s=0.05) for _ in range(2)]
    ranks = [
        PerseusRank(
            gpus[s], schedule, s, client=clients[s], close_client=True, progress=False,
            profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=1, frequencies=SWEEP),
            wait_for_clock=True, handle_signals=False, watchdog=False,
        )
        for s in range(2)
    ]
    planned: list[list] = [[], []]
    threads = [threading.Thread(target=train, args=(ranks[s], gpus[s], 300, planned[s])) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    status = clients[0].status()
    for r in ranks:
        r.close()

    assert all(len(p) == 2 for p in planned), "the plan never arrived"
    for s, rank in enumerate(ranks):
        assert rank.sweep.profiled_frequencies == list(SWEEP)
        assert rank.plan_version >= 1 and not rank.controller.fallen_back
        assert all(c in SWEEP or c in gpus[s].supported_frequencies() for c in planned[s][-1])
        assert gpus[s].sm_clock() == gpus[s].max_frequency()  # reset on close
    # The lighter stage 0 gets slowed down somewhere; the critical stage 1 keeps fast clocks.
    assert min(planned[0][-1]) < 1410
    assert status is not None

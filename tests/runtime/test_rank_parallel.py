"""Data- and tensor-parallel ranks (PerseusRank, plain hooks) against a real `perseus serve`.

Ranks are threads of this process, each on its own simulated A100 whose work sleeps for real.
Each instruction first waits for its pipeline peer (a forward for the previous stage's forward
of its microbatch, a backward for the next stage's backward), as activations and gradients
would; a barrier after each rank's last instruction stands for the gradient all-reduce, so
every rank waits for the slowest pipeline before its iteration ends. One service for the module (it
imports the solver stack once); about 10 s in all, most of it the first plan's solver import
and the plans' start leads (1 s of iterations each).

Wall-clock measurements here include host work (hooks, clock changes, thread wake-ups), which a
loaded machine stretches: checks compare pipelines where such delays hit both alike, and
energies net of the idle power over the iteration's time (the GPU work's own energy, which only
its clocks decide), never one measured time against a tight bound.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from pathlib import Path

import pytest
from test_rank_service import WORKS, serve

from perseus.client import PlannerClient
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.runtime import PerseusRank, ProfilingSettings
from perseus.schedules import build_schedule

SWEEP = (1410, 1200, 1005, 810)
SCHEDULE = build_schedule("1f1b", 2, 4)
IDLE_W = PRESETS["a100-sxm"].idle_w
# For the throttled pipeline: 4x the work, so that host work in compute_time_s (hooks, clock
# changes, thread wake-ups: milliseconds per iteration, tens on a loaded machine) stays small
# beside the 20% throttle the service must tell from it -- or its factor sinks towards its
# thresholds (5% to detect, 2.5% to recover) and the plans flap.
LONG_WORKS = {
    stage: {kind: dataclasses.replace(work, time_s=4 * work.time_s) for kind, work in kinds.items()}
    for stage, kinds in WORKS.items()
}
# Waits end as soon as what they wait for happens; this only bounds a broken run.
DEADLINE_S = 240.0


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    proc, endpoint = serve(state)
    yield endpoint, state
    proc.terminate()
    proc.wait(10)


class Cluster:
    """`len(coords)` ranks, (stage, dp_index, tp_index) each, in lockstep through an all-reduce."""

    def __init__(self, endpoint: str, coords: list[tuple[int, int, int]], tag: str, works=WORKS, **job) -> None:
        self.works = works
        self.gpus = [SimGPU("a100-sxm", r) for r in range(len(coords))]
        self.clients = [PlannerClient(endpoint, timeout_s=0.5, poll_interval_s=0.05) for _ in coords]
        self.ranks = [
            PerseusRank(
                self.gpus[r],
                SCHEDULE,
                stage,
                rank=r,
                dp_index=dp_index,
                tp_index=tp_index,
                tag=tag,
                client=self.clients[r],
                close_client=True,
                progress=False,
                wait_for_clock=True,
                handle_signals=False,
                watchdog=False,
                startup_wait_s=DEADLINE_S,
                profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=1, frequencies=SWEEP),
                # Stated overheads, not the service's calibration: tensor-parallel ranks here meet
                # only at the all-reduce, not in every instruction as real ones do, so the stage
                # timeline one of them sends misses the slower one's (perseus.service.calibration).
                instruction_overhead_s=0.0001,
                **job,
            )
            for r, (stage, dp_index, tp_index) in enumerate(coords)
        ]
        self.logs: list[list[tuple]] = [[] for _ in coords]  # (record, clocks) per iteration
        self.done = False
        self._sent: dict[tuple, threading.Event] = {}  # (pipeline, tp_index, iteration, stage, kind, microbatch)
        self._lock = threading.Lock()

    def _event(self, key: tuple) -> threading.Event:
        with self._lock:
            return self._sent.setdefault(key, threading.Event())

    def _receive(self, rank: PerseusRank, kind: str, microbatch: int) -> None:
        """Wait for the peer's activation (forward) or gradient (backward) of `microbatch`."""
        peer = rank.stage - 1 if kind == "forward" else rank.stage + 1
        if 0 <= peer < SCHEDULE.num_stages:
            self._event((rank.dp_index, rank.tp_index, rank.iteration, peer, kind, microbatch)).wait(30)

    def run(self, until, then=None):
        """Iterate until `until()` holds at an all-reduce (checked once, by one thread, for all);
        returns what `then()` returns, called there while every rank waits."""
        deadline = time.monotonic() + DEADLINE_S
        seen = []

        def decide() -> None:
            self.done = until() or time.monotonic() > deadline
            if self.done and then is not None:
                seen.append(then())

        barrier = threading.Barrier(len(self.ranks), action=decide)

        def train(r: int) -> None:
            rank, gpu = self.ranks[r], self.gpus[r]
            while True:
                rank.on_step_begin()
                clocks = []
                for ins in rank.order:
                    kind = ins.kind.value
                    self._receive(rank, kind, ins.microbatch)
                    rank.on_instruction_begin(kind, ins.microbatch)
                    clocks.append(gpu.sm_clock())
                    gpu.execute(self.works[rank.stage][kind])
                    rank.on_instruction_end(kind, ins.microbatch)
                    self._event((rank.dp_index, rank.tp_index, rank.iteration, rank.stage, kind, ins.microbatch)).set()
                barrier.wait(30)  # the gradient all-reduce: every pipeline waits for the slowest
                rank.on_step_end()
                self.logs[r].append((rank.last_iteration, clocks))
                if self.done:
                    return

        threads = [threading.Thread(target=train, args=(r,)) for r in range(len(self.ranks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S + 60)
        for rank in self.ranks:
            rank.close()
        assert not any(t.is_alive() for t in threads), "a rank never finished"
        assert until(), f"the planner never got there in {DEADLINE_S:.0f} s"
        return seen[0] if seen else None

    def history(self, r: int) -> list[tuple[int, str, int]]:
        """(plan version, phase, iterations) of each run of rank `r`'s iterations, for a failure's message."""
        runs: list[tuple[int, str, int]] = []
        for rec, _ in self.logs[r]:
            key = (rec.plan_version, rec.phase.value)
            if runs and runs[-1][:2] == key:
                runs[-1] = (*key, runs[-1][2] + 1)
            else:
                runs.append((*key, 1))
        return runs

    def planned(self, r: int, version: int) -> list[tuple]:
        return [(rec, clocks) for rec, clocks in self.logs[r] if rec.phase == "planned" and rec.plan_version == version]


@pytest.mark.slow
def test_a_throttled_pipeline_is_seen_by_compute_time_and_the_other_is_replanned_to_its_pace(service):
    endpoint, state = service
    # Torch order, dp=2 x pp=2: rank = stage + 2 * dp_index. Pipeline 1 (ranks 2, 3) is 20% slower.
    cluster = Cluster(
        endpoint,
        [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)],
        "straggler",
        works=LONG_WORKS,
        dp=2,
        rank_mapping="torch",
        # Verification's own tests are elsewhere: here a plan that host load slows by up to 50%
        # is not re-planned with a margin, so the versions are the intrinsic and straggler plans.
        tolerance=0.5,
    )
    for gpu in cluster.gpus[2:]:
        gpu.set_slowdown(1.2)
    fast = cluster.ranks[:2]
    job_id = cluster.ranks[0].job_spec().job_id()

    def service_view():
        """The service's status and record of the job, taken while the ranks wait."""
        status = client.status(job_id)
        return status.jobs[0], json.loads((Path(state) / "jobs" / job_id / "job.json").read_text())

    with PlannerClient(endpoint, timeout_s=DEADLINE_S) as client:
        status, record = cluster.run(
            lambda: all(r.plan_version >= 2 for r in fast) and len(cluster.planned(0, fast[0].plan_version)) >= 3,
            service_view,
        )

    slow, quick = status.pipelines[1], status.pipelines[0]
    # Detected: more than the detector's 5% over the others. Host work in compute_time_s (more of
    # it on a loaded machine) pulls the measured factor from the true 1.2 towards 1, not above.
    assert slow.straggler == "detected" and quick.straggler == "" and slow.straggler_factor < 1.4
    assert slow.deadline_s is None and quick.deadline_s is not None
    plans = record["plans"]
    base = plans["1"]  # the straggler keeps the no-slowdown plan
    # The other pipeline's deadline: the straggler's pace, slower than its no-slowdown plan.
    assert plans["0"]["deadline_s"] == pytest.approx(quick.deadline_s) and quick.deadline_s > base["iteration_time_s"]
    assert plans["0"]["energy_j"] < base["energy_j"] and plans["0"]["iteration_time_s"] > base["iteration_time_s"]
    # Under plan v1, through the all-reduce, both pipelines take the straggler's time; only
    # compute_time_s tells them apart.
    version = fast[0].plan_version
    v1 = [i for i, (rec, _) in enumerate(cluster.logs[0]) if rec.phase == "planned" and rec.plan_version == 1][1:]
    times = [statistics.median(cluster.logs[r][i][0].time_s for i in v1) for r in range(4)]
    computes = [statistics.median(cluster.logs[r][i][0].compute_time_s for i in v1) for r in range(4)]
    time_gap = max(times[2:]) / max(times[:2]) - 1
    compute_gap = max(computes[2:]) / max(computes[:2]) - 1
    assert len(v1) >= 5
    assert compute_gap > 0.05, computes  # the straggler shows in compute_time_s...
    assert abs(time_gap) < compute_gap / 2, (times, computes)  # ...far less in time_s
    # Pipeline 0's ranks run the re-plan together: other clocks, less energy than under plan v1.
    # Its iteration time is the straggler's under both plans (on a loaded machine, also host
    # delays), so compare the energy beyond idle power over the iteration: the GPU work's own.
    # The claim is energy, not the clocks' sum: a plan may raise some clocks to lower others.
    assert fast[1].plan_version == version and cluster.ranks[2].plan_version == cluster.ranks[3].plan_version < version
    for r in (0, 1):
        before, after = cluster.planned(r, 1), cluster.planned(r, version)
        assert before and after and before[-1][1] != after[-1][1]
        work_j = [statistics.median(rec.energy_j - IDLE_W * rec.time_s for rec, _ in runs) for runs in (before, after)]
        assert 0 < work_j[1] < work_j[0], (work_j, cluster.history(r), record["plans"]["0"], status.pipelines[0])
    assert all(g.sm_clock() == g.max_frequency() for g in cluster.gpus)
    for gpu in cluster.gpus:
        gpu.reset_slowdown()


def test_tensor_parallel_ranks_of_a_stage_upload_their_shares_and_share_one_plan(service):
    endpoint, state = service
    # Megatron order, tp=2 x pp=2: rank = tp_index + 2 * stage.
    cluster = Cluster(
        endpoint, [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)], "tensor-parallel", tp=2, rank_mapping="megatron"
    )
    cluster.run(lambda: all(len(cluster.planned(r, 1)) >= 2 for r in range(4)))
    job_id = cluster.ranks[0].job_spec().job_id()
    folder = Path(state) / "jobs" / job_id
    assert {p.name for p in folder.glob("stage-*.json")} == {
        "stage-0.json",
        "stage-0-tp1.json",
        "stage-1.json",
        "stage-1-tp1.json",
    }
    for stage in (0, 1):
        a, b = cluster.planned(2 * stage, 1), cluster.planned(2 * stage + 1, 1)
        assert a[-1][1] == b[-1][1]  # one plan per stage, whichever tensor-parallel rank runs it
    assert min(cluster.planned(0, 1)[-1][1]) < 1410  # the lighter stage 0 is slowed into its slack

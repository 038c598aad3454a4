"""Data- and tensor-parallel ranks (PerseusRank, plain hooks) against a real `perseus serve`.

Ranks are threads of this process, each on its own simulated A100 whose work sleeps for real.
Each instruction first waits for its pipeline peer (a forward for the previous stage's forward
of its microbatch, a backward for the next stage's backward), as activations and gradients
would; a barrier after each rank's last instruction stands for the gradient all-reduce, so
every rank waits for the slowest pipeline before its iteration ends. One service for the module (it
imports the solver stack once); about 8 s in all, most of it the first plan's solver import
and the plans' start leads (1 s of iterations each).
"""

from __future__ import annotations

import json
import statistics
import threading
from pathlib import Path

import pytest
from test_rank_service import WORKS, serve

from perseus.devices.sim import SimGPU
from perseus.runtime import PerseusRank, ProfilingSettings
from perseus.schedules import build_schedule
from perseus.server import PlannerClient

SWEEP = (1410, 1200, 1005, 810)
SCHEDULE = build_schedule("1f1b", 2, 4)


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

    def __init__(self, endpoint: str, coords: list[tuple[int, int, int]], tag: str, **job) -> None:
        self.gpus = [SimGPU("a100-sxm", r) for r in range(len(coords))]
        self.clients = [PlannerClient(endpoint, timeout_s=0.5, poll_interval_s=0.05) for _ in coords]
        self.ranks = [
            PerseusRank(
                self.gpus[r], SCHEDULE, stage, rank=r, dp_index=dp_index, tp_index=tp_index, tag=tag, client=self.clients[r],
                close_client=True, progress=False, wait_for_clock=True, handle_signals=False, watchdog=False,
                profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=1, frequencies=SWEEP), **job,
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

    def run(self, until, limit: int = 600) -> None:
        """Iterate until `until()` holds at an all-reduce (checked once, by one thread, for all)."""

        def decide() -> None:
            self.done = until() or len(self.logs[0]) >= limit

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
                    gpu.execute(WORKS[rank.stage][kind])
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
            t.join(120)
        for rank in self.ranks:
            rank.close()
        assert len(self.logs[0]) < limit, "the planner never got there"

    def planned(self, r: int, version: int) -> list[tuple]:
        return [(rec, clocks) for rec, clocks in self.logs[r] if rec.phase == "planned" and rec.plan_version == version]


def test_a_throttled_pipeline_is_seen_by_compute_time_and_the_other_is_replanned_to_its_pace(service):
    endpoint, state = service
    # Torch order, dp=2 x pp=2: rank = stage + 2 * dp_index. Pipeline 1 (ranks 2, 3) is 20% slower.
    cluster = Cluster(endpoint, [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)], "straggler", dp=2, rank_mapping="torch")
    for gpu in cluster.gpus[2:]:
        gpu.set_slowdown(1.2)
    fast = cluster.ranks[:2]
    cluster.run(lambda: all(r.plan_version >= 2 for r in fast) and len(cluster.planned(0, fast[0].plan_version)) >= 3)
    job_id = cluster.ranks[0].job_spec().job_id()
    with PlannerClient(endpoint) as client:
        status = client.status(job_id).jobs[0]
    record = json.loads((Path(state) / "jobs" / job_id / "job.json").read_text())

    slow, quick = status.pipelines[1], status.pipelines[0]
    assert slow.straggler == "detected" and 1.1 < slow.straggler_factor < 1.3
    assert slow.deadline_s is None and quick.deadline_s is not None
    plans = record["plans"]
    base = plans["1"]  # the straggler keeps the no-slowdown plan
    assert plans["0"]["deadline_s"] == pytest.approx(quick.deadline_s) and quick.deadline_s > 1.1 * base["iteration_time_s"]
    assert plans["0"]["energy_j"] < base["energy_j"] and plans["0"]["iteration_time_s"] > base["iteration_time_s"]
    # Under plan v1, through the all-reduce, both pipelines take the straggler's time; only
    # compute_time_s tells them apart.
    version = fast[0].plan_version
    v1 = [i for i, (rec, _) in enumerate(cluster.logs[0]) if rec.phase == "planned" and rec.plan_version == 1][1:]
    times = [statistics.median(cluster.logs[r][i][0].time_s for i in v1) for r in range(4)]
    computes = [statistics.median(cluster.logs[r][i][0].compute_time_s for i in v1) for r in range(4)]
    assert len(v1) >= 5 and max(times) / min(times) < 1.05
    assert max(computes[2:]) / max(computes[:2]) == pytest.approx(1.2, abs=0.08)
    # Pipeline 0's ranks run the re-plan together: slower clocks, less energy than under plan v1.
    assert fast[1].plan_version == version and cluster.ranks[2].plan_version == cluster.ranks[3].plan_version < version
    for r in (0, 1):
        before, after = cluster.planned(r, 1), cluster.planned(r, version)
        assert before and after and before[-1][1] != after[-1][1]
        assert sum(after[-1][1]) <= sum(before[-1][1])
        assert statistics.median(rec.energy_j for rec, _ in after) < statistics.median(rec.energy_j for rec, _ in before)
    assert all(g.sm_clock() == g.max_frequency() for g in cluster.gpus)
    for gpu in cluster.gpus:
        gpu.reset_slowdown()


def test_tensor_parallel_ranks_of_a_stage_upload_their_shares_and_share_one_plan(service):
    endpoint, state = service
    # Megatron order, tp=2 x pp=2: rank = tp_index + 2 * stage.
    cluster = Cluster(endpoint, [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)], "tensor-parallel", tp=2, rank_mapping="megatron")
    cluster.run(lambda: all(len(cluster.planned(r, 1)) >= 2 for r in range(4)))
    job_id = cluster.ranks[0].job_spec().job_id()
    folder = Path(state) / "jobs" / job_id
    assert {p.name for p in folder.glob("stage-*.json")} == {"stage-0.json", "stage-0-tp1.json", "stage-1.json", "stage-1-tp1.json"}
    for stage in (0, 1):
        a, b = cluster.planned(2 * stage, 1), cluster.planned(2 * stage + 1, 1)
        assert a[-1][1] == b[-1][1]  # one plan per stage, whichever tensor-parallel rank runs it
    assert min(cluster.planned(0, 1)[-1][1]) < 1410  # the lighter stage 0 is slowed into its slack

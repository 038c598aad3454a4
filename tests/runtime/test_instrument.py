"""perseus.instrument on a real PipelineStage: one process, world size 1, gloo, a tiny model.

The fake planner below stands in for PlannerClient's Python interface only (warm-up, a
two-clock sweep, then a plan); the real client and service are tested in tests/server and
the torchrun end-to-end tests. A few seconds in all (torch import and process-group set-up).
"""

from __future__ import annotations

import os
import socket

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import (
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

import perseus
from perseus.client.planner_client import Assignment
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.profiler.profile import KINDS
from perseus.profiler.sweep import SweepPlan
from perseus.runtime import ProfilingSettings
from perseus.runtime.torch_stage import check_torch_version
from perseus.schedules import build_schedule
from perseus.service.sweep import design_steps
from perseus.wire.phases import Phase
from perseus.wire.security import CurveClient, create_keys

MICROBATCHES = 4


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    return SimGPU("a100-sxm", 0)


def make_stage() -> PipelineStage:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return PipelineStage(model, 0, 1, torch.device("cpu"))


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def batch():
    return torch.randn(MICROBATCHES * 2, 8), torch.randn(MICROBATCHES * 2, 4)


#: The service's sweep of 1410 and 1005 MHz, one step each (every instruction at that clock).
SWEEP = SweepPlan((1410, 1005), 1, tuple(dict(zip(KINDS, step)) for step in design_steps((1410, 1005), 1)))


class FakePlanner:
    """The PlannerClient interface: iteration 0 warm-up, then the sweep until the profile is in, then a plan."""

    def __init__(self, plan: list[int]) -> None:
        self.plan = plan
        self.calls: list[str] = []
        self.profiles = {}
        self.reports = []
        self.off_clock = []
        self.closed = []

    def register_job(self, spec):
        self.spec = spec
        self.calls.append("register_job")
        return "job-test"

    def register_rank(self, job_id, info):
        self.info = info
        self.calls.append("register_rank")

    def assignment(self, iteration):
        if iteration < 1:
            return Assignment(Phase.WARMUP, None, None, 0)
        if not self.profiles:
            return Assignment(Phase.PROFILING, None, SWEEP, 0)
        return Assignment(Phase.PLANNED, self.plan, None, 1)

    def upload_profile(self, job_id, stage, profile):
        self.profiles[stage] = profile

    def report_iteration(
        self, job_id, rank, iteration, time_s, energy_j, compute_time_s=None, off_clock=None, closing=False
    ):
        if closing:
            self.closed.append(iteration)
            return
        self.reports.append((iteration, time_s, energy_j, compute_time_s))
        self.off_clock.append(off_clock)


class StaticPlanner(FakePlanner):
    """Planned from the first iteration."""

    def __init__(self) -> None:
        super().__init__([])

    def assignment(self, iteration):
        return Assignment(Phase.PLANNED, self.plan, None, 1)


def record_instructions(stage) -> list[tuple[str, int, int]]:
    seen = []
    rank = stage.perseus
    original = rank.on_instruction_begin

    def spy(kind, microbatch, chunk=0):
        seen.append((str(kind), microbatch, chunk))
        original(kind, microbatch, chunk)

    rank.on_instruction_begin = spy
    return seen


@pytest.mark.parametrize("schedule_cls, name", [(ScheduleGPipe, "gpipe"), (Schedule1F1B, "1f1b")])
def test_instrumented_stage_reports_the_schedules_instructions(gpu, schedule_cls, name):
    stage = make_stage()
    schedule = schedule_cls(stage, MICROBATCHES, loss_fn=loss_fn)
    assert (
        perseus.instrument(
            stage, schedule=schedule, client=False, gpu=gpu, watchdog=False, handle_signals=False, progress=False
        )
        is stage
    )
    seen = record_instructions(stage)
    x, y = batch()
    for _ in range(2):
        schedule.step(x, target=y)
    stage.perseus.close()
    expected = [(i.kind.value, i.microbatch, i.chunk) for i in build_schedule(name, 1, MICROBATCHES).stages[0]]
    assert seen == expected * 2
    assert stage.perseus.iteration == 1
    assert stage.perseus.last_iteration.time_s > 0


@pytest.mark.parametrize(
    "schedule_cls", [ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleLoopedBFS]
)
def test_multi_chunk_schedules_match_their_pipeline_order(gpu, schedule_cls):
    """Two model chunks on this rank; forward, full backward, I and W all seen in torch's order."""
    torch.manual_seed(0)
    stages = [PipelineStage(torch.nn.Linear(8, 8), i, 2, torch.device("cpu")) for i in range(2)]
    schedule = schedule_cls(stages, MICROBATCHES, loss_fn=loss_fn)
    planner = StaticPlanner()
    perseus.instrument(
        stages,
        schedule=schedule,
        client=planner,
        gpu=gpu,
        watchdog=False,
        handle_signals=False,
        progress=False,
        instruction_overhead_s=0.0007,
        hop_latency_s=0.001,
    )
    rank = stages[0].perseus
    assert stages[1].perseus is rank
    rank._registrar.join(5)
    planner.plan = [1200] * len(rank.order)
    seen = record_instructions(stages[0])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(2):
        schedule.step(x, target=y)
    rank.close()
    expected = [(i.kind.value, i.microbatch, i.chunk) for i in rank.order]
    assert seen == expected * 2
    assert {k for k, _, _ in expected} >= {"forward"} and {c for _, _, c in expected} == {0, 1}
    assert rank.plan_version == 1 and not rank.controller.fallen_back and rank.iteration == 1
    assert planner.spec.num_chunks == 2 and planner.spec.stage_orders[0] == tuple(expected)
    assert (planner.spec.instruction_overhead_s, planner.spec.hop_latency_s) == (0.0007, 0.001)


def test_profiles_then_applies_the_plan_on_a_real_stage(gpu):
    order = build_schedule("1f1b", 1, MICROBATCHES).stages[0]
    plan = [1200 if ins.kind.value == "forward" else 990 for ins in order]
    planner = FakePlanner(plan)
    stage = make_stage()
    schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    perseus.instrument(
        stage,
        schedule="1f1b",
        num_microbatches=MICROBATCHES,
        client=planner,
        gpu=gpu,
        profiling=ProfilingSettings(warmup_iterations=1, iterations_per_frequency=1, frequencies=(1410, 1005)),
        watchdog=False,
        handle_signals=False,
        progress=False,
        wait_for_clock=True,
        emulate={"forward": Work(0.003), "backward": Work(0.006)},  # GPU work for the profiler to measure
    )
    rank = stage.perseus
    rank._registrar.join(5)
    clocks = []
    original = rank.on_instruction_begin

    def spy(kind, microbatch, chunk=0):
        original(kind, microbatch, chunk)
        clocks.append(gpu.sm_clock())

    rank.on_instruction_begin = spy
    x, y = batch()
    for _ in range(5):
        schedule.step(x, target=y)
    schedule.eval(x, target=y)  # not a training iteration: default clocks, not counted
    assert rank.controller.wait_applied(30.0)  # pause() waits 0.1 s at most; a loaded machine may take longer
    eval_clock = gpu.sm_clock()
    schedule.step(x, target=y)
    rank.close()

    n = len(order)
    assert planner.spec.stage_orders[0] == tuple((i.kind.value, i.microbatch, i.chunk) for i in order)
    iterations = [clocks[i : i + n] for i in range(0, len(clocks), n)]
    assert iterations[0] == [1410] * n  # warm-up at default clocks
    swept = iterations[1 : iterations.index(plan)]  # the sweep: each step once, a step repeated if uncertain
    assert swept[:2] == [[1410] * n, [1005] * n] and all(set(it) <= {1410, 1005} for it in swept)
    assert iterations[1 + len(swept) :] == [plan] * (5 - len(swept))  # planned from the iteration after the upload
    assert eval_clock == gpu.max_frequency()
    # Off-clock instructions are counted in planned iterations only. On the real clock a worker thread
    # delayed by a loaded machine may apply a clock after a 3 ms instruction ended: not asserted zero.
    unplanned = 1 + len(swept)
    assert planner.off_clock[:unplanned] == [None] * unplanned
    assert all(isinstance(n, int) and 0 <= n < len(order) for n in planner.off_clock[unplanned:])
    assert not rank.controller.fallen_back
    profile = planner.profiles[0]
    assert set(profile.points) == {(0, "forward"), (0, "backward")}
    assert [p.frequency for p in profile.points[(0, "forward")]] == [1410, 1005]
    assert [r[0] for r in planner.reports] == list(range(5)) and planner.closed == [5]  # close() ended the last
    # Every iteration has a compute part: to the end of its last backward, within the step.
    assert all(compute is not None and 0 < compute <= time_s for _, time_s, _, compute in planner.reports)
    assert gpu.sm_clock() == gpu.max_frequency()  # reset on close


def test_bad_input_is_refused_clearly(gpu):
    stage = make_stage()
    with pytest.raises(ConfigError, match="num_microbatches"):
        perseus.instrument(stage, schedule="1f1b", client=False, gpu=gpu)
    with pytest.raises(ConfigError, match="PipelineStage"):
        perseus.instrument(object(), schedule="1f1b", num_microbatches=2, client=False, gpu=gpu)
    with pytest.raises(ConfigError, match="supports torch 2.6 to 2.15"):
        check_torch_version("2.3.1")
    with pytest.raises(
        ConfigError, match=r"found 2.16.0; install a supported torch \(pip install 'torch>=2.6,<2.16'\)"
    ):
        check_torch_version("2.16.0")
    with pytest.raises(ConfigError, match="found 3.0.0"):
        check_torch_version("3.0.0")
    for version in ("2.6.0", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"):
        check_torch_version(version)


def test_security_and_3d_coordinates_pass_through(gpu, tmp_path):
    """instrument(security=...) configures the client it creates; tp/dp/rank_mapping reach the rank."""
    create_keys(tmp_path / "keys", ["rank"])
    security = CurveClient.from_dir(tmp_path / "keys", "rank")
    stage = make_stage()
    perseus.instrument(
        stage,
        schedule="1f1b",
        num_microbatches=MICROBATCHES,
        client="tcp://127.0.0.1:9",
        gpu=gpu,
        security=security,
        rank=1,
        dp=2,
        dp_index=0,
        tp=2,
        tp_index=1,
        rank_mapping="megatron",
        watchdog=False,
        handle_signals=False,
        progress=False,
        startup_wait_s=0.1,
    )
    rank = stage.perseus
    try:
        assert rank._client._security is security
        assert (rank.rank_info().tp_index, rank.job_spec().tp, rank.job_spec().rank_mapping) == (1, 2, "megatron")
    finally:
        rank.close()
    with pytest.raises(ConfigError, match="pass security to PlannerClient"):
        perseus.instrument(
            make_stage(), schedule="1f1b", num_microbatches=MICROBATCHES, client=False, gpu=gpu, security=security
        )

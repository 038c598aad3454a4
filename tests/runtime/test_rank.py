"""PerseusRank without a service: measuring, refusing bad plans, surviving a broken client,
and the progress display. Simulated GPU on a virtual clock; well under a second."""

from __future__ import annotations

import io
import logging
import threading

import pytest

from perseus.client.planner_client import Assignment
from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.runtime import PerseusRank, Progress
from perseus.schedules import build_schedule
from perseus.wire.phases import Phase

SCHEDULE = build_schedule("1f1b", 2, 4)
WORK = Work(0.01)


class PlannedClient:
    def __init__(self, frequencies):
        self.frequencies = frequencies

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        pass

    def assignment(self, iteration):
        return Assignment(Phase.PLANNED, self.frequencies, None, 1)

    def upload_profile(self, *args):
        pass

    def report_iteration(self, *args, **kwargs):
        pass


class BrokenClient(PlannedClient):
    def __init__(self):
        super().__init__(None)
        self.tried = threading.Event()  # the rank's registrar made its first attempt

    def register_rank(self, job_id, info):
        self.tried.set()
        raise RuntimeError("network on fire")

    def assignment(self, iteration):
        raise RuntimeError("network on fire")


@pytest.fixture
def gpu(tmp_path):
    return SimGPU("a100-sxm", 1, clock=VirtualClock(), state_dir=str(tmp_path))


# How long a background thread may take on a loaded machine; waits end as soon as it is done.
DEADLINE_S = 30.0


def make_rank(gpu, client=None, **kwargs):
    """A rank whose background registration is over (a broken client's: its first attempt made)."""
    rank = PerseusRank(
        gpu,
        SCHEDULE,
        1,
        client=client,
        handle_signals=False,
        watchdog=False,
        wait_for_clock=True,
        retry_s=0.01,
        startup_wait_s=0.2,
        **{"progress": False, **kwargs},
    )
    if isinstance(client, BrokenClient):
        assert client.tried.wait(DEADLINE_S)  # it retries until closed: wait for its first try
    elif rank._registrar is not None:
        rank._registrar.join(DEADLINE_S)
        assert not rank._registrar.is_alive()
    return rank


def run(rank, gpu, iterations=1):
    clocks = []
    for _ in range(iterations):
        step(rank, gpu, clocks)
        rank.on_step_end()
    return clocks


def step(rank, gpu, clocks=None):
    """Begin a step and run this rank's instructions (the caller ends it, or not)."""
    rank.on_step_begin()
    for ins in rank.order:
        rank.on_instruction_begin(ins.kind, ins.microbatch)
        if clocks is not None:
            clocks.append(gpu.sm_clock())
        gpu.execute(WORK)
        rank.on_instruction_end(ins.kind, ins.microbatch)


def test_without_a_planner_runs_at_default_clocks_and_measures_iterations(gpu):
    records = []
    rank = make_rank(gpu, on_iteration=records.append)
    clocks = run(rank, gpu, 2)
    rank.close()
    assert set(clocks) == {gpu.max_frequency()}
    assert [r.iteration for r in records] == [0, 1]
    assert records[0].phase == "unplanned"
    assert records[0].time_s == pytest.approx(8 * WORK.time_s)
    assert records[0].energy_j == pytest.approx(8 * gpu.predict(WORK)[1])


def test_a_plan_is_applied_per_instruction(gpu):
    plan = [1410, 1200, 1005, 990, 1200, 1410, 990, 1005]
    rank = make_rank(gpu, PlannedClient(plan))
    assert run(rank, gpu, 2) == plan * 2
    assert rank.phase == "planned" and rank.plan_version == 1
    rank.close()
    assert gpu.sm_clock() == gpu.max_frequency()


@pytest.mark.parametrize("plan, why", [([1234] * 8, "does not support"), ([1200] * 7, "7 frequencies for 8")])
def test_a_bad_plan_is_refused_and_the_rank_runs_at_default_clocks(gpu, caplog, plan, why):
    rank = make_rank(gpu, PlannedClient(plan))
    with caplog.at_level(logging.ERROR):
        clocks = run(rank, gpu, 2)
    rank.close()
    assert set(clocks) == {gpu.max_frequency()}
    assert any(why in r.getMessage() for r in caplog.records)


def test_a_broken_client_never_stops_training(gpu, caplog):
    rank = make_rank(gpu, BrokenClient())
    with caplog.at_level(logging.WARNING):
        clocks = run(rank, gpu, 3)
    rank.close()
    assert set(clocks) == {gpu.max_frequency()} and rank.iteration == 2
    assert sum("cannot reach the Perseus planner" in r.getMessage() for r in caplog.records) == 1
    assert sum("asking the planner" in r.getMessage() for r in caplog.records) <= 1


def test_hook_failures_are_logged_once_and_swallowed(gpu, caplog):
    rank = make_rank(gpu)

    def broken(*args):
        raise RuntimeError("boom")

    rank.controller.before_instruction = broken
    with caplog.at_level(logging.WARNING):
        run(rank, gpu, 2)
    rank.close()
    assert sum("boom" in r.getMessage() for r in caplog.records) == 1


def test_stage_out_of_range_is_refused(gpu):
    with pytest.raises(ConfigError, match="stage 5"):
        PerseusRank(gpu, SCHEDULE, 5, watchdog=False, handle_signals=False)


def test_progress_log_lines_only_on_change():
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.update(0, "warmup")
    p.update(1, "warmup")
    p.update(2, "profiling", 1410, 0, 3, at_most=True)
    p.update(3, "profiling", 1410, 0, 3, at_most=True)
    p.update(4, "profiling", 1320, 1, 3, at_most=True)
    p.update(5, "profiling", 1410, 2, 2, repeats=1)  # the main sweep over: 1410 MHz again
    p.update(5, "planning", None, 2, 2)
    p.update(6, "planning", None, 2, 2, waiting=(1, 3))
    p.update(7, "planning", None, 2, 2, waiting=(1, 3))
    p.update(8, "planning", None, 2, 2, waiting=(3,))
    lines = out.getvalue().splitlines()
    assert lines == [
        "[perseus] iteration 0: warmup at default clocks",
        "[perseus] iteration 2: profiling at 1410 MHz [0 of at most 3 clocks]",
        "[perseus] iteration 4: profiling at 1320 MHz [1 of at most 3 clocks]",
        "[perseus] iteration 5: profiling at 1410 MHz [2 of 2 clocks, 1 again where energy is uncertain]",
        "[perseus] iteration 5: planning at default clocks [2 of 2 clocks]",
        "[perseus] iteration 6: planning at default clocks [2 of 2 clocks], waiting for stages 1, 3 to be profiled",
        "[perseus] iteration 8: planning at default clocks [2 of 2 clocks], waiting for stage 3 to be profiled",
    ]


def test_progress_tells_the_planners_iteration_where_it_differs():
    """A rank that reached the service late: the service's log and status count from where it
    first answered (an outsider read "plan v1 from iteration 38" beside "iteration 69: planned")."""
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.update(0, "unplanned")
    p.update(31, "warmup", job_iteration=0)
    p.update(69, "planned", plan_version=1, job_iteration=38)
    assert out.getvalue().splitlines() == [
        "[perseus] iteration 0: unplanned at default clocks",
        "[perseus] iteration 31 (the planner's 0): warmup at default clocks",
        "[perseus] iteration 69 (the planner's 38): planned at plan v1's clocks",
    ]


def test_progress_bar_on_a_terminal():
    out = io.StringIO()
    p = Progress(out, tty=True)
    p.update(7, "profiling", 1200, 2, 4)
    p.close()
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n")
    assert "profiling" in text and "1200 MHz" in text and "iteration 7" in text
    assert "|" + "#" * 12 + "-" * 12 + "|" in text


def test_without_clock_permission_the_rank_only_measures(tmp_path, caplog):
    class Locked(SimGPU):
        def can_change_clocks(self):
            return False

    gpu = Locked("a100-sxm", 2, clock=VirtualClock(), state_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        rank = make_rank(gpu, PlannedClient([1005] * 8))
        clocks = run(rank, gpu, 2)
    rank.close()
    assert set(clocks) == {gpu.max_frequency()} and rank.phase == "unplanned"
    assert rank.last_iteration.energy_j > 0
    assert any("may not change GPU clocks" in r.getMessage() for r in caplog.records)


def test_the_plan_comes_back_after_an_unplanned_spell(gpu):
    plan = [1200] * 8
    client = PlannedClient(plan)
    rank = make_rank(gpu, client)
    assert run(rank, gpu) == plan
    client.assignment = lambda iteration: Assignment(Phase.UNPLANNED, None, None, 0)
    assert run(rank, gpu) == [gpu.max_frequency()] * 8
    del client.assignment  # the same plan version again
    assert run(rank, gpu) == plan
    rank.close()


class RecordingClient(PlannedClient):
    """Records what the rank reports and uploads."""

    def __init__(self):
        super().__init__(None)
        self.reports, self.uploads, self.closed = [], [], []

    def assignment(self, iteration):
        return Assignment(Phase.WARMUP, None, None, 0)

    def report_iteration(self, job_id, rank, iteration, time_s, energy_j, compute_time_s=None, **kwargs):
        if kwargs.get("closing"):
            self.closed.append(iteration)
        else:
            self.reports.append((iteration, time_s, compute_time_s))


def test_the_iteration_close_ends_is_reported_as_closing(gpu):
    """The script's work after its last step (a checkpoint, a status query) runs on to close():
    the user's record has it; the service is told it is the rank's last (no mean counts it)."""
    client = RecordingClient()
    records = []
    rank = make_rank(gpu, client, on_iteration=records.append)
    step(rank, gpu)
    step(rank, gpu)  # ends the first
    gpu.clock.sleep(0.5)  # the script's own work before close()
    rank.close()
    assert [r.iteration for r in records] == [0, 1] and records[1].time_s == pytest.approx(8 * WORK.time_s + 0.5)
    assert [i for i, _, _ in client.reports] == [0] and client.closed == [1]


def test_compute_time_ends_with_the_last_instruction_before_the_gradient_sync(gpu):
    """The data-parallel all-reduce after the last backward is in time_s, not in compute_time_s."""
    client = RecordingClient()
    records = []
    rank = make_rank(gpu, client, on_iteration=records.append)
    allreduce_s = 0.05
    for _ in range(2):
        step(rank, gpu)
        gpu.clock.sleep(allreduce_s)  # waiting on the other pipelines
        rank.on_step_end()
    rank.on_step_begin()  # an iteration that stops short of its last instruction has no compute part
    rank.on_instruction_begin("forward", 0)
    rank.on_instruction_end("forward", 0)
    rank.on_step_end()
    rank.close()  # the script ended its last step itself: that iteration is reported again, as closing
    assert client.closed == [2]
    assert [r.compute_time_s for r in records[:2]] == [pytest.approx(8 * WORK.time_s)] * 2
    assert [r.time_s for r in records[:2]] == [pytest.approx(8 * WORK.time_s + allreduce_s)] * 2
    assert records[2].compute_time_s is None
    assert [(i, c) for i, _, c in client.reports] == [
        (0, records[0].compute_time_s),
        (1, records[1].compute_time_s),
        (2, None),
    ]


def test_3d_coordinates_reach_the_job_spec_and_rank_info(gpu):
    # Megatron order with pp=2, dp=2, tp=2: rank = tp_index + 2 * (dp_index + 2 * stage).
    rank = PerseusRank(
        gpu,
        SCHEDULE,
        1,
        dp=2,
        dp_index=1,
        tp=2,
        tp_index=1,
        rank_mapping="megatron",
        progress=False,
        handle_signals=False,
        watchdog=False,
    )
    try:
        assert rank.rank == 7
        spec, info = rank.job_spec(), rank.rank_info()
        assert (spec.world_size, spec.pp, spec.dp, spec.tp, spec.rank_mapping) == (8, 2, 2, 2, "megatron")
        assert (info.rank, info.stage, info.dp_index, info.tp_index) == (7, 1, 1, 1)
    finally:
        rank.close()
    torch_order = PerseusRank(
        gpu,
        SCHEDULE,
        1,
        rank=3,
        dp=2,
        dp_index=0,
        tp=2,
        tp_index=1,
        rank_mapping="torch",
        progress=False,
        handle_signals=False,
        watchdog=False,
    )
    torch_order.close()
    assert torch_order.rank_info().tp_index == 1  # torch order: rank 3 = tp_index + 2 * (stage + 2 * dp_index)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(dp=2, dp_index=1), "pass rank="),
        (
            dict(rank=6, dp=2, dp_index=1, tp=2, tp_index=1, rank_mapping="megatron"),
            "rank 6 is stage 1, dp_index 1, tp_index 0",
        ),
        (dict(rank=1, tp=2, tp_index=2), "tp_index must be an integer in 0..1"),
        (dict(rank=1, dp=0), "dp must be a positive integer"),
        (dict(rank=9, dp=2, dp_index=1, tp=2), "rank must be an integer in 0..7"),
        (dict(rank=1, rank_mapping="deepspeed"), "rank_mapping must be one of"),
    ],
)
def test_bad_3d_coordinates_are_refused_naming_the_fix(gpu, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        PerseusRank(gpu, SCHEDULE, 1, progress=False, handle_signals=False, watchdog=False, **kwargs)


def test_overheads_reach_the_job_spec_and_bad_ones_are_refused_at_once(gpu):
    rank = PerseusRank(
        gpu,
        SCHEDULE,
        1,
        instruction_overhead_s=0.0007,
        hop_latency_s=0.001,
        progress=False,
        handle_signals=False,
        watchdog=False,
    )
    try:
        spec = rank.job_spec()
        assert (spec.instruction_overhead_s, spec.hop_latency_s) == (0.0007, 0.001)
    finally:
        rank.close()
    with pytest.raises(ConfigError, match="hop_latency_s must be a finite number"):
        PerseusRank(
            gpu, SCHEDULE, 1, client=object(), hop_latency_s=-1.0, progress=False, handle_signals=False, watchdog=False
        )


def test_progress_names_the_plan_that_runs():
    out = io.StringIO()
    p = Progress(out, tty=False)
    p.update(5, "planning")
    p.update(6, "planned", plan_version=1)
    p.update(7, "planned", plan_version=1)
    p.update(9, "planned", plan_version=2)
    assert out.getvalue().splitlines() == [
        "[perseus] iteration 5: planning at default clocks",
        "[perseus] iteration 6: planned at plan v1's clocks",
        "[perseus] iteration 9: planned at plan v2's clocks",
    ]

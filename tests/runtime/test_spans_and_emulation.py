"""The rank side of calibration: instruction spans sent when the planner asks (baseline iterations
only, bounded, compact), the GPU work `emulate=` runs on a simulated GPU for each instruction,
and the warning when a simulated GPU runs no work. Virtual clock: exact and instant."""

from __future__ import annotations

import logging

import pytest

from perseus.client.planner_client import Assignment
from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.runtime import PerseusRank, spans
from perseus.runtime.emulation import InstructionWork, check_work_spec
from perseus.schedules import build_schedule
from perseus.wire.phases import Phase
from perseus.wire.spans import ReportSpans

SCHEDULE = build_schedule("1f1b", 2, 4)


@pytest.fixture
def gpu(tmp_path):
    return SimGPU("a100-sxm", 1, clock=VirtualClock(), state_dir=str(tmp_path))


class SpanClient:
    """A planner asking for spans: warm-up (0-1), one profiling iteration (2), planning (3-5),
    a plan (6), then a verification reference window at maximum clocks (7-9)."""

    def __init__(self):
        self.spans: list[ReportSpans] = []

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        self.info = info

    def assignment(self, iteration):
        if iteration < 2:
            return Assignment(Phase.WARMUP, None, None, 0, True)
        if iteration == 2:
            return Assignment(Phase.PROFILING, None, 1410, 0, True)
        if iteration < 6:
            return Assignment(Phase.PLANNING, None, None, 0, iteration < 5)
        if iteration == 6:
            return Assignment(Phase.PLANNED, [1410] * 8, None, 1)
        return Assignment(Phase.REFERENCE, [1410] * 8, None, 2, iteration < 9)

    def upload_profile(self, *args):
        pass

    def report_iteration(self, *args, **kwargs):
        pass

    def report_spans(self, report):
        self.spans.append(report)


def make_rank(gpu, client=None, **kwargs):
    rank = PerseusRank(gpu, SCHEDULE, 1, client=client, progress=False, handle_signals=False, watchdog=False, **kwargs)
    if rank._registrar is not None:
        rank._registrar.join(30.0)
    return rank


def run(rank, iterations, host_s=0.0005):
    """Iterations of the rank's instructions, `host_s` of host work before each."""
    for _ in range(iterations):
        rank.on_step_begin()
        for ins in rank.order:
            rank.gpu.clock.sleep(host_s)
            rank.on_instruction_begin(ins.kind, ins.microbatch)
            rank.on_instruction_end(ins.kind, ins.microbatch)
        rank.on_step_end()


def test_spans_go_to_the_planner_in_baseline_iterations_it_asks_for(gpu):
    client = SpanClient()
    rank = make_rank(gpu, client, emulate={"forward": Work(0.006), "backward": Work(0.012)})
    run(rank, 10)
    rank.close()
    assert client.info.timeline  # the rank registered as one that sends spans
    # Warm-up 0-1, planning 3-4 and the reference window's 7-8: asked for; profiling (2),
    # planning 5, the plan (6) and reference 9: not.
    assert [s.iteration for s in client.spans] == [0, 1, 3, 4, 7, 8]
    assert [s.phase for s in client.spans[-2:]] == ["reference", "reference"]
    report = client.spans[3]
    assert report.phase == "planning" and report.frequency is None and report.rank == 1
    assert len(report.begins_us) == len(report.ends_us) == len(rank.order)
    durations = [e - b for b, e in zip(report.begins_us, report.ends_us)]
    expected = [6000 if ins.kind.value == "forward" else 12000 for ins in rank.order]
    assert durations == pytest.approx(expected, abs=2)  # the emulated work, at the highest clock
    gaps = [b - e for b, e in zip(report.begins_us[1:], report.ends_us)]
    assert gaps == pytest.approx([500] * (len(gaps)), abs=2)  # the host work between them
    assert report.step_us >= report.ends_us[-1]


def test_spans_per_rank_are_bounded(gpu, monkeypatch):
    import perseus.runtime.rank as rank_module

    monkeypatch.setattr(rank_module, "MAX_SPAN_REPORTS", 2)
    client = SpanClient()
    rank = make_rank(gpu, client)
    run(rank, 5)
    rank.close()
    assert [s.iteration for s in client.spans] == [0, 1]


def test_emulated_work_follows_the_instructions_clock(gpu):
    work = InstructionWork(gpu, {"forward": Work(0.006)}, lambda timeout: True)
    clock = gpu.clock
    t0 = clock.now()
    work.begin("forward", 0, 0)
    work.end()
    assert clock.now() - t0 == pytest.approx(0.006)
    gpu.lock_sm_clock(1005)
    t0 = clock.now()
    work.begin("forward", 1, 0)
    work.end()
    assert clock.now() - t0 == pytest.approx(gpu.predict(Work(0.006), 1005)[0])
    t0 = clock.now()
    work.begin("backward", 0, 0)  # no work given for it
    work.end()
    assert clock.now() == t0


def test_emulated_work_per_instruction_and_on_real_gpus_nothing():
    calls = []
    real_gpu = object()  # not a SimGPU: InstructionWork touches nothing else of it
    work = InstructionWork(real_gpu, lambda kind, mb, chunk: calls.append((kind, mb, chunk)), lambda t: True)  # type: ignore[arg-type]
    work.begin("forward", 0, 0)
    work.end()
    assert calls == []  # a real GPU runs the real kernels: nothing is asked or emulated


def test_work_specs_are_checked_and_the_backward_split_both_ways():
    spec = check_work_spec({"forward": Work(0.006), "backward": Work(0.012)})
    assert spec["backward_input"] == spec["backward_weight"] == Work(0.006)
    spec = check_work_spec({"backward_input": Work(0.004), "backward_weight": Work(0.002)})
    assert spec["backward"].time_s == pytest.approx(0.006)
    with pytest.raises(ConfigError, match="kind 'fwd'"):
        check_work_spec({"fwd": Work(0.006)})
    with pytest.raises(ConfigError, match="perseus.devices.Work"):
        check_work_spec({"forward": 0.006})
    with pytest.raises(ConfigError, match="mapping"):
        check_work_spec([Work(0.006)])


def test_a_simulated_gpu_that_runs_no_work_is_warned_about(gpu, caplog):
    with caplog.at_level(logging.WARNING):
        rank = make_rank(gpu)
        run(rank, spans.WorkCheck.MAX_ITERATIONS + 2)
        rank.close()
    warnings = [r.getMessage() for r in caplog.records if "ran no work on its simulated GPU" in r.getMessage()]
    assert len(warnings) == 1 and "emulate=" in warnings[0]


def test_no_warning_when_the_work_is_emulated(gpu, caplog):
    with caplog.at_level(logging.WARNING):
        rank = make_rank(gpu, emulate={"forward": Work(0.006), "backward": Work(0.012)})
        run(rank, 12)
        rank.close()
    assert not [r for r in caplog.records if "ran no work" in r.getMessage()]

"""A rank on a GPU with timing events (a simulated GPU whose timer records fake CUDA events, on a
virtual clock): its instruction spans and compute time come from the events resolved once per
iteration, while the host issues work ahead of the GPU and never synchronises per instruction
(the profiler's side: tests/profiler/test_online_events.py)."""

from __future__ import annotations

import pytest

from perseus.client.planner_client import Assignment
from perseus.clock import VirtualClock
from perseus.runtime import PerseusRank
from perseus.schedules import build_schedule
from perseus.testing.fake_cuda import EventTimedSimGPU
from perseus.wire.phases import Phase

SCHEDULE = build_schedule("1f1b", 2, 4)
WORK_S = {"forward": 0.006, "backward": 0.012}
HOST_S = 0.0005  # host time to issue an instruction: far less than its GPU work


class SpanClient:
    """A planner in warm-up that asks for every iteration's spans."""

    def __init__(self):
        self.spans = []
        self.iterations = []

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        pass

    def assignment(self, iteration):
        return Assignment(Phase.WARMUP, None, None, 0, True)

    def upload_profile(self, *args):
        pass

    def report_iteration(self, job_id, rank, iteration, time_s, energy_j, **kwargs):
        if not kwargs.get("closing"):  # close()'s report again of the last iteration
            self.iterations.append((time_s, kwargs.get("compute_time_s")))

    def report_spans(self, report):
        self.spans.append(report)


def test_spans_and_compute_time_come_from_events_while_the_host_issues_ahead(tmp_path):
    gpu = EventTimedSimGPU("a100-sxm", 1, clock=VirtualClock(100.0), state_dir=str(tmp_path))
    client = SpanClient()
    rank = PerseusRank(gpu, SCHEDULE, 1, client=client, progress=False, handle_signals=False, watchdog=False)
    rank._registrar.join(30.0)
    iterations = 3
    for _ in range(iterations):
        rank.on_step_begin()
        for ins in rank.order:
            gpu.clock.advance(HOST_S)
            rank.on_instruction_begin(ins.kind, ins.microbatch)
            gpu.cuda.run(WORK_S[ins.kind.value])  # queued: the host goes on at once
            rank.on_instruction_end(ins.kind, ins.microbatch)
        rank.on_step_end()
    rank.close()

    # One device synchronisation per iteration (its end), none per instruction, and one per
    # iteration to resolve the events.
    assert gpu.synchronize_calls == iterations and gpu.cuda.synchronize_calls == iterations
    assert len(client.spans) == iterations
    report = client.spans[-1]
    durations = [e - b for b, e in zip(report.begins_us, report.ends_us)]
    assert durations == pytest.approx([WORK_S[ins.kind.value] * 1e6 for ins in rank.order], abs=1)
    # The GPU ran them back to back from the first one's issue: no host gaps inside the spans.
    assert report.begins_us[0] == pytest.approx(HOST_S * 1e6, abs=1)
    assert list(report.begins_us[1:]) == pytest.approx(list(report.ends_us[:-1]), abs=1)
    busy = sum(WORK_S[ins.kind.value] for ins in rank.order)
    time_s, compute_s = client.iterations[-1]
    assert compute_s == pytest.approx(HOST_S + busy, abs=1e-6)  # when the GPU finished the last one
    assert time_s == pytest.approx(compute_s, abs=1e-6)

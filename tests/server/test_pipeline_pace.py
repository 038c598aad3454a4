"""A pipeline's iteration time is that of the stages that end its iterations: beside a straggler,
a stage that another waits for starts each step early (its data-parallel gradient sync returns
when the straggler's same stage arrives) and its compute time runs long by the wait."""

from __future__ import annotations

import pytest
from server_helpers import FREQUENCIES, job_spec

from perseus.planner.dag import ending_stages
from perseus.schedules import build_schedule
from perseus.service.measurements import Measurements
from perseus.service.plans import PublishedPlan
from perseus.wire.messages import ReportIteration
from perseus.wire.spec import RankInfo


@pytest.mark.parametrize(
    "name,args,stages",
    [
        ("1f1b", (4, 8), {0}),
        ("gpipe", (4, 8), {0}),
        ("interleaved-1f1b", (4, 8, 2), {0}),
        ("zb-h1", (4, 8), {0, 1, 2, 3}),
    ],
)
def test_the_stages_that_end_an_iteration(name, args, stages):
    assert ending_stages(build_schedule(name, *args)) == stages


def test_a_straggler_is_measured_against_the_others_own_pace_not_their_wait_for_it():
    """dp=2 x 2 stages; pipeline 1 takes 1.3x. Pipeline 0's stage 0 measures its 0.3633 s; its stage
    1, released early by its gradient sync with pipeline 1's stage 1, measures 0.376 s (as an
    outsider's 1F1B job on simulated A100s did). The factor is 1.3, not 0.4723 / 0.376 = 1.256."""
    spec = job_spec(4, dp=2)
    measurements = Measurements(spec)
    measurements.ending_stages = ending_stages(build_schedule("1f1b", 2, 4))
    times = {0: 0.3633, 1: 0.376, 2: 0.4723, 3: 0.4719}  # rank = dp_index * 2 + stage
    infos = {r: RankInfo(r, r % 2, dp_index=r // 2, gpu_model="sim-a100", frequencies=FREQUENCIES) for r in times}
    plans = {
        k: PublishedPlan(((1410,), (1410,)), 0.36, 100.0, 90.0, 0.36, 100.0, version=1, start_iteration=0)
        for k in (0, 1)
    }
    measurements.published(plans, [0, 1], -1, {k: (p.key, p.stage_frequencies) for k, p in plans.items()})
    for iteration in range(10):
        for rank, time_s in times.items():
            report = ReportIteration(spec.job_id(), rank, iteration, time_s + 0.001, 50.0, compute_time_s=time_s)
            measurements.record(infos[rank], report, plans, lambda k: 0.36)
    assert measurements.measured_time_s(0) == pytest.approx(0.3633)
    measurements.update_stragglers()
    straggler = measurements.straggler()
    assert straggler is not None and straggler[0] == 1 and straggler[1] == pytest.approx(0.4723 / 0.3633)

"""perseus.service.calibration on synthetic timelines: a pipeline simulated here with host gaps
between each stage's instructions and stage-to-stage hops, each rank's times given from its own
step start (as ranks send them: no clock shared across ranks), with seeded noise.

The fit must reproduce the measured iteration within 1% (and each stage's window), find the
hop, and give the planner a model on which a no-slowdown plan really does not slow the simulated
pipeline. With no GPU work, the profile explains too little to plan on.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from timeline_helpers import HOP_S, STAGES, profile, simulate, timelines

from perseus.planner import Planner
from perseus.schedules import build_schedule
from perseus.service.calibration import MIN_EXPLAINED, TOLERANCE, fit
from perseus.service.model import with_margin, with_overheads
from perseus.service.timelines import FITTED, ModelState

SCHEDULES = {
    "gpipe": build_schedule("gpipe", STAGES, 8),
    "1f1b": build_schedule("1f1b", STAGES, 8),
    "interleaved-1f1b": build_schedule("interleaved-1f1b", STAGES, 8, 2),
    "zb-h1": build_schedule("zb-h1", STAGES, 8),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_calibrated_model_reproduces_the_measured_baseline(name):
    schedule = SCHEDULES[name]
    prof = profile(schedule.num_virtual_stages)
    c = fit(schedule, prof, timelines(schedule, prof))
    assert abs(c.error) <= TOLERANCE and c.fit_ok and c.plannable and not c.reason(), c.describe()
    assert c.gpu_only_s < c.measured_s * 0.97  # the GPU profile alone falls short
    assert c.hop_s == pytest.approx(HOP_S, rel=0.35)
    assert len(c.stages) == STAGES and all(abs(s.error) <= 2 * TOLERANCE for s in c.stages), c.stages
    assert set(c.overheads) == {(prof.stage_for(i, schedule), i.kind.value) for i in schedule.instructions()}


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b"])
def test_a_plan_on_the_calibrated_model_keeps_the_pipelines_time(name):
    schedule = SCHEDULES[name]
    prof = profile(schedule.num_virtual_stages)
    c = fit(schedule, prof, timelines(schedule, prof))
    _, baseline_end = simulate(schedule, prof)
    baseline = max(baseline_end.values())
    calibrated = Planner(schedule, with_overheads(prof, c.overheads)).plan()
    _, end = simulate(schedule, prof, calibrated.frequencies)
    assert max(end.values()) <= baseline * (1 + TOLERANCE)
    assert calibrated.energy_j < Planner(schedule, with_overheads(prof, c.overheads)).max_frequency_energy_j * 0.95


def test_without_gpu_work_the_profile_explains_too_little_to_plan_on():
    schedule = SCHEDULES["1f1b"]
    prof = profile(STAGES, work_s=0.0)  # instructions of host work only: what no emulated GPU work looks like
    c = fit(schedule, prof, timelines(schedule, prof))
    assert c.explained < MIN_EXPLAINED and not c.plannable
    assert "explains only" in c.reason() and "emulate" in c.reason()


def test_the_fit_does_not_depend_on_when_each_rank_started_its_step():
    schedule = SCHEDULES["1f1b"]
    prof = profile(STAGES)
    a = fit(schedule, prof, timelines(schedule, prof, seed=1))
    b = fit(schedule, prof, timelines(schedule, prof, seed=2))
    assert a.model_s == pytest.approx(b.model_s, rel=0.005)
    assert a.hop_s == pytest.approx(b.hop_s, rel=0.1)


def test_host_noise_that_stretches_a_rows_instructions_is_reserved_on_its_slowed_points():
    """A rank stalled in a quarter of the iterations: its instructions' mean outlasts their
    median, and a plan that slows them must leave that room (the slack absorbed it at maximum
    clocks); the quiet rows keep none, and the top clock is left as measured."""
    schedule = SCHEDULES["1f1b"]
    prof = profile(schedule.num_virtual_stages)
    quiet = timelines(schedule, prof)
    stall = 0.003
    noisy = [
        dataclasses.replace(
            tl,
            ends=tuple(
                tuple(t + stall for t in row) if s == 1 and k % 4 == 0 else row for s, row in enumerate(tl.ends)
            ),
        )
        for k, tl in enumerate(quiet)
    ]
    c = fit(schedule, prof, noisy)
    assert c.reserve[(1, "forward")] == pytest.approx(stall / 4, rel=0.2)
    assert c.reserve[(1, "backward")] == pytest.approx(stall / 4, rel=0.2)
    assert all(v < 1e-4 for (s, _), v in c.reserve.items() if s != 1), c.reserve
    assert max(fit(schedule, prof, quiet).reserve.values()) < 1e-4
    assert "noise reserve" in c.describe()
    reserved = with_margin(prof, 0.0, c.reserve).points[(1, "forward")]
    measured = prof.points[(1, "forward")]
    assert reserved[0] == measured[0]
    assert reserved[1].time == pytest.approx(measured[1].time + c.reserve[(1, "forward")])
    state = ModelState(FITTED, calibration=c)
    assert ModelState.from_record(json.loads(json.dumps(state.to_record()))).calibration == c

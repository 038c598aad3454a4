"""The online profiler fed by timing events (a simulated GPU whose rank's instruction timer
records fake CUDA events, resolved once per iteration) measures what the synchronised timer
measures: on a simulated GPU both see the same instants, so the profiles are identical."""

from __future__ import annotations

import pytest
from stage_run import profile_stage

from perseus.devices.sim_realism import IDEAL, SimRealism
from perseus.devices.sim_work import Work
from perseus.testing.fake_cuda import EventTimedSimGPU

STEPPING = SimRealism(counter_period_s=0.1, switch_latency_s=0.01)


def points(profile):
    """Every point as numbers, row by row (the events' floating-point anchoring may differ in the last bit)."""
    return [x for key in sorted(profile.points) for p in profile.points[key] for x in (p.frequency, p.time, p.energy)]


@pytest.mark.parametrize("realism", [IDEAL, STEPPING], ids=["ideal", "stepping"])
def test_a_profile_timed_by_events_is_the_synchronised_one(tmp_path, realism):
    works = {"forward": Work(0.005), "backward": Work(0.01)}
    timed, gpu, _ = profile_stage(works, realism, str(tmp_path / "events"), sweep_step=10, gpu_class=EventTimedSimGPU)
    reference, _, _ = profile_stage(works, realism, str(tmp_path / "host"), sweep_step=10)
    assert points(timed) == pytest.approx(points(reference), rel=1e-9)
    assert timed.blocking_power_w == pytest.approx(reference.blocking_power_w, rel=1e-9)
    assert gpu.cuda.events_made > 0 and gpu.cuda.synchronize_calls > 0  # the events did the timing

"""The switch latency on the planning side: a stage's profile carries its GPU's latency, and the
service plans instructions shorter than that at their top clock (they would never run at a
lower one asked for as they start), leaving longer ones free."""

from __future__ import annotations

from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, predict
from perseus.planner import Planner
from perseus.profiler.profile import SWITCH_LATENCY_META, Profile, ProfilePoint
from perseus.schedules import build_schedule
from perseus.service.profiles import Profiling
from perseus.wire.spec import JobSpec

PRESET = PRESETS["a100-sxm"]
FREQS = PRESET.frequencies[::6]


def stage_profile(stage: int, forward: Work, backward: Work, latency: float | None) -> Profile:
    points = {
        (stage, kind): [ProfilePoint(f, *predict(PRESET, work, f)) for f in FREQS]
        for kind, work in (("forward", forward), ("backward", backward))
    }
    meta = {} if latency is None else {SWITCH_LATENCY_META: str(latency)}
    return Profile(points, PRESET.idle_w, meta)


def plan_with(latency: float | None):
    spec = JobSpec(2, 2, schedule_name="1f1b", num_microbatches=4, gpu_model="a100")
    schedule = build_schedule("1f1b", 2, 4)
    profiling = Profiling(spec)
    # Stage 0's forward (4 ms) is shorter than a 10 ms switch; its backward is not. Stage 1 sets the pace.
    uploads = [
        stage_profile(0, Work(0.004), Work(0.02), latency),
        stage_profile(1, Work(0.008), Work(0.03), latency),
    ]
    for s, profile in enumerate(uploads):
        profiling.take("a100", s, 0, profile, f"stage-{s}")
    profile = profiling.pipeline_profile(schedule, ("a100", "a100"))
    assert profile is not None
    return profile, Planner(schedule, profile).plan(), schedule, profiling


def test_instructions_shorter_than_a_switch_are_planned_at_their_top_clock():
    free_profile, free, schedule, _ = plan_with(None)
    held_profile, held, _, profiling = plan_with(0.01)
    assert len(free_profile.points[(0, "forward")]) == len(FREQS)  # no latency known: every clock
    assert [p.frequency for p in held_profile.points[(0, "forward")]] == [PRESET.max_mhz]
    assert len(held_profile.points[(0, "backward")]) == len(FREQS)  # 20 ms: longer than the switch
    forwards = [f for ins, f in zip(schedule.stages[0], free.stage_frequencies(0)) if ins.kind.value == "forward"]
    assert min(forwards) < PRESET.max_mhz  # without the latency the planner slows the short forwards
    held_forwards = [f for ins, f in zip(schedule.stages[0], held.stage_frequencies(0)) if ins.kind.value == "forward"]
    assert set(held_forwards) == {PRESET.max_mhz}
    assert min(held.stage_frequencies(0)) < PRESET.max_mhz  # its backwards still slow down
    cached = profiling.model_profile("a100")
    assert cached is not None and cached.switch_latency_s() == 0.01  # the signature cache keeps it

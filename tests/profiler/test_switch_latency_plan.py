"""The switch latency on the planning side: a stage's profile carries its GPU's latency, and the
service's plans hold no clock for less time than that (a shorter run of one clock would never
be in force), while runs of short instructions at one clock stay free to slow down."""

from __future__ import annotations

from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_work import Work, predict
from perseus.planner import Planner
from perseus.planner.switches import segments
from perseus.profiler.profile import (
    SWITCH_LATENCIES_META,
    SWITCH_LATENCY_META,
    Profile,
    ProfilePoint,
    format_switch_latencies,
)
from perseus.schedules import build_schedule
from perseus.service.planning import plan_pipeline
from perseus.service.profiles import Profiling
from perseus.wire.spec import JobSpec

PRESET = PRESETS["a100-sxm"]
FREQS = PRESET.frequencies[::6]


def stage_profile(stage: int, forward: Work, backward: Work, latency: float | None) -> Profile:
    points = {
        (stage, kind): [ProfilePoint(f, *predict(PRESET, work, f)) for f in FREQS]
        for kind, work in (("forward", forward), ("backward", backward))
    }
    meta = {}
    if latency is not None:
        meta[SWITCH_LATENCY_META] = str(latency)
        meta[SWITCH_LATENCIES_META] = format_switch_latencies(dict.fromkeys(FREQS, latency))
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
    planner = Planner(schedule, profile)
    return profile, planner.plan(), plan_pipeline(planner)[0], schedule, profiling


def test_no_clock_is_held_for_less_than_a_switch():
    free_profile, free, _, schedule, _ = plan_with(None)
    held_profile, raw, held, _, profiling = plan_with(0.01)
    assert held_profile.points == free_profile.points  # every clock stays a choice
    assert held_profile.switch_latency_s(0) == held_profile.switch_latency_s(1) == 0.01
    times = {key: {p.frequency: p.time for p in pts} for key, pts in held_profile.points.items()}

    def short_runs(stage: int, clocks: tuple[int, ...] | list[int]) -> list[range]:
        row = schedule.stages[stage]
        return [
            run
            for run in segments(clocks)
            if sum(times[(stage, row[i].kind.value)][clocks[i]] for i in run) < 0.01
            and any(clocks[j] > clocks[run.start] for j in (run.start - 1, run.stop) if 0 <= j < len(row))
        ]

    assert short_runs(0, raw.stage_frequencies(0))  # the solver alone plans 4 ms forwards apart
    for s in range(2):
        assert not short_runs(s, held.stage_frequencies[s])
        assert all(h >= r for h, r in zip(held.stage_frequencies[s], raw.stage_frequencies(s)))
    assert min(held.stage_frequencies[0]) < PRESET.max_mhz  # still slowed where a switch has the time
    assert held.iteration_time_s <= raw.iteration_time_s + 1e-12
    assert plan_with(None)[2].stage_frequencies == tuple(tuple(free.stage_frequencies(s)) for s in range(2))
    cached = profiling.model_profile("a100")
    assert cached is not None and cached.switch_latency_s() == 0.01  # the signature cache keeps it
    # Per target clock too: each stage's own in the pipeline's profile, and in the cache.
    assert held_profile.switch_latencies_s(0) == held_profile.switch_latencies_s(1) == dict.fromkeys(FREQS, 0.01)
    assert cached.switch_latencies_s() == dict.fromkeys(FREQS, 0.01)


def test_a_plan_whose_saving_the_switches_eat_is_warned_about(caplog):
    import logging

    from perseus.service.planning import make_planner
    from perseus.service.results import _warn_switches

    spec = JobSpec(2, 2, schedule_name="1f1b", num_microbatches=6, gpu_model="a100")
    schedule = build_schedule("1f1b", 2, 6)
    profiling = Profiling(spec)
    for s in range(2):  # an outsider's balanced stages: 6 ms forwards and 12 ms backwards, 30 ms switches
        profiling.take("a100", s, 0, stage_profile(s, Work(0.006), Work(0.012), 0.03), f"stage-{s}")
    profile = profiling.pipeline_profile(schedule, ("a100", "a100"))
    assert profile is not None
    result, document = plan_pipeline(make_planner(schedule, profile))
    switches = document["switches"]
    assert switches["latency_s"] == 0.03 and 0.006 < switches["median_instruction_s"] < 0.013
    saving = 1 - result.energy_j / result.baseline_energy_j
    instant = 1 - switches["instant_switch_energy_j"] / result.baseline_energy_j
    assert instant > saving + 0.01 and saving < instant / 2  # the switches take what the clocks alone would save
    with caplog.at_level(logging.WARNING, logger="perseus.service.results"):
        _warn_switches("job-0123456789abcdef", (("a100", "a100"), None), result, switches)
    assert "a switch takes up to 30 ms and the median instruction" in caplog.text
    caplog.clear()
    instant_profile = Profile(profile.points, profile.blocking_power_w, {})  # no latency: nothing lost, nothing said
    free, free_document = plan_pipeline(make_planner(schedule, instant_profile))
    _warn_switches("job-0123456789abcdef", (("a100", "a100"), None), free, free_document["switches"])
    assert free_document["switches"]["latency_s"] == 0.0 and not caplog.text

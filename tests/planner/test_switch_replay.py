"""Replaying a stage's plan with clock switch latencies (perseus.planner.switches.stage_run): what
a simulated GPU under the frequency controller really runs, and plans that spend less so replayed."""

from __future__ import annotations

import math

import pytest

from perseus.clock import VirtualClock
from perseus.controller import FrequencyController
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import SimRealism
from perseus.devices.sim_work import Work, predict
from perseus.planner import Planner, switches
from perseus.planner.switches import (
    _Replay,
    clock_changes,
    followable,
    profile_latency,
    raise_short_segments,
    stage_run,
)
from perseus.profiler.profile import SWITCH_LATENCIES_META, SWITCH_LATENCY_META, Profile, ProfilePoint
from perseus.schedules import build_schedule

PRESET = PRESETS["a100-sxm"]
REALISM = SimRealism(switch_latency_s=0.01, switch_latency_low_extra_s=0.02)


def latency(target: int) -> float:
    return REALISM.switch_latency_for(PRESET, target)


def table(work: Work) -> dict[int, tuple[float, float]]:
    return {f: predict(PRESET, work, f) for f in PRESET.frequencies}


def test_a_lower_clock_comes_in_a_latency_after_its_segment_starts_a_higher_one_before():
    flat = {1410: 0.01, 990: 0.02}.__getitem__
    force = clock_changes([1410, 990, 990, 1410], [0.0, 0.01, 0.03, 0.05], flat)
    assert force[0] == (-math.inf, 1410, -math.inf)  # the plan repeats: the last instruction's clock
    assert force[1] == pytest.approx((0.01 + 0.02, 990, 0.01))  # asked for as its segment starts
    assert force[2] == pytest.approx((0.05 - 0.25 * 0.01 - 0.001, 1410, 0.05 - 0.0135))  # asked early, in force early


def test_a_request_replaces_one_not_yet_in_force():
    # 990 is asked for at 0.01 (in force at 0.03), 1410 for the instruction at 0.02 at once: 990 never comes.
    force = clock_changes([1410, 990, 1410], [0.0, 0.01, 0.02], {1410: 0.01, 990: 0.02}.__getitem__)
    assert [clock for _, clock, _ in force] == [1410, 1410]


def test_a_segment_shorter_than_its_switch_runs_at_the_clock_before_it():
    work = Work(0.006)
    tables = [table(work)] * 3
    clocks, starts = [1410, 810, 1410], [0.0, 0.007, 0.02]
    times, energies = stage_run(tables, clocks, starts, latency)
    assert times[1] == pytest.approx(tables[1][1410][0])  # 810 MHz would be in force only after it ended
    assert energies[1] == pytest.approx(tables[1][1410][1])


def test_replay_matches_a_simulated_gpu_under_the_controller(tmp_path):
    """The same stage plan on a latent simulated GPU (virtual clock) under the frequency
    controller: each instruction's time and energy as `stage_run` replays them from its start."""
    gpu = SimGPU("a100-sxm", 0, clock=VirtualClock(), state_dir=str(tmp_path), realism=REALISM)
    controller = FrequencyController(gpu, handle_signals=False, watchdog=False)
    works = [Work(0.006), Work(0.012), Work(0.006), Work(0.012), Work(0.006), Work(0.012), Work(0.006), Work(0.012)]
    order = [("forward" if k % 2 == 0 else "backward", k // 2, 0) for k in range(len(works))]
    clocks = [1410, 990, 990, 990, 1410, 1410, 810, 810]
    controller.set_plan(order, clocks)
    for _ in range(3):  # the controller times its early changes on the iteration before
        controller.begin_iteration()
        starts, times, energies = [], [], []
        for key, work in zip(order, works):
            controller.before_instruction(*key)
            assert controller.wait_applied(30.0)
            starts.append(gpu.clock.now())
            energy = gpu.energy_mj()
            gpu.execute(work)
            times.append(gpu.clock.now() - starts[-1])
            energies.append((gpu.energy_mj() - energy) / 1000)
            controller.after_instruction()
            gpu.clock.sleep(0.002)
    controller.close()
    replayed = stage_run([table(w) for w in works], clocks, starts, latency)
    assert replayed[0] == pytest.approx(times, rel=1e-6)
    assert replayed[1] == pytest.approx(energies, rel=1e-6)
    at_plan = [table(w)[f] for w, f in zip(works, clocks)]
    assert sum(energies) > sum(e for _, e in at_plan)  # the latencies cost energy the plan's figures leave out


def pipeline_profile(latencies: dict[int, float] | None) -> Profile:
    points = {}
    for stage, scale in enumerate((1.0, 1.0, 1.3, 1.3)):
        for kind, seconds in (("forward", 0.006), ("backward", 0.012)):
            work = Work(seconds * scale)
            points[(stage, kind)] = [ProfilePoint(f, *predict(PRESET, work, f)) for f in PRESET.frequencies[::8]]
    meta = {}
    if latencies is not None:
        meta[SWITCH_LATENCY_META] = str(max(latencies.values()))
        meta[SWITCH_LATENCIES_META] = ",".join(f"{f}:{s}" for f, s in latencies.items())
    return Profile(points, PRESET.idle_w, meta)


def test_followable_plans_save_more_replayed_than_raising_alone_and_never_run_longer():
    latencies = {f: latency(f) for f in PRESET.frequencies[::8]}
    schedule = build_schedule("1f1b", 4, 8)
    profile = pipeline_profile(latencies)
    planner = Planner(schedule, profile)
    plan = planner.plan()
    per_stage = [profile_latency(profile, s) for s in range(4)]
    assert per_stage[0](PRESET.frequencies[8]) == pytest.approx(latencies[PRESET.frequencies[8]])
    followed = followable(planner, plan, per_stage)
    assert followed.iteration_time_s <= plan.iteration_time_s * (1 + 1e-12)
    assert followed.energy_j > plan.energy_j  # the per-instruction figures were too good
    frequencies = dict(plan.frequencies)
    for row in schedule.stages:
        times = [{p.frequency: p.time for p in profile.points_for(ins, schedule)} for ins in row]
        raised = raise_short_segments([plan.frequencies[i] for i in row], times, max(latencies.values()))
        frequencies.update(zip(row, raised))
    _, raised_energy = _Replay(planner, frequencies, per_stage).replayed()
    assert followed.energy_j < raised_energy
    assert followed.energy_j < planner.max_frequency_energy_j  # still a saving


def test_without_latencies_the_plan_is_unchanged():
    schedule = build_schedule("1f1b", 4, 8)
    profile = pipeline_profile(None)
    planner = Planner(schedule, profile)
    plan = planner.plan()
    assert followable(planner, plan, [profile_latency(profile, s) for s in range(4)]) is plan


@pytest.mark.skipif(switches._flow is None, reason="the planner's C extension is not built here")
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_the_c_replay_gives_the_python_bits(monkeypatch, scale):
    """A merge replays its stage in C for every move it tries: the same plan, times and energies
    as the Python replay, on latencies that leave most segments short (scale 3: 30-90 ms)."""
    latencies = {f: scale * latency(f) for f in PRESET.frequencies[::8]}
    schedule = build_schedule("1f1b", 4, 8)
    profile = pipeline_profile(latencies)
    planner = Planner(schedule, profile)
    per_stage = [profile_latency(profile, s) for s in range(4)]
    plans = [planner.plan(), planner.plan(max_slowdown=1.1, padded=True)]
    in_c = [followable(planner, plan, per_stage) for plan in plans]
    replay = _Replay(planner, plans[0].frequencies, per_stage)
    start, _ = replay.arrays.longest_path(replay.nominal())
    first = start[replay.nodes[1]]
    moves = [None, (2, 5, max(replay.clocks[1])), (0, 1, min(replay.clocks[1]))]
    c_runs = [replay._run(1, first, move) for move in moves]
    monkeypatch.setattr(switches, "_flow", None)
    assert [followable(planner, plan, per_stage) for plan in plans] == in_c
    assert [replay._run(1, first, move) for move in moves] == c_runs
    assert any(f.frequencies != p.frequencies for f, p in zip(in_c, plans))  # the merge moved something

"""The sweep: the service's design of steps (perseus.service.sweep) and a rank's walk over them
(perseus.profiler.sweep): order, early stop, bounded repeats where the energy is uncertain."""

from __future__ import annotations

import pytest

from perseus.exceptions import ConfigError
from perseus.profiler.profile import KINDS
from perseus.profiler.sweep import Sweep, SweepPlan
from perseus.service.sweep import design_steps

FREQS = (1410, 1200, 990, 810, 630)


def plan(freqs=FREQS, n=3) -> SweepPlan:
    return SweepPlan(tuple(freqs), n, tuple(dict(zip(KINDS, s)) for s in design_steps(freqs, n)))


def test_each_frequency_runs_uniform_then_mixed_with_the_previous_one():
    steps = [dict(zip(KINDS, s)) for s in design_steps(FREQS, 3)]
    assert len(steps) == 15
    first, forward_alone, backward_alone = steps[3:6]  # the block of 1200 MHz
    assert set(first.values()) == {1200}
    assert forward_alone["forward"] == 1200 and forward_alone["backward"] == 1410
    assert backward_alone["forward"] == 1410 and backward_alone["backward"] == 1200
    assert backward_alone["backward_input"] == 1200 and forward_alone["backward_weight"] == 1200  # groups 0/2 vs 1
    assert steps[1]["forward"] == 1410 and steps[1]["backward"] == 1200  # the first mixes with the next one
    assert design_steps((1410,), 2) == ((1410,) * 4, (1410,) * 4)  # one clock: nothing to mix with
    assert all(set(s) == {f} for s, f in zip(design_steps(FREQS, 1), FREQS))  # one step: uniform only
    four = [dict(zip(KINDS, s)) for s in design_steps(FREQS, 4)][5:8]  # 1200's mixed steps, zero-bubble kinds
    assert [sorted(k for k, f in s.items() if f == 1200) for s in four] == [
        ["forward"],
        ["backward", "backward_input"],
        ["backward_weight"],
    ]
    with pytest.raises(ConfigError, match="at least one"):
        design_steps((), 3)


def walk(sweep: Sweep, energy, error=lambda f: 0.001):
    """Run the sweep to its end; `energy(f)` is the stage's energy per iteration at f."""
    ran = []
    while (index := sweep.next_step()) is not None:
        ran.append(index)
        block = sweep.step_done(index)
        if block is not None:
            f = sweep.plan.frequencies[block]
            sweep.evaluated(block, energy(f), {g: error(g) for g in sweep.profiled_frequencies + [f]})
        assert len(ran) < 200
    return ran


def test_blocks_run_in_order_and_stop_after_three_rises():
    sweep = Sweep(0, early_stop_rises=3)
    sweep.follow(plan(FREQS + (450, 300), 2))
    ran = walk(sweep, {1410: 10.0, 1200: 8.0, 990: 9.0, 810: 9.5, 630: 10.0, 450: 5.0, 300: 1.0}.get)
    assert ran == list(range(10))  # 1410..630: 990, 810, 630 are three rises past 1200's minimum
    assert sweep.done and sweep.profiled_frequencies == [1410, 1200, 990, 810, 630]
    assert sweep.iteration_energy()[1200] == 8.0


def test_the_count_of_frequencies_is_a_bound_until_the_main_sweep_stops():
    sweep = Sweep(0, early_stop_rises=3)
    assert sweep.frequency_count == (0, False)
    sweep.follow(plan(FREQS + (450, 300), 2))
    assert sweep.frequency_count == (7, False)  # the service's plan: at most 7
    walk(sweep, {1410: 10.0, 1200: 8.0, 990: 9.0, 810: 9.5, 630: 10.0}.get)
    assert sweep.frequency_count == (5, True)  # stopped early: the 5 it profiled
    whole = Sweep(0)
    whole.follow(plan(FREQS, 1))
    walk(whole, lambda f: f / 1000)
    assert whole.frequency_count == (5, True)


def test_a_dip_resets_the_rise_count():
    sweep = Sweep(0, early_stop_rises=2)
    sweep.follow(plan((1410, 1320, 1230, 1140), 1))
    assert walk(sweep, {1410: 10.0, 1320: 11.0, 1230: 9.0, 1140: 9.5}.get) == [0, 1, 2, 3]


def test_a_rise_within_the_fits_error_does_not_stop_the_sweep():
    # A fine grid near the top clock: energy still falls, by less than the counter's noise.
    freqs = (1410, 1395, 1380, 1365, 1350, 1335, 1320)
    noisy = {1410: 100.0, 1395: 100.4, 1380: 100.3, 1365: 100.5, 1350: 99.0, 1335: 98.5, 1320: 98.0}
    sweep = Sweep(0, early_stop_rises=3)
    sweep.follow(plan(freqs, 1))
    walk(sweep, noisy.get, error=lambda f: 0.006)
    assert sweep.profiled_frequencies == list(freqs)
    exact = Sweep(0, early_stop_rises=3)  # the same energies measured exactly: three rises
    exact.follow(plan(freqs, 1))
    walk(exact, noisy.get, error=lambda f: 0.0)
    assert exact.profiled_frequencies == list(freqs[:4])
    unknown = Sweep(0, early_stop_rises=3)  # an error the fit cannot tell: judged at RISE_ERROR_CAP
    unknown.follow(plan(freqs, 1))
    walk(unknown, noisy.get, error=lambda f: float("inf"))
    assert unknown.profiled_frequencies == list(freqs)


def test_uncertain_frequencies_are_profiled_again_within_bounds():
    sweep = Sweep(0, target_error=0.01, max_repeats=2, max_extra_fraction=1.0)
    sweep.follow(plan(FREQS, 3))
    ran = walk(sweep, lambda f: f / 1000, error=lambda f: 0.05 if f == 990 else 0.001)
    assert ran[:15] == list(range(15))
    assert ran[15:] == [6, 7, 8, 6, 7, 8]  # 990's block twice more, then the bound stops it
    assert sweep.repeats == 2  # what rank 0's progress line counts once every clock is profiled
    bounded = Sweep(0, target_error=0.01, max_repeats=5, max_extra_fraction=0.2)
    bounded.follow(plan(FREQS, 3))
    assert walk(bounded, lambda f: f / 1000, error=lambda f: 0.05)[15:] == [0, 1, 2]  # 3 of 15 * 0.2
    assert bounded.repeats == 1


def test_a_changed_plan_and_bad_settings_are_refused():
    sweep = Sweep(0)
    sweep.follow(plan())
    sweep.follow(plan())  # the same plan again: fine
    with pytest.raises(ConfigError, match="changed the sweep"):
        sweep.follow(plan(FREQS[:3]))
    with pytest.raises(ConfigError, match="disagree"):
        SweepPlan(FREQS, 3, ())
    with pytest.raises(ConfigError, match="early_stop_rises"):
        Sweep(0, early_stop_rises=0)

"""The pieces under the online profiler: the least-squares fit over counter windows, the counter
sampler (grid recovery on a stepping counter, continuous counters, irregular ones) and the
timeline (spans cut where the clock changed)."""

from __future__ import annotations

import math
import random

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import SimRealism
from perseus.devices.sim_work import Work
from perseus.profiler.energy_fit import IDLE, Segment, Window, fit_powers
from perseus.profiler.sampler import Change, CounterSampler, _grid_instants
from perseus.profiler.timeline import BETWEEN, Timeline, column


def synthetic(powers, segments, period=0.1, end=None, offset=0.0):
    """Exact windows of a counter updating every `period` over piecewise-constant power."""
    end = end or max(s.end for s in segments)

    def energy(t):
        total = powers[IDLE] * t
        for s in segments:
            total += (powers[s.column] - powers[IDLE]) * max(0.0, min(s.end, t) - s.start)
        return total

    instants = [offset + k * period for k in range(int((end - offset) / period) + 1)]
    return [Window(a, b, energy(b) - energy(a)) for a, b in zip(instants, instants[1:])]


def test_exact_windows_give_exact_powers():
    rng = random.Random(1)
    powers = {IDLE: 80.0, "f": 300.0, "b": 260.0}
    segments, t = [], 0.0
    for _ in range(60):
        for col, d in (("f", 0.007), ("b", 0.013)):
            t += rng.uniform(0.001, 0.02)
            segments.append(Segment(t, t + d, col))
            t += d
    fit = fit_powers(synthetic(powers, segments), segments, [(0.0, t)])
    for col, p in powers.items():
        assert fit.power_w[col] == pytest.approx(p, rel=1e-9)
        assert fit.relative_error(col) < 0.01
    assert fit.rms_residual_j < 1e-9


def test_windows_outside_the_watched_ranges_are_left_out_and_events_are_spread():
    powers = {IDLE: 80.0, "f": 300.0, BETWEEN: 0.0}
    segments = [Segment(0.05 + 0.2 * k, 0.15 + 0.2 * k, "f") for k in range(20) if k != 5]
    windows = synthetic(powers, segments, period=0.03)
    # Between 1.0 and 1.2 the framework's own work ran: 5 J beyond blocking power, spread evenly.
    gap = Segment(1.0, 1.2, BETWEEN, event=True)
    hit = [
        Window(w.start, w.end, w.energy_j + 5.0 * max(0.0, min(w.end, 1.2) - max(w.start, 1.0)) / 0.2) for w in windows
    ]
    fit = fit_powers(hit, [*segments, gap], [(0.0, 4.0)])
    assert fit.power_w[BETWEEN] == pytest.approx(5.0, rel=1e-6)  # joules per gap
    assert fit.power_w["f"] == pytest.approx(300.0, rel=1e-9)
    assert fit_powers(windows, segments, [(5.0, 6.0)]).windows == 0  # no window inside: nothing fitted


def test_columns_the_windows_cannot_tell_apart_are_reported_unidentified():
    # f and g always run back to back in the same proportion, inside every window.
    segments = [Segment(0.1 * k, 0.1 * k + 0.03, "f") for k in range(50)]
    segments += [Segment(0.1 * k + 0.03, 0.1 * k + 0.09, "g") for k in range(50)]
    windows = synthetic({IDLE: 80.0, "f": 300.0, "g": 200.0}, segments, period=0.1)
    fit = fit_powers(windows, segments, [(0.0, 5.0)])
    assert math.isinf(fit.relative_error("f")) and math.isinf(fit.relative_error("g"))


def changes_of(instants, poll, phase, jitter=0.0, seed=0):
    """The Changes a sampler polling every `poll` s sees of a counter updating at `instants`."""
    rng = random.Random(seed)
    out = []
    for u in instants:
        k = math.ceil((u - phase) / poll)
        by = phase + k * poll + rng.uniform(0, jitter)
        out.append(Change(by - poll, by, by, u))
    return out


def test_a_regular_counter_gives_away_its_grid():
    truth = [0.0137 + 0.1 * k for k in range(60)]
    grid = _grid_instants(changes_of(truth, 0.0017, 0.0003))
    assert grid is not None
    assert max(abs(u - t) for (u, _), t in zip(grid, truth)) < 2e-5
    assert all(err < 1e-4 for _, err in grid)
    irregular = [0.1 * k + random.Random(k).uniform(-0.02, 0.02) for k in range(60)]
    assert _grid_instants(changes_of(irregular, 0.0017, 0.0003)) is None  # falls back to brackets


def test_the_sampler_on_a_stepping_and_on_a_continuous_counter(tmp_path):
    for period in (0.1, 0.0):
        clock = VirtualClock(10.0)
        gpu = SimGPU("a100-sxm", 0, clock=clock, state_dir=str(tmp_path), realism=SimRealism(counter_period_s=period))
        exact = SimGPU("a100-sxm", 0, clock=clock, state_dir=str(tmp_path))  # the same GPU, read ideally
        truth: dict[float, float] = {}

        def note(clock=clock, exact=exact, truth=truth):
            truth[round(clock.now(), 6)] = exact.energy_mj() / 1000

        ticker = clock.every(0.1, note)
        sampler = CounterSampler(gpu)
        sampler.start()
        for _ in range(30):
            gpu.execute(Work(0.02))
            clock.advance(0.013)
        sampler.stop()
        sampler.stop()  # idempotent
        ticker.cancel()
        clock.advance(1.0)  # not sampled
        windows = sampler.windows()
        assert len(windows) > 5 and all(w.end > w.start for w in windows)
        if period:
            assert sampler.update_period_s() == pytest.approx(0.1, rel=1e-3)
            assert all(abs(w.start - round(w.start, 1)) < 1e-3 for w in windows)  # the counter's grid
            start, end = round(windows[0].start, 1), round(windows[-1].end, 1)
            assert sum(w.energy_j for w in windows) == pytest.approx(truth[end] - truth[start], rel=1e-9)
        else:
            assert all(w.end - w.start >= 0.005 for w in windows)
            assert sampler.update_period_s() < 0.005
        assert all(0.999 * gpu.preset.idle_w < w.energy_j / (w.end - w.start) < gpu.preset.tdp_w for w in windows)


def test_the_timeline_cuts_spans_at_clock_changes():
    tl = Timeline()
    tl.clock_change(0.0, 1410)
    tl.span((0, "forward"), 1.0, 2.0)
    tl.clock_change(2.5, 1005)
    tl.span((0, "backward"), 2.2, 3.0)  # straddles the change at 2.5
    tl.clock_change(3.5, 990)
    tl.clock_change(3.4, 810)  # a change before the last one came into force supersedes it
    tl.span((0, "forward"), 3.6, 4.0)
    tl.watched(1.0, 4.0)
    f, b, f2 = tl.spans
    assert (tl.clock_of(f), tl.clock_of(b), tl.clock_of(f2)) == (1410, None, 810)
    assert [(s.start, s.end, s.column) for s in tl.segments()] == [
        (1.0, 2.0, column((0, "forward"), 1410)),
        (2.2, 2.5, column((0, "backward"), 1410)),
        (2.5, 3.0, column((0, "backward"), 1005)),
        (3.6, 4.0, column((0, "forward"), 810)),
    ]
    tl.between(4.0, 4.5)
    tl.watched(4.5, 5.0)
    assert tl.covered() == [(1.0, 5.0)]
    assert tl.segments()[-1] == Segment(4.0, 4.5, BETWEEN, event=True)

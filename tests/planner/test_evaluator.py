"""The evaluator against a hand-computed two-stage example, and its fast array path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from perseus.exceptions import ConfigError
from perseus.planner import Evaluator, build_dag, evaluate, max_frequencies, shared_frequencies, uniform_frequencies
from perseus.profiler import Profile, ProfilePoint, load_profile
from perseus.schedules import Instruction, Kind, build_schedule

GPT3 = Path(__file__).resolve().parents[2] / "../shared/data/perseus-sosp24/stage_profiles/gpt3-175b+a100_sxm_bf16.csv"


def hand_profile() -> Profile:
    P = ProfilePoint
    return Profile(
        {
            (0, "forward"): [P(1000, 1.0, 10.0), P(500, 2.0, 8.0)],
            (0, "backward"): [P(1000, 2.0, 20.0), P(500, 4.0, 16.0)],
            (1, "forward"): [P(1000, 1.5, 15.0), P(500, 3.0, 12.0)],
            (1, "backward"): [P(1000, 3.0, 30.0), P(500, 6.0, 24.0)],
        },
        blocking_power_w=2.0,
    )


def ins(text: str) -> Instruction:
    """'F0@s1' -> Instruction(1, forward, 0)."""
    kinds = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.BACKWARD_INPUT, "W": Kind.BACKWARD_WEIGHT}
    head, stage = text.split("@s")
    return Instruction(int(stage), kinds[head[0]], int(head[1:]))


def test_all_max_by_hand():
    # 1F1B, 2 stages, 2 microbatches. Stage 0: F0 F1 B0 B1; stage 1: F0 B0 F1 B1.
    # F0@s0 [0,1]  F1@s0 [1,2]  F0@s1 [1,2.5]  B0@s1 [2.5,5.5]  F1@s1 [5.5,7]  B1@s1 [7,10]
    # B0@s0 [5.5,7.5]  B1@s0 [10,12]  ->  T = 12
    # sum t = 6 + 9 = 15, sum e = 60 + 90 = 150, E = 150 + 2 * (2 * 12 - 15) = 168
    s = build_schedule("1f1b", 2, 2)
    result = evaluate(s, max_frequencies(s, hand_profile()), hand_profile())
    assert result.iteration_time_s == pytest.approx(12.0)
    assert result.energy_j == pytest.approx(168.0)
    expected = {
        "F0@s0": (0, 1),
        "F1@s0": (1, 2),
        "F0@s1": (1, 2.5),
        "B0@s1": (2.5, 5.5),
        "F1@s1": (5.5, 7),
        "B1@s1": (7, 10),
        "B0@s0": (5.5, 7.5),
        "B1@s0": (10, 12),
    }
    timeline = {str(k): v for k, v in result.timeline.items()}
    assert timeline.keys() == expected.keys()
    for name, span in expected.items():
        assert timeline[name] == pytest.approx(span), name
    s0, s1 = result.stages
    assert (s0.busy_time_s, s0.blocked_time_s, s0.compute_energy_j, s0.blocking_energy_j) == pytest.approx(
        (6, 6, 60, 12)
    )
    assert (s1.busy_time_s, s1.blocked_time_s, s1.compute_energy_j, s1.blocking_energy_j) == pytest.approx(
        (9, 3, 90, 6)
    )
    assert s0.energy_j + s1.energy_j == pytest.approx(result.energy_j)
    assert [str(i) for i in result.critical_path()] == ["F0@s0", "F0@s1", "B0@s1", "F1@s1", "B1@s1", "B1@s0"]


def test_mixed_plan_by_hand():
    # F0@s0 and B0@s0 at 500 MHz: F0@s0 [0,2]  F1@s0 [2,3]  F0@s1 [2,3.5]  B0@s1 [3.5,6.5]
    # F1@s1 [6.5,8]  B1@s1 [8,11]  B0@s0 [6.5,10.5]  B1@s0 [11,13]  ->  T = 13
    # sum t = 9 + 9 = 18, sum e = 54 + 90 = 144, E = 144 + 2 * (26 - 18) = 160
    s = build_schedule("1f1b", 2, 2)
    plan = max_frequencies(s, hand_profile())
    plan[ins("F0@s0")] = plan[ins("B0@s0")] = 500
    result = evaluate(build_dag(s), plan, hand_profile())
    assert (result.iteration_time_s, result.energy_j) == pytest.approx((13.0, 160.0))
    assert result.timeline[ins("B0@s0")] == pytest.approx((6.5, 10.5))
    assert result.frequencies[ins("F0@s0")] == 500
    assert [str(i) for i in result.critical_path()][0] == "F0@s0"


def test_array_path_agrees_and_batches():
    s = build_schedule("1f1b", 2, 2)
    ev = Evaluator(s, hand_profile())
    choices = np.zeros(len(ev.nodes), dtype=np.int64)
    t, e = ev.times_energies(choices)
    assert ev.evaluate_arrays(t, e) == pytest.approx((12.0, 168.0))
    slow = ev.choice_indices(uniform_frequencies(s, hand_profile(), 500))
    t2, e2 = ev.times_energies(slow)
    tt, ee = ev.times_energies(np.stack([choices, slow]))
    assert np.array_equal(tt, np.stack([t, t2])) and np.array_equal(ee, np.stack([e, e2]))
    T, E = ev.evaluate_arrays(tt, ee)
    assert T == pytest.approx([12.0, 24.0]) and E == pytest.approx([168.0, 120 + 2 * (48 - 30)])
    assert ev.frequencies_of(slow) == uniform_frequencies(s, hand_profile(), 500)


def test_time_energy_of_node_frequencies_is_evaluate_s():
    # The planner's check of every plan: each node's MHz in node order, no dict of instructions.
    s = build_schedule("1f1b", 2, 2)
    ev = Evaluator(s, hand_profile())
    plan = max_frequencies(s, hand_profile())
    plan[ins("B0@s0")] = 500
    plan[ins("F1@s1")] = 500
    result = ev.evaluate(plan)
    frequencies = np.array([plan[i] for i in ev.nodes])
    assert ev.time_energy(frequencies) == (result.iteration_time_s, result.energy_j)
    assert np.array_equal(ev.frequency_indices(frequencies), ev.choice_indices(plan))
    frequencies[ev.nodes.index(ins("B1@s1"))] = 750
    with pytest.raises(ConfigError, match=r"B1@s1: frequency 750 MHz is not in the profile of stage 1 backward"):
        ev.time_energy(frequencies)
    frequencies[ev.nodes.index(ins("B1@s1"))] = 2000  # above every profiled one
    with pytest.raises(ConfigError, match="frequency 2000 MHz"):
        ev.time_energy(frequencies)


def test_unknown_frequency_and_missing_instruction():
    s = build_schedule("1f1b", 2, 2)
    plan = max_frequencies(s, hand_profile())
    plan[ins("B1@s1")] = 750
    with pytest.raises(ConfigError, match=r"B1@s1: frequency 750 MHz is not in the profile of stage 1 backward"):
        evaluate(s, plan, hand_profile())
    del plan[ins("B1@s1")]
    with pytest.raises(ConfigError, match="no frequency given for instruction B1@s1"):
        evaluate(s, plan, hand_profile())
    with pytest.raises(ConfigError, match="frequency 750 MHz"):
        uniform_frequencies(s, hand_profile(), 750)
    assert shared_frequencies(s, hand_profile()) == [1000, 500]


def test_interleaved_profile_by_virtual_stage_or_rank():
    s = build_schedule("interleaved-1f1b", 2, 2, num_chunks=2)
    by_rank = hand_profile()
    four = Profile(
        {
            (st, k): pts
            for st in range(4)
            for k, pts in [
                ("forward", by_rank.points[(st % 2, "forward")]),
                ("backward", by_rank.points[(st % 2, "backward")]),
            ]
        },
        2.0,
    )
    four.points[(3, "forward")] = [ProfilePoint(1000, 5.0, 50.0)]
    four.points[(3, "backward")] = [ProfilePoint(1000, 5.0, 50.0)]
    c1 = Instruction(1, Kind.FORWARD, 0, chunk=1)
    assert by_rank.stage_for(c1, s) == 1 and four.stage_for(c1, s) == 3
    a = evaluate(s, max_frequencies(s, by_rank), by_rank)
    b = evaluate(s, max_frequencies(s, four), four)
    assert b.timeline[c1][1] - b.timeline[c1][0] == pytest.approx(5.0)
    assert a.timeline[c1][1] - a.timeline[c1][0] == pytest.approx(1.5)


def test_zb_h1_with_derived_split():
    s = build_schedule("zb-h1", 2, 2)
    profile = hand_profile().with_split_backward(0.25)
    result = evaluate(s, max_frequencies(s, profile), profile)
    i0 = Instruction(0, Kind.BACKWARD_INPUT, 0)
    assert result.timeline[i0][1] - result.timeline[i0][0] == pytest.approx(0.5)
    assert sum(st.compute_energy_j for st in result.stages) == pytest.approx(150.0)


@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus SOSP'24 data not present")
def test_real_gpt3_profile_all_max():
    profile = load_profile(GPT3, blocking_power_w=83.64)
    s = build_schedule("1f1b", 8, 12)
    result = evaluate(s, max_frequencies(s, profile), profile)
    # Every rank waits at some point but never for the whole iteration.
    assert all(0 <= st.blocked_time_s < result.iteration_time_s for st in result.stages)
    busy = [st.busy_time_s for st in result.stages]
    assert result.iteration_time_s >= max(busy)
    recomputed = sum(st.energy_j for st in result.stages)
    assert result.energy_j == pytest.approx(recomputed, rel=1e-12)
    path = result.critical_path()
    assert path[0] == Instruction(0, Kind.FORWARD, 0) and path[-1] == Instruction(0, Kind.BACKWARD, 11)
    # Along the critical path every instruction starts exactly when the previous one ends.
    for u, v in zip(path, path[1:]):
        assert result.timeline[v][0] == pytest.approx(result.timeline[u][1], abs=1e-12)

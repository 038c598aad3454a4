"""Schedule builders: hand-worked orders for small pipelines, and input checking."""

from __future__ import annotations

import pytest

from perseus.exceptions import ConfigError, ScheduleError
from perseus.schedules import SCHEDULES, Instruction, Kind, Schedule, build_schedule


def order(schedule: Schedule) -> list[str]:
    return [" ".join(str(ins) for ins in row) for row in schedule.stages]


def test_names():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


def test_1f1b_2x4_megatron_order():
    assert order(build_schedule("1f1b", 2, 4)) == [
        "F0@s0 F1@s0 B0@s0 F2@s0 B1@s0 F3@s0 B2@s0 B3@s0",
        "F0@s1 B0@s1 F1@s1 B1@s1 F2@s1 B2@s1 F3@s1 B3@s1",
    ]


def test_1f1b_warmup_capped_by_microbatches():
    # 4 stages, 2 microbatches: stage 0 would warm up with 3 forwards but only has 2.
    assert order(build_schedule("1f1b", 4, 2))[0] == "F0@s0 F1@s0 B0@s0 B1@s0"
    assert order(build_schedule("1f1b", 4, 2))[2] == "F0@s2 F1@s2 B0@s2 B1@s2"
    assert order(build_schedule("1f1b", 4, 2))[3] == "F0@s3 B0@s3 F1@s3 B1@s3"


def test_gpipe():
    assert order(build_schedule("gpipe", 2, 3)) == [
        "F0@s0 F1@s0 F2@s0 B0@s0 B1@s0 B2@s0",
        "F0@s1 F1@s1 F2@s1 B0@s1 B1@s1 B2@s1",
    ]


def test_interleaved_2x4_two_chunks():
    # Megatron: rank r warms up with (v-1)N + 2(N-1-r) forwards; chunk of forward k is (k // N) % v.
    s = build_schedule("interleaved-1f1b", 2, 4, num_chunks=2)
    assert s.num_chunks == 2 and s.num_virtual_stages == 4
    assert order(s) == [
        "F0@s0 F1@s0 F0@s0.c1 F1@s0.c1 F2@s0 B0@s0.c1 F3@s0 B1@s0.c1 "
        "F2@s0.c1 B0@s0 F3@s0.c1 B1@s0 B2@s0.c1 B3@s0.c1 B2@s0 B3@s0",
        "F0@s1 F1@s1 F0@s1.c1 B0@s1.c1 F1@s1.c1 B1@s1.c1 F2@s1 B0@s1 "
        "F3@s1 B1@s1 F2@s1.c1 B2@s1.c1 F3@s1.c1 B3@s1.c1 B2@s1 B3@s1",
    ]
    assert [s.virtual_stage(Instruction(r, Kind.FORWARD, 0, c)) for c in (0, 1) for r in (0, 1)] == [0, 1, 2, 3]


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ScheduleError, match="multiple of the number of stages"):
        build_schedule("interleaved-1f1b", 4, 6, num_chunks=2)
    with pytest.raises(ScheduleError, match="at least 2 chunks"):
        build_schedule("interleaved-1f1b", 4, 8, num_chunks=1)


def test_zb_h1_2x4():
    # Rank r delays its first r weight-gradient passes to the end (the cool-down bubble).
    assert order(build_schedule("zb-h1", 2, 4)) == [
        "F0@s0 F1@s0 I0@s0 W0@s0 F2@s0 I1@s0 W1@s0 F3@s0 I2@s0 W2@s0 I3@s0 W3@s0",
        "F0@s1 I0@s1 F1@s1 I1@s1 W0@s1 F2@s1 I2@s1 W1@s1 F3@s1 I3@s1 W2@s1 W3@s1",
    ]


@pytest.mark.parametrize(
    "name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1)]
)
@pytest.mark.parametrize("stages,microbatches", [(1, 3), (3, 3), (4, 8), (8, 16)])
def test_every_schedule_is_complete(name, chunks, stages, microbatches):
    s = build_schedule(name, stages, microbatches, num_chunks=chunks)
    s.validate()
    per_mb = 3 if name == "zb-h1" else 2
    assert len(s.instructions()) == stages * chunks * microbatches * per_mb


def test_unknown_name_lists_schedules():
    with pytest.raises(ConfigError, match="gpipe, 1f1b, interleaved-1f1b, zb-h1"):
        build_schedule("pipedream", 2, 4)


@pytest.mark.parametrize("args", [(0, 4), (2, 0), (2, -1)])
def test_bad_sizes(args):
    with pytest.raises(ConfigError, match="positive integer"):
        build_schedule("1f1b", *args)


def test_chunks_only_for_interleaved():
    with pytest.raises(ConfigError, match="interleaved-1f1b"):
        build_schedule("1f1b", 2, 4, num_chunks=2)


def test_validate_rejects_missing_and_duplicate_and_misplaced():
    F, B = Kind.FORWARD, Kind.BACKWARD
    with pytest.raises(ScheduleError, match="no forward for microbatch 1 on stage 0"):
        Schedule("x", 2, ((Instruction(0, F, 0), Instruction(0, B, 0), Instruction(0, B, 1)),)).validate()
    with pytest.raises(ScheduleError, match="more than once"):
        Schedule("x", 1, ((Instruction(0, F, 0), Instruction(0, F, 0), Instruction(0, B, 0)),)).validate()
    with pytest.raises(ScheduleError, match="listed on stage 0"):
        Schedule("x", 1, ((Instruction(1, F, 0), Instruction(0, B, 0)),)).validate()
    with pytest.raises(ScheduleError, match="outside 0..0"):
        Schedule("x", 1, ((Instruction(0, F, 0), Instruction(0, B, 0), Instruction(0, B, 1)),)).validate()
    with pytest.raises(ScheduleError, match="either one backward"):
        Schedule(
            "x", 1, ((Instruction(0, F, 0), Instruction(0, B, 0), Instruction(0, Kind.BACKWARD_WEIGHT, 0)),)
        ).validate()


def test_v_style_placement_round_trips():
    s = Schedule("v", 1, ((),) * 3, num_chunks=2, style="v")
    assert [s.placement(v) for v in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    for v in range(6):
        rank, chunk = s.placement(v)
        assert s.virtual_stage(Instruction(rank, Kind.FORWARD, 0, chunk)) == v

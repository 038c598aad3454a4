"""The torch.distributed.pipelining converter, against torch's own schedule classes.

torch's schedule classes compute `pipeline_order` in their constructors from a few attributes of
their stages (num_stages, group_size, group_rank, and submod for a torch.compile check); stand-in
stage objects carrying just those let us build the real orders without a process group.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgpack
import pytest

from perseus.exceptions import ConfigError, ScheduleError
from perseus.planner.dag import build_dag
from perseus.schedules import build_schedule, from_torch_pipeline_order
from perseus.service.planning import job_schedule
from perseus.wire.spec import JobSpec

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def stages(num_ranks: int, indices: list[int], total: int, rank: int = 0) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            num_stages=total,
            group_size=num_ranks,
            group_rank=rank,
            stage_index=i,
            is_first=i == 0,
            is_last=i == total - 1,
            submod=None,
        )
        for i in indices
    ]


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 3)])
def test_gpipe_equals_builder(n, m):
    order = schedules.ScheduleGPipe(stages(n, [0], n)[0], m).pipeline_order
    assert from_torch_pipeline_order(order, m).stages == build_schedule("gpipe", n, m).stages


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8)])
def test_1f1b_equals_builder_and_catches_torch_off_by_one(n, m):
    order = schedules.Schedule1F1B(stages(n, [0], n)[0], m).pipeline_order
    ours = build_schedule("1f1b", n, m)
    last = [a for a in order[n - 1] if a is not None and a.computation_type.value == "F"]
    if [a.microbatch_index for a in last] == list(range(1, m + 1)):
        # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..M
        # (its runtime runs 0..M-1): the converter must refuse it, and every other rank must match.
        with pytest.raises(ScheduleError, match=f"microbatch {m}, outside"):
            from_torch_pipeline_order(order, m)
        fixed = dict(order)
        fixed[n - 1] = [
            a._replace(microbatch_index=a.microbatch_index - 1) if a.computation_type.value == "F" else a
            for a in order[n - 1]
        ]
        assert from_torch_pipeline_order(fixed, m).stages == ours.stages
    else:
        assert from_torch_pipeline_order(order, m).stages == ours.stages


@pytest.mark.parametrize("n,v,m", [(2, 2, 4), (4, 2, 8), (2, 3, 4), (4, 2, 4)])
def test_interleaved_equals_builder(n, v, m):
    order = schedules.ScheduleInterleaved1F1B(stages(n, [c * n for c in range(v)], n * v), m).pipeline_order
    converted = from_torch_pipeline_order(order, m)
    assert converted.num_chunks == v and converted.style == "loop"
    assert converted.stages == build_schedule("interleaved-1f1b", n, m, num_chunks=v).stages


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (4, 12)])
def test_zero_bubble_one_chunk_equals_zb_h1(n, m):
    order = schedules.ScheduleInterleavedZeroBubble(stages(n, [0], n), m).pipeline_order
    assert from_torch_pipeline_order(order, m).stages == build_schedule("zb-h1", n, m).stages


@pytest.mark.parametrize("cls", ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"])
def test_v_schedules_convert_to_acyclic_dags(cls):
    n, m = 4, 8
    order = getattr(schedules, cls)(stages(n, [0, 2 * n - 1], 2 * n), m).pipeline_order
    converted = from_torch_pipeline_order(order, m, num_stages=2 * n, name=cls)
    assert converted.style == "v" and converted.num_chunks == 2
    # torch stage 2N-1 (the loss) lives on rank 0's second chunk.
    assert converted.placement(2 * n - 1) == (0, 1)
    graph = build_dag(converted)
    assert graph.number_of_nodes() == len(converted.instructions())
    computes = sum(1 for r in order.values() for a in r if a is not None and a.computation_type.value in "FBIW")
    overlapped = sum(len(a.sub_actions) for r in order.values() for a in r if a is not None and a.sub_actions)
    assert len(converted.instructions()) == computes + overlapped


def test_dualpipev_overlapped_pairs_send_after_the_pair():
    """torch runs an OVERLAP_F_B's sub-actions and only then sends their outputs: a pair's F feeds
    the next rank from the end of the pair's B, and the JobSpec a rank registers carries it."""
    n, m = 4, 8
    order = schedules.ScheduleDualPipeV(stages(n, [0, 2 * n - 1], 2 * n), m).pipeline_order
    converted = from_torch_pipeline_order(order, m, num_stages=2 * n, name="dualpipev")
    pairs = [(r, i) for r, positions in enumerate(converted.overlapped) for i in positions]
    groups = sum(1 for r in order.values() for a in r if a is not None and a.sub_actions)
    assert len(pairs) == groups > 0
    graph = build_dag(converted)
    moved = 0
    for r, i in pairs:
        first, second = converted.stages[r][i], converted.stages[r][i + 1]
        remote = [v for v in graph.successors(first) if v.stage != r]
        assert not remote  # nothing leaves another rank from the pair's first instruction...
        moved += sum(1 for v in graph.successors(second) if v.stage != r)
    assert moved >= len(pairs)  # ...it leaves from the second
    plain = dataclasses.replace(converted, overlapped=())
    assert set(build_dag(plain).edges) != set(graph.edges)
    spec = JobSpec(
        n,
        n,
        schedule_name="dualpipev",
        num_microbatches=m,
        num_chunks=2,
        schedule_style="v",
        stage_orders=tuple(tuple((i.kind.value, i.microbatch, i.chunk) for i in row) for row in converted.stages),
        overlapped=converted.overlapped,
        gpu_model="sim-a100",
    )
    again = JobSpec.from_wire(msgpack.unpackb(msgpack.packb(spec.to_wire())))
    assert again == spec and job_schedule(again) == converted
    assert "overlapped" not in dataclasses.replace(spec, overlapped=None).to_wire()
    with pytest.raises(ConfigError, match="overlapped"):
        dataclasses.replace(spec, overlapped=((5, 3),) + spec.overlapped[1:])
    with pytest.raises(ScheduleError, match="overlapped"):
        dataclasses.replace(converted, overlapped=converted.overlapped[:1]).validate()


def test_rejects_stage_on_two_ranks():
    A = schedules._Action
    F, B = schedules.FORWARD, schedules.FULL_BACKWARD
    order = {0: [A(0, F, 0), A(0, B, 0)], 1: [A(0, F, 0)]}
    with pytest.raises(ScheduleError, match="torch stage 0 runs on both rank 0 and rank 1"):
        from_torch_pipeline_order(order, 1)


def test_rejects_unknown_layout():
    A = schedules._Action
    F, B = schedules.FORWARD, schedules.FULL_BACKWARD
    # Stages 0..3 on ranks 0,0,1,1: neither loop nor V.
    order = {0: [A(s, k, 0) for s in (0, 1) for k in (F, B)], 1: [A(s, k, 0) for s in (2, 3) for k in (F, B)]}
    with pytest.raises(ScheduleError, match="neither loop"):
        from_torch_pipeline_order(order, 1)


@pytest.mark.parametrize(
    "cls,n,v,m",
    [("ScheduleLoopedBFS", 3, 2, 5), ("ScheduleInterleaved1F1B", 4, 2, 6), ("ScheduleInterleavedZeroBubble", 3, 2, 6)],
)
def test_loop_schedules_beyond_our_builders(cls, n, v, m):
    order = getattr(schedules, cls)(stages(n, [c * n for c in range(v)], n * v), m).pipeline_order
    converted = from_torch_pipeline_order(order, m)
    assert converted.style == "loop" and converted.num_chunks == v
    assert build_dag(converted).number_of_nodes() == sum(
        1 for r in order.values() for a in r if a is not None and a.computation_type.value in "FBIW"
    )

"""Convert a torch.distributed.pipelining schedule's `pipeline_order` into a Schedule.

`pipeline_order` maps rank -> list of `_Action(stage_index, computation_type, microbatch_index,
sub_actions)` or None (an idle slot). Compute types F, B (full backward), I and W become
instructions; OVERLAP_F_B contributes its sub-actions in order (all but the last marked
`Schedule.overlapped`: torch sends the group's outputs after it); communication, FSDP,
REDUCE_GRAD and the WAIT_* actions are dropped. The rank and chunk of each torch stage index
come from the order itself (the rank that runs it); chunk = stage_index // N, and the layout
must be torch's "loop" (stage i on rank i % N) or "v" (zig-zag) mapping. Works on the objects only: torch is
not imported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from perseus.exceptions import ScheduleError
from perseus.schedules.instruction import Instruction, Kind, Schedule

_KINDS = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.BACKWARD_INPUT, "W": Kind.BACKWARD_WEIGHT}


def _type_letter(action: Any) -> str:
    """The action's letter: the enum's value from torch 2.11 (a str enum), its str() before (an
    int enum whose __str__ gives the letter), or a plain string."""
    ctype = action.computation_type
    value = getattr(ctype, "value", ctype)
    return value if isinstance(value, str) else str(ctype)


def _compute_actions(actions: Iterable[Any]) -> Iterable[tuple[Any, bool]]:
    """The compute actions, each with whether it runs overlapped with the next one (an
    OVERLAP_F_B's sub-actions but its last: torch sends their outputs after the whole group)."""
    for action in actions:
        if action is None:
            continue
        subs = getattr(action, "sub_actions", None)
        if subs:
            group = [a for a in subs if _type_letter(a) in _KINDS]
            yield from ((a, i < len(group) - 1) for i, a in enumerate(group))
        elif _type_letter(action) in _KINDS:
            yield action, False


def _style(stage_rank: Mapping[int, int], num_ranks: int, num_stages: int) -> str:
    loop = all(stage_rank[i] == i % num_ranks for i in range(num_stages))
    if loop:
        return "loop"
    v = Schedule("v", 1, ((),) * num_ranks, num_stages // num_ranks, style="v")
    if all(stage_rank[i] == v.placement(i)[0] for i in range(num_stages)):
        return "v"
    raise ScheduleError(
        f"torch stage-to-rank mapping {dict(sorted(stage_rank.items()))} is neither loop "
        "(stage i on rank i % N) nor V-shaped; only those two layouts can be converted"
    )


def from_torch_pipeline_order(
    pipeline_order: Mapping[int, list[Any] | None],
    num_microbatches: int,
    num_stages: int | None = None,
    name: str = "torch",
) -> Schedule:
    """A Schedule from torch's `pipeline_order`; `num_stages` is torch's total number of stage
    indices (all chunks of all ranks), inferred from the order when None."""
    num_ranks = len(pipeline_order)
    if num_ranks == 0 or sorted(pipeline_order) != list(range(num_ranks)):
        raise ScheduleError(f"pipeline_order must map ranks 0..N-1 to action lists, got ranks {sorted(pipeline_order)}")
    compute = {r: list(_compute_actions(pipeline_order[r] or [])) for r in range(num_ranks)}
    per_rank = {r: [a for a, _ in compute[r]] for r in range(num_ranks)}
    overlapped = tuple(tuple(i for i, (_, joined) in enumerate(compute[r]) if joined) for r in range(num_ranks))

    stage_rank: dict[int, int] = {}
    for rank, actions in per_rank.items():
        for a in actions:
            owner = stage_rank.setdefault(a.stage_index, rank)
            if owner != rank:
                raise ScheduleError(f"torch stage {a.stage_index} runs on both rank {owner} and rank {rank}")
    if num_stages is None:
        num_stages = max(stage_rank, default=-1) + 1
    if num_stages < num_ranks or num_stages % num_ranks:
        raise ScheduleError(f"{num_stages} torch stages cannot be spread evenly over {num_ranks} ranks")
    missing = sorted(set(range(num_stages)) - set(stage_rank))
    extra = sorted(set(stage_rank) - set(range(num_stages)))
    if missing or extra:
        raise ScheduleError(
            f"pipeline_order lacks torch stages {missing} or has out-of-range stages {extra} (expected "
            f"0..{num_stages - 1})"
        )
    style = _style(stage_rank, num_ranks, num_stages)

    rows = []
    for rank in range(num_ranks):
        row = []
        for a in per_rank[rank]:
            if a.microbatch_index is None:
                raise ScheduleError(f"rank {rank}: compute action {a!r} has no microbatch index")
            row.append(Instruction(rank, _KINDS[_type_letter(a)], int(a.microbatch_index), a.stage_index // num_ranks))
        rows.append(tuple(row))
    schedule = Schedule(
        name,
        num_microbatches,
        tuple(rows),
        num_chunks=num_stages // num_ranks,
        style=style,
        overlapped=overlapped if any(overlapped) else (),
    )
    schedule.validate()
    return schedule

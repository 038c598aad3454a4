"""The torch converter on the action shapes of every supported torch release, whichever torch
is installed: an int-valued computation type whose str() is the letter (2.6 to 2.10), a str
enum (2.11 on), and the actions 2.15 added (WAIT_SEND_F/B, WAIT_REDUCE_GRAD), which are not
instructions."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import pytest

from perseus.schedules import build_schedule, from_torch_pipeline_order


class IntType(enum.Enum):
    """torch 2.6-2.10's _ComputationType: int values, the letter from __str__."""

    FORWARD = 1
    BACKWARD_INPUT = 2
    BACKWARD_WEIGHT = 3
    SEND_F = 6
    FULL_BACKWARD = 10
    REDUCE_GRAD = 12

    def __str__(self) -> str:
        return {1: "F", 2: "I", 3: "W", 6: "SEND_F", 10: "B", 12: "REDUCE_GRAD"}[self.value]


class StrType(str, enum.Enum):
    """torch 2.15's _ComputationType (a str enum), with its new WAIT_* actions."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_F = "SEND_F"
    WAIT_SEND_F = "WAIT_SEND_F"
    FULL_BACKWARD = "B"
    REDUCE_GRAD = "REDUCE_GRAD"
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"


class Action(NamedTuple):
    stage_index: int
    computation_type: Any
    microbatch_index: int | None
    sub_actions: tuple | None = None


def gpipe_order(types: type[enum.Enum], extra: list[str]) -> dict[int, list[Action]]:
    """torch's GPipe order on 2 ranks, 2 microbatches, with communication actions mixed in."""
    t = types.__members__
    order: dict[int, list[Action]] = {}
    for rank in (0, 1):
        actions = []
        for mb in (0, 1):
            actions.append(Action(rank, t["FORWARD"], mb))
            if rank == 0:
                actions.append(Action(rank, t["SEND_F"], mb))
        for mb in (0, 1):
            actions.append(Action(rank, t["FULL_BACKWARD"], mb))
        actions += [Action(rank, t[name], None) for name in extra]
        order[rank] = actions
    return order


@pytest.mark.parametrize(
    "types, extra",
    [(IntType, ["REDUCE_GRAD"]), (StrType, ["REDUCE_GRAD", "WAIT_SEND_F", "WAIT_REDUCE_GRAD"])],
    ids=["torch 2.6-2.10", "torch 2.15"],
)
def test_every_release_converts_to_the_same_schedule(types, extra):
    converted = from_torch_pipeline_order(gpipe_order(types, extra), 2)
    assert converted.stages == build_schedule("gpipe", 2, 2).stages


def test_split_backward_of_the_int_era():
    t = IntType
    order = {
        0: [Action(0, t.FORWARD, 0), Action(0, t.BACKWARD_INPUT, 0), Action(0, t.BACKWARD_WEIGHT, 0)],
        1: [Action(1, t.FORWARD, 0), Action(1, t.BACKWARD_INPUT, 0), Action(1, t.BACKWARD_WEIGHT, 0)],
    }
    kinds = [i.kind.name for i in from_torch_pipeline_order(order, 1).stages[0]]
    assert kinds == ["FORWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"]

"""perseus.wire.Parallelism: one rank's place in a 3D job, passed whole to PerseusRank and instrument."""

from __future__ import annotations

import logging

import pytest

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.exceptions import ConfigError
from perseus.runtime import PerseusRank
from perseus.schedules import build_schedule
from perseus.wire import Parallelism

SCHEDULE = build_schedule("1f1b", 2, 4)
QUIET = {"progress": False, "handle_signals": False, "watchdog": False}


@pytest.fixture
def gpu(tmp_path):
    return SimGPU("a100-sxm", 1, clock=VirtualClock(), state_dir=str(tmp_path))


def test_the_rank_arithmetic_lives_in_parallelism():
    assert Parallelism(2, 1).rank == 1  # pp only: rank = stage
    megatron = Parallelism(2, 1, dp=2, dp_index=1, tp=2, tp_index=1, rank_mapping="megatron")
    assert megatron.rank == 7 and megatron.world_size == 8 and megatron.coordinates == (1, 1, 1)
    torch_order = Parallelism.from_rank(3, 2, dp=2, tp=2, rank_mapping="torch")
    assert torch_order == Parallelism(2, 1, dp=2, dp_index=0, tp=2, tp_index=1, rank_mapping="torch", rank=3)
    with pytest.raises(ConfigError, match="pass rank="):
        Parallelism(2, 1, dp=2, dp_index=1)
    with pytest.raises(ConfigError, match="rank 6 is stage 1, dp_index 1, tp_index 0"):
        Parallelism(2, 1, dp=2, dp_index=1, tp=2, tp_index=1, rank_mapping="megatron", rank=6)
    with pytest.raises(ConfigError, match="stage 2 is outside the pipeline's stages 0..1"):
        Parallelism(2, 2)
    with pytest.raises(ConfigError, match="tp must be a positive integer"):
        Parallelism.from_rank(3, 2, dp=2, tp=0)


def test_a_rank_given_parallelism_registers_what_the_keywords_give(gpu):
    layout = Parallelism(2, 1, dp=2, dp_index=1, tp=2, tp_index=1, rank_mapping="megatron")
    whole = PerseusRank(gpu, SCHEDULE, parallelism=layout, **QUIET)
    keywords = PerseusRank(gpu, SCHEDULE, 1, dp=2, dp_index=1, tp=2, tp_index=1, rank_mapping="megatron", **QUIET)
    try:
        assert whole.job_spec().to_wire() == keywords.job_spec().to_wire()
        assert whole.rank_info() == keywords.rank_info() and whole.parallelism == keywords.parallelism == layout
        assert (whole.rank, whole.stage, whole.dp, whole.dp_index, whole.tp, whole.tp_index, whole.rank_mapping) == (
            7,
            1,
            2,
            1,
            2,
            1,
            "megatron",
        )
    finally:
        whole.close()
        keywords.close()


@pytest.mark.parametrize(
    "args, kwargs, words",
    [
        ((), {"parallelism": Parallelism(2, 1), "dp": 2}, "pass parallelism= or dp=, not both"),
        ((), {"parallelism": Parallelism(3, 1)}, "parallelism.pp is 3 but the schedule has 2 stages"),
        ((0,), {"parallelism": Parallelism(2, 1)}, "pipeline stage is 0 but parallelism.stage is 1"),
        ((), {"parallelism": (2, 1)}, "must be a perseus.wire.Parallelism"),
        ((), {}, "pass stage= or parallelism="),
        ((5,), {}, "stage 5 is outside the schedule's stages 0..1"),
    ],
)
def test_a_parallelism_that_does_not_fit_is_refused(gpu, args, kwargs, words):
    with pytest.raises(ConfigError, match=words):
        PerseusRank(gpu, SCHEDULE, *args, **kwargs, **QUIET)


def test_instrument_takes_torch_distributed_s_rank_and_logs_when_it_fails(monkeypatch, caplog):
    dist = pytest.importorskip("torch.distributed")
    from perseus.runtime import torch_stage

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    assert torch_stage._global_rank(1) == 5

    def torn_down():
        raise RuntimeError("Default process group has not been initialized")

    monkeypatch.setattr(dist, "get_rank", torn_down)
    with caplog.at_level(logging.WARNING, logger="perseus.runtime.torch_stage"):
        assert torch_stage._global_rank(1) == 1  # the pipeline rank, as without torch.distributed
    assert "Default process group has not been initialized" in caplog.text
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert torch_stage._global_rank(1) == 1

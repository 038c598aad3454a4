"""Which visible GPUs a rank of a distributed job owns (what Monitor() measures by default)."""

from __future__ import annotations

import pytest

from perseus.devices import local_gpu_indices
from perseus.exceptions import ConfigError


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_outside_a_distributed_job_every_gpu_is_ours():
    assert local_gpu_indices(4) is None


def test_one_gpu_per_rank_is_the_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_gpu_indices(2) == [1]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # some launchers set only LOCAL_RANK
    assert local_gpu_indices(4) == [1]


def test_several_gpus_per_rank_are_a_block():
    assert local_gpu_indices(8, local_rank=1, local_world_size=4) == [2, 3]
    assert local_gpu_indices(4, local_rank=0, local_world_size=1) == [0, 1, 2, 3]


def test_a_single_visible_gpu_is_the_ranks_own():
    """A launcher that gives each rank its own CUDA_VISIBLE_DEVICES."""
    assert local_gpu_indices(1, local_rank=3, local_world_size=4) == [0]


def test_a_split_that_cannot_be_told_is_an_error_that_says_what_to_do(monkeypatch):
    with pytest.raises(ConfigError, match="3 visible GPUs do not split evenly among the 2 ranks.*gpu_indices"):
        local_gpu_indices(3, local_rank=0, local_world_size=2)
    with pytest.raises(ConfigError, match="only 2 GPUs are visible"):
        local_gpu_indices(2, local_rank=2)
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ConfigError, match=r"\$LOCAL_RANK must be an integer"):
        local_gpu_indices(2)

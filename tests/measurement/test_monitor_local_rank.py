"""Monitor() in one rank of a distributed job measures that rank's own GPU(s), not every GPU."""

from __future__ import annotations

import pytest

from perseus.devices.sim import SimGPU
from perseus.measurement import Monitor


@pytest.fixture(autouse=True)
def two_simulated_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_a_single_process_measures_every_visible_gpu():
    assert [g.index for g in Monitor(cpus=[]).gpus] == [0, 1]


def test_a_torchrun_rank_measures_its_own_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [g.index for g in Monitor(cpus=[]).gpus] == [1]
    # Asking explicitly still wins: GPU indices, or GPU objects.
    assert [g.index for g in Monitor(gpu_indices=[0, 1], cpus=[]).gpus] == [0, 1]
    gpus = [SimGPU("a100-sxm", 0), SimGPU("a100-sxm", 1)]
    assert Monitor(gpus=gpus, cpus=[]).gpus == gpus

"""Without a monitor, the optimizer caps and measures this rank's own GPU(s)."""

from __future__ import annotations

import pytest

from perseus.power_limit import GlobalPowerLimitOptimizer, Time


@pytest.fixture(autouse=True)
def two_simulated_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def test_without_a_monitor_a_single_process_uses_every_gpu():
    with GlobalPowerLimitOptimizer(selector=Time(), watchdog=False) as optimizer:
        assert [g.index for g in optimizer.gpus] == [0, 1]
        assert optimizer.monitor.cpus == []  # GPU energy is all it reads


def test_without_a_monitor_a_rank_uses_its_own_gpu_and_says_when_ranks_cannot_agree(monkeypatch, caplog):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, but no process group: each rank would choose alone
    with GlobalPowerLimitOptimizer(selector=Time(), watchdog=False) as optimizer:
        assert [g.index for g in optimizer.gpus] == [1]
        assert optimizer.gpus[0].power_limit_mw() == 400_000
    assert "torch.distributed is not initialised" in caplog.text

"""One rank of the data-parallel test (run by torchrun): rank 0 runs memory-bound work, rank 1
compute-bound work, so each alone would choose a different limit; both must apply one."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.measurement import Monitor
from perseus.power_limit import GlobalPowerLimitOptimizer, MaxSlowdownConstraint

WORK = {0: Work(0.1, alpha=0.3), 1: Work(0.1, alpha=0.9)}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gpu = SimGPU("a100-sxm", index=rank, clock=VirtualClock())
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=[gpu], cpus=[]),
        MaxSlowdownConstraint(1.1),
        warmup_steps=1,
        profile_steps=3,
        profile_path=os.path.join(out_dir, "profile.json"),
    )
    for _ in range(8):  # 2 limits measured per epoch, the third cut and retried
        optimizer.on_epoch_begin()
        for _ in range(10):
            optimizer.on_step_begin()
            gpu.execute(WORK[rank])
            optimizer.on_step_end()
        optimizer.on_epoch_end()
    applied = gpu.power_limit_mw()
    dist.barrier()
    optimizer.close()
    result = {
        "selected_mw": optimizer.selected_mw,
        "applied_mw": applied,
        "after_close_mw": gpu.power_limit_mw(),
        "num_gpus": optimizer.num_gpus,
        "local": [[m.power_limit_mw, m.time_s, m.energy_j] for m in optimizer.local_measurements],
        "global": [[m.power_limit_mw, m.time_s, m.energy_j] for m in optimizer.measurements],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

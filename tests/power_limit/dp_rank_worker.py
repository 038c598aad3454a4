"""One rank of the data-parallel tests in test_data_parallel_defaults.py (run by torchrun, gloo).

`defaults`: PERSEUS_GPU=sim:a100-sxm:2 on the real clock, as a new user's script has it. Monitor()
and GlobalPowerLimitOptimizer() with no GPUs named must take this rank's own GPU; work issued
without blocking through another SimGPU object for that GPU must be waited for.

`shared`: PERSEUS_GPU=sim:a100-sxm:1, both ranks on that GPU: the optimizer warns.

`sweep`: virtual clocks; on each benchmark workload and selector, a full sweep and an early-stopping
one run one after the other, with every limit's figures combined over both ranks.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.devices.sim_work import Work
from perseus.measurement import Monitor
from perseus.power_limit import Energy, GlobalPowerLimitOptimizer, MaxSlowdownConstraint, Phase, ZeusCost

WORKLOADS = {  # per rank: the same on both, and one mixed (each rank alone would choose otherwise)
    "alpha 0.3": (Work(0.1, alpha=0.3), Work(0.1, alpha=0.3)),
    "alpha 0.78": (Work(0.1), Work(0.1)),
    "alpha 0.95": (Work(0.1, alpha=0.95), Work(0.1, alpha=0.95)),
    "mixed 0.3/0.9": (Work(0.1, alpha=0.3), Work(0.1, alpha=0.9)),
}
SELECTORS = {
    "MaxSlowdownConstraint(1.1)": lambda: MaxSlowdownConstraint(1.1),
    "ZeusCost(0.5)": lambda: ZeusCost(0.5),
    "Energy()": Energy,
}


def defaults(rank: int) -> dict:
    local = int(os.environ["LOCAL_RANK"])
    monitor = Monitor(cpus=[])
    other = SimGPU("a100-sxm", local)  # another object for this rank's GPU, as a user's own script makes
    work = Work(0.05, alpha=0.3)
    t, e = other.predict(work)
    monitor.begin_window("sync")
    for _ in range(3):
        other.execute(work, blocking=False)  # returns at once, as a kernel launch does
    m = monitor.end_window("sync")
    sync = {"time_s": m.time_s, "energy_j": m.gpu_energy_j[local], "work_time_s": 3 * t, "work_energy_j": 3 * e}

    optimizer = GlobalPowerLimitOptimizer(
        selector=MaxSlowdownConstraint(1.1), warmup_steps=0, profile_steps=2, pl_step_w=100, watchdog=False
    )
    optimizer.on_epoch_begin()
    while optimizer.phase is not Phase.DONE:
        optimizer.on_step_begin()
        other.execute(Work(0.01, alpha=0.3), blocking=False)
        optimizer.on_step_end()
    optimizer.on_epoch_end()
    applied = other.power_limit_mw()
    dist.barrier()
    optimizer.close()
    return {
        "monitor_gpus": [g.index for g in monitor.gpus],
        "optimizer_gpus": [g.index for g in optimizer.gpus],
        "num_gpus": optimizer.num_gpus,
        "selected_mw": optimizer.selected_mw,
        "applied_mw": applied,
        "skipped_mw": optimizer.skipped_mw,
        "sync": sync,
    }


def shared(rank: int) -> dict:
    """Both ranks on the one simulated GPU there is: the optimizer is made, and says so."""
    optimizer = GlobalPowerLimitOptimizer(watchdog=False)
    optimizer.close()
    return {"optimizer_gpus": [g.index for g in optimizer.gpus]}


def run_sweep(rank: int, work: Work, selector, early_stop: bool) -> dict:
    clock = VirtualClock()
    gpu = SimGPU("a100-sxm", rank, clock=clock)
    optimizer = GlobalPowerLimitOptimizer(
        Monitor(gpus=[gpu], cpus=[]),
        selector,
        warmup_steps=2,
        profile_steps=5,
        early_stop=early_stop,
        watchdog=False,
        verbose=False,
    )
    start_mj = gpu.energy_mj()
    optimizer.on_epoch_begin()
    while optimizer.phase is not Phase.DONE:
        optimizer.on_step_begin()
        gpu.execute(work, blocking=False)
        optimizer.on_step_end()
    gpu.synchronize()
    result = {
        "selected_mw": optimizer.selected_mw,
        "measured_mw": [m.power_limit_mw for m in optimizer.measurements],
        "skipped_mw": optimizer.skipped_mw,
        "steps": optimizer.sweep_steps,
        "energy_j": (gpu.energy_mj() - start_mj) / 1000,  # this rank's GPU while sweeping
        "time_s": clock.now(),
    }
    optimizer.close()
    return result


def sweep(rank: int) -> dict:
    results = {}
    for workload, works in WORKLOADS.items():
        for name, make in SELECTORS.items():
            full = run_sweep(rank, works[rank], make(), early_stop=False)
            early = run_sweep(rank, works[rank], make(), early_stop=True)
            results[f"{workload} / {name}"] = {"full": full, "early": early}
    return results


def main(mode: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"defaults": defaults, "shared": shared, "sweep": sweep}[mode](rank)
    with open(os.path.join(out_dir, f"{mode}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

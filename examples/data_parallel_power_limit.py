"""Data-parallel training with one power limit for all GPUs, chosen while it trains.

Run it on simulated GPUs (no GPU needed; each rank's simulated GPU runs the step's work on a
virtual clock, so the sweep takes seconds):

    torchrun --standalone --nproc-per-node 2 examples/data_parallel_power_limit.py

or in one process: `python examples/data_parallel_power_limit.py`. On real GPUs, set
PERSEUS_GPU=nvml (needs the right to set power limits: root or CAP_SYS_ADMIN) and the model
trains on cuda with NCCL.

What happens: torch DDP trains a small regression model. A GlobalPowerLimitOptimizer on each
rank sweeps the power limit from 400 W down in 25 W steps, measures time and energy per step
at each, agrees with the other ranks (energy summed, time maxed) and keeps the limit that
MaxSlowdownConstraint(1.1) picks: the least energy at most 10% slower than the maximum limit.
Rank 0 writes the sweep to --profile-path; run again and profiling is skipped. A
CarbonReporter logs each epoch's energy, carbon and time (carbon-rank<N>.jsonl).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from perseus.clock import VirtualClock
from perseus.devices import Work, get_gpus, parse_gpu_spec
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import sim_realism
from perseus.measurement import Monitor
from perseus.measurement.carbon import CarbonReporter, StaticIntensity
from perseus.power_limit import GlobalPowerLimitOptimizer, MaxSlowdownConstraint


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--profile-path", default=None, help="JSON sweep to write, or to reuse when it exists")
    p.add_argument("--intensity", type=float, default=400.0, help="grid carbon intensity (g/kWh) for the report")
    p.add_argument("--out-dir", default=".", help="where the carbon reports go")
    p.add_argument("--sim-step-s", type=float, default=0.2, help="simulated GPU time of one step at max power")
    p.add_argument("--sim-alpha", type=float, default=0.3, help="compute-bound fraction of the simulated step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    quiet = int(os.environ.get("RANK", 0)) != 0  # one rank's log is enough
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    distributed = "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    spec = parse_gpu_spec(os.environ.get("PERSEUS_GPU") or f"sim:a100-sxm:{os.environ.get('LOCAL_WORLD_SIZE', 1)}")
    simulated = spec.backend == "sim"
    if simulated:
        gpu = SimGPU(spec.preset, index=local_rank, clock=VirtualClock(), realism=sim_realism(spec.preset))
        device = torch.device("cpu")
    else:
        gpu = get_gpus()[local_rank]
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("gloo" if device.type == "cpu" else "nccl")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    data = TensorDataset(x, x @ torch.randn(32, 1) + 0.1 * torch.randn(2048, 1))
    sampler = DistributedSampler(data, seed=0) if distributed else None
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    if distributed:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    monitor = Monitor(gpus=[gpu], cpus=[] if simulated else None)
    optimizer = GlobalPowerLimitOptimizer(
        monitor,
        MaxSlowdownConstraint(1.1),
        warmup_steps=args.warmup_steps,
        profile_steps=args.profile_steps,
        profile_path=args.profile_path,
    )
    reporter = CarbonReporter(
        monitor, StaticIntensity(args.intensity), os.path.join(args.out_dir, f"carbon-rank{rank}.jsonl")
    )
    step_work = Work(args.sim_step_s, alpha=args.sim_alpha)

    with optimizer:  # restores the default power limit however training ends
        for epoch in range(args.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            optimizer.on_epoch_begin()
            reporter.on_epoch_begin()
            for inputs, targets in loader:
                optimizer.on_step_begin()
                loss = nn.functional.mse_loss(model(inputs.to(device)), targets.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if simulated:
                    gpu.execute(step_work)  # the GPU time this step would take
                optimizer.on_step_end()
            optimizer.on_epoch_end()
            record = reporter.on_epoch_end()
            if rank == 0:
                carbon = "carbon unknown" if record.carbon_g is None else f"{record.carbon_g:.3f} g CO2e"
                print(
                    f"epoch {epoch + 1}: loss {loss.item():.4f}, power limit {gpu.power_limit_mw() / 1000:.0f} W, "
                    f"{record.energy_j:.0f} J, {carbon} (rank 0's GPU)"
                )
        reporter.on_train_end()

    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Perseus on a torch.distributed.pipelining job: wrap each rank's stage with perseus.instrument.

Start the planner service, then the job (one rank per pipeline stage):

    perseus serve --state-dir ./perseus-state &
    torchrun --nproc-per-node 4 examples/pipeline_torch.py --steps 200

No GPU? Simulate them (the job then trains on CPU with gloo):

    PERSEUS_GPU=sim:a100-sxm:4 torchrun --nproc-per-node 4 examples/pipeline_torch.py

Perseus profiles every stage's forward and backward during the first iterations, the service
calibrates its model on the job's own baseline iterations, plans each instruction's SM clock,
and every later iteration runs that plan while the service verifies it on measured time.
Training never waits for the planner: with no service it runs at default clocks. On simulated
GPUs this script gives them no work, so the service finds the GPU profile explains almost none
of the iteration and makes no plan (a WARNING, and `perseus status`, say why);
examples/pipeline_emulated.py and `perseus demo` emulate the model's GPU work, so the saving is
measurable.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import perseus

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def build_stage_module(stage: int, num_stages: int, width: int, layers: int) -> nn.Module:
    """This rank's slice of an MLP: `layers` residual-free blocks per stage, a head on the last."""
    torch.manual_seed(stage)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    if stage == num_stages - 1:
        blocks.append(nn.Linear(width, 1))
    return nn.Sequential(*blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="training iterations")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1f1b")
    parser.add_argument(
        "--planner", default=None, help="planner address (default: $PERSEUS_PLANNER or tcp://127.0.0.1:7787)"
    )
    parser.add_argument("--no-planner", action="store_true", help="measure only: no planner, default clocks")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    module = build_stage_module(rank, world, args.width, args.layers_per_stage).to(device)
    stage = PipelineStage(module, rank, world, device)
    schedule = SCHEDULES[args.schedule](stage, args.microbatches, loss_fn=nn.functional.mse_loss)

    # The one Perseus line: every forward and backward of this stage is now seen by Perseus.
    stage = perseus.instrument(stage, schedule=schedule, client=False if args.no_planner else args.planner)

    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    batch = args.microbatches * args.microbatch_size
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, args.width, generator=generator).to(device)
    targets = torch.randn(batch, 1, generator=generator).to(device)
    previous_loss = None
    try:
        for _ in range(args.steps):
            optimizer.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(inputs)
            elif rank == world - 1:
                schedule.step(target=targets, losses=losses)
            else:
                schedule.step()
            optimizer.step()
            # An iteration ends where the next step() starts: Perseus has just measured the previous one.
            record = stage.perseus.last_iteration
            if rank == world - 1 and record is not None:
                print(
                    f"iteration {record.iteration}: {record.phase}, {record.time_s:.3f} s, "
                    f"{record.energy_j:.1f} J on this GPU, loss {previous_loss:.4f}",
                    flush=True,
                )
            previous_loss = torch.stack(losses).mean().item() if losses else None
    finally:
        stage.perseus.close()  # finish the last iteration and put the GPU back at default clocks
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

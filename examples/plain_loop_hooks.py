"""Perseus in a training loop of your own: call the four framework hooks yourself.

For frameworks that are not torch.distributed.pipelining (Megatron-LM, DeepSpeed, a plain
loop), tell Perseus where each iteration and each instruction starts and ends:

    rank.on_step_begin()
    for each forward / backward:
        rank.on_instruction_begin(kind, microbatch) ... rank.on_instruction_end(kind, microbatch)
    rank.on_step_end()

This script is one rank with gradient accumulation: a one-stage "pipeline" whose schedule is
forward 0, backward 0, forward 1, backward 1, ... Run it beside a planner service, on a real
GPU or a simulated one:

    perseus serve &
    PERSEUS_GPU=sim:a100-sxm:1 python examples/plain_loop_hooks.py --steps 40

With a pipeline, build the whole job's schedule (`perseus.schedules.build_schedule("1f1b",
num_stages, num_microbatches)`) and pass each rank its stage.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from perseus.devices import get_gpus
from perseus.runtime import PerseusRank
from perseus.schedules import build_schedule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training iterations")
    parser.add_argument("--microbatches", type=int, default=4, help="gradient-accumulation microbatches per iteration")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument(
        "--planner", default=None, help="planner address, e.g. tcp://127.0.0.1:7787 (default: none, measure only)"
    )
    args = parser.parse_args()

    gpu = get_gpus()[0]
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    client = None
    if args.planner:
        from perseus.client.planner_client import PlannerClient

        client = PlannerClient(args.planner)
    schedule = build_schedule("1f1b", 1, args.microbatches)
    rank = PerseusRank(gpu, schedule, stage=0, client=client, tag="plain-loop-example")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.Linear(args.width, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    inputs = torch.randn(args.microbatches, 32, args.width, device=device)
    targets = torch.randn(args.microbatches, 32, 1, device=device)
    try:
        for _ in range(args.steps):
            rank.on_step_begin()
            optimizer.zero_grad(set_to_none=True)
            for mb in range(args.microbatches):  # the schedule's order: F0 B0 F1 B1 ...
                rank.on_instruction_begin("forward", mb)
                loss = nn.functional.mse_loss(model(inputs[mb]), targets[mb]) / args.microbatches
                rank.on_instruction_end("forward", mb)
                rank.on_instruction_begin("backward", mb)
                loss.backward()
                rank.on_instruction_end("backward", mb)
            optimizer.step()
            rank.on_step_end()
            record = rank.last_iteration
            print(
                f"iteration {record.iteration}: {record.phase}, {record.time_s * 1000:.1f} ms, "
                f"{record.energy_j:.2f} J, loss {loss.item() * args.microbatches:.4f}",
                flush=True,
            )
    finally:
        rank.close()  # reset the GPU's clocks and stop Perseus' background work
        if client is not None:
            client.close()


if __name__ == "__main__":
    main()

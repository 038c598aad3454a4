"""Any torch pipeline schedule under Perseus on simulated GPUs, the model's GPU work emulated.

    perseus serve &
    PERSEUS_GPU=sim:a100-sxm:4 torchrun --standalone --nproc-per-node 4 examples/pipeline_emulated.py \
        --schedule ScheduleInterleaved1F1B --out results/

Each rank trains its part of a small model with a torch pipelining schedule over gloo; every
instruction stands for about 6 ms of GPU work at the highest clock (forward 6 ms, backward
12 ms, the zero-bubble halves 6 ms each), and the later half of the ranks 25% more. Perseus is
one line (`perseus.instrument`); the script only reads what Perseus reports about each
iteration and writes it to OUT/rank<R>.json. Only public API: nothing here knows Perseus'
internals. Once rank 0 has run `--planned` iterations on one plan version (or after
`--max-iterations`), the ranks close Perseus together and train `--after` more iterations at
default clocks, measured with a `Monitor` (phase "after"): a baseline on either side of the
planned iterations, for comparisons a machine's changing load cannot tilt.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

import perseus
from perseus.devices import Work
from perseus.measurement import Monitor
from perseus.runtime import ProfilingSettings

SINGLE = ("ScheduleGPipe", "Schedule1F1B")
LOOPED = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
WIDTH = 16
MICROBATCH_SIZE = 2


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    """The torch stage indices this rank holds."""
    if schedule in SINGLE:
        return [rank]
    if schedule in LOOPED:
        return [rank, rank + world]
    return [rank, 2 * world - 1 - rank]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=SINGLE + LOOPED + V_SHAPED, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--planner", default=None)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--work-ms", type=float, default=6.0, help="forward GPU work at the highest clock")
    parser.add_argument("--heavier", type=float, default=1.25, help="work factor of the later half of the ranks")
    parser.add_argument("--planned", type=int, default=30, help="stop after this many iterations on one plan")
    parser.add_argument("--max-iterations", type=int, default=400)
    parser.add_argument("--after", type=int, default=10, help="iterations at default clocks once Perseus is closed")
    parser.add_argument("--frequencies", default="1410,1305,1200,1095,990,885,780")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    indices = stage_indices(args.schedule, rank, world)
    num_stages = world * len(indices)
    stages = [
        pipelining.PipelineStage(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), i, num_stages, torch.device("cpu"))
        for i in indices
    ]
    cls = getattr(pipelining, args.schedule)
    loss = nn.functional.mse_loss
    schedule = cls(stages[0] if args.schedule in SINGLE else stages, args.microbatches, loss_fn=loss)

    factor = args.heavier if rank >= world // 2 else 1.0
    forward_s = args.work_ms / 1000 * factor
    instrumented = perseus.instrument(
        stages[0] if args.schedule in SINGLE else stages,
        schedule=schedule,
        client=args.planner,
        tag=f"outsider-{args.schedule}",
        profiling=ProfilingSettings(
            warmup_iterations=4, frequencies=tuple(int(f) for f in args.frequencies.split(","))
        ),
        emulate={"forward": Work(forward_s), "backward": Work(2 * forward_s)},
    )
    perseus_rank = (instrumented[0] if isinstance(instrumented, list) else instrumented).perseus

    batch = args.microbatches * MICROBATCH_SIZE
    inputs = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(0))
    targets = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    records = []
    holds = set(indices)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        target = {"target": targets} if num_stages - 1 in holds else {}
        if 0 in holds:
            schedule.step(inputs, **target)
        else:
            schedule.step(**target)
        optimizer.step()

    stable, version = 0, None
    try:
        for _ in range(args.max_iterations):
            train_step()
            perseus_rank.on_step_end()
            record = perseus_rank.last_iteration
            records.append(
                {
                    "iteration": record.iteration,
                    "phase": str(record.phase),
                    "plan_version": record.plan_version,
                    "time_s": record.time_s,
                    "energy_j": record.energy_j,
                }
            )
            planned = str(record.phase) == "planned"
            stable = stable + 1 if planned and record.plan_version == version else int(planned)
            version = record.plan_version if planned else None
            stop = torch.tensor([int(rank == 0 and stable >= args.planned)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the ranks stop together
            if stop.item():
                break
        perseus_rank.close()  # default clocks from here on; the emulated GPU work goes on
        monitor = Monitor()  # this rank's GPU
        # As Perseus measures an iteration's energy: from the previous iteration's end to this
        # one's, so that the iterations' energies tile the run (see perseus.runtime.rank); the
        # time is the step's own.
        dist.barrier()
        monitor.begin_window("since")
        for _ in range(args.after):
            dist.barrier()
            with monitor.window("step") as window:
                train_step()
            since = monitor.end_window("since", expect_short=True)
            monitor.begin_window("since", sync=False)
            records.append(
                {
                    "iteration": len(records),
                    "phase": "after",
                    "plan_version": 0,
                    "time_s": window.measurement.time_s,
                    "energy_j": sum(since.gpu_energy_j.values()),
                }
            )
        monitor.end_window("since", cancel=True)
    finally:
        perseus_rank.close()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "job_id": perseus_rank.job_spec().job_id(), "iterations": records}, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

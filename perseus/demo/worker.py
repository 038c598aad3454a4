"""One rank of the demo job, started by torchrun: `python -m perseus.demo.worker CONFIG.json`.

Trains its stage of the demo transformer with torch's Schedule1F1B on gloo, every
instruction emulated on this rank's simulated GPU, and writes what it measured per
iteration (window, energy, instruction spans, Perseus phase) to `<out_dir>/rank<R>.json`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from perseus.atomic import write_json_atomic
from perseus.demo.config import DemoConfig
from perseus.demo.emulation import EmulatedStage, GPUEmulator
from perseus.demo.model import build_stage, lm_loss, make_batch
from perseus.demo.workload import stage_works
from perseus.devices import get_gpus

#: Iterations at default clocks after profiling (no plan: the service failed to plan) before the demo stops.
UNPLANNED_AFTER_PROFILING = 3


def run_rank(config: DemoConfig) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        gpu = get_gpus()[local_rank]
        emulator = GPUEmulator(gpu, stage_works(world, config.time_scale)[rank])
        model = build_stage(config.model, rank, world, config.seed)
        stage = PipelineStage(
            EmulatedStage(model, emulator),
            rank,
            world,
            torch.device("cpu"),
            input_args=model.example_input(config.model, config.microbatch_size),
            output_args=model.example_output(config.model, config.microbatch_size),
        )
        schedule = Schedule1F1B(stage, config.num_microbatches, loss_fn=lm_loss)
        trainer = _Trainer(config, rank, world, schedule, model, emulator)
        trainer.run(config.baseline_iterations)  # the baseline: no Perseus, maximum clocks
        if config.server is not None:
            from perseus.server.client import PlannerClient

            client = PlannerClient(config.server)
            try:
                _instrument(stage, schedule, gpu, client, config)
                try:
                    trainer.run(config.max_iterations, stage.perseus, client)
                finally:
                    stage.perseus.close()
            finally:
                client.close()
    finally:
        dist.destroy_process_group()


def _instrument(stage, schedule, gpu, client, config: DemoConfig) -> None:
    """Perseus on this rank's stage, talking to the planner through `client`."""
    import perseus
    from perseus.runtime import ProfilingSettings

    settings = ProfilingSettings(
        warmup_iterations=config.warmup_iterations,
        iterations_per_frequency=config.iterations_per_frequency,
        frequencies=tuple(config.sweep_frequencies) if config.sweep_frequencies else None,
    )
    perseus.instrument(stage, schedule=schedule, client=client, gpu=gpu, tag=config.tag, profiling=settings)


class _Trainer:
    """The training loop. Every iteration ends at a tiny all-reduce, so each rank's measured
    window covers the whole iteration, its idle time included; the ranks' windows line up."""

    def __init__(self, config: DemoConfig, rank: int, world: int, schedule, model, emulator: GPUEmulator) -> None:
        self.config, self.rank, self.world = config, rank, world
        self.schedule, self.emulator, self.gpu = schedule, emulator, emulator.gpu
        self.optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
        self.tokens, self.targets = make_batch(config.model, config.num_microbatches * config.microbatch_size, config.seed)
        self.path = os.path.join(config.out_dir, f"rank{rank}.json")
        self.records: list[dict] = []
        self.job_id: str | None = None

    def run(self, max_iterations: int, perseus_rank=None, client=None) -> None:
        """Train `max_iterations`, or with Perseus until `planned_iterations` iterations (after
        the switch) ran the plan on every rank, or until `UNPLANNED_AFTER_PROFILING` iterations
        ran unplanned after profiling (the service could not plan: see its log)."""
        if perseus_rank is not None:
            self.job_id = perseus_rank.job_spec().job_id()
        planned = given_up = 0
        profiled = False
        plan: list[int] | None = None
        start, energy_start = self.gpu.clock.now(), self.gpu.energy_mj()
        for _ in range(max_iterations):
            self.step()
            phase = "baseline" if perseus_rank is None else str(perseus_rank.phase)
            profiled = profiled or phase == "profiling"
            if phase == "planned":  # the clocks this rank was told to run (the client's cached table)
                assigned = client.assignment(perseus_rank.job_iteration).frequencies
                plan = list(assigned) if assigned is not None else plan
            # One all-reduce ends the iteration: MIN of (all planned, not given up).
            flags = torch.tensor([int(phase == "planned"), -int(profiled and phase == "unplanned")])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            end, energy_end = self.gpu.clock.now(), self.gpu.energy_mj()
            self.records.append(
                {
                    "iteration": len(self.records),
                    "phase": phase,
                    "start": start,
                    "end": end,
                    "energy_j": (energy_end - energy_start) / 1000.0,
                    "plan": plan if phase == "planned" else None,
                    "spans": [asdict(s) for s in self.emulator.take_spans()],
                }
            )
            self.save()
            start, energy_start = end, energy_end
            planned += int(flags[0].item())
            given_up += -int(flags[1].item())
            if planned > self.config.planned_iterations or given_up >= UNPLANNED_AFTER_PROFILING:
                return

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.tokens)
        elif self.rank == self.world - 1:
            self.schedule.step(target=self.targets)
        else:
            self.schedule.step()
        self.optimizer.step()

    def save(self) -> None:
        doc = {"rank": self.rank, "pid": os.getpid(), "world_size": self.world, "job_id": self.job_id, "iterations": self.records}
        write_json_atomic(self.path, doc, indent=None, fsync=False)  # a progress record, rewritten every iteration


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m perseus.demo.worker CONFIG.json (started by `perseus demo`)", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        run_rank(DemoConfig.from_json(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

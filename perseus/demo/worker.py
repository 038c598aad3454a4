"""One rank of the demo job, started by torchrun: `python -m perseus.demo.worker CONFIG.json`.

Trains its stage of the demo transformer with torch's Schedule1F1B on gloo (with several
data-parallel pipelines: in its pipeline's group, its gradients averaged over the stage's
replicas), every instruction emulated on this rank's simulated GPU, and writes what it measured per
iteration (window, energy, instruction spans, Perseus phase) to `<out_dir>/rank<R>.jsonl`. Perseus
attaches as it would to any job: no overheads are given, the service calibrates its model on the
ranks' own baseline timeline and verifies the plan while it runs.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import perseus
from perseus.client.planner_client import PlannerClient
from perseus.demo.config import DemoConfig
from perseus.demo.emulation import EmulatedStage, GPUEmulator
from perseus.demo.model import build_stage, lm_loss, make_batch
from perseus.demo.results import rank_record_path, read_verdicts
from perseus.demo.workload import stage_works
from perseus.devices import get_gpus
from perseus.exceptions import ConfigError
from perseus.runtime import PerseusRank, ProfilingSettings

#: Iterations at default clocks after profiling (no plan: the service failed to plan) before the demo stops.
UNPLANNED_AFTER_PROFILING = 3


def run_rank(config: DemoConfig) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if world != config.world_size:
        raise ConfigError(
            f"torchrun started {world} ranks but the demo config needs {config.world_size} ({config.dp} x "
            f"{config.num_stages})"
        )
    stage_index, pipeline = rank % config.num_stages, rank // config.num_stages
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        pipeline_group, replica_group = _groups(config, stage_index, pipeline)
        gpu = get_gpus()[local_rank]
        emulator = GPUEmulator(gpu, stage_works(config.num_stages, config.time_scale)[stage_index])
        model = build_stage(config.model, stage_index, config.num_stages, config.seed)
        stage = PipelineStage(
            EmulatedStage(model, emulator),
            stage_index,
            config.num_stages,
            torch.device("cpu"),
            input_args=model.example_input(config.model, config.microbatch_size),
            output_args=model.example_output(config.model, config.microbatch_size),
            group=pipeline_group,
        )
        schedule = Schedule1F1B(stage, config.num_microbatches, loss_fn=lm_loss)
        trainer = _Trainer(config, rank, stage_index, pipeline, schedule, model, emulator, replica_group)
        trainer.run(config.baseline_iterations)  # the baseline: no Perseus, maximum clocks
        if config.server is not None:
            client = PlannerClient(config.server)
            try:
                perseus_rank = _instrument(stage, schedule, gpu, client, config, rank, pipeline)
                try:
                    trainer.run(config.max_iterations, perseus_rank, client)
                finally:
                    perseus_rank.close()  # maximum clocks again
            finally:
                client.close()
            trainer.run(config.after_iterations, label="after")
    finally:
        dist.destroy_process_group()


def _groups(config: DemoConfig, stage: int, pipeline: int):
    """This rank's pipeline group and its stage's data-parallel replica group (None, None with
    one pipeline: the world is the pipeline, and there is no gradient to share)."""
    if config.dp == 1:
        return None, None
    pp = config.num_stages
    # Every rank creates every group, in the same order (torch.distributed requires it).
    pipelines = [dist.new_group([k * pp + s for s in range(pp)]) for k in range(config.dp)]
    replicas = [dist.new_group([k * pp + s for k in range(config.dp)]) for s in range(pp)]
    return pipelines[pipeline], replicas[stage]


def _instrument(stage, schedule, gpu, client, config: DemoConfig, rank: int, pipeline: int) -> PerseusRank:
    """Perseus on this rank's stage, talking to the planner through `client`, as any job would
    attach it (what the GPU-only profile leaves out, the service fits on the ranks' timeline).
    Returns the stage's `PerseusRank` (`stage.perseus`)."""
    settings = ProfilingSettings(
        warmup_iterations=config.warmup_iterations,
        iterations_per_frequency=config.iterations_per_frequency,
        frequencies=tuple(config.sweep_frequencies) if config.sweep_frequencies else None,
    )
    instrumented = perseus.instrument(
        stage,
        schedule=schedule,
        client=client,
        gpu=gpu,
        tag=config.tag,
        profiling=settings,
        rank=rank,
        dp=config.dp,
        dp_index=pipeline,
    )
    return instrumented.perseus


class _Trainer:
    """The training loop. With data-parallel pipelines, each iteration ends with the gradient
    all-reduce over the stage's replicas, where a fast pipeline waits for a slow one; then every
    iteration ends at a tiny all-reduce over all ranks, so each rank's measured window covers the
    whole iteration, its idle time included, and the ranks' windows line up."""

    def __init__(
        self,
        config: DemoConfig,
        rank: int,
        stage: int,
        pipeline: int,
        schedule,
        model,
        emulator: GPUEmulator,
        replica_group,
    ) -> None:
        self.config, self.rank, self.stage, self.pipeline = config, rank, stage, pipeline
        self.schedule, self.model, self.emulator, self.gpu = schedule, model, emulator, emulator.gpu
        self.replica_group = replica_group
        self.optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate)
        batch = config.num_microbatches * config.microbatch_size
        self.tokens, self.targets = make_batch(config.model, batch, config.seed + 7919 * pipeline)  # its own data
        self.path = rank_record_path(config.out_dir, rank)
        self.iterations = 0  # recorded so far
        self.job_id: str | None = None
        self.write_details()

    def run(self, max_iterations: int, perseus_rank=None, client=None, label: str = "baseline") -> None:
        """Train `max_iterations`, or with Perseus until `planned_iterations` iterations (after
        the switch) ran the plan on every rank -- with a straggler, the straggler-aware plan
        on every other pipeline -- and, with `await_verification`, the service's verification
        has decided on the plan every rank runs (the launcher says so: `read_verdicts`), or
        until `UNPLANNED_AFTER_PROFILING` iterations ran unplanned after profiling (the service
        could not plan: see its log), or until `replan_wait_iterations` planned iterations
        passed without a straggler-aware plan. Without Perseus, each iteration's phase is `label`."""
        if perseus_rank is not None:
            self.job_id = perseus_rank.job_spec().job_id()
            self._append(self.details())
        straggler = self.config.straggler_pipeline
        planned = replanned = given_up = 0
        profiled = False
        first_version: int | None = None
        plan: list[int] | None = None
        start, energy_start = self.gpu.clock.now(), self.gpu.energy_mj()
        for _ in range(max_iterations):
            self.step()
            phase = label if perseus_rank is None else str(perseus_rank.phase)
            version = perseus_rank.plan_version if phase == "planned" else None
            profiled = profiled or phase == "profiling"
            if phase == "planned":  # the clocks this rank was told to run (the client's cached table)
                assigned = client.assignment(perseus_rank.job_iteration).frequencies
                plan = list(assigned) if assigned is not None else plan
                first_version = version if first_version is None else first_version
            # A re-plan: the straggler keeps its plan, the others get one at its pace.
            holds_final = phase == "planned" and (
                straggler is None or self.pipeline == straggler or version != first_version
            )
            checked = not self.config.await_verification or (
                phase == "planned" and read_verdicts(self.config.out_dir).get(self.pipeline) == version
            )
            # One all-reduce ends the iteration: MIN of (all planned, all at the final plan, not
            # given up, every rank's plan verified).
            flags = torch.tensor(
                [int(phase == "planned"), int(holds_final), -int(profiled and phase == "unplanned"), int(checked)]
            )
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            end, energy_end = self.gpu.clock.now(), self.gpu.energy_mj()
            self._append(
                {
                    "iteration": self.iterations,
                    "phase": phase,
                    "plan_version": version,
                    "start": start,
                    "end": end,
                    "energy_j": (energy_end - energy_start) / 1000.0,
                    "plan": plan if phase == "planned" else None,
                    "spans": [asdict(s) for s in self.emulator.take_spans()],
                }
            )
            self.iterations += 1
            start, energy_start = end, energy_end
            planned += int(flags[0].item())
            replanned += int(flags[1].item())
            given_up += -int(flags[2].item())
            checked_all = bool(flags[3].item())
            if (replanned > self.config.planned_iterations and checked_all) or given_up >= UNPLANNED_AFTER_PROFILING:
                return
            if straggler is not None and not replanned and planned >= self.config.replan_wait_iterations:
                return  # no straggler-aware plan came: the result says so

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage == 0:
            self.schedule.step(self.tokens)
        elif self.stage == self.config.num_stages - 1:
            self.schedule.step(target=self.targets)
        else:
            self.schedule.step()
        self.sync_gradients()
        self.optimizer.step()

    def sync_gradients(self) -> None:
        """Average the stage's gradients over its data-parallel replicas (one flat all-reduce)."""
        if self.replica_group is None:
            return
        params = list(self.model.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.replica_group)
        flat /= self.config.dp
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def write_details(self) -> None:
        """(Re)start this rank's record with its details: a restarted attempt starts afresh."""
        self._append(self.details(), mode="w")

    def details(self) -> dict:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "pipeline": self.pipeline,
            "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),  # torchrun's group restarts
            "world_size": self.config.world_size,
            "job_id": self.job_id,
        }

    def _append(self, entry: dict, mode: str = "a") -> None:
        """One line of the record (perseus.demo.results.rank_record_path), in one write."""
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")


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

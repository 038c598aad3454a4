"""One rank of the demo job, started by torchrun: `python -m perseus.demo.worker CONFIG.json`.

Trains its stage of the demo transformer with torch's Schedule1F1B on gloo (with several
data-parallel pipelines: in its pipeline's group, its gradients averaged over the stage's
replicas), every instruction emulated on this rank's simulated GPU, and writes what it measured per
iteration (window, energy, instruction spans, Perseus phase) to `<out_dir>/rank<R>.json`. Before
Perseus attaches, the ranks agree on the host gap and pipeline hop their baseline measured, which
the planner adds to the profile.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import perseus
from perseus.atomic import write_json_atomic
from perseus.client.planner_client import PlannerClient
from perseus.demo.config import DemoConfig
from perseus.demo.emulation import EmulatedStage, GPUEmulator
from perseus.demo.model import build_stage, lm_loss, make_batch
from perseus.demo.results import load_iterations, model_overheads, rank_record_path
from perseus.demo.workload import stage_works
from perseus.devices import get_gpus
from perseus.exceptions import ConfigError
from perseus.runtime import PerseusRank, ProfilingSettings

#: Ping-pong round trips per pair of adjacent stages when measuring gloo's latency.
HOP_ROUNDS = 20
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
        trainer.gloo_latency_s = gloo_latency(config, stage_index, rank)
        trainer.run(config.baseline_iterations)  # the baseline: no Perseus, maximum clocks
        if config.server is not None:
            overheads = measured_overheads(config, rank)
            client = PlannerClient(config.server)
            try:
                perseus_rank = _instrument(stage, schedule, gpu, client, config, rank, pipeline, overheads)
                try:
                    trainer.run(config.max_iterations, perseus_rank, client)
                finally:
                    perseus_rank.close()
            finally:
                client.close()
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


def gloo_latency(config: DemoConfig, stage: int, rank: int) -> float | None:
    """The median one-way time (s) of sending one microbatch's activations to the next stage
    over gloo, by ping-pong with it (the planner's model has no such cost); None on the last
    stage. Adjacent stage pairs take turns, in every pipeline at once."""
    x = torch.zeros(config.microbatch_size, config.model.seq_len, config.model.d_model)
    latency = None
    for first in (stage - 1, stage):  # the pair with the previous stage, then with the next
        if not 0 <= first < config.num_stages - 1:
            continue
        sender = first == stage
        peer = rank + 1 if sender else rank - 1
        times = []
        for _ in range(HOP_ROUNDS):
            began = time.perf_counter()
            if sender:
                dist.send(x, peer)
                dist.recv(x, peer)
                times.append((time.perf_counter() - began) / 2)
            else:
                dist.recv(x, peer)
                dist.send(x, peer)
        if sender:
            latency = statistics.median(times)
    return latency


def measured_overheads(config: DemoConfig, rank: int) -> tuple[float, float]:
    """(host gap between instructions, pipeline hop) in seconds, as the baseline measured them
    (`perseus.demo.results.model_overheads`): rank 0 reads every rank's records once all are
    written, and broadcasts its figures, so every rank's job spec carries the same numbers."""
    dist.barrier()  # every rank's baseline records are on disk
    values = torch.zeros(2, dtype=torch.float64)
    if rank == 0:
        values[:] = torch.tensor(model_overheads(load_iterations(config.out_dir, config.world_size), config.num_stages))
    dist.broadcast(values, 0)
    return float(values[0]), float(values[1])


def _instrument(
    stage, schedule, gpu, client, config: DemoConfig, rank: int, pipeline: int, overheads: tuple[float, float]
) -> PerseusRank:
    """Perseus on this rank's stage, talking to the planner through `client`; the planner counts
    the measured host gap and hop (`overheads`) the GPU-only profile leaves out. Returns the
    stage's `PerseusRank` (`stage.perseus`)."""
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
        instruction_overhead_s=overheads[0],
        hop_latency_s=overheads[1],
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
        self.records: list[dict] = []
        self.job_id: str | None = None
        self.gloo_latency_s: float | None = None

    def run(self, max_iterations: int, perseus_rank=None, client=None) -> None:
        """Train `max_iterations`, or with Perseus until `planned_iterations` iterations (after
        the switch) ran the plan on every rank -- with a straggler, the straggler-aware plan
        on every other pipeline --, or until `UNPLANNED_AFTER_PROFILING` iterations ran
        unplanned after profiling (the service could not plan: see its log), or until
        `replan_wait_iterations` planned iterations passed without a straggler-aware plan."""
        if perseus_rank is not None:
            self.job_id = perseus_rank.job_spec().job_id()
        straggler = self.config.straggler_pipeline
        planned = replanned = given_up = 0
        profiled = False
        first_version: int | None = None
        plan: list[int] | None = None
        start, energy_start = self.gpu.clock.now(), self.gpu.energy_mj()
        for _ in range(max_iterations):
            self.step()
            phase = "baseline" if perseus_rank is None else str(perseus_rank.phase)
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
            # One all-reduce ends the iteration: MIN of (all planned, all at the final plan, not given up).
            flags = torch.tensor([int(phase == "planned"), int(holds_final), -int(profiled and phase == "unplanned")])
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
            end, energy_end = self.gpu.clock.now(), self.gpu.energy_mj()
            self.records.append(
                {
                    "iteration": len(self.records),
                    "phase": phase,
                    "plan_version": version,
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
            replanned += int(flags[1].item())
            given_up += -int(flags[2].item())
            if replanned > self.config.planned_iterations or given_up >= UNPLANNED_AFTER_PROFILING:
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

    def save(self) -> None:
        doc = {
            "rank": self.rank,
            "stage": self.stage,
            "pipeline": self.pipeline,
            "pid": os.getpid(),
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),  # torchrun's group restarts
            "world_size": self.config.world_size,
            "job_id": self.job_id,
            "gloo_latency_s": self.gloo_latency_s,
            "iterations": self.records,
        }
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

"""`perseus demo`: a planner service, a torchrun pipeline job on simulated GPUs (4 ranks, or
several data-parallel pipelines, one of them a straggler), and what Perseus saved, measured.
The GPUs are A100-SXMs unless the options name another preset (`perseus demo` takes it from
PERSEUS_GPU=sim:PRESET[:COUNT], e.g. sim:mi300x:4; see `default_preset`).

The launcher starts a `perseus agent` for the job's simulated GPUs (the ranks change clocks
through it; it resets each GPU as its rank's lease ends), `perseus serve` on a free loopback
port, throttles the straggler's simulated GPUs if asked, then torchrun with one
`perseus.demo.worker` per rank (gloo on CPU, every rank on its own simulated GPU whose state
lives in a private folder). It follows rank 0's progress and the service's status of the job:
its calibration and its verification of the plan (perseus.demo.watch); the ranks run the plan
until it is verified, then close Perseus and measure the baseline again. Afterwards it joins the
ranks' measurements, takes the prediction, the model's fit and verification's verdict from the
service (its status, and with a straggler its saved plans) and checks that every simulated GPU
is back at its default clocks. The processes are in perseus.demo.processes, the report
(figures, text, timeline) in perseus.demo.report.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from perseus.agent.process import AgentProcess
from perseus.atomic import write_json_atomic
from perseus.demo.config import DemoConfig
from perseus.demo.processes import PRESET, ServiceProcess, log_tail, sim_gpus_at_default, start_job, stop_job, throttle
from perseus.demo.report import job_record, summarize, summarize_straggler, write_frontier, write_timeline
from perseus.demo.results import load_iterations, median_iteration, read_rank_record, split_phases
from perseus.demo.watch import ServiceWatch
from perseus.demo.workload import default_time_scale
from perseus.devices.select import ENV_VAR, parse_gpu_spec
from perseus.devices.sim import SIM_DIR_ENV
from perseus.devices.sim_presets import get_preset
from perseus.exceptions import ConfigError, PerseusError
from perseus.service.timelines import MAX_ATTEMPTS, MIN_ITERATIONS, fit_interval
from perseus.service.verification import MAX_REPLANS, PERSISTS, SKIP, WINDOW

MAX_PROCESSES = 8  # torchrun ranks in all
#: Iterations at default clocks the service may take to calibrate its model after profiling
#: (a fit on MIN_ITERATIONS of them, tried again on more up to MAX_ATTEMPTS times, then once on
#: a fresh window: see perseus.service.timelines.fit_interval).
CALIBRATION_ITERATIONS = MIN_ITERATIONS * MAX_ATTEMPTS + fit_interval(MAX_ATTEMPTS)
#: Planned iterations the service's verification may take to decide: a plan's first window, a
#: reference window at maximum clocks and the plan again (twice: once more when the reference has
#: gone stale), re-planned up to MAX_REPLANS times, each after PERSISTS windows over its target and
#: one more after another reference.
VERIFICATION_ITERATIONS = 5 * (SKIP + WINDOW) + MAX_REPLANS * (SKIP + PERSISTS * WINDOW + 2 * (SKIP + WINDOW))


@dataclass(frozen=True)
class DemoOptions:
    ranks: int = 4  # pipeline stages, one rank each, per pipeline
    dp: int = 1  # data-parallel pipelines
    straggler: float = 1.0  # the last pipeline's GPUs take this many times longer (> 1 needs dp >= 2)
    microbatches: int = 8
    iterations: int = 4  # measured baseline iterations, and at least as many planned (each phase runs one more)
    sweep_step: int = 5  # profile every n-th supported clock, from the highest
    iterations_per_frequency: int = 3  # the first is dropped: medians over two iterations
    state_dir: str | None = None  # default: a temporary one
    port: int | None = None  # default: a free one
    seed: int = 0
    time_scale: float | None = None  # default: about 1.5 s per iteration (default_time_scale)
    plot_dir: str | None = None
    keep_dir: bool = False  # keep the work folder (logs, per-rank records)
    timeout_s: float = 600.0
    preset: str = PRESET  # the simulated GPU model every rank runs on

    def __post_init__(self) -> None:
        get_preset(self.preset)  # ConfigError naming the presets if unknown
        if not 2 <= self.ranks <= 8:
            raise ConfigError(f"--ranks must be between 2 and 8, got {self.ranks}")
        if not 1 <= self.dp <= 4 or self.ranks * self.dp > MAX_PROCESSES:
            raise ConfigError(
                f"--dp must be between 1 and 4 with at most {MAX_PROCESSES} ranks in all (--dp x --ranks), "
                f"got --dp {self.dp} x --ranks {self.ranks}"
            )
        if not self.straggler >= 1.0 or (self.straggler > 1.0 and self.dp < 2):
            raise ConfigError(
                f"--straggler must be a slowdown factor >= 1.0 (1.2: 20% slower), and above 1.0 needs --dp 2 or more; "
                f"got --straggler {self.straggler} with --dp {self.dp}"
            )
        if self.time_scale is not None and not self.time_scale > 0:
            raise ConfigError(f"--time-scale must be positive, got {self.time_scale}")
        if self.microbatches < self.ranks:
            raise ConfigError(
                f"--microbatches ({self.microbatches}) must be at least --ranks ({self.ranks}): 1F1B needs a "
                "microbatch in flight on every stage"
            )
        if self.iterations < 1:
            raise ConfigError(f"--iterations must be >= 1, got {self.iterations}")
        if self.sweep_step < 1:
            raise ConfigError(f"--sweep-step must be >= 1, got {self.sweep_step}")
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be a TCP port (1-65535), got {self.port}")


def default_preset(environ: dict[str, str] | None = None) -> str:
    """The preset of PERSEUS_GPU when it names simulated GPUs (sim:PRESET[:COUNT]; the count is the
    demo's ranks), else the A100-SXM: the demo runs on simulated GPUs whatever PERSEUS_GPU says."""
    spec = (os.environ if environ is None else environ).get(ENV_VAR)
    if spec:
        parsed = parse_gpu_spec(spec)
        if parsed.backend == "sim" and parsed.preset is not None:
            get_preset(parsed.preset)
            return parsed.preset
    return PRESET


def run_demo(options: DemoOptions, progress: Callable[[str], None] | None = None) -> dict:
    """Run the whole demo; returns the result document (`perseus demo --json` prints it)."""
    say = progress or (lambda _: None)
    began = time.monotonic()
    if options.plot_dir:
        # Deliberately lazy: only --plot needs the planner's plot module, which loads scipy and HiGHS.
        from perseus.planner.plot import pyplot

        pyplot()  # fails now if matplotlib is missing, not after the run
    work = tempfile.mkdtemp(prefix="perseus-demo-")
    try:
        out_dir, sim_dir = os.path.join(work, "ranks"), os.path.join(work, "sim")
        os.makedirs(out_dir)
        os.makedirs(sim_dir)
        state_dir = options.state_dir or os.path.join(work, "state")
        os.makedirs(state_dir, exist_ok=True)
        config = demo_config(options, out_dir, None)
        world = config.world_size
        slow = config.straggler_pipeline
        slow_ranks = None if slow is None else [slow * options.ranks + s for s in range(options.ranks)]

        agent = AgentProcess(
            os.path.join(work, "agent.sock"),
            os.path.join(work, "agent-leases.json"),
            f"sim:{options.preset}:{world}",
            os.path.join(work, "agent.log"),
            env={SIM_DIR_ENV: sim_dir},
        ).start()
        say(f"perseus agent (pid {agent.pid}) serves the {world} simulated GPUs; the ranks change clocks through it")
        service = ServiceProcess(state_dir, os.path.join(work, "service.log"), options.port)
        try:
            address = service.start()
        except BaseException:
            agent.stop()
            raise
        say(f"planner service listening on {address} (state in {state_dir})")
        watch = ServiceWatch(address, out_dir, say)
        try:
            # The plan runs until verified; then Perseus closes and the baseline is measured again,
            # on the other side of the planned iterations (a changing load tilts neither way).
            config = dataclasses.replace(
                demo_config(options, out_dir, address),
                await_verification=True,
                after_iterations=options.iterations + 1,
            )
            config_path = os.path.join(work, "config.json")
            write_json_atomic(config_path, config.to_json())
            pipelines = f"{options.dp} data-parallel pipelines x " if options.dp > 1 else ""
            say(
                f"torchrun: {world} ranks (gloo, CPU), {pipelines}{options.ranks} stages, each rank on a simulated "
                f"{get_preset(options.preset).product}; {options.microbatches} microbatches per iteration, "
                "Schedule1F1B"
            )
            if slow_ranks is not None:
                throttle(slow_ranks, options.straggler, sim_dir, options.preset)
                say(
                    f"straggler: pipeline {slow} (ranks {slow_ranks[0]}-{slow_ranks[-1]}) on GPUs "
                    f"{options.straggler:g}x slower"
                )
            try:
                rc = _run_job(
                    options, world, config_path, sim_dir, os.path.join(work, "torchrun.log"), say, agent, watch
                )
            finally:
                if slow_ranks is not None:
                    throttle(slow_ranks, 1.0, sim_dir, options.preset)
            job_id = _job_id(out_dir) if rc == 0 else None
            status = watch.fetch(job_id) if job_id is not None else None
            # The ranks' leases end with them, and the agent resets their GPUs: wait for it, then check.
            clocks_reset = agent.wait_until_free() and sim_gpus_at_default(world, sim_dir, options.preset)
            say(f"perseus agent: the ranks' leases ended; GPUs at defaults: {'yes' if clocks_reset else 'NO'}")
        finally:
            watch.close()
            service.stop()
            agent.stop()
        if rc != 0:
            log_path = os.path.join(work, "torchrun.log")
            first = first_rank_error(_read(log_path))
            raise PerseusError(
                f"the demo job failed (torchrun exit code {rc})"
                + (f": {first}" if first else "")
                + f"\nthe end of its log ({log_path}):\n{log_tail(log_path)}"
            )

        iterations = load_iterations(out_dir, world)
        if not any(set(it.phases) == {"planned"} for it in iterations):
            why = f" ({status.error})" if status is not None and status.error else ""
            raise PerseusError(
                f"the demo job ran no planned iteration: the planner service published no plan{why}; its log:\n"
                + log_tail(os.path.join(work, "service.log"))
            )
        if slow_ranks is None:
            result = summarize(iterations, status)
        else:
            result = summarize_straggler(
                iterations, status, options.ranks, options.dp, options.straggler, job_record(state_dir, job_id)
            )
        result.update(
            ranks=world,
            stages=options.ranks,
            dp=options.dp,
            microbatches=options.microbatches,
            time_scale=config.time_scale,
            gpu=f"sim:{options.preset}",
            job_id=job_id,
            clocks_reset=clocks_reset,
            wall_time_s=time.monotonic() - began,
        )
        if options.plot_dir:
            phases = split_phases(iterations, slow_ranks)
            panels = [
                (name, median_iteration(phases[name]))
                for name in ("baseline", "intrinsic", "planned")
                if phases.get(name)
            ]
            if panels:
                result["plots"] = write_timeline(panels, options.plot_dir)
            result["plots"] = result.get("plots", []) + write_frontier(phases, status, options.plot_dir)
        if options.keep_dir:
            result["work_dir"] = work
        return result
    finally:
        if not options.keep_dir:
            shutil.rmtree(work, ignore_errors=True)


def demo_config(options: DemoOptions, out_dir: str, address: str | None) -> DemoConfig:
    """What every rank runs: `options` with the planner at `address` (None: baseline only)."""
    sweep = list(get_preset(options.preset).frequencies[:: options.sweep_step])
    time_scale = options.time_scale or default_time_scale(options.ranks, options.microbatches)
    return DemoConfig(
        out_dir=out_dir,
        num_stages=options.ranks,
        dp=options.dp,
        straggler=options.straggler,
        num_microbatches=options.microbatches,
        seed=options.seed,
        time_scale=time_scale,
        baseline_iterations=options.iterations + 1,
        planned_iterations=options.iterations,
        # A generous cap under Perseus: warm-up, the whole sweep, calibration and planning,
        # (waiting for the straggler-aware re-plan,) then the planned ones until verified.
        max_iterations=1
        + len(sweep) * options.iterations_per_frequency
        + CALIBRATION_ITERATIONS
        + 20
        + max(options.iterations + 1, VERIFICATION_ITERATIONS)
        + (DemoConfig.replan_wait_iterations if options.straggler > 1.0 else 0),
        server=address,
        iterations_per_frequency=options.iterations_per_frequency,
        sweep_frequencies=sweep,
    )


def _run_job(
    options: DemoOptions,
    world: int,
    config_path: str,
    sim_dir: str,
    log_path: str,
    say: Callable[[str], None],
    agent: AgentProcess,
    watch: ServiceWatch,
) -> int:
    """Run torchrun to completion, its ranks changing clocks through `agent`, reporting rank 0's
    finished iterations as they land and what the service says of the job (`watch`)."""
    proc = start_job(world, config_path, sim_dir, log_path, preset=options.preset, agent_socket=agent.socket_path)
    deadline = time.monotonic() + options.timeout_s
    seen = 0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise PerseusError(
                    f"the demo job did not finish within {options.timeout_s:g} s; its log:\n{log_tail(log_path)}"
                )
            time.sleep(0.25)
            doc = read_rank_record(watch.out_dir, 0)
            seen = _report_progress(doc, seen, say)
            watch.poll(doc.get("job_id") if doc else None)
        _report_progress(read_rank_record(watch.out_dir, 0), seen, say)
        return proc.returncode
    finally:
        stop_job(proc)


def _report_progress(doc: dict | None, seen: int, say: Callable[[str], None]) -> int:
    """Say rank 0's iterations its record (`doc`) holds beyond the first `seen`; how many it holds."""
    if doc is None:
        return seen
    records = doc["iterations"]
    for r in records[seen:]:
        clocks = sorted({s["frequency"] for s in r["spans"]}, reverse=True)
        clock = f"{clocks[0]} MHz" if len(clocks) == 1 else f"{clocks[-1]}-{clocks[0]} MHz"
        say(f"iteration {r['iteration']:>3} {r['phase']:<10} {r['end'] - r['start']:.3f} s  rank 0 at {clock}")
    return len(records)


def _job_id(out_dir: str) -> str | None:
    doc = read_rank_record(out_dir, 0)
    return doc.get("job_id") if doc else None


_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?\brank\s*:\s*(\d+)", re.S)


def first_rank_error(log: str) -> str | None:
    """ "rank R: <exception>" of the rank torchrun names as the root cause, else of the first
    traceback in its log; None if no rank raised. torchrun prefixes each rank's lines with
    "[rankR]:" (older releases do not: then the rank is unknown); its own ChildFailedError is
    not a rank's error."""
    errors: list[tuple[int | None, str]] = []
    in_traceback: dict[int | None, bool] = {}
    for line in log.splitlines():
        match = _RANK_PREFIX.match(line)
        rank, text = (int(match[1]), match[2]) if match else (None, line)
        if text.startswith("Traceback (most recent call last):"):
            in_traceback[rank] = True
        elif in_traceback.get(rank) and text[:1].strip() and not text.startswith("During handling"):
            in_traceback[rank] = False
            if not text.startswith("torch.distributed.elastic."):
                errors.append((rank, text.strip()))
    if not errors:
        return None
    root = _ROOT_CAUSE.search(log)
    if root is not None:
        for rank, text in errors:
            if rank == int(root[1]):
                return f"rank {rank}: {text}"
    rank, text = errors[0]
    return text if rank is None else f"rank {rank}: {text}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""

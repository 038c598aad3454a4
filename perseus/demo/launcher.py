"""`perseus demo`: a planner service, a torchrun pipeline job on simulated A100s (4 ranks, or
several data-parallel pipelines, one of them a straggler), and what Perseus saved, measured.

The launcher starts `perseus serve` on a free loopback port, throttles the straggler's
simulated GPUs if asked, then torchrun with one `perseus.demo.worker` per rank (gloo on CPU,
every rank on its own simulated GPU whose state lives in a private folder), follows rank 0's
progress, and afterwards joins the ranks' measurements, takes the prediction from the service
(its status, and with a straggler its saved plans) and checks that every simulated GPU is back
at its default clocks.
"""

from __future__ import annotations

import glob
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from perseus.atomic import write_bytes_atomic, write_json_atomic
from perseus.client.planner_client import PlannerClient
from perseus.demo.config import DemoConfig
from perseus.demo.results import (
    Iteration,
    gloo_latency,
    instruction_gaps,
    load_iterations,
    read_rank_record,
    median_iteration,
    phase_stats,
    pipeline_hops,
    split_phases,
)
from perseus.demo.workload import default_time_scale
from perseus.devices.sim import SimGPU, get_preset
from perseus.exceptions import ConfigError, PerseusError
from perseus.schedules.instruction import KIND_LETTERS

PRESET = "a100-sxm"
SERVICE_START_TIMEOUT_S = 60.0
MAX_PROCESSES = 8  # torchrun ranks in all


@dataclass(frozen=True)
class DemoOptions:
    ranks: int = 4  # pipeline stages, one rank each, per pipeline
    dp: int = 1  # data-parallel pipelines
    straggler: float = 1.0  # the last pipeline's GPUs take this many times longer (> 1 needs dp >= 2)
    microbatches: int = 8
    iterations: int = 4  # measured baseline and planned iterations (each phase runs one more)
    sweep_step: int = 5  # profile every n-th supported clock, from the highest
    iterations_per_frequency: int = 3  # the first is dropped: medians over two iterations
    state_dir: str | None = None  # default: a temporary one
    port: int | None = None  # default: a free one
    seed: int = 0
    time_scale: float | None = None  # default: about 1.5 s per iteration (default_time_scale)
    plot_dir: str | None = None
    keep_dir: bool = False  # keep the work folder (logs, per-rank records)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
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


class ServiceProcess:
    """`perseus serve` as a child process on loopback; its log goes to `log_path`."""

    def __init__(self, state_dir: str, log_path: str, port: int | None = None) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.port = port
        self.address: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = SERVICE_START_TIMEOUT_S) -> str:
        """Start the service; returns its address once it listens."""
        bind = f"tcp://127.0.0.1:{self.port or 0}"
        cmd = [sys.executable, "-m", "perseus.cli.main", "serve", "--bind", bind, "--state-dir", self.state_dir]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=_child_env())
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while b"\n" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                self.stop()
                raise PerseusError(
                    f"the planner service did not start ({'exited' if left > 0 else 'timed out'}); "
                    f"its log:\n{log_tail(self.log_path)}"
                )
            if select.select([self._proc.stdout], [], [], min(left, 0.2))[0]:
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                if not chunk and self._proc.poll() is not None:
                    continue
                line += chunk
        # "perseus serve: listening on tcp://127.0.0.1:PORT"
        self.address = line.decode(errors="replace").strip().split()[-1]
        return self.address

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no last state write. Idempotent; `start` again resumes."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def start_job(ranks: int, config_path: str, sim_dir: str, log_path: str, max_restarts: int = 0) -> subprocess.Popen[bytes]:
    """Start torchrun with `ranks` demo workers (in their own process group), output to `log_path`.

    Rank r runs on simulated GPU r, whose state lives in `sim_dir`. With `max_restarts`, torchrun
    restarts the whole group that many times after a rank fails.
    """
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
        "--max-restarts", str(max_restarts), "-m", "perseus.demo.worker", config_path,
    ]
    env = _child_env(
        PERSEUS_GPU=f"sim:{PRESET}:{ranks}", PERSEUS_SIM_DIR=sim_dir, OMP_NUM_THREADS="1",
        # A restarted group must not share torchrun's rendezvous store: gloo would read the
        # previous attempt's addresses from it and fail to connect (pytorch/pytorch#135712).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_job(proc: subprocess.Popen[bytes]) -> None:
    """Stop a job `start_job` started, if it still runs: SIGTERM to torchrun (it passes it on,
    and the ranks reset their clocks), then SIGKILL to its process group if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_job(proc: subprocess.Popen[bytes], predicate: Callable[[], Any], what: str, timeout_s: float,
                 log_path: str) -> Any:
    """Poll `predicate` while the job `proc` runs until it returns something truthy (returned);
    PerseusError with the job's log if the job exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise PerseusError(f"the demo job exited ({proc.returncode}) before {what}; its log:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise PerseusError(f"the demo job ran {timeout_s:g} s without {what}; its log:\n{log_tail(log_path)}")
        time.sleep(0.05)


def sim_gpus_at_default(ranks: int, sim_dir: str) -> bool:
    """True when every simulated GPU of the job is at its default clocks and power limit."""
    for i in range(ranks):
        gpu = SimGPU(PRESET, i, state_dir=sim_dir)
        if os.path.exists(gpu.state_path) or gpu.sm_clock() != gpu.max_frequency():
            return False
        if gpu.power_limit_mw() != gpu.default_power_limit_mw():
            return False
    return True


def throttle(gpus: list[int], factor: float, sim_dir: str) -> None:
    """Make the simulated GPUs `gpus` take `factor` times longer for their work (1.0: undo)."""
    for i in gpus:
        gpu = SimGPU(PRESET, i, state_dir=sim_dir)
        if factor == 1.0:
            gpu.reset_slowdown()
        else:
            gpu.set_slowdown(factor)


def fetch_status(address: str, job_id: str | None) -> Any:
    """The service's status of `job_id` (a `perseus.wire.protocol.JobStatus`), or None."""
    if job_id is None:
        return None
    with PlannerClient(address, timeout_s=5.0) as client:
        status = client.status(job_id)
    return status.jobs[0] if status is not None and status.jobs else None


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

        service = ServiceProcess(state_dir, os.path.join(work, "service.log"), options.port)
        address = service.start()
        say(f"planner service listening on {address} (state in {state_dir})")
        try:
            config = demo_config(options, out_dir, address)
            config_path = os.path.join(work, "config.json")
            write_json_atomic(config_path, config.to_json())
            pipelines = f"{options.dp} data-parallel pipelines x " if options.dp > 1 else ""
            say(f"torchrun: {world} ranks (gloo, CPU), {pipelines}{options.ranks} stages, each rank on a simulated "
                f"A100-SXM; {options.microbatches} microbatches per iteration, Schedule1F1B")
            if slow_ranks is not None:
                throttle(slow_ranks, options.straggler, sim_dir)
                say(f"straggler: pipeline {slow} (ranks {slow_ranks[0]}-{slow_ranks[-1]}) on GPUs {options.straggler:g}x slower")
            try:
                rc = _run_job(options, world, config_path, sim_dir, os.path.join(work, "torchrun.log"), out_dir, say)
            finally:
                if slow_ranks is not None:
                    throttle(slow_ranks, 1.0, sim_dir)
            job_id = _job_id(out_dir) if rc == 0 else None
            status = fetch_status(address, job_id)
        finally:
            service.stop()
        if rc != 0:
            raise PerseusError(f"the demo job failed (torchrun exit code {rc}); its log:\n{log_tail(os.path.join(work, 'torchrun.log'))}")

        iterations = load_iterations(out_dir, world)
        if not any(set(it.phases) == {"planned"} for it in iterations):
            raise PerseusError(
                "the demo job ran no planned iteration: the planner service published no plan; its log:\n"
                + log_tail(os.path.join(work, "service.log"))
            )
        if slow_ranks is None:
            result = summarize(iterations, status)
        else:
            result = summarize_straggler(iterations, status, options, job_record(state_dir, job_id))
        result["gloo_latency_s"] = gloo_latency(out_dir, world)
        result.update(
            ranks=world,
            stages=options.ranks,
            dp=options.dp,
            microbatches=options.microbatches,
            time_scale=config.time_scale,
            gpu=f"sim:{PRESET}",
            job_id=job_id,
            clocks_reset=sim_gpus_at_default(world, sim_dir),
            wall_time_s=time.monotonic() - began,
        )
        if options.plot_dir:
            phases = split_phases(iterations, slow_ranks)
            panels = [(name, median_iteration(phases[name])) for name in ("baseline", "intrinsic", "planned") if phases.get(name)]
            if panels:
                result["plots"] = write_timeline(panels, options.plot_dir)
        if options.keep_dir:
            result["work_dir"] = work
        return result
    finally:
        if not options.keep_dir:
            shutil.rmtree(work, ignore_errors=True)


def write_timeline(panels: list[tuple[str, Iteration]], out_dir: str) -> list[str]:
    """Write `timeline.png` (a Gantt panel per (title, iteration): a box per instruction on its
    rank's row, coloured by the SM clock it ran at) and `timeline.json` (the spans plotted) to
    `out_dir`; returns the paths written."""
    # Deliberately lazy, as in run_demo.
    from perseus.planner.plot import Bar, Panel, plot_gantt

    gantt = [
        Panel(
            f"{title}: iteration {it.index}, {it.time_s:.3f} s, {it.energy_j:.0f} J (all GPUs)",
            [Bar(rank, s["start"], s["end"], f"{KIND_LETTERS.get(s['kind'], '?')}{s['microbatch']}", s["frequency"])
             for rank, spans in enumerate(it.spans) for s in spans],
        )
        for title, it in panels
    ]
    rows = [f"rank {r}" for r in range(len(panels[0][1].spans))]
    os.makedirs(out_dir, exist_ok=True)
    png, data = os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "timeline.json")
    write_bytes_atomic(png, plot_gantt(gantt, rows, "SM clock (MHz)", "seconds since the iteration started"))
    write_json_atomic(
        data,
        [{"panel": title, "iteration": it.index, "time_s": it.time_s, "energy_j": it.energy_j, "ranks": [list(r) for r in it.spans]}
         for title, it in panels],
    )
    return [png, data]


def summarize(iterations: list[Iteration], status: Any, phases: dict[str, list[Iteration]] | None = None) -> dict:
    """Per-phase figures, the service's prediction (`status`: its JobStatus, or None) against
    the measured saving, and whether the planned clocks ran as assigned. `phases`: the
    iterations split by `split_phases` (default: split here)."""
    phases = split_phases(iterations) if phases is None else phases
    stats = {name: phase_stats(its) for name, its in phases.items()}
    baseline, planned = stats["baseline"], stats["planned"]
    result: dict = {name: (s.to_json() if s else None) for name, s in stats.items()}
    result["iterations_run"] = len(iterations)
    result["profiled"] = bool(phases["profiling"])
    result["measured_saving"] = _saving(baseline, planned)
    result["iteration_time_change"] = (planned.iteration_time_s / baseline.iteration_time_s - 1.0) if baseline and planned else None
    result["predicted_saving"] = status.predicted_saving if status is not None else None
    result["predicted"] = None
    if status is not None and status.predicted_energy_j is not None:
        result["predicted"] = {
            "iteration_time_s": status.predicted_iteration_time_s,
            "energy_j": status.predicted_energy_j,
            "baseline_energy_j": status.predicted_baseline_energy_j,
            "plan_version": status.plan_version,
        }
    # How far the measured baseline runs over the planner's model of it (a no-slowdown plan takes
    # the max-clock time): pipeline hops and host scheduling the model does not include.
    predicted_time = status.predicted_iteration_time_s if status is not None else None
    result["model_time_gap"] = baseline.iteration_time_s / predicted_time - 1.0 if baseline and predicted_time else None
    hops, gaps = pipeline_hops(phases["baseline"]), instruction_gaps(phases["baseline"])
    result["hop_latency_s"] = statistics.median(hops) if hops else None
    result["instruction_gap_s"] = statistics.median(gaps) if gaps else None
    last = phases["planned"][-1] if phases["planned"] else None
    result["plan_frequencies"] = list(last.plans) if last is not None else None
    result["plan_applied"] = plan_applied(phases["planned"])
    return result


def summarize_straggler(iterations: list[Iteration], status: Any, options: DemoOptions, record: dict | None) -> dict:
    """A job with a straggler pipeline (the last one): per pipeline, its baseline, its intrinsic
    plan (no slowdown) and its straggler-aware plan, measured and predicted. The top-level
    figures are those of the other pipelines together -- the ones Perseus slows to the
    straggler's pace --; `pipelines` lists every pipeline, the straggler included.

    Predictions are the service's plans (`record`: its job record, see `job_record`), each put
    at the straggler's pace T' (the straggler-aware plan's deadline): a plan of time T and
    energy E costs E + P_block x stages x (T' - T) when it waits for the straggler."""
    pp, dp = options.ranks, options.dp
    slow = dp - 1
    ranks_of = {k: [k * pp + s for s in range(pp)] for k in range(dp)}
    phases = split_phases(iterations, ranks_of[slow])
    predicted = predict_at_pace(record, pp, slow)
    rows = []
    for k, ranks in ranks_of.items():
        stats = {name: phase_stats([it.of_ranks(ranks) for it in phases[name]]) for name in ("baseline", "intrinsic", "planned")}
        row: dict = {"pipeline": k, "straggler": k == slow, "slowdown": options.straggler if k == slow else 1.0}
        for name, st in stats.items():
            row[name] = None if st is None else {
                **st.to_json(),
                "compute_time_s": statistics.median(it.of_ranks(ranks).compute_time_s() for it in phases[name]),
            }
        row["measured_intrinsic_saving"] = _saving(stats["baseline"], stats["intrinsic"])
        row["measured_saving"] = _saving(stats["baseline"], stats["planned"])
        row.update(predicted.get(k, {"predicted_intrinsic_saving": None, "predicted_saving": None}))
        rows.append(row)

    fast = [r for k in range(dp) if k != slow for r in ranks_of[k]]
    fast_phases = {name: [it.of_ranks(fast) for it in its] for name, its in phases.items()}
    result = summarize(iterations, None, fast_phases)
    for key in ("predicted_intrinsic_saving", "predicted_saving"):
        values = [row[key] for row in rows if not row["straggler"]]
        result[key] = statistics.mean(values) if None not in values else None
    result["measured_intrinsic_saving"] = _saving(phase_stats(fast_phases["baseline"]), phase_stats(fast_phases["intrinsic"]))
    result["pipelines"] = rows
    result["saving_scope"] = f"pipelines {', '.join(str(k) for k in range(dp) if k != slow)} (not the straggler)"
    pipeline = status.pipelines[slow] if status is not None and len(status.pipelines) > slow else None
    result["straggler"] = {
        "pipeline": slow,
        "slowdown": options.straggler,
        "source": (pipeline.straggler or None) if pipeline is not None else None,  # "detected" or "declared"
        "factor": pipeline.straggler_factor if pipeline is not None else None,  # as the service sees it
        "deadline_s": predicted.get("deadline_s"),
    }
    return result


def predict_at_pace(record: dict | None, stages: int, slow: int) -> dict:
    """Per pipeline (not the straggler): the predicted intrinsic and straggler-aware savings at
    the straggler's pace, from the service's job record; the straggler: its plan's saving."""
    if not record or not record.get("plans") or record.get("blocking_power_w") is None:
        return {}
    plans = {int(k): p for k, p in record["plans"].items()}
    block = record["blocking_power_w"] * stages
    paced = [p for k, p in plans.items() if k != slow and p.get("deadline_s") is not None]
    out: dict = {}
    if slow in plans:
        p = plans[slow]
        out[slow] = {"predicted_intrinsic_saving": 1 - p["energy_j"] / p["baseline_energy_j"], "predicted_saving": 1 - p["energy_j"] / p["baseline_energy_j"]}
    base = next((p for p in plans.values() if p.get("deadline_s") is None), None)
    if base is None:
        return out
    pace = max((p["deadline_s"] for p in paced), default=None)
    out["deadline_s"] = pace
    at = (lambda e, t: e + block * (pace - t)) if pace is not None else (lambda e, t: e)
    baseline = at(base["baseline_energy_j"], base["baseline_iteration_time_s"])
    intrinsic = 1 - at(base["energy_j"], base["iteration_time_s"]) / baseline
    for k, p in plans.items():
        if k != slow:
            final = 1 - at(p["energy_j"], p["iteration_time_s"]) / baseline if p.get("deadline_s") is not None else None
            out[k] = {"predicted_intrinsic_saving": intrinsic, "predicted_saving": final}
    return out


def job_record(state_dir: str, job_id: str | None) -> dict | None:
    """The service's saved record of `job_id` (its published plans), with the blocking power per
    GPU its planner used (the job's, else the mean of its stage profiles'); None if missing."""
    if job_id is None:
        return None
    folder = os.path.join(state_dir, "jobs", job_id)
    try:
        with open(os.path.join(folder, "job.json"), encoding="utf-8") as f:
            record = json.load(f)
        powers = []
        for path in sorted(glob.glob(os.path.join(folder, "stage-*.json"))):
            with open(path, encoding="utf-8") as f:
                powers.append(float(json.load(f)["blocking_power_w"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    declared = record.get("spec", {}).get("blocking_power_w")
    record["blocking_power_w"] = declared if declared is not None else (statistics.mean(powers) if powers else None)
    return record


def _saving(baseline: Any, planned: Any) -> float | None:
    return (1.0 - planned.energy_j / baseline.energy_j) if baseline and planned else None


def plan_applied(planned: list[Iteration]) -> float | None:
    """Fraction of planned instructions whose GPU work ran (mostly) at the clock assigned to it."""
    total = hits = 0
    for it in planned:
        for spans, want in zip(it.spans, it.plans):
            want = want or []
            total += max(len(spans), len(want))
            hits += sum(1 for s, f in zip(spans, want) if s["frequency"] == f)
    return hits / total if total else None


def format_report(result: dict) -> str:
    """The human-readable summary `perseus demo` prints."""
    lines = []
    if result.get("pipelines"):
        lines += _straggler_report(result)
    lines.append(f"{'phase':<10} {'iterations':>10} {'iteration time':>15} {'energy':>16}")
    for name in ("baseline", "profiling", "intrinsic", "planned"):
        if name not in result:
            continue
        s = result.get(name)
        if s:
            lines.append(f"{name:<10} {s['iterations']:>10} {s['iteration_time_s']:>13.3f} s {s['energy_j']:>14.1f} J")
        else:
            lines.append(f"{name:<10} {'-':>10}")
    scope = f" of {result['saving_scope']}" if result.get("saving_scope") else ""
    predicted, measured = result.get("predicted_saving"), result.get("measured_saving")
    if predicted is not None and measured is not None:
        ratio = f" ({measured / predicted:.0%} of predicted)" if predicted > 0 else ""
        lines.append(f"energy saving{scope}: predicted {predicted:.1%}, measured {measured:.1%}{ratio}")
    elif measured is not None:
        lines.append(f"energy saving{scope}: measured {measured:.1%} (the service reported no prediction)")
    else:
        lines.append("energy saving: not measured (a phase has no measured iterations)")
    if result.get("iteration_time_change") is not None:
        lines.append(f"iteration time: {result['iteration_time_change']:+.1%} planned against baseline")
    if result.get("model_time_gap") is not None:
        lines.append(f"baseline against the planner's model: {result['model_time_gap']:+.1%} (what host work and hops take beyond the overheads below, which it counts)")
    if result.get("hop_latency_s") is not None:
        gloo = f" (of which gloo's send: {result['gloo_latency_s'] * 1e3:.2f} ms)" if result.get("gloo_latency_s") else ""
        lines.append(f"pipeline hop, stage to stage: {result['hop_latency_s'] * 1e3:.1f} ms{gloo}")
    if result.get("instruction_gap_s") is not None:
        lines.append(f"host gap between instructions on a stage: {result['instruction_gap_s'] * 1e3:.1f} ms")
    if result.get("plan_applied") is not None:
        lines.append(f"planned clocks applied on time: {result['plan_applied']:.0%} of instructions")
    if not result.get("profiled"):
        lines.append("profiling: skipped (the state directory held this job's profile)")
    lines.append(f"clocks reset at the end: {'yes' if result['clocks_reset'] else 'NO'}")
    for path in result.get("plots", []):
        lines.append(f"timeline written: {path}")
    lines.append(f"wall time: {result['wall_time_s']:.0f} s")
    return "\n".join(lines)


def _straggler_report(result: dict) -> list[str]:
    """Per pipeline: baseline, intrinsic and straggler-aware energy, savings measured (predicted)."""
    straggler = result["straggler"]
    how = {"detected": "detected by the service", "declared": "declared"}.get(straggler["source"] or "", "NOT detected")
    seen = f" at {straggler['factor']:.2f}x" if straggler.get("factor") else ""
    lines = [
        f"straggler: pipeline {straggler['pipeline']} on GPUs {straggler['slowdown']:g}x slower, {how}{seen}",
        f"{'pipeline':<14} {'compute':>8} {'baseline':>10} {'intrinsic plan: saving':>32} {'straggler-aware plan: saving':>36}",
    ]

    def cell(row: dict, phase: str, saving: str, predicted: str) -> str:
        if not row.get(phase):
            return "-"
        pred = f" (predicted {row[predicted]:.1%})" if row.get(predicted) is not None else ""
        return f"{row[phase]['energy_j']:.0f} J {row[saving]:.1%}{pred}"

    for row in result["pipelines"]:
        name = f"{row['pipeline']}{' (straggler)' if row['straggler'] else ''}"
        compute = f"{row['baseline']['compute_time_s']:.2f} s" if row.get("baseline") else "-"
        base = f"{row['baseline']['energy_j']:.0f} J" if row.get("baseline") else "-"
        lines.append(
            f"{name:<14} {compute:>8} {base:>10} "
            f"{cell(row, 'intrinsic', 'measured_intrinsic_saving', 'predicted_intrinsic_saving'):>32} "
            f"{cell(row, 'planned', 'measured_saving', 'predicted_saving'):>36}"
        )
    return lines


def demo_config(options: DemoOptions, out_dir: str, address: str | None) -> DemoConfig:
    """What every rank runs: `options` with the planner at `address` (None: baseline only)."""
    sweep = list(get_preset(PRESET).frequencies[:: options.sweep_step])
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
        # A generous cap under Perseus: warm-up, the whole sweep, planning, (waiting for the
        # straggler-aware re-plan,) then the planned ones.
        max_iterations=1 + len(sweep) * options.iterations_per_frequency + 20 + options.iterations + 1
        + (DemoConfig.replan_wait_iterations if options.straggler > 1.0 else 0),
        server=address,
        iterations_per_frequency=options.iterations_per_frequency,
        sweep_frequencies=sweep,
    )


def _run_job(options: DemoOptions, world: int, config_path: str, sim_dir: str, log_path: str, out_dir: str,
             say: Callable[[str], None]) -> int:
    """Run torchrun to completion, reporting rank 0's finished iterations as they land."""
    proc = start_job(world, config_path, sim_dir, log_path)
    deadline = time.monotonic() + options.timeout_s
    seen = 0
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise PerseusError(f"the demo job did not finish within {options.timeout_s:g} s; its log:\n{log_tail(log_path)}")
            time.sleep(0.25)
            seen = _report_progress(out_dir, seen, say)
        _report_progress(out_dir, seen, say)
        return proc.returncode
    finally:
        stop_job(proc)


def _report_progress(out_dir: str, seen: int, say: Callable[[str], None]) -> int:
    doc = read_rank_record(out_dir, 0)
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


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: str, lines: int = 40) -> str:
    """The last `lines` lines of the log at `path`, for an error message."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"

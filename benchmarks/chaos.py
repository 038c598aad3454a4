"""Chaos: kill the planner service three times and one rank once during a real end-to-end run.

    python benchmarks/chaos.py [--time-scale 0.05] [--outage-iterations 3] [--json]

A `perseus demo` job (a real `perseus serve` on loopback, torchrun with 2 ranks on gloo and
simulated A100s, `--max-restarts 1`) runs while this script, watching the ranks' records:
  1. SIGKILLs the service while the ranks profile, and restarts it on the same state directory
     once rank 0 has finished --outage-iterations iterations without it;
  2. does the same once every rank runs the plan;
  3. SIGKILLs one rank at a planned (non-default) clock: its watchdog must reset its GPU, and
     torchrun restarts the whole group, whose ranks rejoin the job;
  4. kills and restarts the service again once the restarted ranks run the plan;
and then lets the job finish. Prints, side by side: each outage and the iterations trained
through it; how fast the killed rank's GPU got back to default clocks and the group back to
training; whether a profile was lost (every stage's profile in the state directory, and no
re-profiling after the restarts); the longest stall of any iteration (its time over the median
of its phase) against the client's timeout; and whether every simulated GPU ended at its default
clocks. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from perseus.atomic import write_json_atomic
from perseus.client.planner_client import PlannerClient
from perseus.demo.launcher import DemoOptions, demo_config
from perseus.demo.processes import PRESET, ServiceProcess, sim_gpus_at_default, start_job, stop_job, wait_for_job
from perseus.demo.results import read_rank_record
from perseus.devices.sim import SimGPU

RANKS = 2
#: How long a rank may block on the planner per call: the client's timeout.
CLIENT_TIMEOUT_S = inspect.signature(PlannerClient).parameters["timeout_s"].default


class Records:
    """Every iteration any rank recorded, across torchrun restarts: the ranks rewrite their
    record file each iteration, a restarted group from scratch, so it is read often and kept."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.rows: dict[tuple[int, int, int], dict] = {}  # (attempt, rank, iteration) -> record
        self.pids: dict[tuple[int, int], int] = {}  # (attempt, rank) -> pid

    def poll(self) -> None:
        for rank in range(RANKS):
            doc = read_rank_record(self.out_dir, rank)
            if doc is None:
                continue
            attempt = doc.get("attempt", 0)
            self.pids[(attempt, rank)] = doc["pid"]
            for r in doc["iterations"]:
                self.rows[(attempt, rank, r["iteration"])] = r

    def of(self, attempt: int, rank: int, phase: str | None = None) -> list[dict]:
        rows = [r for (a, k, _), r in sorted(self.rows.items()) if a == attempt and k == rank]
        return [r for r in rows if phase is None or r["phase"] == phase]

    def attempts(self) -> list[int]:
        return sorted({a for a, _, _ in self.rows})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_chaos(
    work: str, time_scale: float = 0.05, outage_iterations: int = 3, say: Callable[[str], None] = print
) -> dict:
    """Run the scenario in the folder `work`; returns the figures (see the module docstring)."""
    out_dir, sim_dir, state_dir = (os.path.join(work, name) for name in ("ranks", "sim", "state"))
    for folder in (out_dir, sim_dir, state_dir):
        os.makedirs(folder, exist_ok=True)
    began = time.monotonic()
    options = DemoOptions(ranks=RANKS, microbatches=4, iterations=40, sweep_step=8, time_scale=time_scale)
    service = ServiceProcess(state_dir, os.path.join(work, "service.log"), port=free_port())
    address = service.start()
    config_path = os.path.join(work, "config.json")
    write_json_atomic(config_path, demo_config(options, out_dir, address).to_json())
    log_path = os.path.join(work, "torchrun.log")
    job = start_job(RANKS, config_path, sim_dir, log_path, max_restarts=1)
    records = Records(out_dir)
    outages: list[dict] = []

    def until(predicate: Callable[[], bool], what: str, timeout_s: float = 90.0) -> None:
        wait_for_job(job, lambda: records.poll() or predicate(), what, timeout_s, log_path)

    def outage(attempt: int, during: str) -> None:
        done = len(records.of(attempt, 0))
        service.kill()
        killed = time.monotonic()
        until(
            lambda: len(records.of(attempt, 0)) >= done + outage_iterations,
            f"{outage_iterations} iterations without the service",
        )
        service.start()
        back = time.monotonic()
        outages.append(
            {
                "during": during,
                "down_s": back - killed,
                "killed": killed,
                "back": back,
                "iterations_trained": len(records.of(attempt, 0)) - done,
            }
        )
        say(
            f"service killed while {during}: down {back - killed:.2f} s, "
            f"rank 0 trained {outages[-1]['iterations_trained']} iterations meanwhile"
        )

    try:
        until(lambda: len(records.of(0, 0, "profiling")) >= 2, "rank 0 profiling")
        outage(0, "the ranks profiled")
        until(lambda: all(records.of(0, r, "planned") for r in range(RANKS)), "every rank running the plan")
        outage(0, "the ranks ran the plan")
        planned = len(records.of(0, 0, "planned"))
        until(lambda: len(records.of(0, 0, "planned")) >= planned + 2, "the plan running after the restart")

        gpus = [SimGPU(PRESET, r, state_dir=sim_dir) for r in range(RANKS)]
        until(lambda: any(os.path.exists(g.state_path) for g in gpus), "a rank at a planned clock", 10)
        victim = next(r for r, g in enumerate(gpus) if os.path.exists(g.state_path))
        os.kill(records.pids[(0, victim)], signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: not os.path.exists(gpus[victim].state_path), "the watchdog resetting the killed rank's GPU", 10)
        reset_s = time.monotonic() - killed
        until(lambda: records.of(1, 0), "torchrun restarting the group")
        rejoined_s = time.monotonic() - killed
        say(
            f"rank {victim} SIGKILLed: its GPU at default clocks after {reset_s:.2f} s, "
            f"the group training again after {rejoined_s:.1f} s"
        )

        until(lambda: all(records.of(1, r, "planned") for r in range(RANKS)), "the restarted ranks running the plan")
        outage(1, "the restarted ranks ran the plan")
        rc = job.wait(120)
    finally:
        if job.poll() is None:
            stop_job_and_ranks(job, records)
        service.stop()
    records.poll()
    drops = profile_drops(os.path.join(work, "service.log"))
    return figures(records, state_dir, sim_dir, outages, rc, reset_s, rejoined_s, time.monotonic() - began, drops)


def profile_drops(service_log: str) -> list[str]:
    """The service's log lines that drop a kept profile on purpose: the restarted group's spans
    contradicted it (a loaded host slows them as a changed workload would), so it profiles again."""
    with open(service_log, errors="replace") as f:
        return [line.strip() for line in f if "is profiled again" in line]


def stop_job_and_ranks(job, records: Records) -> None:
    """Stop torchrun and its ranks: through torchrun first (the ranks reset their clocks), then
    SIGKILL any rank left (the ranks run in sessions of their own, out of torchrun's group)."""
    stop_job(job)
    for pid in records.pids.values():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                ours = b"perseus.demo.worker" in f.read()  # not a later process with a reused id
            if ours:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def figures(
    records: Records,
    state_dir: str,
    sim_dir: str,
    outages: list[dict],
    rc: int,
    reset_s: float,
    rejoined_s: float,
    wall_s: float,
    drops: list[str],
) -> dict:
    stalls = []  # (stall, attempt, rank, iteration, during an outage)
    for attempt in records.attempts():
        for rank in range(RANKS):
            rows = records.of(attempt, rank)[1:]  # the first iteration of a (re)start warms up
            for phase in {r["phase"] for r in rows}:
                same = [r for r in rows if r["phase"] == phase]
                median = statistics.median(r["end"] - r["start"] for r in same)
                for r in same:
                    down = any(o["killed"] < r["end"] and r["start"] < o["back"] for o in outages)
                    stalls.append((r["end"] - r["start"] - median, attempt, rank, r["iteration"], down))
    worst = max(stalls)
    restarted = {r["phase"] for r in records.of(1, 0)}
    profiles = sorted(os.path.basename(p) for p in glob.glob(os.path.join(state_dir, "jobs", "*", "stage-*.json")))
    return {
        "job_exit_code": rc,
        "service_kills": len(outages),
        "outages": [{k: v for k, v in o.items() if k not in ("killed", "back")} for o in outages],
        "rank_kills": 1,
        "killed_rank_gpu_reset_s": reset_s,
        "group_rejoined_s": rejoined_s,
        "attempts": len(records.attempts()),
        "stage_profiles_saved": profiles,
        "reprofiled_after_restart": "profiling" in restarted,
        "profile_drops": drops,
        "restart_phases": sorted(restarted),
        "max_stall_s": worst[0],
        "max_stall_at": {"attempt": worst[1], "rank": worst[2], "iteration": worst[3], "service_down": worst[4]},
        "max_stall_while_down_s": max((s[0] for s in stalls if s[4]), default=None),
        "client_timeout_s": CLIENT_TIMEOUT_S,
        "iterations_recorded": len(records.rows),
        "clocks_reset": sim_gpus_at_default(RANKS, sim_dir),
        "wall_time_s": wall_s,
    }


def check(result: dict) -> list[str]:
    """What failed, in words (empty: every check passed)."""
    failures = []
    if result["job_exit_code"] != 0:
        failures.append(f"the job exited with {result['job_exit_code']}")
    if result["stage_profiles_saved"] != [f"stage-{s}.json" for s in range(RANKS)]:
        failures.append(f"stage profiles in the state directory: {result['stage_profiles_saved']}")
    if result["reprofiled_after_restart"] and not result["profile_drops"]:
        failures.append("the restarted group profiled again, and the service's log drops no profile (one was lost)")
    if "planned" not in result["restart_phases"]:
        failures.append("the restarted group never ran the plan")
    if not result["max_stall_s"] < result["client_timeout_s"]:
        failures.append(
            f"an iteration stalled {result['max_stall_s']:.2f} s (client timeout {result['client_timeout_s']} s)"
        )
    if not result["killed_rank_gpu_reset_s"] <= 1.0:
        failures.append(f"the killed rank's GPU took {result['killed_rank_gpu_reset_s']:.2f} s to reset")
    if not result["clocks_reset"]:
        failures.append("a simulated GPU did not end at its default clocks")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--time-scale", type=float, default=0.05, help="GPU work time scale (0.05: about 0.15 s per iteration)"
    )
    parser.add_argument(
        "--outage-iterations", type=int, default=3, help="iterations rank 0 trains while the service is down"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="perseus-chaos-") as work:
        result = run_chaos(work, args.time_scale, args.outage_iterations, say=lambda line: print(line, file=sys.stderr))
    failures = check(result)
    if args.json:
        print(json.dumps({**result, "failures": failures}, indent=1))
    else:
        downs = ", ".join(f"{o['down_s']:.2f} s" for o in result["outages"])
        trained = ", ".join(str(o["iterations_trained"]) for o in result["outages"])
        print(
            f"service killed and restarted: {result['service_kills']} times, down {downs}; "
            f"rank 0 trained {trained} iterations through them"
        )
        print(
            f"rank SIGKILLed: {result['rank_kills']}; "
            f"its GPU at default clocks after {result['killed_rank_gpu_reset_s']:.2f} s; "
            f"torchrun restarted the group, training again after {result['group_rejoined_s']:.1f} s"
        )
        print(
            f"profiles: {', '.join(result['stage_profiles_saved'])} kept; re-profiled after the restarts: "
            f"{'YES' if result['reprofiled_after_restart'] else 'no'} "
            f"(restarted group's phases: {', '.join(result['restart_phases'])})"
        )
        for line in result["profile_drops"]:
            print(f"  the service dropped a kept profile on purpose: {line}")
        down = result["max_stall_while_down_s"]
        print(
            f"longest stall: {result['max_stall_s']:.3f} s over its phase's median (while the service was down: "
            f"{'-' if down is None else f'{down:.3f} s'}); client timeout {result['client_timeout_s']:g} s"
        )
        print(
            f"clocks reset at the end: {'yes' if result['clocks_reset'] else 'NO'}; "
            f"job exit code {result['job_exit_code']}; "
            f"wall time {result['wall_time_s']:.0f} s"
        )
        for failure in failures:
            print(f"FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""`perseus straggler`: declare a known-slow data-parallel pipeline, so the planner service slows
the others to its pace (or clear it); without --factor or --clear, show each pipeline's state."""

from __future__ import annotations

import argparse
import time

from perseus.cli.service_args import add_service_arguments, check_job_id, fetch_status, service_client, unreachable
from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ConfigError
from perseus.wire.limits import DEFAULT_ADDRESS, MAX_STRAGGLER_FACTOR
from perseus.wire.messages import JobStatus, Status

#: How long a declaration waits for the re-plan it causes before printing the table.
REPLAN_WAIT_S = 5.0

EPILOG = f"""examples:
  perseus straggler --job job-1a2b3c4d5e6f7a8b --pipeline 1 --factor 1.2
                          pipeline 1 runs 20% slower than planned: the others are re-planned to its pace
  perseus straggler --job job-1a2b3c4d5e6f7a8b --pipeline 1 --clear
  perseus straggler --job job-1a2b3c4d5e6f7a8b      show pipelines, deadlines and stragglers

A declaration (or --clear) waits up to {REPLAN_WAIT_S:g} s for the re-plan it causes, then prints the
plans. The service also detects stragglers from the iteration times ranks report; the slowest
straggler, declared or detected, sets the others' pace. Address: --address (default {DEFAULT_ADDRESS}).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "straggler",
        help="declare a slow data-parallel pipeline to the planner service",
        description="Tell a running planner service that one data-parallel pipeline of a job is slow by a known "
        "factor (a throttled or older node). The other pipelines get the least-energy plan at the straggler's pace "
        "(factor x its planned iteration time), starting together at an iteration boundary.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--job", required=True, metavar="ID", help="the job id (perseus serve logs it; job-<hex>)")
    parser.add_argument(
        "--pipeline", type=int, default=None, metavar="K", help="the straggling pipeline's data-parallel index"
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument(
        "--factor",
        type=float,
        default=None,
        metavar="F",
        help=f"its iteration time over its planned time, in [1, {MAX_STRAGGLER_FACTOR:g}]",
    )
    action.add_argument(
        "--clear", action="store_true", help="withdraw the declaration (the others go back to their no-slowdown plans)"
    )
    add_service_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.factor is not None or args.clear) and args.pipeline is None:
        raise ConfigError("say which pipeline with --pipeline K (its data-parallel index)")
    check_job_id(args.job)
    if args.pipeline is not None and args.pipeline < 0:
        raise ConfigError(f"--pipeline is a data-parallel index, 0 or more; got {args.pipeline}")
    if args.factor is not None and not 1.0 <= args.factor <= MAX_STRAGGLER_FACTOR:
        raise ConfigError(
            f"--factor is the straggler's iteration time over its planned time, in [1, {MAX_STRAGGLER_FACTOR:g}]; got "
            f"{args.factor:g}"
        )
    with service_client(args) as client:
        if args.factor is not None or args.clear:
            before = fetch_status(client, args, args.job).jobs[0].plan_version
            if not client.declare_straggler(args.job, args.pipeline, None if args.clear else args.factor):
                raise unreachable(args)
            what = "cleared" if args.clear else f"declared {args.factor:g}x"
            print(f"job {args.job}: pipeline {args.pipeline} {what}")
            status = _replanned(client, args, before)
        else:
            status = fetch_status(client, args, args.job)
    print(format_pipelines(status.jobs[0]))
    return 0


def _replanned(client: PlannerClient, args: argparse.Namespace, before: int) -> Status:
    """The job's status once a plan newer than version `before` is published (the service solves
    the re-plan in the background), or after REPLAN_WAIT_S, saying it is still to come."""
    deadline = time.monotonic() + REPLAN_WAIT_S
    while True:
        status = fetch_status(client, args, args.job)
        if status.jobs[0].plan_version > before:
            return status
        if time.monotonic() >= deadline:
            print(
                f"no plan published within {REPLAN_WAIT_S:g} s (none may change, or it is still being solved): "
                f"`perseus straggler --job {args.job}` shows the plans later"
            )
            return status
        time.sleep(0.1)


def format_pipelines(job: JobStatus) -> str:
    """One line per pipeline: plan version, deadline, predicted and measured time, straggler."""
    rows = [f"job {job.job_id} ({job.phase})", "pipeline  plan  deadline_s  predicted_s  measured_s  straggler"]
    for p in job.pipelines:
        straggler = f"{p.straggler} {p.straggler_factor:.3f}x" if p.straggler else "-"
        rows.append(
            f"{p.pipeline:>8}  v{p.plan_version:<3}  {_num(p.deadline_s, 'none'):>10}  "
            f"{_num(p.predicted_iteration_time_s):>11}  {_num(p.measured_iteration_time_s):>10}  {straggler}"
        )
    return "\n".join(rows)


def _num(value: float | None, missing: str = "-") -> str:
    return missing if value is None else f"{value:.4f}"

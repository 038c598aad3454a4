"""`perseus straggler`: declare a known-slow data-parallel pipeline, so the planner service slows
the others to its pace (or clear it); without --factor or --clear, show each pipeline's state."""

from __future__ import annotations

import argparse
import time

from perseus.cli.service_args import add_service_arguments, check_job_id, fetch_status, service_client, unreachable
from perseus.client.planner_client import PlannerClient
from perseus.exceptions import ConfigError
from perseus.wire.limits import DEFAULT_ADDRESS, MAX_STRAGGLER_FACTOR
from perseus.wire.messages import JobStatus

#: How long a declaration waits for the re-plan it causes before printing the table.
REPLAN_WAIT_S = 5.0
#: What the service says in the reason of a pipeline whose new plan is being solved
#: (perseus.service.status.SOLVING; not imported: this command pays only for the client's imports).
SOLVING = "being solved"

EPILOG = f"""examples:
  perseus straggler --job job-1a2b3c4d5e6f7a8b --pipeline 1 --factor 1.2
                          pipeline 1 runs 20% slower than planned: the others are re-planned to its pace
  perseus straggler --job job-1a2b3c4d5e6f7a8b --pipeline 1 --clear
  perseus straggler --job job-1a2b3c4d5e6f7a8b      show pipelines, deadlines and stragglers

A declaration (or --clear) waits up to {REPLAN_WAIT_S:g} s for the re-plan it causes, then prints the
plans; where it changes no plan, it says so at once, and why. The service also detects stragglers
from the iteration times ranks report; the slowest straggler, declared or detected, sets the others'
pace. A declared factor over 10% from what the pipeline's iterations measure is contradicted by
measurement: the measured factor sets the pace instead, and the reply says so.
Address: --address (default {DEFAULT_ADDRESS}).
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
            before = fetch_status(client, args, args.job).jobs[0]
            if not client.declare_straggler(args.job, args.pipeline, None if args.clear else args.factor):
                raise unreachable(args)
            what = "cleared" if args.clear else f"declared {args.factor:g}x"
            print(f"job {args.job}: pipeline {args.pipeline} {what}")
            job = _settled(client, args, before.plan_version)
            for line in _outcome(args, before, job):
                print(line)
        else:
            job = fetch_status(client, args, args.job).jobs[0]
    print(format_pipelines(job))
    return 0


def _settled(client: PlannerClient, args: argparse.Namespace, before: int) -> JobStatus:
    """The job's status once a plan newer than version `before` is published (the service solves
    the re-plan in the background); at once where no pipeline awaits one (nothing changes), and
    after REPLAN_WAIT_S at the latest."""
    deadline = time.monotonic() + REPLAN_WAIT_S
    while True:
        job = fetch_status(client, args, args.job).jobs[0]
        if job.plan_version > before or not _solving(job) or time.monotonic() >= deadline:
            return job
        time.sleep(0.1)


def _solving(job: JobStatus) -> bool:
    return any(SOLVING in p.reason for p in job.pipelines)


def _outcome(args: argparse.Namespace, before: JobStatus, after: JobStatus) -> list[str]:
    """What the declaration did, above the plans (nothing there: it re-planned), and what the
    service says of the pipeline (a declaration its iterations contradict, say)."""
    reason = after.pipelines[args.pipeline].reason if args.pipeline < len(after.pipelines) else ""
    lines = [] if after.plan_version > before.plan_version else [_unpublished(args, before, after)]
    return lines + ([f"pipeline {args.pipeline}: {reason}"] if reason else [])


def _unpublished(args: argparse.Namespace, before: JobStatus, after: JobStatus) -> str:
    """Why no plan was published: it is still being solved, or none changes (and why)."""
    if _solving(after):
        return (
            f"no plan published within {REPLAN_WAIT_S:g} s, it is still being solved: `perseus straggler --job "
            f"{args.job}` shows the plans later"
        )
    if after.plan_version == 0:
        return (
            f"nothing to re-plan: the job has no plan yet ({after.phase}); its first plans are made for the "
            "stragglers as they are then"
        )
    return f"nothing to re-plan: {_unchanged(args, before, after)}"


def _unchanged(args: argparse.Namespace, before: JobStatus, after: JobStatus) -> str:
    """Why no plan changes: the pace the stragglers set now is the one the plans in force run at."""
    slow = next((p for p in after.pipelines if p.straggler), None)
    if slow is None:
        pace = "no straggler sets a pace"
    else:
        pace = f"pipeline {slow.pipeline} ({slow.straggler} {slow.straggler_factor:.3f}x) sets the others' pace"
    was = before.pipelines[args.pipeline].straggler if args.pipeline < len(before.pipelines) else ""
    held = f"pipeline {args.pipeline} held no declaration that set the pace; " if args.clear and not was else ""
    return f"{held}{pace}, and the plans in force already run the clocks for it"


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

"""`perseus status`: what a running planner service knows of every job (or one): phase, plans,
how its model fits the measured timeline, predicted against measured time and energy, the
measured saving (none claimed where every plan fell back to maximum clocks), each plan's
verification (re-plans, fallbacks and why) and stragglers."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from perseus.atomic import write_bytes_atomic
from perseus.cli.service_args import add_service_arguments, check_job_id, fetch_status, service_client
from perseus.exceptions import ConfigError
from perseus.wire.calibration import CalibrationStatus
from perseus.wire.limits import DEFAULT_ADDRESS
from perseus.wire.messages import JobStatus, PipelineStatus

EPILOG = f"""examples:
  perseus status                       every job: phase, model fit, plans, measured saving
  perseus status --job job-1a2b3c4d5e6f7a8b
  perseus status --json                the same as JSON (the service's JobStatus fields)
  perseus status --png plots/          also write plots/<job>-frontier.png per job (needs perseus-energy[plot])

Address: --address (default {DEFAULT_ADDRESS}); a service run with --curve-keys needs --curve-keys.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the jobs of a running planner service",
        description="Show what a running planner service knows of each job: its phase and plan, how the "
        "calibrated model fits the baseline measured on the job's own timeline (per stage), the predicted "
        "against the measured iteration time and energy, the saving measured against the baseline, each plan's "
        "verification on measured time (re-plans and fallbacks, with reasons) and stragglers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--job", default=None, metavar="ID", help="one job (job-<hex>); default: every job")
    parser.add_argument("--json", action="store_true", help='print JSON: {"jobs": [JobStatus fields, ...]}')
    parser.add_argument(
        "--png",
        default=None,
        metavar="DIR",
        help="also write DIR/<job>-frontier.png per job: energy against iteration time of the baseline and the "
        "plan, measured and predicted (needs matplotlib: pip install 'perseus-energy[plot]')",
    )
    add_service_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_job_id(args.job)
    if args.png is not None:
        from perseus.planner.plot import pyplot  # lazy: matplotlib is an optional extra

        pyplot()  # matplotlib missing: say so before asking the service
    with service_client(args) as client:
        status = fetch_status(client, args, args.job)
    if args.json:
        print(json.dumps({"jobs": [job_json(job) for job in status.jobs]}, indent=2))
    elif not status.jobs:
        print(f"no jobs on the service at {args.address}")
    else:
        print("\n\n".join(format_job(job) for job in status.jobs))
    if args.png is not None:
        for job in status.jobs:
            path = write_frontier_png(job, args.png)
            print(
                f"wrote {path}" if path else f"{job.job_id}: nothing measured or predicted yet, no PNG", file=sys.stderr
            )
    return 0


def job_json(job: JobStatus) -> dict:
    """A job as --json prints it: every JobStatus field (those the wire leaves out at their
    defaults too: a script reads `replans` or `saving_withheld` without a KeyError), and the
    savings the text shows (measured_saving null where none is claimed: `saving_withheld` says why)."""
    return {**dataclasses.asdict(job), "measured_saving": job.measured_saving, "predicted_saving": job.predicted_saving}


def frontier_points(job: JobStatus) -> tuple[dict[str, list[tuple[float, float]]], dict[str, tuple[float, float]]]:
    """(measured, predicted) (iteration time, energy) points of the baseline and the plan. The
    predicted baseline's time is the calibrated model's at max clocks (its slowest pipeline model)."""
    measured = {
        name: [(t, e)]
        for name, t, e in (
            ("baseline", job.baseline_iteration_time_s, job.baseline_energy_j),
            ("planned", job.planned_iteration_time_s, job.planned_energy_j),
        )
        if t is not None and e is not None
    }
    model_times = [c.model_s for c in job.calibrations if c.model_s is not None]
    predicted = {
        name: (t, e)
        for name, t, e in (
            ("baseline", max(model_times, default=None), job.predicted_baseline_energy_j),
            ("plan", job.predicted_iteration_time_s, job.predicted_energy_j),
        )
        if t is not None and e is not None
    }
    return measured, predicted


def write_frontier_png(job: JobStatus, out_dir: str) -> str | None:
    """Write `<out_dir>/<job>-frontier.png` (atomically); its path, or None when the job has no point yet."""
    from perseus.planner.plot import plot_measured  # lazy, as in run

    measured, predicted = frontier_points(job)
    if not measured and not predicted:
        return None
    try:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{job.job_id}-frontier.png")
        write_bytes_atomic(path, plot_measured(measured, predicted), fsync=False)
    except OSError as e:
        raise ConfigError(f"--png {out_dir}: cannot write there ({e.strerror}); give a writable directory") from None
    return path


def format_job(job: JobStatus) -> str:
    """A job as text: a header line, its models' fits, its pipelines, its measured iterations."""
    tolerance = "" if job.tolerance is None else f", tolerance {100 * job.tolerance:g}%"
    lines = [
        f"job {job.job_id}: {job.phase}, {job.ranks_registered} of {job.world_size} ranks, plan v{job.plan_version}, "
        + (f"iteration {job.last_iteration}" if job.last_iteration >= 0 else "no iteration reported yet")
        + tolerance
        + _quiet(job)
    ]
    if job.error:
        lines.append(f"  error: {job.error}")
    if job.warning:
        lines.append(f"  warning: {job.warning}")
    if job.profile_dropped:
        lines.append(f"  profiled again: {job.profile_dropped}")
    if job.phase == "profiling":
        done = ", ".join(map(str, job.profiled_stages)) or "none yet"
        lines.append(f"  stages profiled: {done} (the service plans once every stage's profile is in)")
    for calibration in job.calibrations:
        lines += _calibration(calibration)
    if job.pipelines:
        lines.append(
            "  pipeline  plan  deadline_s  predicted_s  measured_s  baseline_s  target_s  verified_s  check       "
            "replans  straggler"
        )
        for p in job.pipelines:
            lines += _pipeline(p)
    lines.append("  " + _iterations(job))
    return "\n".join(lines)


def _quiet(job: JobStatus) -> str:
    """Whether the job ended (every rank's close() reported) or went quiet."""
    if job.ranks_closed >= job.world_size:
        return "; every rank closed: the job ended"
    closed = f"; {job.ranks_closed} of {job.world_size} ranks closed" if job.ranks_closed else ""
    if not job.went_quiet:
        return closed
    return f"{closed}; no iteration reported for {job.quiet_s:.0f} s: the job ended, or stalls"


def _tolerance(tolerance: float | None) -> str:
    return f", tolerance {100 * tolerance:.1f}%" if tolerance is not None else ""


def _calibration(c: CalibrationStatus) -> list[str]:
    head = f"  model of {c.models}: {c.state}"
    if c.model_s is not None and c.measured_s is not None:
        head += (
            f" on {c.iterations} baseline iterations: model {c.model_s:.4f} s vs measured {c.measured_s:.4f} s "
            f"({_percent(c.error)}{_tolerance(c.tolerance)}); GPU profile alone {_num(c.gpu_only_s)} s "
            f"({_percent(c.explained, signed=False)} explained); host gap {_ms(c.host_gap_s)}, hop {_ms(c.hop_s)}"
        )
    if c.margin:
        head += f"; margin {100 * c.margin:.0f}% on slowed instructions"
    lines = [head]
    if c.reason:
        lines.append(f"    {c.reason}")
    if c.stages:
        lines.append("    stage  measured_s  model_s  error   busy_s  host_gap")
        for s in c.stages:
            lines.append(
                f"    {s.stage:>5}  {_num(s.measured_s):>10}  {_num(s.model_s):>7}  {_percent(s.error):>6}  "
                f"{_num(s.busy_s):>6}  {_ms(s.host_gap_s)}"
            )
    return lines


def _pipeline(p: PipelineStatus) -> list[str]:
    straggler = f"{p.straggler} {p.straggler_factor:.3f}x" if p.straggler and p.straggler_factor else "-"
    line = (
        f"  {p.pipeline:>8}  v{p.plan_version:<3}  {_num(p.deadline_s, 'none'):>10}  "
        f"{_num(p.predicted_iteration_time_s):>11}  {_num(p.measured_iteration_time_s):>10}  "
        f"{_num(p.baseline_iteration_time_s):>10}  {_num(p.target_iteration_time_s):>8}  "
        f"{_num(p.verified_iteration_time_s):>10}  {p.verification or '-':<10}  {p.replans:>7}  {straggler}"
    )
    return [line] + ([f"            {p.reason}"] if p.reason else [])


def _iterations(job: JobStatus) -> str:
    baseline = (
        f"baseline {_num(job.baseline_iteration_time_s)} s, {_num(job.baseline_energy_j, digits=1)} J "
        f"({_count(job.baseline_iterations, 'iteration')})"
    )
    planned = (
        f"planned {_num(job.planned_iteration_time_s)} s, {_num(job.planned_energy_j, digits=1)} J "
        f"({_count(job.planned_iterations, 'iteration')})"
    )
    if job.saving_withheld:
        return f"{baseline}; {planned}; no saving claimed: {job.saving_withheld}"
    saving = f"saving {_percent(job.measured_saving, signed=False)} measured"
    if job.predicted_saving is not None:
        saving += f" (predicted {_percent(job.predicted_saving, signed=False)})"
    return f"{baseline}; {planned}; {saving}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _num(value: float | None, missing: str = "-", digits: int = 4) -> str:
    return missing if value is None else f"{value:.{digits}f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.2f} ms"


def _percent(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}%" if signed else f"{100 * value:.1f}%"

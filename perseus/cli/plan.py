"""`perseus plan`: plan GPU frequencies for a pipeline schedule from a time-energy profile."""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from perseus.atomic import write_bytes_atomic, write_json_atomic, write_text_atomic
from perseus.exceptions import ConfigError, PlanError
from perseus.profiler import load_profile
from perseus.profiler.checks import clock_notes, unit_problems
from perseus.profiler.profile import REPEATS
from perseus.schedules import SCHEDULES, build_schedule
from perseus.schedules.instruction import Kind
from perseus.wire.limits import MAX_INSTRUCTIONS

EPILOG = """examples:
  perseus plan --profile gpt3.csv --blocking-power 83.64 --stages 8 --microbatches 96
                          no slowdown: what Perseus saves at the all-max-clock iteration time
  perseus plan --profile gpt3.csv --blocking-power 83.64 --stages 8 --microbatches 96 --max-slowdown 1.1 --out plan.json
                          up to 10% slower, the plan written as JSON
  perseus plan --profile gpt3.csv --blocking-power 83.64 --stages 8 --microbatches 96 --max-slowdown 1.1 --padded
                          another pipeline straggles at 1.1x: every iteration lasts that long, so use the slack
  perseus plan --profile gpt3.csv --blocking-power 83.64 --stages 32 --microbatches 512 --repeat-profile tile
                          a 32-stage pipeline of the 8 profiled stages' layers (stage s takes stage s % 8's rows)
  perseus plan --profile prof.json --stages 4 --microbatches 16 --frontier frontier.csv --plot plots/
                          the whole time-energy frontier, with pictures (a JSON profile carries its blocking power)

A CSV profile has the columns stage,instruction,frequency,time,energy: one row per stage,
instruction kind (forward, backward, ...) and SM frequency (MHz), with seconds and joules.
Numbers that look like other units (kW, mW, ms), instructions missing the highest clock and
lower clocks that run faster than the highest are said on stderr, and kept in --out's "notes".
"""


# A plan this much shorter than its deadline stopped at its least energy (rounding leaves less).
LEAST_ENERGY_NOTE = 0.005
# Instructions `perseus plan` solves: 4x what the service takes for a live job (MAX_INSTRUCTIONS).
# Measured (GPT-3 A100 profile tiled, no slowdown, 2-core machine): 64 x 1024 1F1B, 131,072
# instructions, 204 s and 1.6 GB; the LP relaxation's simplex grows faster than the job above it.
MAX_PLAN_INSTRUCTIONS = 1 << 17
# Deadlines up to this factor of the all-max-clock time (a plan stops at its least energy well before).
MAX_SLOWDOWN = 10.0
MAX_FRONTIER_POINTS = 1000
# From this size a frontier takes minutes, printing nothing meanwhile (an outsider's 32 x 512: 480 s): said first.
LARGE_FRONTIER_INSTRUCTIONS = 8192


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="plan per-instruction GPU frequencies that cut energy within a deadline",
        description="Choose an SM frequency for every instruction of one pipeline iteration: the least "
        "energy within the deadline (default: no slowdown against every GPU at its maximum clock). "
        "Prints the plan next to the baselines, with a certified lower bound on the energy.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--profile", required=True, type=Path, metavar="FILE", help="time-energy profile (.csv or .json)"
    )
    parser.add_argument(
        "--blocking-power",
        type=float,
        metavar="W",
        help="watts a GPU draws while waiting on a peer (required for CSV profiles)",
    )
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    parser.add_argument("--stages", type=int, required=True, metavar="N", help="number of pipeline stages (ranks)")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="microbatches per iteration")
    parser.add_argument(
        "--chunks", type=int, default=1, metavar="V", help="model chunks per rank (interleaved-1f1b; default 1)"
    )
    parser.add_argument(
        "--split-backward",
        type=float,
        metavar="F",
        help="zb-h1 with a profile of whole backwards: derive input- and weight-gradient rows, F of each backward's "
        "time and energy to the input part (e.g. 0.5)",
    )
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--deadline", type=float, metavar="S", help="iteration time limit in seconds")
    limit.add_argument(
        "--max-slowdown",
        type=float,
        metavar="F",
        help="iteration time limit as a factor of the all-max-clock time, e.g. 1.1",
    )
    parser.add_argument(
        "--padded",
        action="store_true",
        help="the iteration lasts the deadline whatever the plan (a straggling pipeline sets the pace, and every "
        "GPU blocks until then): plan the least energy of such an iteration, using the slack",
    )
    parser.add_argument(
        "--repeat-profile",
        choices=REPEATS,
        metavar="HOW",
        help="plan more stages than the profile has, from the same layers: 'tile' repeats the profiled pipeline "
        "(stage s takes the rows of stage s %% K), 'stretch' spreads each profiled stage over consecutive ones "
        "(s * K // stages)",
    )
    parser.add_argument("--out", type=Path, metavar="FILE", help="write the plan as JSON here")
    parser.add_argument("--frontier", type=Path, metavar="FILE", help="write the time-energy frontier as CSV here")
    parser.add_argument("--frontier-points", type=int, default=50, metavar="N", help="frontier points (default 50)")
    parser.add_argument(
        "--plot", type=Path, metavar="DIR", help="write timeline.png and frontier.png into DIR (needs matplotlib)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Deliberately lazy: `perseus --help` imports every command module, and the planner loads
    # scipy and HiGHS (about a second); only `perseus plan` itself needs them.
    from perseus.planner import Planner
    from perseus.planner.baselines import envpipe_plan, max_frequency_plan, uniform_plan

    # A missing file is said as such by the loader below, not as a missing --blocking-power.
    if args.blocking_power is None and args.profile.suffix.lower() == ".csv" and args.profile.is_file():
        raise ConfigError(
            f"{args.profile}: a CSV profile carries no blocking power; pass --blocking-power W "
            "(watts a GPU draws while waiting on a peer, e.g. 83.64 for A100-SXM, 70.38 for A40)"
        )
    if args.split_backward is not None and not 0.0 < args.split_backward < 1.0:
        raise ConfigError(
            "--split-backward is the input part's share of each backward, strictly between 0 and 1; got "
            f"{args.split_backward:g}"
        )
    if not 2 <= args.frontier_points <= MAX_FRONTIER_POINTS:
        raise ConfigError(
            f"--frontier-points must be from 2 (the fastest and the least-energy plan) to {MAX_FRONTIER_POINTS}, "
            f"got {args.frontier_points}"
        )
    for flag, value, what in (
        ("--deadline", args.deadline, "a positive number of seconds, e.g. 16.5"),
        ("--max-slowdown", args.max_slowdown, "a positive factor of the all-max-clock time, e.g. 1.1"),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} must be {what}; got {value:g}")
    if args.max_slowdown is not None and args.max_slowdown > MAX_SLOWDOWN:
        raise ConfigError(
            f"--max-slowdown {args.max_slowdown:g} is past what is worth planning: at most {MAX_SLOWDOWN:g}, a factor "
            "(1.1 is 10% slower; a plan stops at its least energy, about 1.2-1.5x on the profiles we know)"
        )
    _check_size(args)
    for flag, path in (("--out", args.out), ("--frontier", args.frontier)):
        if path is not None and path.is_dir():
            raise ConfigError(
                f"{flag} {path} is a folder; give a file path, e.g. "
                f"{path / ('plan.json' if flag == '--out' else 'frontier.csv')}"
            )
        if path is not None and not path.parent.exists():
            raise ConfigError(f"folder {path.parent} does not exist; create it or choose another path for {path.name}")
    if args.plot is not None and args.plot.exists() and not args.plot.is_dir():
        raise ConfigError(f"--plot {args.plot} is a file; give a folder for timeline.png and frontier.png")
    if args.plot is not None:
        from perseus.planner.plot import pyplot  # lazy, as the planner above

        pyplot()  # fail before planning if matplotlib is missing
    profile = load_profile(args.profile, args.blocking_power)  # logs what looks like other units
    for note in clock_notes(profile):
        print(f"note: {args.profile}: {note}", file=sys.stderr)
    schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.chunks)
    profiled = len(profile.stages())
    if profiled > schedule.num_virtual_stages:
        print(
            f"note: {args.profile} profiles {profiled} stages; this pipeline has "
            f"{schedule.num_virtual_stages}, so it plans with the profile's stages 0-{schedule.num_virtual_stages - 1}"
            + (f" (--repeat-profile {args.repeat_profile} repeats none)" if args.repeat_profile else "")
        )
    elif args.repeat_profile is not None:
        profile = profile.repeated(schedule.num_virtual_stages, args.repeat_profile)
    elif schedule.num_chunks > 1 and profiled < schedule.num_virtual_stages:
        print(
            f"note: {args.profile} profiles {profiled} stages, not this schedule's {schedule.num_virtual_stages} "
            f"virtual stages ({schedule.num_stages} ranks x {schedule.num_chunks} chunks): every chunk of a rank "
            "takes its rank's rows, so those rows must be one chunk's instruction, not the whole rank's"
        )
    if args.split_backward is not None:
        profile = profile.with_split_backward(args.split_backward)
    elif Kind.BACKWARD_INPUT in {ins.kind for row in schedule.stages for ins in row} and not any(
        Kind.BACKWARD_INPUT.value in profile.kinds(stage) for stage in profile.stages()
    ):
        raise ConfigError(
            f"{schedule.name} splits each backward into input- and weight-gradient parts, which {args.profile} "
            "does not profile apart; pass --split-backward F to give F of each backward to the input part (e.g. 0.5)"
        )
    planner = Planner(schedule, profile)
    if args.deadline is not None and args.deadline > MAX_SLOWDOWN * planner.max_frequency_time_s:
        raise ConfigError(
            f"--deadline {args.deadline:g} s is {args.deadline / planner.max_frequency_time_s:.3g}x the all-max-clock "
            f"time ({planner.max_frequency_time_s:.6g} s), past what is worth planning: at most {MAX_SLOWDOWN:g}x"
        )
    plan = planner.plan(deadline=args.deadline, max_slowdown=args.max_slowdown, padded=args.padded)

    ev = planner.evaluator
    pace = max(plan.deadline_s, planner.max_frequency_time_s)
    rows = [max_frequency_plan(ev)]
    missed = []
    for name, baseline in (("uniform clock", uniform_plan), ("EnvPipe", envpipe_plan)):
        try:
            rows.append(baseline(ev, plan.deadline_s))
        except PlanError as e:  # deadline below the all-max time, or no clock every stage has
            missed.append((name, "no clock every stage profiles" if "no frequency" in str(e) else _SHORT[name]))
    base = planner.energy_at_pace(rows[0].energy_j, rows[0].iteration_time_s, pace)
    print(
        f"{schedule.name}, {schedule.num_stages} stage{'s' * (schedule.num_stages != 1)} x "
        f"{schedule.num_microbatches} microbatch{'es' * (schedule.num_microbatches != 1)} "
        f"({planner.problem.num_nodes} instructions), blocking power {profile.blocking_power_w:g} W, "
        f"deadline {plan.deadline_s:.6g} s"
    )
    print(f"{'plan':<22} {'iteration s':>12} {'energy J':>12} {'saving':>8}")
    for r in rows:
        padded = planner.energy_at_pace(r.energy_j, r.iteration_time_s, pace)
        print(f"{r.name:<22} {r.iteration_time_s:>12.6g} {padded:>12.1f} {100 * (1 - padded / base):>7.2f}%")
    saving = planner.saving(plan)
    print(f"{'Perseus':<22} {plan.iteration_time_s:>12.6g} {base * (1 - saving):>12.1f} {100 * saving:>7.2f}%")
    for name, reason in missed:
        print(f"{name:<22} {reason:>34}")
    # The table's energies span `pace` (the baselines' too); where that shows another figure than the
    # plan's own, say so.
    span = plan.deadline_s if plan.padded else plan.iteration_time_s
    spans_more = round(planner.energy_at_pace(plan.energy_j, span, pace), 1) != round(plan.energy_j, 1)
    own = " (over its own iteration)" if spans_more else ""
    print(
        f"lower bound {plan.lower_bound_j:.1f} J on the plan's {plan.energy_j:.1f} J{own}: Perseus is within "
        f"{100 * plan.gap:.3f}% of optimal"
    )
    if spans_more or pace > planner.max_frequency_time_s:
        what = "" if pace > planner.max_frequency_time_s else ", the all-max-clock iteration the saving is against"
        slack = (
            ""
            if plan.padded or pace <= planner.max_frequency_time_s
            else "; --padded plans for that and uses the slack"
        )
        print(
            f"(energies and savings over an iteration of {pace:.6g} s{what}: a plan that ends early blocks until "
            f"then, as beside a straggler{slack})"
        )
    if not plan.padded and plan.iteration_time_s < plan.deadline_s * (1 - LEAST_ENERGY_NOTE):
        print(
            f"note: the plan ends at {plan.iteration_time_s:.6g} s "
            f"({plan.iteration_time_s / planner.max_frequency_time_s:.4g} x the all-max-clock time), before the "
            f"deadline: the least energy the planner found within it, slower instructions costing more (by the bound, "
            f"no plan within the deadline is over {100 * plan.gap:.3f}% cheaper; a longer one may still save a little)"
        )

    if args.out is not None:
        with _writing("--out", args.out):
            write_json_atomic(args.out, _plan_document(plan, args.profile, profile, rows[0], saving, pace))
        print(f"plan written to {args.out}")
    frontier = None
    if args.frontier is not None or args.plot is not None:
        if planner.problem.num_nodes >= LARGE_FRONTIER_INSTRUCTIONS:
            print(
                f"computing the {args.frontier_points}-point frontier of {planner.problem.num_nodes:,} instructions: "
                "minutes at this size (32 x 512, 50 points: about 8 minutes and 1.6 GB)",
                flush=True,
            )
            frontier = planner.frontier(args.frontier_points, _tenths)
        else:
            frontier = planner.frontier(args.frontier_points)
    if args.frontier is not None:
        assert frontier is not None  # computed just above
        with _writing("--frontier", args.frontier):
            _write_frontier(frontier, args.frontier)
        print(f"frontier ({len(frontier)} points) written to {args.frontier}")
    if args.plot is not None:
        with _writing("--plot", args.plot):
            _plots(args.plot, planner, plan, frontier, rows)
        print(f"plots written to {args.plot / 'timeline.png'} and {args.plot / 'frontier.png'}")
    return 0


@contextmanager
def _writing(flag: str, path: Path) -> Iterator[None]:
    """An OS error while writing an output is the user's to fix: say which flag, not a traceback."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"cannot write {flag} {path}: {e.strerror or e}; choose a writable path") from None


def _plan_document(plan, path, profile, max_clocks, saving: float, pace: float) -> dict:
    """The plan's JSON, with what the printed table says beside it: which profile, the maximum-clock
    iteration it is compared with, and the saving over an iteration of `pace` (`energy_j` is over
    the plan's own iteration unless `padded`), and the notes on the profile (`notes`: units that look
    wrong, clocks the baselines misread)."""
    return {
        **plan.to_json(),
        "profile": str(path),
        "blocking_power_w": profile.blocking_power_w,
        "max_clocks": {"iteration_time_s": max_clocks.iteration_time_s, "energy_j": max_clocks.energy_j},
        "saving": saving,
        "saving_over_s": pace,
        "notes": unit_problems(profile) + clock_notes(profile),
    }


# Why a baseline has no row: it cannot meet a deadline that only other clocks reach.
_SHORT = {
    "uniform clock": "no one clock meets the deadline",
    "EnvPipe": "cannot meet the deadline: it slows only instructions off the all-max critical path",
}


def _tenths(done: int, total: int) -> None:
    """Progress of a large frontier, at each tenth of its points."""
    if done * 10 // total != (done - 1) * 10 // total or done == total:
        print(f"  frontier point {done} of {total}", flush=True)


def _write_frontier(points, path: Path) -> None:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["deadline_s", "time_s", "energy_j", "lower_bound_j", "gap"])
    for p in points:
        writer.writerow(
            [repr(p.plan.deadline_s), repr(p.time_s), repr(p.energy_j), repr(p.lower_bound_j), repr(p.plan.gap)]
        )
    write_text_atomic(path, buf.getvalue())


def _plots(folder: Path, planner, plan, frontier, baselines) -> None:
    from perseus.planner.plot import plot_frontier, plot_timeline  # lazy, as the planner in run()

    ev = planner.evaluator
    panels = [
        ("all GPUs at max clock", ev.evaluate(baselines[0].frequencies)),
        ("Perseus plan", ev.evaluate(plan.frequencies)),
    ]
    write_bytes_atomic(folder / "timeline.png", plot_timeline(panels, planner.schedule, planner.profile))
    points = {r.name: (r.iteration_time_s, r.energy_j) for r in baselines}
    points["Perseus plan"] = (plan.iteration_time_s, plan.energy_j)
    write_bytes_atomic(folder / "frontier.png", plot_frontier(frontier, points))


def _check_size(args: argparse.Namespace) -> None:
    """Refuse, before building anything, a pipeline past MAX_PLAN_INSTRUCTIONS; note one past
    what the service takes for a live job."""
    kinds = 3 if args.schedule == "zb-h1" else 2  # forward and backward (input and weight apart)
    if min(args.stages, args.microbatches, args.chunks) < 1:
        return  # build_schedule names the bad number
    count = kinds * args.stages * args.microbatches * args.chunks
    shape = f"{args.stages} stages x {args.microbatches} microbatches" + (
        f" x {args.chunks} chunks" if args.chunks > 1 else ""
    )
    if count > MAX_PLAN_INSTRUCTIONS:
        raise ConfigError(
            f"{shape} is {count:,} instructions, over the {MAX_PLAN_INSTRUCTIONS:,} perseus plan solves (64 x 1024 "
            "1F1B takes about 3.5 minutes and 1.6 GB, deeper pipelines longer); plan fewer stages or microbatches "
            "(past the pipeline's warm-up every microbatch repeats the one before, and so does its plan)"
        )
    if count > MAX_INSTRUCTIONS:
        print(
            f"note: {shape} is {count:,} instructions, over the {MAX_INSTRUCTIONS:,} the planner service takes for a "
            "live job; a plan this large takes minutes"
        )

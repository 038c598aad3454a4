"""`perseus demo`: Perseus end to end on simulated GPUs -- service, torchrun pipeline, saving."""

from __future__ import annotations

import argparse
import json
import sys

from perseus.demo.launcher import DemoOptions, default_preset, run_demo
from perseus.demo.report import format_report

DESCRIPTION = """Run Perseus end to end: start a planner service (`perseus serve` on loopback) and a torchrun
job (gloo, CPU) that trains a small transformer split into pipeline stages with torch's Schedule1F1B,
each rank on a simulated GPU (an A100-SXM unless --preset or PERSEUS_GPU=sim:PRESET names another).
The job runs baseline iterations at maximum clocks, then Perseus attaches as it would to any job: it
profiles the stages online, the service calibrates its model on the job's own baseline timeline, plans
every instruction's SM clock, and verifies the plan on measured time while the job runs it (re-planning
if it runs slow) until verification has decided. Prints iteration time and energy per phase, the
predicted against the measured saving, the model's fit and verification's verdict. Exits 1 if it fails,
a simulated GPU left off its default clocks included."""

EPILOG = """examples:
  perseus demo                         4 ranks, 8 microbatches: baseline, profiling, calibration, planned
                                       until verified (2-5 minutes)
  perseus demo --json                  one JSON object (baseline, planned, predicted/measured saving,
                                       calibration, verification, ...)
  perseus demo --plot out/             also write out/timeline.png: one baseline and one planned iteration
  perseus demo --state-dir ./state     keep the profile: a second run skips profiling
  perseus demo --dp 2 --straggler 1.2  2 data-parallel pipelines x 2 stages, the second on GPUs 20% slower:
                                       the service detects it and slows the other pipeline to its pace
  PERSEUS_GPU=sim:mi300x:4 perseus demo
                                       on simulated AMD Instinct MI300X GPUs (or: perseus demo --preset mi300x)

No GPU needed: every rank runs on a simulated GPU (`perseus info --presets` lists them) that takes
the time and draws the power of a GPT-3 pipeline stage at its current SM clock.
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run Perseus end to end on a simulated 4-GPU pipeline",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument(
        "--plot",
        metavar="DIR",
        default=None,
        help="write the measured timeline (timeline.png, timeline.json) and time-energy points (frontier.png) to DIR",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=None,
        metavar="N",
        help="pipeline stages per pipeline, one rank each (2-8; default 4, or 2 with --dp above 1)",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel pipelines (1-4, at most 8 ranks in all; default 1)",
    )
    parser.add_argument(
        "--straggler",
        type=float,
        default=1.0,
        metavar="F",
        help="the last pipeline's simulated GPUs take F times longer (e.g. 1.2; needs --dp 2 or more)",
    )
    parser.add_argument(
        "--microbatches", type=int, default=8, metavar="N", help="microbatches per iteration (default 8)"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=4,
        metavar="N",
        help="measured baseline iterations, and at least as many planned ones (the plan runs until the service "
        "has verified it); each phase runs one more, unmeasured (default 4)",
    )
    parser.add_argument(
        "--sweep-step", type=int, default=5, metavar="N", help="profile every N-th supported clock (default 5)"
    )
    parser.add_argument(
        "--state-dir", metavar="DIR", default=None, help="planner state directory (default: a temporary one)"
    )
    parser.add_argument(
        "--port", type=int, default=None, metavar="PORT", help="planner service port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="simulated GPU model of every rank (default: the preset of PERSEUS_GPU=sim:PRESET[:COUNT], else a100-sxm)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="model and data seed (default 0)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="F",
        help="GPU work time scale (default: about 1.5 s per iteration at maximum clocks)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (logs, per-rank records) and print its path"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = DemoOptions(
        ranks=args.ranks if args.ranks is not None else (4 if args.dp == 1 else 2),
        dp=args.dp,
        straggler=args.straggler,
        microbatches=args.microbatches,
        iterations=args.iterations,
        sweep_step=args.sweep_step,
        state_dir=args.state_dir,
        port=args.port,
        seed=args.seed,
        time_scale=args.time_scale,
        plot_dir=args.plot,
        keep_dir=args.keep,
        preset=args.preset or default_preset(),
    )
    progress = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    result = run_demo(options, progress)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_report(result))
        if args.keep:
            print(f"work folder kept: {result['work_dir']}")
    return 0 if result["clocks_reset"] else 1

"""`perseus`: one entry point; each subcommand lives in its own module under perseus.cli.

A command module defines `register(subparsers)`, which adds its parser and sets
`func=run` (a callable taking the parsed args and returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from perseus.exceptions import PerseusError

# Order here is the order `perseus --help` lists them.
COMMANDS = [
    "perseus.cli.info",
    "perseus.cli.monitor",
    "perseus.cli.power",
    "perseus.cli.reset",
    "perseus.cli.probe",
    "perseus.cli.plan",
    "perseus.cli.serve",
    "perseus.cli.agent",
    "perseus.cli.straggler",
    "perseus.cli.status",
    "perseus.cli.keys",
    "perseus.cli.demo",
]


EPILOG = """examples:
  perseus info                                GPUs, clocks, power limits, permissions
  perseus plan --profile gpt3.csv --blocking-power 83.64 --stages 8 --microbatches 96
  perseus serve                               the planner service that instrumented training talks to
  perseus status                              its jobs: model fit, plans, predicted and measured saving
  perseus demo                                end to end on a simulated 4-GPU pipeline
  perseus probe                               what this GPU's counters and clock changes really do

`perseus COMMAND --help` shows a command's options and more examples.
GPUs: real ones through NVML by default; PERSEUS_GPU=sim:a100-sxm:4 simulates four A100s.
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `command`, only that subcommand's module is imported, so a command
    pays only for its own imports (`perseus serve` starts in a fraction of a second)."""
    parser = argparse.ArgumentParser(
        prog="perseus",
        description="Measure and cut the energy of deep-learning training on GPUs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = f"perseus.cli.{command}"
    for name in [wanted] if wanted in COMMANDS else COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The subcommand named by argv (the first argument that is not an option), if any."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg
        if arg == "--":
            return None
    return None


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(_command_in(argv))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PerseusError as e:
        print(f"perseus: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # said, so a long `perseus plan` that stops is not mistaken for one that ended
        print("perseus: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left, e.g. `perseus power | head`: a normal way to stop
        # Python flushes stdout again at exit; point it at /dev/null so that flush cannot fail too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""`perseus reset`: unlock SM clocks and restore default power limits (the safety valve after a crash)."""

from __future__ import annotations

import argparse
import sys

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.devices.agent_gpu import AgentWrites
from perseus.devices.reset import reset

EPILOG = """examples:
  sudo perseus reset                     every GPU NVML sees
  perseus reset --gpu-indices 0,3
  PERSEUS_GPU=sim:a100-sxm:4 perseus reset

Run it after a training job that Perseus controlled crashed or was killed: locked clocks and
power limits outlive the process that set them. It prints what changed, or `already at
defaults`, per GPU; a GPU it could not reset is an error (exit status 1). Where a perseus agent
serves the GPUs, it resets them itself when a job ends, and `perseus reset` goes through it: a
GPU another process holds is refused with that process's pid (`perseus agent revoke` ends its
lease).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reset",
        help="unlock SM clocks and restore default power limits",
        description="Reset the locked SM clock and the power limit of the selected GPUs to their "
        "defaults and print what changed.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gpu_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    failed = False
    for gpu in select_gpus(args):
        outcome = reset(gpu)
        via = f" through {gpu.agent.where}" if isinstance(gpu, AgentWrites) else ""
        print(f"GPU {gpu.index} ({gpu.name()}){via}: {outcome.summary()}")
        for error in outcome.errors:
            print(f"perseus: error: GPU {gpu.index}: {error}", file=sys.stderr)
        failed = failed or bool(outcome.errors)
    return 1 if failed else 0

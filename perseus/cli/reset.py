"""`perseus reset`: unlock SM clocks and restore default power limits (the safety valve after a crash)."""

from __future__ import annotations

import argparse
import sys

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.devices.agent_gpu import AgentWrites
from perseus.devices.gpu import GPU
from perseus.exceptions import DeviceError

EPILOG = """examples:
  sudo perseus reset                     every GPU NVML sees
  perseus reset --gpu-indices 0,3
  PERSEUS_GPU=sim:a100-sxm:4 perseus reset

Run it after a training job that Perseus controlled crashed or was killed: locked clocks and
power limits outlive the process that set them. Where a perseus agent serves the GPUs, it resets
them itself when a job ends, and `perseus reset` goes through it: a GPU another process holds is
refused with that process's pid (`perseus agent revoke` ends its lease).
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
        done, errors = reset(gpu)
        via = f" through {gpu.agent.where}" if isinstance(gpu, AgentWrites) else ""
        print(f"GPU {gpu.index} ({gpu.name()}){via}: {'; '.join(done) or 'nothing reset'}")
        for error in errors:
            print(f"perseus: error: GPU {gpu.index}: {error}", file=sys.stderr)
        failed = failed or bool(errors)
    return 1 if failed else 0


def reset(gpu: GPU) -> tuple[list[str], list[DeviceError]]:
    """Unlock the SM clock and restore the default power limit, each tried even if the other
    fails or its current value cannot be read. Returns what was done (as text) and the errors."""
    done: list[str] = []
    errors: list[DeviceError] = []
    settings = (
        (gpu.sm_clock, gpu.reset_sm_clock, "SM clock unlocked ({} -> {} MHz)"),
        (lambda: f"{gpu.power_limit_mw() / 1000:g}", gpu.reset_power_limit, "power limit {} -> {} W (default)"),
    )
    for read, restore, template in settings:
        try:
            try:
                before = read()
            except DeviceError:
                before = "unreadable"  # e.g. a corrupt simulated state file: the reset replaces it
            restore()
            done.append(template.format(before, read()))
        except DeviceError as e:
            errors.append(e)
    return done, errors

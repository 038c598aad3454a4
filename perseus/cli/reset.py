"""`perseus reset`: unlock SM clocks and restore default power limits (the safety valve after a crash)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.devices.agent_gpu import AgentWrites
from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.exceptions import PerseusError

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


@dataclass
class ResetOutcome:
    """What a reset did to one GPU: the settings that changed (as text), those it could not reset,
    and the distinct errors why."""

    changes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def summary(self) -> str:
        done = self.changes + [f"{name} NOT reset" for name in self.failed]
        return "; ".join(done) if done else "already at defaults"


def reset(gpu: GPU) -> ResetOutcome:
    """Unlock the SM clock and restore the default power limit, each tried even if the other
    fails or its current value cannot be read; a setting counts as changed when its reading does."""
    outcome = ResetOutcome()
    settings: tuple[tuple[str, Callable[[], object], Callable[[], None], str], ...] = (
        ("SM clock", gpu.sm_clock, gpu.reset_sm_clock, "SM clock unlocked ({} -> {} MHz)"),
        ("power limit", lambda: f"{gpu.power_limit_mw() / 1000:g}", gpu.reset_power_limit, "power limit {} -> {} W"),
    )
    for name, read, restore, template in settings:
        try:
            before = read()
        except PerseusError:
            before = "unreadable"  # e.g. a corrupt simulated state file: the reset replaces it
        try:
            restore()
            if isinstance(gpu, SimGPU) and name == "SM clock":
                gpu.clock.sleep(gpu.clock_switch_latency_s())  # read the clock in force once it is
            after = read()
        except PerseusError as e:
            outcome.failed.append(name)
            if str(e) not in outcome.errors:  # e.g. one lease held for both settings: said once
                outcome.errors.append(str(e))
            continue
        if after != before:
            outcome.changes.append(template.format(before, after))
    return outcome

"""Putting a GPU back at its default SM clock and power limit, and saying what changed: what
`perseus reset` prints and what the agent logs when a lease ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from perseus.devices.gpu import GPU
from perseus.devices.sim import SimGPU
from perseus.exceptions import PerseusError


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
    fails (whatever it raises) or its current value cannot be read; a setting counts as changed
    when its reading does. Never raises: what failed is in the outcome."""
    outcome = ResetOutcome()
    settings: tuple[tuple[str, Callable[[], object], Callable[[], None], str], ...] = (
        ("SM clock", gpu.sm_clock, gpu.reset_sm_clock, "SM clock unlocked ({} -> {} MHz)"),
        ("power limit", lambda: f"{gpu.power_limit_mw() / 1000:g}", gpu.reset_power_limit, "power limit {} -> {} W"),
    )
    for name, read, restore, template in settings:
        try:
            before = read()
        except Exception:  # whatever the read raises, the reset is tried
            before = "unreadable"  # e.g. a corrupt simulated state file: the reset replaces it
        try:
            restore()
            if isinstance(gpu, SimGPU) and name == "SM clock":
                gpu.clock.sleep(gpu.clock_switch_latency_s())  # read the clock in force once it is
            after = read()
        except Exception as e:  # whatever it raises, the other setting is reset
            error = str(e) if isinstance(e, PerseusError) else f"{type(e).__name__}: {e}"
            outcome.failed.append(name)
            if error not in outcome.errors:  # e.g. one lease held for both settings: said once
                outcome.errors.append(error)
            continue
        if after != before:
            outcome.changes.append(template.format(before, after))
    return outcome

"""The safety net: whatever changes GPU clocks or power limits puts them back on every exit.

`ResetGuard` runs a reset at interpreter exit and on SIGTERM/SIGINT; `Watchdog` is a separate
process that resets the GPUs if their owner is SIGKILLed. The frequency controller
(perseus.controller) and the power-limit optimizer (perseus.power_limit) both use it; it depends
only on the device layer.
"""

from perseus.safety.guard import ResetGuard
from perseus.safety.watchdog import Watchdog

__all__ = ["ResetGuard", "Watchdog"]

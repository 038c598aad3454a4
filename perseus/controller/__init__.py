"""Rank-local frequency control: apply a plan's clock per instruction, and always reset clocks.

`FrequencyController` applies clocks off the training thread; `ResetGuard` resets them at exit
and on SIGTERM/SIGINT; `Watchdog` is a separate process that resets them if the trainer is
SIGKILLed.
"""

from perseus.controller.controller import ControllerStats, FrequencyController, InstructionKey
from perseus.controller.safety import ResetGuard
from perseus.controller.watchdog import Watchdog

__all__ = ["ControllerStats", "FrequencyController", "InstructionKey", "ResetGuard", "Watchdog"]

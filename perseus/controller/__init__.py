"""Rank-local frequency control: apply a plan's clock per instruction, and always reset clocks.

`FrequencyController` applies clocks off the training thread and resets them on every exit
path through the safety net in perseus.safety (`ResetGuard` at exit and on SIGTERM/SIGINT, a
`Watchdog` process if the trainer is SIGKILLed).
"""

from perseus.controller.controller import ControllerStats, FrequencyController, InstructionKey

__all__ = ["ControllerStats", "FrequencyController", "InstructionKey"]

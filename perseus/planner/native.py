"""The planner's optional C extension (perseus/planner/_flow.c): the module, or None where it could
not be compiled. Then HiGHS solves every LP and the longest path, the rounding's passes and the
switch replay run in Python, with the same results."""

from __future__ import annotations

from types import ModuleType

extension: ModuleType | None
try:
    from perseus.planner import _flow as extension
except ImportError:
    extension = None

"""Pipeline schedules: which instructions each stage runs, in which order."""

from perseus.schedules.builders import SCHEDULES, build_schedule, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from perseus.schedules.instruction import KIND_LETTERS, Instruction, Kind, Schedule
from perseus.schedules.torch_order import from_torch_pipeline_order

__all__ = [
    "KIND_LETTERS",
    "SCHEDULES",
    "Instruction",
    "Kind",
    "Schedule",
    "build_schedule",
    "from_torch_pipeline_order",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zb_h1",
]

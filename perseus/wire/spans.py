"""`ReportSpans`: one rank's instruction timeline in one iteration, what the service calibrates
its model of the job on (see perseus.service.calibration).

Compact: two lists of whole microseconds, each instruction's begin and end after the rank's own
step began, in the rank's schedule order. Times of different ranks are never compared directly
(their hosts' clocks need not agree): only differences on one rank are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from perseus.exceptions import ConfigError
from perseus.wire.fields import Message, check_int, check_job_id, check_seq, check_str, set_fields
from perseus.wire.limits import MAX_FREQUENCY_MHZ, MAX_INSTRUCTIONS, MAX_RANK_ITERATION, MAX_RANKS, MAX_TIME_S
from perseus.wire.phases import Phase

MAX_SPAN_US = round(MAX_TIME_S * 1e6)
_RANK_PHASES = tuple(p.value for p in Phase)


@dataclass(frozen=True)
class ReportSpans(Message):
    """Rank `rank`'s iteration `iteration` (counted as in ReportIteration): its phase and uniform
    clock (`frequency`, None: default clocks), the step's length and every instruction's span.
    `begins_us[i] <= ends_us[i] <= begins_us[i + 1]`, all within the step."""

    TYPE: ClassVar[str] = "report_spans"
    job_id: str
    rank: int
    iteration: int
    phase: str
    frequency: int | None
    step_us: int
    begins_us: tuple[int, ...]
    ends_us: tuple[int, ...]

    def __post_init__(self) -> None:
        n = "report_spans"
        check_job_id(self.job_id, f"{n}.job_id")
        check_int(self.rank, f"{n}.rank", 0, MAX_RANKS - 1)
        check_int(self.iteration, f"{n}.iteration", 0, MAX_RANK_ITERATION)
        check_str(self.phase, f"{n}.phase", 16, choices=_RANK_PHASES)
        if self.frequency is not None:
            check_int(self.frequency, f"{n}.frequency", 1, MAX_FREQUENCY_MHZ)
        step = check_int(self.step_us, f"{n}.step_us", 1, MAX_SPAN_US)
        begins = _offsets(self.begins_us, f"{n}.begins_us", step)
        ends = _offsets(self.ends_us, f"{n}.ends_us", step)
        if len(begins) != len(ends):
            raise ConfigError(f"{n}: {len(begins)} begins but {len(ends)} ends; send one of each per instruction")
        previous = 0
        for i, (b, e) in enumerate(zip(begins, ends)):
            if not previous <= b <= e:
                raise ConfigError(
                    f"{n}: instruction {i} spans {b}..{e} us after an instruction that ended at {previous} us; "
                    "spans must be in schedule order and must not overlap"
                )
            previous = e
        set_fields(self, begins_us=begins, ends_us=ends)

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "begins_us": list(self.begins_us), "ends_us": list(self.ends_us)}


def _offsets(value: Any, name: str, step_us: int) -> tuple[int, ...]:
    values = check_seq(value, name, MAX_INSTRUCTIONS, min_len=1)
    if set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= step_us:
        return tuple(values)  # the common case, checked a column at a time
    return tuple(check_int(v, f"{name}[{i}]", 0, step_us) for i, v in enumerate(values))

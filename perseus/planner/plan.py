"""A frequency plan: one SM frequency per instruction, with the numbers that justify it.

JSON layout (what the runtime reads): `stages` is one entry per rank, each with the rank's
instructions in schedule order as {kind, microbatch, frequency} (plus `chunk` when the schedule
interleaves chunks), next to `iteration_time_s`, `energy_j`, `lower_bound_j`, `gap`, `deadline_s`, `padded`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from perseus.exceptions import PlanError
from perseus.schedules.instruction import Instruction, Kind, Schedule

JSON_FORMAT = "perseus.plan"


@dataclass(frozen=True)
class Plan:
    """Frequencies (MHz) for every instruction of `schedule`, as evaluated against the profile.

    `lower_bound_j` is a certified lower bound on the energy of any plan that meets `deadline_s`;
    `gap` = (energy - bound) / bound, so the plan is provably within `gap` of optimal. `padded`:
    energy and bound are for an iteration that lasts `deadline_s` (every GPU blocks from the
    plan's own `iteration_time_s` until then, as when a straggler sets the pace).
    """

    frequencies: dict[Instruction, int] = field(repr=False)  # thousands of entries in a large job
    iteration_time_s: float
    energy_j: float
    lower_bound_j: float
    gap: float
    deadline_s: float
    schedule: Schedule = field(repr=False, compare=False)
    padded: bool = False

    def stage_frequencies(self, stage: int) -> list[int]:
        """The frequencies of `stage`'s instructions, in the order the stage runs them."""
        if not 0 <= stage < self.schedule.num_stages:
            raise PlanError(f"stage {stage} is outside 0..{self.schedule.num_stages - 1}")
        return [self.frequencies[ins] for ins in self.schedule.stages[stage]]

    def to_json(self) -> dict:
        chunked = self.schedule.num_chunks > 1
        stages = []
        for s, row in enumerate(self.schedule.stages):
            entries = []
            for ins in row:
                entry = {"kind": ins.kind.value, "microbatch": ins.microbatch, "frequency": self.frequencies[ins]}
                if chunked:
                    entry["chunk"] = ins.chunk
                entries.append(entry)
            stages.append({"stage": s, "instructions": entries})
        return {
            "format": JSON_FORMAT,
            "version": 1,
            "schedule": self.schedule.name,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "num_chunks": self.schedule.num_chunks,
            "iteration_time_s": self.iteration_time_s,
            "energy_j": self.energy_j,
            "lower_bound_j": self.lower_bound_j,
            "gap": self.gap,
            "deadline_s": self.deadline_s,
            "padded": self.padded,
            "stages": stages,
        }

    @classmethod
    def from_json(cls, doc: dict, schedule: Schedule) -> Plan:
        """Read a plan written by `to_json` for `schedule`; PlanError names the first mismatch."""
        if not isinstance(doc, dict) or not isinstance(doc.get("stages"), list):
            raise PlanError("not a Perseus plan: expected an object with a 'stages' list")
        numbers = {}
        for key in ("iteration_time_s", "energy_j", "lower_bound_j"):
            numbers[key] = _number(doc, key)
        stages = doc["stages"]
        if len(stages) != schedule.num_stages:
            raise PlanError(
                f"plan has {len(stages)} stages, the schedule {schedule.num_stages}; plan again for this schedule"
            )
        frequencies: dict[Instruction, int] = {}
        for s, (entry, row) in enumerate(zip(stages, schedule.stages)):
            if (
                not isinstance(entry, dict)
                or entry.get("stage") != s
                or not isinstance(entry.get("instructions"), list)
            ):
                raise PlanError(f"plan stages[{s}] must be {{'stage': {s}, 'instructions': [...]}}")
            items = entry["instructions"]
            if len(items) != len(row):
                raise PlanError(
                    f"plan stage {s} has {len(items)} instructions, the schedule {len(row)}; plan again for this "
                    "schedule"
                )
            for k, (item, ins) in enumerate(zip(items, row)):
                where = f"plan stage {s} instruction {k}"
                try:
                    kind, mb, chunk, freq = (
                        Kind(item["kind"]),
                        item["microbatch"],
                        item.get("chunk", 0),
                        item["frequency"],
                    )
                except (KeyError, TypeError, ValueError):
                    raise PlanError(
                        f"{where}: needs kind (one of {[k.value for k in Kind]}), microbatch and frequency"
                    ) from None
                if (kind, mb, chunk) != (ins.kind, ins.microbatch, ins.chunk):
                    raise PlanError(
                        f"{where} is {kind.value} microbatch {mb} chunk {chunk}, but the schedule runs {ins} there; "
                        "plan again for this schedule"
                    )
                if not isinstance(freq, int) or isinstance(freq, bool) or freq <= 0:
                    raise PlanError(f"{where}: frequency must be a positive whole number of MHz, got {freq!r}")
                frequencies[ins] = freq
        bound = numbers["lower_bound_j"]
        gap = doc.get("gap", (numbers["energy_j"] - bound) / bound if bound > 0 else math.inf)
        deadline = doc.get("deadline_s", numbers["iteration_time_s"])
        padded = doc.get("padded", False)
        if not isinstance(padded, bool):
            raise PlanError(f"plan field 'padded' must be true or false, got {padded!r}")
        return cls(
            frequencies,
            numbers["iteration_time_s"],
            numbers["energy_j"],
            bound,
            float(gap),
            float(deadline),
            schedule,
            padded,
        )


def _number(doc: dict, key: str) -> float:
    value = doc.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise PlanError(f"plan field {key!r} must be a finite number, got {value!r}")
    return float(value)

"""How well a job's model fits its measured timeline, as `JobStatus.calibrations` carries it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from perseus.wire.fields import Message, check_int, check_opt_float, check_seq, check_str, set_fields
from perseus.wire.limits import MAX_RANKS

CALIBRATION_STATES = ("collecting", "fitting", "fitted", "failed", "uncalibrated", "overridden")


@dataclass(frozen=True)
class StageFitStatus(Message):
    """One stage: its measured instruction window (first begin to last end, median over the
    baseline iterations) against the planner's calibrated model; its busy time and host gap."""

    stage: int
    measured_s: float | None
    model_s: float | None
    busy_s: float | None = None
    host_gap_s: float | None = None

    def __post_init__(self) -> None:
        check_int(self.stage, "stage_fit.stage", 0, 4095)
        for name in ("measured_s", "model_s", "busy_s", "host_gap_s"):
            set_fields(self, **{name: check_opt_float(getattr(self, name), f"stage_fit.{name}")})

    @property
    def error(self) -> float | None:
        if self.measured_s is None or self.model_s is None or not self.measured_s:
            return None
        return self.model_s / self.measured_s - 1.0


@dataclass(frozen=True)
class CalibrationStatus(Message):
    """The model of the pipelines with GPU models `models` ("/"-joined per stage, or one name):
    its state (perseus.service.timelines), the baseline it was fitted on, the planner's model of
    it, the GPU profile's share, the fitted host gap and hop, the verification margin, and why
    it cannot be planned on (`reason`), and how far the model may be from the baseline to be
    fitted (`tolerance`: 1%, or the baseline's noise if more)."""

    models: str
    state: str
    iterations: int = 0
    measured_s: float | None = None
    model_s: float | None = None
    gpu_only_s: float | None = None
    explained: float | None = None
    host_gap_s: float | None = None
    hop_s: float | None = None
    margin: float = 0.0
    reason: str = ""
    stages: tuple[StageFitStatus, ...] = ()
    tolerance: float | None = None  # how far the model may be from measured_s to be fitted

    def __post_init__(self) -> None:
        check_str(self.models, "calibration.models", 4096)
        check_str(self.state, "calibration.state", 16, choices=CALIBRATION_STATES)
        check_int(self.iterations, "calibration.iterations", 0, 1 << 30)
        for name in ("measured_s", "model_s", "gpu_only_s", "explained", "host_gap_s", "hop_s", "tolerance"):
            set_fields(self, **{name: check_opt_float(getattr(self, name), f"calibration.{name}")})
        set_fields(self, margin=check_opt_float(self.margin, "calibration.margin"))
        check_str(self.reason, "calibration.reason", 4096, printable=False)
        stages = check_seq(self.stages, "calibration.stages", MAX_RANKS)
        set_fields(
            self, stages=tuple(s if isinstance(s, StageFitStatus) else StageFitStatus.from_wire(s) for s in stages)
        )

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "stages": [s.to_wire() for s in self.stages]}

    @property
    def error(self) -> float | None:
        """The model against the measured baseline iteration (+: the model is slower)."""
        if self.measured_s is None or self.model_s is None or not self.measured_s:
            return None
        return self.model_s / self.measured_s - 1.0

"""Perseus' figures as TensorBoard scalars, for loops without the Hugging Face Trainer.

    reporter = TensorBoardReporter("runs/perseus")        # torch.utils.tensorboard's SummaryWriter
    stage = perseus.instrument(stage, schedule=schedule, on_iteration=reporter.on_iteration)
    ...
    reporter.close()

`on_iteration` writes each iteration a `perseus.instrument` (or `PerseusRank`) job measures:
`perseus/iteration_time_s`, `perseus/energy_j` (this rank's GPU), `perseus/power_w`,
`perseus/plan_version`, `perseus/planned` (1 once the plan is in force) and, while profiling,
`perseus/frequency_mhz`, at global step = the iteration. `add_window(step, measurement)` writes
a Monitor window of a plain loop (time, GPU energy, average power). Pass `writer=` to use a writer
of your own (anything with `add_scalar(tag, value, step)`, e.g. tensorboardX's); without one the
reporter opens torch's SummaryWriter on `log_dir` (needs the tensorboard package:
pip install 'perseus-energy[tensorboard]') and closes it on `close()`.
"""

from __future__ import annotations

import os
from typing import Any

from perseus.exceptions import ConfigError
from perseus.measurement.monitor import Measurement
from perseus.runtime.records import IterationRecord
from perseus.wire.phases import Phase


class TensorBoardReporter:
    def __init__(
        self, log_dir: str | os.PathLike[str] | None = None, *, writer: Any = None, prefix: str = "perseus"
    ) -> None:
        if writer is not None and log_dir is not None:
            raise ConfigError("TensorBoardReporter: pass log_dir or writer, not both")
        if writer is None:
            writer = _summary_writer(log_dir)
            self._owns_writer = True
        else:
            if not callable(getattr(writer, "add_scalar", None)):
                raise ConfigError(f"TensorBoardReporter: writer needs add_scalar(tag, value, step), got {writer!r}")
            self._owns_writer = False
        self.writer = writer
        self.prefix = prefix.rstrip("/")

    def _scalar(self, name: str, value: float, step: int) -> None:
        self.writer.add_scalar(f"{self.prefix}/{name}", value, step)

    def on_iteration(self, record: IterationRecord) -> None:
        """One measured iteration of a perseus.instrument job (its `on_iteration` callback)."""
        step = record.iteration
        self._scalar("iteration_time_s", record.time_s, step)
        self._scalar("energy_j", record.energy_j, step)
        if record.time_s > 0:
            self._scalar("power_w", record.energy_j / record.time_s, step)
        self._scalar("plan_version", record.plan_version, step)
        self._scalar("planned", 1.0 if record.phase == Phase.PLANNED else 0.0, step)
        if record.frequency is not None:
            self._scalar("frequency_mhz", record.frequency, step)

    def add_window(self, step: int, measurement: Measurement, name: str = "window") -> None:
        """One Monitor window of a plain loop: `perseus/<name>/time_s`, `.../gpu_energy_j`,
        `.../energy_j` (GPUs and CPUs) and `.../power_w`."""
        self._scalar(f"{name}/time_s", measurement.time_s, step)
        self._scalar(f"{name}/gpu_energy_j", sum(measurement.gpu_energy_j.values()), step)
        self._scalar(f"{name}/energy_j", measurement.total_energy_j, step)
        self._scalar(f"{name}/power_w", measurement.average_power_w, step)

    def flush(self) -> None:
        flush = getattr(self.writer, "flush", None)
        if callable(flush):
            flush()

    def close(self) -> None:
        """Flush; close the writer if this reporter opened it."""
        self.flush()
        if self._owns_writer:
            self.writer.close()

    def __enter__(self) -> TensorBoardReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary_writer(log_dir: str | os.PathLike[str] | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"TensorBoardReporter needs torch and tensorboard ({e}): pip install 'perseus-energy[torch,tensorboard]', "
            "or pass writer= (anything with add_scalar)"
        ) from None
    return SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))

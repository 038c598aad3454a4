"""Power limits for the Hugging Face Trainer (and TRL's SFTTrainer, which shares its callbacks).

    from perseus.integrations.huggingface import PowerLimitCallback
    from perseus.power_limit import MaxSlowdownConstraint

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[PowerLimitCallback(selector=MaxSlowdownConstraint(1.1))])
    trainer.train()

The callback builds its `GlobalPowerLimitOptimizer` when training begins, after the Trainer
has set up torch.distributed, so every rank joins the agreement on one limit. Each rank
measures the GPU(s) it trains on (`perseus.devices.local_gpu_indices`; all visible GPUs in a
single process). The default power limit is restored when training ends (and on exit,
exceptions and SIGTERM, by the optimizer).

Its figures go into the Trainer's logs, so every `report_to` backend (TensorBoard, W&B,
MLflow, ...) and `trainer.state.log_history` record them at each logging step:
`perseus/energy_j` (GPU energy of this process's GPUs since training began, J),
`perseus/power_w` (their average power since the previous log, W; left out where that log came
under 2 s before, too short for energy counters that step every 100 ms) and
`perseus/power_limit_w` (the limit in force: the sweep's, then the chosen one) and, when
carbon is configured (`carbon_provider=`, or a `carbon_reporter`'s provider),
`perseus/emissions_g` (g CO2e of that energy, each log's energy at the grid's intensity then).
Reporters only log on the main process, so these are rank 0's GPUs. The chosen limit is also
printed once by rank 0 (see perseus.notice).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "perseus.integrations.huggingface needs transformers: pip install 'perseus-energy[huggingface]'"
    ) from e

from perseus.devices.local_rank import local_gpu_indices
from perseus.devices.select import get_gpus
from perseus.exceptions import CarbonIntensityError, ConfigError
from perseus.measurement.carbon import CarbonIntensityProvider, CarbonReporter, emissions_g
from perseus.measurement.monitor import Monitor
from perseus.power_limit.optimizer import GlobalPowerLimitOptimizer, Phase
from perseus.power_limit.selectors import PowerLimitSelector

FIGURES_WINDOW = "perseus.huggingface.log"

logger = logging.getLogger(__name__)


def _check_optimizer_kwargs(kwargs: dict[str, Any]) -> None:
    """ConfigError now for what GlobalPowerLimitOptimizer would refuse only when training starts."""
    known = inspect.signature(GlobalPowerLimitOptimizer).parameters
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ConfigError(
            f"PowerLimitCallback: GlobalPowerLimitOptimizer takes no argument {', '.join(map(repr, unknown))}; "
            f"its arguments: {', '.join(known)}"
        )
    for name in ("selector", "optimum_selector"):
        if kwargs.get(name) is not None and not isinstance(kwargs[name], PowerLimitSelector):
            raise ConfigError(
                f"PowerLimitCallback: {name} must be a PowerLimitSelector (Time(), Energy(), ZeusCost(eta), "
                f"MaxSlowdownConstraint(1.1), ...), got {kwargs[name]!r}"
            )


class PowerLimitCallback(TrainerCallback):
    """Runs a GlobalPowerLimitOptimizer (and optionally a CarbonReporter) inside `Trainer.train`.

    Pass a ready `optimizer`, or keyword arguments for one (`selector`, `warmup_steps`,
    `profile_steps`, `pl_step_w`, `profile_path`, `early_stop`, `monitor`, ...); without
    `monitor`, one is made over this rank's GPU(s). `carbon_reporter` writes a per-epoch carbon
    report beside it; `carbon_provider` (default: the reporter's) prices the logged energy in
    g CO2e. Its figures land in the Trainer's logs (see the module docstring).
    """

    def __init__(
        self,
        optimizer: GlobalPowerLimitOptimizer | None = None,
        *,
        carbon_reporter: CarbonReporter | None = None,
        carbon_provider: CarbonIntensityProvider | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        if carbon_provider is None and carbon_reporter is not None:
            carbon_provider = carbon_reporter.provider
        if carbon_provider is not None and not isinstance(carbon_provider, CarbonIntensityProvider):
            raise ConfigError(
                f"PowerLimitCallback: carbon_provider must be a CarbonIntensityProvider (StaticIntensity(400), "
                f"ElectricityMaps(zone), ...), got {carbon_provider!r}"
            )
        self.carbon_provider = carbon_provider
        self._emissions_g = 0.0
        self._intensity: float | None = None  # the last one the provider gave
        if isinstance(optimizer, PowerLimitSelector):
            raise ConfigError(
                f"PowerLimitCallback: its first argument is a GlobalPowerLimitOptimizer; pass a selector by name: "
                f"PowerLimitCallback(selector={optimizer!r}, ...)"
            )
        _check_optimizer_kwargs(optimizer_kwargs)
        if optimizer is not None and optimizer_kwargs:
            raise ConfigError(
                f"PowerLimitCallback: pass either an optimizer or its arguments, not both "
                f"(got an optimizer and {sorted(optimizer_kwargs)})"
            )
        if optimizer is not None and not isinstance(optimizer, GlobalPowerLimitOptimizer):
            raise ConfigError(f"PowerLimitCallback: optimizer must be a GlobalPowerLimitOptimizer, got {optimizer!r}")
        self.optimizer = optimizer
        self.carbon_reporter = carbon_reporter
        self._optimizer_kwargs = optimizer_kwargs
        self._energy_j = 0.0  # this process's GPUs, since training began
        self._figures_open = False
        self._logger: _LogFigures | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.optimizer is None:
            options = dict(self._optimizer_kwargs)
            if "monitor" not in options:
                gpus = get_gpus()
                rank = args.local_process_index if args.world_size > 1 else None
                options["monitor"] = Monitor(gpus=gpus, gpu_indices=local_gpu_indices(len(gpus), rank))
            self.optimizer = GlobalPowerLimitOptimizer(**options)
        self._energy_j = 0.0
        self._emissions_g = 0.0
        self.optimizer.monitor.begin_window(FIGURES_WINDOW)
        self._figures_open = True
        self._log_first()

    def _log_first(self) -> None:
        """Put a `_LogFigures` first in the Trainer's callback list. The Trainer lists report_to
        integrations before the user's callbacks, and each reads `logs` when its own on_log
        runs, so figures added by this callback's on_log would come too late for them."""
        frame = inspect.currentframe()
        handler = None
        try:
            while frame is not None and handler is None:  # the CallbackHandler calling this hook
                candidate = frame.f_locals.get("self")
                if isinstance(candidate, CallbackHandler) and self in candidate.callbacks:
                    handler = candidate
                frame = frame.f_back
        finally:
            del frame
        if handler is None:
            return  # not called by a Trainer: on_log adds the figures itself
        if not any(isinstance(cb, _LogFigures) and cb.owner is self for cb in handler.callbacks):
            self._logger = _LogFigures(self)
            handler.callbacks = [self._logger, *handler.callbacks]  # a new list: the handler is iterating the old one

    def add_figures(self, state: Any, logs: dict[str, Any] | None) -> None:
        """Add this process's energy, average power and power limit since the last log to `logs`
        (and to the matching `state.log_history` entry)."""
        if logs is None or not self._figures_open or self.optimizer is None or "perseus/energy_j" in logs:
            return
        monitor = self.optimizer.monitor
        m = monitor.end_window(FIGURES_WINDOW, expect_short=True)  # summed; power_w left out if short
        monitor.begin_window(FIGURES_WINDOW, sync=False)  # the GPUs were just synchronised
        energy_j = sum(m.gpu_energy_j.values())
        self._energy_j += energy_j
        figures = {"perseus/energy_j": round(self._energy_j, 3)}
        if m.time_s > 0 and m.time_s >= self.optimizer.min_measure_s:
            # None over a shorter window (the closing summary, right after the last log): it
            # reads the energy counter's steps, 0 W or double, not the power.
            figures["perseus/power_w"] = round(energy_j / m.time_s, 3)
        figures["perseus/power_limit_w"] = self.optimizer.power_limit_mw / 1000
        intensity = self._grid_intensity()
        if intensity is not None:
            self._emissions_g += emissions_g(energy_j, intensity)
            figures["perseus/emissions_g"] = round(self._emissions_g, 6)
        logs.update(figures)
        history = getattr(state, "log_history", None)
        if (
            history
            and isinstance(history[-1], dict)
            and all(history[-1].get(k) == v for k, v in logs.items() if k not in figures)
        ):
            history[-1].update(figures)

    def _grid_intensity(self) -> float | None:
        """The provider's intensity now; the last one if it fails (a warning), None before any."""
        if self.carbon_provider is None:
            return None
        try:
            self._intensity = self.carbon_provider.current()
        except CarbonIntensityError as e:
            if self._intensity is None:
                logger.warning("carbon intensity unavailable (%s); perseus/emissions_g not logged yet", e)
            else:
                logger.warning("carbon intensity unavailable (%s); reusing %.0f g/kWh", e, self._intensity)
        return self._intensity

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._logger is None:  # no _LogFigures ahead of the reporters: reach those after this one
            self.add_figures(state, logs)

    def _started(self) -> GlobalPowerLimitOptimizer:
        if self.optimizer is None:
            raise ConfigError("PowerLimitCallback: on_train_begin must come first (Trainer.train calls it)")
        return self.optimizer

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._started().on_epoch_begin()
        if self.carbon_reporter is not None:
            self.carbon_reporter.on_epoch_begin()

    def on_step_begin(self, args, state, control, **kwargs):
        self._started().on_step_begin()

    def on_step_end(self, args, state, control, **kwargs):
        self._started().on_step_end()

    def on_epoch_end(self, args, state, control, **kwargs):
        self._started().on_epoch_end()
        if self.carbon_reporter is not None:
            self.carbon_reporter.on_epoch_end()

    def on_train_end(self, args, state, control, **kwargs):
        if self.carbon_reporter is not None:
            self.carbon_reporter.on_train_end()
        optimizer = self._started()
        if self._figures_open and optimizer.phase is not Phase.CLOSED:
            optimizer.monitor.end_window(FIGURES_WINDOW, cancel=True)
        self._figures_open = False
        optimizer.close()


class _LogFigures(TrainerCallback):
    """First in the Trainer's callback list: adds `owner`'s figures to the logs every later
    callback (printers, report_to integrations) reads."""

    def __init__(self, owner: PowerLimitCallback) -> None:
        self.owner = owner

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.owner.add_figures(state, logs)

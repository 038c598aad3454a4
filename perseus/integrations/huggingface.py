"""Power limits for the Hugging Face Trainer (and TRL's SFTTrainer, which shares its callbacks).

    from perseus.integrations.huggingface import PowerLimitCallback
    from perseus.power_limit import MaxSlowdownConstraint

    trainer = Trainer(model, args, train_dataset=data,
                      callbacks=[PowerLimitCallback(selector=MaxSlowdownConstraint(1.1))])
    trainer.train()

The callback builds its `GlobalPowerLimitOptimizer` when training begins, after the Trainer
has set up torch.distributed, so every rank joins the agreement on one limit. Each rank
measures the GPU it trains on (all visible GPUs in a single process). The default power
limit is restored when training ends (and on exit, exceptions and SIGTERM, by the optimizer).
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("perseus.integrations.huggingface needs transformers: pip install 'perseus[huggingface]'") from e

from perseus.exceptions import ConfigError
from perseus.measurement.carbon import CarbonReporter
from perseus.measurement.monitor import Monitor
from perseus.power_limit.optimizer import GlobalPowerLimitOptimizer


class PowerLimitCallback(TrainerCallback):
    """Runs a GlobalPowerLimitOptimizer (and optionally a CarbonReporter) inside `Trainer.train`.

    Pass a ready `optimizer`, or keyword arguments for one (`selector`, `warmup_steps`,
    `profile_steps`, `pl_step_w`, `profile_path`, `monitor`); without `monitor`, one is made
    over this rank's GPU. `carbon_reporter` writes a per-epoch carbon report beside it.
    """

    def __init__(
        self,
        optimizer: GlobalPowerLimitOptimizer | None = None,
        *,
        carbon_reporter: CarbonReporter | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
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

    def on_train_begin(self, args, state, control, **kwargs):
        if self.optimizer is None:
            options = dict(self._optimizer_kwargs)
            if "monitor" not in options:
                indices = [args.local_process_index] if args.world_size > 1 else None
                options["monitor"] = Monitor(gpu_indices=indices)
            self.optimizer = GlobalPowerLimitOptimizer(**options)

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
        self._started().close()

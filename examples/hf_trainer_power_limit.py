"""Hugging Face Trainer with an automatically chosen GPU power limit and a carbon report.

    pip install 'perseus-energy[huggingface]'
    python examples/hf_trainer_power_limit.py

Trains a small randomly initialised GPT-2 (built from a config: nothing is downloaded) on random
token ids. `PowerLimitCallback` sweeps the power limit during the first steps, keeps the one
MaxSlowdownConstraint(1.1) picks, and restores the default when training ends. The same
callback works with TRL's SFTTrainer (`SFTTrainer(..., callbacks=[callback])`). A
CarbonReporter writes each epoch's energy, carbon and time to carbon.jsonl; pass
`--zone DE` (and set PERSEUS_ELECTRICITYMAPS_KEY) to use live Electricity Maps data instead of
a fixed intensity, and `--carbon-aware` to let CarbonCost choose the limit.

Without a GPU (the default, PERSEUS_GPU unset) the model trains on CPU and two simulated
A100s on a virtual clock "run" each step: a small callback issues the step's GPU work to
them, so the sweep takes seconds. With PERSEUS_GPU=nvml the Trainer uses the real GPUs and
the callback measures them (setting power limits needs root or CAP_SYS_ADMIN).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import torch
import transformers

from perseus.clock import VirtualClock
from perseus.devices import Work, get_gpus
from perseus.devices.sim import sim_gpus
from perseus.integrations.huggingface import PowerLimitCallback
from perseus.measurement import Monitor
from perseus.measurement.carbon import CarbonReporter, ElectricityMaps, StaticIntensity
from perseus.power_limit import CarbonCost, MaxSlowdownConstraint


class TokenDataset(torch.utils.data.Dataset):
    """Random token ids for causal language modelling (labels = inputs)."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SimulatedGPUWork(transformers.TrainerCallback):
    """Issues one step's GPU work to the simulated GPUs at each step end (listed before the
    PowerLimitCallback, so the work is done when the step is measured)."""

    def __init__(self, gpus, work: Work) -> None:
        self.gpus, self.work = gpus, work

    def on_step_end(self, args, state, control, **kwargs):
        for gpu in self.gpus:
            gpu.execute(self.work, blocking=False)
        for gpu in self.gpus:
            gpu.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--zone", default=None, help="Electricity Maps zone (e.g. DE); default: a fixed 400 g/kWh")
    p.add_argument("--carbon-aware", action="store_true", help="choose the limit with CarbonCost(0.5)")
    p.add_argument("--output-dir", default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    transformers.logging.set_verbosity_warning()
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="perseus-hf-")

    simulated = not os.environ.get("PERSEUS_GPU", "").startswith("nvml")
    callbacks: list[transformers.TrainerCallback] = []
    if simulated:
        gpus = sim_gpus("a100-sxm", 2, VirtualClock())
        callbacks.append(SimulatedGPUWork(gpus, Work(0.3, alpha=0.3)))
    else:
        gpus = get_gpus()
    monitor = Monitor(gpus=gpus, cpus=[] if simulated else None)

    provider = ElectricityMaps(args.zone) if args.zone else StaticIntensity(400.0)
    selector = CarbonCost(0.5, provider) if args.carbon_aware else MaxSlowdownConstraint(1.1)
    callback = PowerLimitCallback(
        monitor=monitor,
        selector=selector,
        warmup_steps=2,
        profile_steps=5,
        pl_step_w=50,
        carbon_reporter=CarbonReporter(monitor, provider, os.path.join(output_dir, "carbon.jsonl")),
    )
    callbacks.append(callback)

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    trainer = transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config),
        args=transformers.TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=8,
            num_train_epochs=args.epochs,
            use_cpu=simulated,
            report_to=[],
            save_strategy="no",
            logging_steps=16,
            disable_tqdm=True,
        ),
        train_dataset=TokenDataset(256, 32, 256),
        callbacks=callbacks,
    )
    trainer.train()

    optimizer = callback.optimizer
    top = optimizer.measurements[0]
    chosen = next(m for m in optimizer.measurements if m.power_limit_mw == optimizer.selected_mw)
    print(
        f"power limit {chosen.power_limit_w:.0f} W ({selector!r}): per step {chosen.time_s / top.time_s:.3f}x "
        f"the time and {chosen.energy_j / top.energy_j:.3f}x the energy of {top.power_limit_w:.0f} W; "
        f"now back to {gpus[0].power_limit_mw() / 1000:.0f} W"
    )
    print(f"carbon report: {os.path.join(output_dir, 'carbon.jsonl')}")


if __name__ == "__main__":
    main()

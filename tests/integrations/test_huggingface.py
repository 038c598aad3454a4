"""A real transformers.Trainer trains a tiny random GPT-2 on CPU with PowerLimitCallback.

The simulated GPUs do the work: a small callback runs one `Work` per training step on every
GPU (on a VirtualClock), so the sweep measures what the model predicts. Slower than most
tests (about 10-15 s on a busy 2-core machine): importing transformers and setting up the
first Trainer dominate; training 40 tiny steps is quick.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_work import Work, predict
from perseus.exceptions import ConfigError
from perseus.integrations.huggingface import PowerLimitCallback
from perseus.measurement import Monitor
from perseus.measurement.carbon import CarbonReporter, StaticIntensity
from perseus.power_limit import MaxSlowdownConstraint, Phase

WORK = Work(0.1, alpha=0.3)
STEPS_PER_EPOCH = 8  # 32 samples, batch 4


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


class TokenDataset(torch.utils.data.Dataset):
    """Random token ids: a language-modelling batch with no tokenizer and no download."""

    def __init__(self, n=32, length=16, vocab=64):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GPUWorkload(transformers.TrainerCallback):
    """Each optimizer step runs `work` on every simulated GPU and records their power limits.

    Listed before PowerLimitCallback, so at on_step_end the work is done before it is measured.
    """

    def __init__(self, gpus, work=WORK):
        self.gpus = gpus
        self.work = work
        self.limits: list[list[int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.limits.append([g.power_limit_mw() for g in self.gpus])
        for gpu in self.gpus:
            gpu.execute(self.work, blocking=False)
        for gpu in self.gpus:
            gpu.synchronize()


def trainer(tmp_path, callbacks, epochs, **overrides):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    options = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_train_epochs=epochs,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    args = transformers.TrainingArguments(**{**options, **overrides})
    return transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=callbacks)


@pytest.mark.slow
def test_trainer_applies_the_selected_limit_to_every_gpu_and_restores_it(tmp_path):
    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    monitor = Monitor(gpus=gpus, cpus=[])
    workload = GPUWorkload(gpus)
    report = tmp_path / "carbon.jsonl"
    callback = PowerLimitCallback(
        monitor=monitor,
        selector=MaxSlowdownConstraint(1.1),
        warmup_steps=1,
        profile_steps=2,
        pl_step_w=50,
        carbon_reporter=CarbonReporter(monitor, StaticIntensity(300), report),
    )
    result = trainer(tmp_path, [workload, callback], epochs=5).train()
    assert result.global_step == 5 * STEPS_PER_EPOCH

    optimizer = callback.optimizer
    assert optimizer.phase is Phase.CLOSED
    # Limits 400..100 W by 50, 3 steps each, with epochs of 8 steps cutting measurements; the
    # sweep stops at 150 W (200 and 150 W: two in a row beyond 1.1x slower than 400 W), skipping 100 W.
    assert [m.power_limit_mw for m in optimizer.measurements] == [w * 1000 for w in range(400, 149, -50)]
    assert optimizer.skipped_mw == [100_000]
    for m in optimizer.measurements:
        t, e = predict("a100-sxm", WORK, 1410, m.power_limit_w)
        assert m.time_s == pytest.approx(t) and m.energy_j == pytest.approx(2 * e)
    assert optimizer.selected_mw == 250_000  # 250 W: 1.066x slower; 200 W: 1.138x
    assert workload.limits[-STEPS_PER_EPOCH:] == [[250_000, 250_000]] * STEPS_PER_EPOCH
    assert [g.power_limit_mw() for g in gpus] == [400_000, 400_000]

    lines = [json.loads(line) for line in report.read_text().splitlines()]
    assert [line.get("epoch") for line in lines] == [1, 2, 3, 4, 5, None]
    assert lines[-1]["energy_j"] == pytest.approx(sum(line["energy_j"] for line in lines[:-1]))
    assert lines[-1]["carbon_g"] == pytest.approx(lines[-1]["energy_j"] / 3.6e6 * 300)


@pytest.mark.slow
def test_callback_builds_its_optimizer_on_the_gpus_from_perseus_gpu(tmp_path, monkeypatch):
    """No monitor given: the callback measures the GPUs PERSEUS_GPU selects (real clock; the
    work is 1 ms per step)."""
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    workload = GPUWorkload(sim_gpus("a100-sxm", 2), Work(0.001, alpha=0.3))  # same GPUs: shared state files
    callback = PowerLimitCallback(warmup_steps=0, profile_steps=1, pl_step_w=100)
    trainer(tmp_path, [workload, callback], epochs=2).train()
    optimizer = callback.optimizer
    assert len(optimizer.gpus) == 2
    selected = optimizer.selected_mw
    assert selected is not None
    assert workload.limits[-1] == [selected, selected]
    assert [g.power_limit_mw() for g in workload.gpus] == [400_000, 400_000]


class Reporter(transformers.TrainerCallback):
    """Stands for a report_to integration (TensorBoard, W&B, ...): the Trainer lists those before
    the user's callbacks, and each reads `logs` in its own on_log."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.mark.slow
def test_energy_power_and_limit_reach_every_reporter_and_the_log_history(tmp_path):
    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    reporter, workload = Reporter(), GPUWorkload(gpus)
    callback = PowerLimitCallback(
        monitor=Monitor(gpus=gpus, cpus=[]),
        selector=MaxSlowdownConstraint(1.1),
        warmup_steps=1,
        profile_steps=2,
        pl_step_w=50,
        verbose=False,
    )
    run = trainer(tmp_path, [reporter, workload, callback], epochs=5, logging_strategy="steps", logging_steps=4)
    run.train()

    step_logs = [line for line in reporter.logs if "loss" in line]
    assert len(step_logs) == 5 * STEPS_PER_EPOCH // 4
    energies = [line["perseus/energy_j"] for line in step_logs]
    assert all(b > a for a, b in zip(energies, energies[1:]))  # since training began
    # Average power of 2 GPUs over steps that keep them busy: between idle and the highest limit.
    idle_w = gpus[0].preset.idle_w
    for line in step_logs:
        assert 2 * idle_w < line["perseus/power_w"] <= 2 * 400
        assert line["perseus/power_limit_w"] in {400, 350, 300, 250, 200, 150}
    assert callback.optimizer.selected_mw == 250_000
    assert step_logs[-1]["perseus/power_limit_w"] == 250  # the choice, once the sweep is done
    history = [h for h in run.state.log_history if "loss" in h]
    assert [h["perseus/energy_j"] for h in history] == energies
    summary = reporter.logs[-1]  # the Trainer's closing summary log carries the total
    assert "train_runtime" in summary and summary["perseus/energy_j"] >= energies[-1]


def test_optimizer_and_its_arguments_together_is_an_error():
    with pytest.raises(ConfigError, match="either an optimizer or its arguments"):
        PowerLimitCallback(object(), warmup_steps=1)  # type: ignore[arg-type]
    # What the optimizer would refuse once training starts is refused when the callback is made.
    with pytest.raises(ConfigError, match=r"first argument is a GlobalPowerLimitOptimizer; pass a selector by name"):
        PowerLimitCallback(MaxSlowdownConstraint(1.1), profile_steps=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"takes no argument 'profile_stepz'; its arguments: monitor, selector"):
        PowerLimitCallback(profile_stepz=3)
    with pytest.raises(ConfigError, match="selector must be a PowerLimitSelector .* got 'time'"):
        PowerLimitCallback(selector="time")

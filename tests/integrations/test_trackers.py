"""Perseus' figures in experiment trackers, read back with TensorBoard's own event reader: a real
transformers Trainer with report_to=["tensorboard"], and TensorBoardReporter on torch's real
SummaryWriter for a PerseusRank job and a plain loop's Monitor windows."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU, sim_gpus
from perseus.devices.sim_work import Work
from perseus.exceptions import ConfigError
from perseus.integrations.tensorboard import TensorBoardReporter
from perseus.measurement import Monitor
from perseus.measurement.carbon import StaticIntensity
from perseus.runtime import PerseusRank
from perseus.schedules import build_schedule


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files under `log_dir`: tag -> [(step, value)]."""
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_perseus_rank_job_in_tensorboard(tmp_path):
    gpu = SimGPU("a100-sxm", 0, clock=VirtualClock(), state_dir=str(tmp_path / "gpu"))
    work = Work(0.01)
    with TensorBoardReporter(tmp_path / "runs") as reporter:
        rank = PerseusRank(
            gpu,
            build_schedule("1f1b", 1, 2),
            0,
            client=None,
            progress=False,
            handle_signals=False,
            watchdog=False,
            on_iteration=reporter.on_iteration,
        )
        for _ in range(3):
            rank.on_step_begin()
            for ins in rank.order:
                rank.on_instruction_begin(ins.kind, ins.microbatch)
                gpu.execute(work)
                rank.on_instruction_end(ins.kind, ins.microbatch)
            rank.on_step_end()
        rank.close()
    series = scalars(tmp_path / "runs")
    time_s, energy_j = 4 * work.time_s, 4 * gpu.predict(work)[1]
    assert [step for step, _ in series["perseus/iteration_time_s"]] == [0, 1, 2]
    assert all(v == pytest.approx(time_s, rel=1e-6) for _, v in series["perseus/iteration_time_s"])
    assert all(v == pytest.approx(energy_j, rel=1e-6) for _, v in series["perseus/energy_j"])
    assert all(v == pytest.approx(energy_j / time_s, rel=1e-6) for _, v in series["perseus/power_w"])
    assert [v for _, v in series["perseus/plan_version"]] == [0, 0, 0]
    assert [v for _, v in series["perseus/planned"]] == [0, 0, 0]  # no planner: default clocks


def test_monitor_windows_of_a_plain_loop(tmp_path):
    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    monitor = Monitor(gpus=gpus, cpus=[])
    with TensorBoardReporter(tmp_path / "runs", prefix="energy") as reporter:
        for step in range(2):
            with monitor.window("step") as w:
                for gpu in gpus:
                    gpu.execute(Work(0.5 * (step + 1)), blocking=False)
            assert w.measurement is not None
            reporter.add_window(step, w.measurement, "step")
    series = scalars(tmp_path / "runs")
    assert [round(v, 6) for _, v in series["energy/step/time_s"]] == [0.5, 1.0]
    one = 2 * gpus[0].predict(Work(0.5))[1]
    assert series["energy/step/gpu_energy_j"][0][1] == pytest.approx(one, rel=1e-6)
    assert series["energy/step/power_w"][0][1] == pytest.approx(one / 0.5, rel=1e-6)


def test_writer_arguments_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="log_dir or writer, not both"):
        TensorBoardReporter(tmp_path, writer=object())
    with pytest.raises(ConfigError, match=r"add_scalar\(tag, value, step\)"):
        TensorBoardReporter(writer=object())


@pytest.mark.slow
def test_trainer_reports_energy_power_limit_and_emissions_to_tensorboard(tmp_path):
    """report_to=["tensorboard"]: the Trainer's own TensorBoard callback writes Perseus' figures."""
    transformers = pytest.importorskip("transformers")
    from test_huggingface import STEPS_PER_EPOCH, GPUWorkload, trainer

    from perseus.integrations.huggingface import PowerLimitCallback
    from perseus.power_limit import MaxSlowdownConstraint

    gpus = sim_gpus("a100-sxm", 2, VirtualClock())
    callback = PowerLimitCallback(
        monitor=Monitor(gpus=gpus, cpus=[]),
        selector=MaxSlowdownConstraint(1.1),
        warmup_steps=1,
        profile_steps=2,
        pl_step_w=50,
        verbose=False,
        carbon_provider=StaticIntensity(300),
    )
    run = trainer(
        tmp_path,
        [GPUWorkload(gpus), callback],
        epochs=2,
        logging_strategy="steps",
        logging_steps=4,
        report_to=["tensorboard"],
    )
    assert isinstance(run, transformers.Trainer)
    run.train()
    (events,) = tmp_path.rglob("events.out.tfevents.*")  # where this transformers version puts them
    series = scalars(events.parent)

    def named(suffix: str) -> list[tuple[int, float]]:
        (tag,) = [t for t in series if t.endswith(suffix)]
        return series[tag]

    energy = named("perseus/energy_j")
    emissions = named("perseus/emissions_g")
    # Every 4 steps, then the closing summary with the total at the last step.
    assert [step for step, _ in energy] == [*range(4, 2 * STEPS_PER_EPOCH + 1, 4), 2 * STEPS_PER_EPOCH]
    assert all(b > a for (_, a), (_, b) in zip(energy[:-1], energy[1:-1])) and energy[-1][1] == energy[-2][1]
    for (_, joules), (_, grams) in zip(energy, emissions):
        assert grams == pytest.approx(joules / 3.6e6 * 300, rel=1e-4)
    assert {v for _, v in named("perseus/power_limit_w")} <= {400, 350, 300, 250, 200}
    assert all(v > 0 for _, v in named("perseus/power_w"))

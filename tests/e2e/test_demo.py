"""End to end: the planner service, torchrun ranks (gloo, CPU) and simulated GPUs, for real.

Slow by nature (each torchrun start imports torch in every rank): the module runs two
short jobs on 2 ranks with GPU work scaled down (about 0.45 s per iteration: the service
calibrates its model on the job's own timeline and publishes no plan unless the model reproduces
the measured iteration within 1%, so the GPU work must outweigh a loaded machine's host stalls;
at 0.15 s, under load 6-7 on 2 cores, it did not) and a coarse profiling sweep; the second
shares the first job's state directory. A third runs two pipelines, one a straggler. (A rank
killed with SIGKILL: see test_chaos.py.)

What a loaded machine changes -- host work between instructions, and with it iteration times,
the idle energy over them, how late an asynchronous clock change lands, and the straggler
factor measured from compute times -- is kept out of the checks: energies are compared as the
energy beyond idle power over each rank's window (the GPU work's own, which only its clocks
decide), put at the planner's pace to compare with its prediction (`saving_at`). The wall-clock
figures themselves (iteration time change, plan_applied, the measured factor against 1.2, the
straggler's compute-time gap) are demo targets that `perseus demo` prints; a test cannot hold a
shared machine to them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import time

import pytest

pytest.importorskip("torch")

from perseus.atomic import write_json_atomic
from perseus.demo import launcher
from perseus.demo.launcher import DemoOptions, demo_config, run_demo
from perseus.demo.processes import PRESET, ServiceProcess, log_tail, sim_gpus_at_default, start_job, wait_for_job
from perseus.demo.report import format_report
from perseus.demo.results import Iteration, load_iterations, read_rank_record, split_phases
from perseus.devices.sim_presets import get_preset

RANKS = 2
# Three iterations per clock: the first is dropped, the medians of the other two (8 samples per
# instruction kind) hold against scheduling stalls of a busy CI machine.
OPTIONS = DemoOptions(
    ranks=RANKS, microbatches=4, iterations=3, sweep_step=8, iterations_per_frequency=3, time_scale=0.15, timeout_s=400
)
MAX_MHZ = 1410
IDLE_W = get_preset(PRESET).idle_w
# The jobs stop after a number of iterations without a plan (or without the straggler-aware
# re-plan); the service's solve takes seconds, more iterations on a loaded machine: allow many more.
SPARE_ITERATIONS = 300


def roomy(config):
    """`config` with SPARE_ITERATIONS more iterations to wait for plans."""
    return dataclasses.replace(
        config,
        max_iterations=config.max_iterations + 2 * SPARE_ITERATIONS,
        replan_wait_iterations=config.replan_wait_iterations + SPARE_ITERATIONS,
    )


@contextlib.contextmanager
def demo_run(options: DemoOptions):
    """run_demo(options) with roomy job limits; its work folder (per-rank records) is kept for
    the test, then removed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher, "demo_config", lambda *args, **kwargs: roomy(demo_config(*args, **kwargs)))
        result = run_demo(dataclasses.replace(options, keep_dir=True))
    try:
        yield result, load_iterations(os.path.join(result["work_dir"], "ranks"), result["ranks"])
    except BaseException:
        # What the service said of the profiles, calibrations and plans: shown with the failure.
        print(log_tail(os.path.join(result["work_dir"], "service.log"), 200))
        raise
    finally:
        shutil.rmtree(result["work_dir"], ignore_errors=True)


def work_energy_j(iterations: list[Iteration], ranks: list[int] | None = None) -> float:
    """Median over `iterations` of the energy beyond idle power over each rank's window, summed
    over `ranks` (default: all): what the GPU work drew, whatever the windows' lengths."""
    ranks = list(range(len(iterations[0].windows))) if ranks is None else ranks
    return statistics.median(sum(it.windows[r][1] - IDLE_W * it.windows[r][0] for r in ranks) for it in iterations)


def saving_at(baseline_j: float, other_j: float, gpus: int, pace_s: float) -> float:
    """The measured saving of work energy `other_j` against `baseline_j` (see work_energy_j)
    with both iterations lasting `pace_s` on `gpus` GPUs, as the planner predicts savings."""
    return (baseline_j - other_j) / (baseline_j + gpus * IDLE_W * pace_s)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("planner-state"))


@pytest.fixture(scope="module")
def demo_and_iterations(state_dir, tmp_path_factory):
    plot_dir = str(tmp_path_factory.mktemp("plot"))
    options = DemoOptions(**{**OPTIONS.__dict__, "state_dir": state_dir, "plot_dir": plot_dir})
    with demo_run(options) as (result, iterations):
        yield result, iterations


@pytest.fixture(scope="module")
def demo(demo_and_iterations):
    return demo_and_iterations[0]


class _Job:
    """One torchrun demo job against a planner service on `state_dir`, in `tmp`."""

    def __init__(self, tmp, state_dir: str, **changes) -> None:
        self.out_dir, self.sim_dir = str(tmp / "ranks"), str(tmp / "sim")
        os.makedirs(self.out_dir)
        os.makedirs(self.sim_dir)
        self.service = ServiceProcess(state_dir, str(tmp / "service.log"))
        self.address = self.service.start()
        config = demo_config(OPTIONS, self.out_dir, self.address)
        config_path = str(tmp / "config.json")
        write_json_atomic(config_path, {**config.to_json(), **changes})
        self.log = str(tmp / "torchrun.log")
        self.proc = start_job(RANKS, config_path, self.sim_dir, self.log)

    def until(self, predicate, timeout_s: float, what: str):
        """Wait for `predicate` while the job runs; fail with its log if it ends first."""
        return wait_for_job(self.proc, predicate, what, timeout_s, self.log)

    def records(self, rank: int = 0) -> dict | None:
        return read_rank_record(self.out_dir, rank)

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout_s)
        except Exception:
            self.proc.kill()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.service.stop()


@pytest.mark.slow
def test_demo_profiles_plans_applies_and_saves(demo_and_iterations):
    demo, iterations = demo_and_iterations
    assert demo["profiled"], "a fresh state directory must be profiled"
    assert demo["clocks_reset"] is True
    # The plan is non-trivial, and the ranks ran it: planned instructions at its clocks.
    plan = demo["plan_frequencies"]
    assert len(plan) == RANKS and all(len(row) == 2 * OPTIONS.microbatches for row in plan)
    assert min(min(row) for row in plan) < MAX_MHZ
    phases = split_phases(iterations)
    assert all(list(it.plans) == plan for it in phases["planned"])
    ran = {s["frequency"] for it in phases["planned"] for rank in it.spans for s in rank}
    assert ran & {f for row in plan for f in row if f < MAX_MHZ}
    # The GPU work's energy went down by a good part of what the planner predicted (at the
    # planned iteration time, as predicted; the time measured is the machine's).
    assert 0 < demo["predicted_saving"] < 0.5
    baseline_j, planned_j = work_energy_j(phases["baseline"]), work_energy_j(phases["planned"])
    measured = saving_at(baseline_j, planned_j, RANKS, demo["predicted"]["iteration_time_s"])
    assert measured > 0.3 * demo["predicted_saving"], (measured, demo["predicted_saving"])
    # The baseline on both sides of Perseus: before it attached and after it closed.
    assert demo["before"]["iterations"] == demo["after"]["iterations"] == OPTIONS.iterations
    assert demo["baseline"]["iterations"] == 2 * OPTIONS.iterations
    # The ranks ran the plan until the service's verification decided on it: at least a window.
    assert demo["planned"]["iterations"] >= OPTIONS.iterations
    # Calibrated on the job's own timeline, as any client's (the demo gives no overheads), and verified.
    (fit,) = demo["calibration"]
    # Within the service's own tolerance: 1%, or the baseline's noise on a loaded host.
    assert fit["state"] == "fitted" and 0.01 <= fit["tolerance"] < 0.05, fit
    assert abs(fit["model_s"] / fit["measured_s"] - 1) <= fit["tolerance"], fit
    assert [p["verification"] for p in demo["verification"]] in (["holds"], ["fallback"]), demo["verification"]
    assert demo["service"]["baseline_iterations"] >= 8 and demo["service"]["planned_iterations"] >= 10
    png, data, frontier = demo["plots"]
    for picture in (png, frontier):
        with open(picture, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(data, encoding="utf-8") as f:
        panels = json.load(f)
    assert [p["panel"] for p in panels] == ["baseline", "planned"]
    assert all(len(p["ranks"][r]) == 2 * OPTIONS.microbatches for p in panels for r in range(RANKS))
    report = format_report(demo)
    assert "energy saving: predicted" in report and "clocks reset at the end: yes" in report
    assert "calibration (NVIDIA A100-SXM4-40GB (simulated)): model fitted on" in report
    assert "verification: pipeline 0, plan v" in report


@pytest.mark.slow
def test_restarted_service_resumes_without_profiling_and_training_survives_its_stop(demo, state_dir, tmp_path):
    # A new service process on the first job's state: the same job skips profiling.
    job = _Job(tmp_path, state_dir, planned_iterations=10, max_iterations=SPARE_ITERATIONS)
    try:

        def planned_pids():
            docs = [job.records(r) for r in range(RANKS)]
            if all(d and any(i["phase"] == "planned" for i in d["iterations"]) for d in docs):
                return [d["pid"] for d in docs]
            return None

        pids = job.until(planned_pids, 90, "every rank running the plan")
        # The planner goes away mid-run. The ranks are held meanwhile (SIGSTOP), so that they
        # train on after it however long a loaded machine takes to stop it.
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            job.service.stop()
            stopped_at = time.monotonic()
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert job.wait() == 0, log_tail(job.log)
    finally:
        job.close()
    iterations = load_iterations(job.out_dir, RANKS)
    phases = {p for it in iterations for p in it.phases}
    assert "profiling" not in phases
    after_stop = [it for it in iterations if it.start > stopped_at]
    assert after_stop, "training must go on after the planner stopped"
    assert all(set(it.phases) == {"planned"} for it in after_stop), [it.phases for it in after_stop]
    phases = split_phases(iterations)
    planned = phases["planned"]
    # A new run is planned on its own baseline (measured again, the model fitted again) and the
    # stored profile: one plan, below maximum clocks somewhere, whose clocks took effect.
    plan = planned[0].plans if planned else None
    assert plan and all(it.plans == plan for it in planned), [it.plans for it in planned]
    assert min(min(row) for row in plan) < MAX_MHZ
    assert work_energy_j(planned) < work_energy_j(phases["baseline"])
    assert sim_gpus_at_default(RANKS, job.sim_dir)


@pytest.mark.slow
def test_straggler_pipeline_is_detected_and_the_other_saves_more_at_its_pace():
    # 2 pipelines x 2 stages, the second on GPUs 20% slower (about 27 s: profiling, the intrinsic
    # plan, detection over 5+ iterations, the straggler-aware re-plan).
    with demo_run(DemoOptions(**{**OPTIONS.__dict__, "dp": 2, "straggler": 1.2})) as (result, iterations):
        # From the ranks' compute times, nothing declared: detected means over the detector's 5%.
        # Host work in the compute times (more on a loaded machine) pulls the factor from the true
        # 1.2 towards 1, not above.
        assert result["straggler"]["source"] == "detected" and result["straggler"]["factor"] < 1.4
        fast, slow = result["pipelines"]
        assert slow["straggler"] and not fast["straggler"]
        # The throttle is in the straggler's GPU work: 1.2x as long at the same power, so 1.2x the
        # work energy at maximum clocks. (How far it shows in wall-clock compute times depends on
        # the host work beside it: the service's detection, above, is what tells it from them.)
        ranks, slow_ranks = list(range(RANKS)), [RANKS + s for s in range(RANKS)]
        phases = split_phases(iterations, slow_ranks)
        throttled = work_energy_j(phases["baseline"], slow_ranks) / work_energy_j(phases["baseline"], ranks)
        assert throttled == pytest.approx(1.2, rel=0.01)
        # The fast pipeline saves more at the straggler's pace than with its intrinsic plan, as
        # predicted, and by a good part of the prediction (the work energy, at the planner's pace).
        assert fast["predicted_saving"] > fast["predicted_intrinsic_saving"] > 0
        pace = result["straggler"]["deadline_s"]
        baseline_j = work_energy_j(phases["baseline"], ranks)
        intrinsic = saving_at(baseline_j, work_energy_j(phases["intrinsic"], ranks), RANKS, pace)
        final = saving_at(baseline_j, work_energy_j(phases["planned"], ranks), RANKS, pace)
        assert final > intrinsic > 0, (final, intrinsic)
        assert final > 0.7 * fast["predicted_saving"], (final, fast["predicted_saving"])
        assert result["clocks_reset"] is True  # clocks and the straggler's throttle undone
        assert "straggler-aware plan" in format_report(result)

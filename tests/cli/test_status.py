"""`perseus status` as text, from a job's status: the model's fit per stage, the plan's check with
its re-plans and why, the measured saving against the baseline. (Through a real service:
tests/server/test_server_calibration.py.)"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from perseus.cli.main import main
from perseus.cli.status import format_job, frontier_points, job_json
from perseus.wire.calibration import CalibrationStatus, StageFitStatus
from perseus.wire.messages import JobStatus, PipelineStatus


def job_status() -> JobStatus:
    return JobStatus(
        job_id="job-1a2b3c4d5e6f7a8b",
        phase="planned",
        world_size=2,
        ranks_registered=2,
        profiled_stages=(0, 1),
        plan_version=2,
        last_iteration=61,
        predicted_iteration_time_s=0.2800,
        predicted_energy_j=90.0,
        predicted_baseline_energy_j=100.0,
        baseline_iterations=8,
        baseline_iteration_time_s=0.2810,
        baseline_energy_j=101.0,
        planned_iterations=20,
        planned_iteration_time_s=0.2820,
        planned_energy_j=93.0,
        pipelines=(
            PipelineStatus(
                0,
                2,
                None,
                0.2800,
                0.2790,
                baseline_iteration_time_s=0.2780,
                target_iteration_time_s=0.2780,
                verification="holds",
                verified_iteration_time_s=0.2790,
                replans=1,
                reason="plan v1 runs +4.0% over its target; re-planning (1 of 3)",
            ),
        ),
        calibrations=(
            CalibrationStatus(
                "sim-a100",
                "fitted",
                iterations=8,
                measured_s=0.2810,
                model_s=0.2800,
                gpu_only_s=0.2500,
                explained=0.89,
                host_gap_s=0.0006,
                hop_s=0.0009,
                margin=0.08,
                stages=(
                    StageFitStatus(0, 0.2700, 0.2710, 0.15, 0.0005),
                    StageFitStatus(1, 0.2600, 0.2580, 0.2, 0.0007),
                ),
            ),
        ),
        tolerance=0.01,
    )


def test_the_text_tells_fit_check_and_saving():
    text = format_job(job_status())
    assert "job job-1a2b3c4d5e6f7a8b: planned, 2 of 2 ranks, plan v2, iteration 61, tolerance 1%" in text
    assert "model of sim-a100: fitted on 8 baseline iterations: model 0.2800 s vs measured 0.2810 s (-0.4%)" in text
    assert "(89.0% explained); host gap 0.60 ms, hop 0.90 ms; margin 8% on slowed instructions" in text
    assert "        1      0.2600   0.2580   -0.8%" in text
    assert "holds" in text and "re-planning (1 of 3)" in text
    assert "saving 7.9% measured (predicted 10.0%)" in text
    # The tolerance the fit was accepted within, where the service says it (a noisy baseline's).
    status = job_status()
    noisy = dataclasses.replace(status.calibrations[0], tolerance=0.016)
    text = format_job(dataclasses.replace(status, calibrations=(noisy,)))
    assert "model 0.2800 s vs measured 0.2810 s (-0.4%, tolerance 1.6%)" in text


def test_the_json_has_every_field_even_at_its_default():
    doc = json.loads(json.dumps(job_json(job_status())))
    assert doc["saving_withheld"] == "" and doc["warning"] == ""
    assert doc["measured_saving"] == pytest.approx(1 - 93 / 101)
    (pipeline,) = doc["pipelines"]
    assert pipeline["plan_since"] == 0 and pipeline["straggler"] == "" and pipeline["replans"] == 1
    assert doc["calibrations"][0]["stages"][1]["stage"] == 1


def test_a_job_its_ranks_stopped_reporting_is_told():
    assert "no iteration reported" not in format_job(dataclasses.replace(job_status(), quiet_s=29.0))
    ended = format_job(dataclasses.replace(job_status(), quiet_s=95.4))
    assert "iteration 61, tolerance 1%; no iteration reported for 95 s: the job ended, or stalls" in ended
    slow = dataclasses.replace(job_status(), quiet_s=40.0, planned_iteration_time_s=5.0)  # 8 of its iterations
    assert "no iteration reported" not in format_job(slow)
    one = format_job(dataclasses.replace(job_status(), quiet_s=95.4, ranks_closed=1))
    assert "tolerance 1%; 1 of 2 ranks closed; no iteration reported for 95 s" in one
    ended = format_job(dataclasses.replace(job_status(), quiet_s=95.4, ranks_closed=2))
    assert ended.splitlines()[0].endswith("tolerance 1%; every rank closed: the job ended")


def test_a_profiling_job_names_the_stages_profiled_so_far():
    profiling = dataclasses.replace(job_status(), phase="profiling", profiled_stages=(0, 2), pipelines=())
    assert "stages profiled: 0, 2" in format_job(profiling)
    assert "stages profiled: none yet" in format_job(dataclasses.replace(profiling, profiled_stages=()))
    assert "stages profiled" not in format_job(job_status())


def test_a_bad_job_id_is_refused_before_any_connection(capsys):
    assert main(["status", "--job", "nope", "--timeout", "0.2"]) == 1
    assert "--job takes a job id" in capsys.readouterr().err


def test_an_absent_service_is_one_clear_error(capsys):
    assert main(["status", "--address", "tcp://127.0.0.1:9", "--timeout", "0.3"]) == 1
    assert "did not answer within 0.3 s; is it running?" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "5000"])
def test_the_timeout_is_checked(capsys, timeout):
    assert main(["status", "--timeout", timeout]) == 1
    assert "--timeout is in seconds" in capsys.readouterr().err


def test_the_png_points_are_the_status_figures():
    measured, predicted = frontier_points(job_status())
    assert measured == {"baseline": [(0.2810, 101.0)], "planned": [(0.2820, 93.0)]}
    # The predicted baseline: the calibrated model's time at max clocks, the evaluator's energy there.
    assert predicted == {"baseline": (0.2800, 100.0), "plan": (0.2800, 90.0)}


def test_png_without_matplotlib_is_one_clear_error_before_any_connection(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    assert main(["status", "--png", str(tmp_path), "--address", "tcp://127.0.0.1:9", "--timeout", "0.3"]) == 1
    err = capsys.readouterr().err
    assert "plotting needs matplotlib: pip install 'perseus-energy[plot]'" in err and "did not answer" not in err


def test_the_address_defaults_to_the_ranks_planner_variable(capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_PLANNER", "tcp://127.0.0.1:9")
    assert main(["status", "--timeout", "0.3"]) == 1
    assert "the planner service at tcp://127.0.0.1:9 did not answer" in capsys.readouterr().err

"""`perseus plan` as a real subprocess: the savings table, plan.json, frontier CSV, plots, errors.

Each subprocess starts Python and imports the planner (about a second), hence few, combined
invocations.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from test_solver import random_profile

from perseus.profiler import save_profile
from perseus.schedules import build_schedule


def perseus(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.fixture
def profile_csv(tmp_path):
    path = tmp_path / "profile.csv"
    save_profile(random_profile(21, 3, 6, power_w=70.0), path)
    return path


@pytest.mark.slow
def test_writes_plan_frontier_and_plots(tmp_path, profile_csv):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.json"
    frontier = tmp_path / "frontier.csv"
    result = perseus(
        "plan",
        "--profile",
        str(profile_csv),
        "--blocking-power",
        "70",
        "--stages",
        "3",
        "--microbatches",
        "6",
        "--max-slowdown",
        "1.1",
        "--out",
        str(out),
        "--frontier",
        str(frontier),
        "--frontier-points",
        "5",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert result.returncode == 0, result.stderr
    for name in ("max frequency", "uniform", "EnvPipe", "Perseus", "lower bound"):
        assert name in result.stdout
    doc = json.loads(out.read_text())
    assert {"iteration_time_s", "energy_j", "lower_bound_j", "stages"} <= set(doc)
    assert doc["lower_bound_j"] <= doc["energy_j"]
    schedule = build_schedule("1f1b", 3, 6)
    assert [s["stage"] for s in doc["stages"]] == [0, 1, 2]
    for entry, row in zip(doc["stages"], schedule.stages):
        assert [(i["kind"], i["microbatch"]) for i in entry["instructions"]] == [
            (i.kind.value, i.microbatch) for i in row
        ]
        assert all(isinstance(i["frequency"], int) for i in entry["instructions"])
    rows = list(csv.DictReader(frontier.open()))
    assert len(rows) == 5
    assert float(rows[0]["energy_j"]) >= float(rows[-1]["energy_j"])
    for name in ("timeline.png", "frontier.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:4] == b"\x89PNG"


def test_errors_name_the_problem(tmp_path, profile_csv):
    result = perseus("plan", "--profile", str(profile_csv), "--stages", "3", "--microbatches", "4")
    assert result.returncode == 1
    assert "blocking" in result.stderr
    result = perseus(
        "plan",
        "--profile",
        str(profile_csv),
        "--blocking-power",
        "70",
        "--stages",
        "3",
        "--microbatches",
        "4",
        "--deadline",
        "0.001",
    )
    assert result.returncode == 1
    assert "relax the deadline" in result.stderr


def test_flag_mistakes_are_caught_before_planning(tmp_path, profile_csv, capsys):
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--stages", "3", "--microbatches", "4"]
    assert main(base) == 1
    assert "pass --blocking-power W" in capsys.readouterr().err
    assert main([*base, "--blocking-power", "70", "--frontier", str(tmp_path / "f.csv"), "--frontier-points", "1"]) == 1
    out, err = capsys.readouterr()
    assert "--frontier-points must be at least 2" in err
    assert out == ""  # no savings table printed before the failure
    assert not (tmp_path / "f.csv").exists()


def test_output_paths_that_cannot_be_written_are_errors_not_tracebacks(tmp_path, profile_csv, capsys):
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "4"]
    assert main([*base, "--out", str(tmp_path)]) == 1
    assert f"--out {tmp_path} is a folder" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main([*base, "--plot", str(a_file)]) == 1
    assert "is a file; give a folder" in capsys.readouterr().err
    assert main([*base, "--out", str(a_file / "plan.json")]) == 1  # its folder is a file: found when writing
    assert f"cannot write --out {a_file / 'plan.json'}" in capsys.readouterr().err


def test_zero_bubble_from_a_profile_of_whole_backwards_needs_split_backward(tmp_path, capsys):
    from perseus.cli.main import main
    from perseus.profiler.profile import Profile

    whole = random_profile(4, 2, 4, power_w=70.0)
    path = tmp_path / "whole.csv"
    save_profile(Profile({k: v for k, v in whole.points.items() if k[1] in ("forward", "backward")}, 70.0), path)
    base = [
        "plan",
        "--profile",
        str(path),
        "--blocking-power",
        "70",
        "--schedule",
        "zb-h1",
        "--stages",
        "2",
        "--microbatches",
        "4",
    ]
    assert main(base) == 1
    assert "pass --split-backward F" in capsys.readouterr().err
    assert main([*base, "--split-backward", "1.5"]) == 1
    assert "--split-backward is the input part's share" in capsys.readouterr().err
    assert main([*base, "--split-backward", "0.5"]) == 0
    assert "Perseus is within" in capsys.readouterr().out

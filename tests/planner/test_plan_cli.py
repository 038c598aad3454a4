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
    assert "--frontier-points must be from 2" in err
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


def _table(out: str) -> dict[str, tuple[float, float, float]]:
    """{plan name: (iteration s, energy J, saving %)} from the savings table."""
    rows = {}
    for line in out.splitlines():
        parts = line.rsplit(None, 3)
        if len(parts) == 4 and parts[3].endswith("%"):
            try:
                rows[parts[0].strip()] = (float(parts[1]), float(parts[2]), float(parts[3][:-1]))
            except ValueError:
                continue
    return rows


def test_a_straggler_deadline_table_adds_up_and_padded_plans_use_the_slack(tmp_path, profile_csv, capsys):
    """Past the all-max time every row counts an iteration of the deadline (energy and saving
    alike, so 1 - E / E_max is the saving printed); --padded plans for that iteration."""
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    plain_json, padded_json = tmp_path / "plain.json", tmp_path / "padded.json"
    assert main([*base, "--max-slowdown", "1.3", "--out", str(plain_json)]) == 0
    plain = _table(capsys.readouterr().out)
    assert main([*base, "--max-slowdown", "1.3", "--padded", "--out", str(padded_json)]) == 0
    out = capsys.readouterr().out
    padded = _table(out)
    for table in (plain, padded):
        maximum = table["max frequency"][1]
        for _, e, saving in table.values():
            assert saving == pytest.approx(100 * (1 - e / maximum), abs=0.01)
    assert json.loads(padded_json.read_text())["padded"] is True
    assert json.loads(plain_json.read_text())["padded"] is False
    doc = json.loads(plain_json.read_text())  # the table's context beside the plan
    assert doc["saving"] == pytest.approx(plain["Perseus"][2] / 100, abs=1e-4) and doc["blocking_power_w"] == 70
    assert doc["max_clocks"]["iteration_time_s"] == pytest.approx(plain["max frequency"][0], rel=1e-5)
    assert doc["saving_over_s"] >= doc["deadline_s"] and doc["profile"] == str(profile_csv)
    assert padded["Perseus"][1] <= plain["Perseus"][1] * (1 + 1e-6)
    assert "--padded plans for that" not in out


def test_a_deadline_past_the_least_energy_time_says_so(profile_csv, capsys):
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    assert main([*base, "--max-slowdown", "110"]) == 1  # a percentage meant as a factor
    assert "at most 10, a factor (1.1 is 10% slower" in capsys.readouterr().err
    assert main([*base, "--deadline", "inf"]) == 1
    assert "--deadline must be a positive number of seconds, e.g. 16.5; got inf" in capsys.readouterr().err
    assert main([*base, "--max-slowdown", "nan"]) == 1
    assert "--max-slowdown must be a positive factor of the all-max-clock time, e.g. 1.1; got nan" in (
        capsys.readouterr().err
    )
    assert main([*base, "--max-slowdown", "110"]) == 1
    assert "at most 10, a factor (1.1 is 10% slower" in capsys.readouterr().err
    assert main([*base, "--max-slowdown", "5"]) == 0
    out = capsys.readouterr().out  # what the bound says, not that no longer deadline saves more
    assert "before the deadline: the least energy the planner found within it" in out
    assert "by the bound, no plan within the deadline is over" in out and "a longer one may still save" in out
    assert main([*base, "--max-slowdown", "1.0"]) == 0
    assert "the least energy the planner found" not in capsys.readouterr().out


def test_repeat_profile_plans_a_deeper_pipeline_of_the_profiled_stages(tmp_path, profile_csv, capsys):
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "6", "--microbatches", "8"]
    assert main(base) == 1
    assert "--repeat-profile tile|stretch" in capsys.readouterr().err
    energies = {}
    for how in ("tile", "stretch"):
        out = tmp_path / f"{how}.json"
        assert main([*base, "--repeat-profile", how, "--out", str(out)]) == 0
        energies[how] = _table(capsys.readouterr().out)["Perseus"][1]
        assert len(json.loads(out.read_text())["stages"]) == 6
    assert energies["tile"] != energies["stretch"]  # stage 1 takes stage 1's rows, or stage 0's


@pytest.mark.parametrize(("slowdown", "padded"), [(1.0, False), (1.3, False), (1.3, True), (0.99, True)])
def test_the_api_saving_is_the_one_the_table_prints(tmp_path, profile_csv, capsys, slowdown, padded):
    """`Planner.saving(plan)` is the Perseus row's saving (an outsider had to rebuild it by hand:
    1 - energy_j / max_frequency_energy_j compares iterations of different lengths past the
    all-max time)."""
    from perseus.cli.main import main
    from perseus.planner import Planner
    from perseus.profiler import load_profile

    args = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    args += ["--max-slowdown", str(slowdown)] + (["--padded"] if padded else [])
    planner = Planner(build_schedule("1f1b", 3, 6), load_profile(profile_csv, 70.0))
    if slowdown * planner.max_frequency_time_s < planner.fastest_time_s:
        pytest.skip("this profile's fastest plan is the all-max one")
    assert main(args) == 0
    printed = _table(capsys.readouterr().out)["Perseus"][2]
    plan = planner.plan(max_slowdown=slowdown, padded=padded)
    assert 100 * planner.saving(plan) == pytest.approx(printed, abs=0.006)
    if slowdown > 1.0:
        pace = plan.deadline_s
        energy = plan.energy_j if padded else planner.energy_at_pace(plan.energy_j, plan.iteration_time_s, pace)
        base = planner.energy_at_pace(planner.max_frequency_energy_j, planner.max_frequency_time_s, pace)
        assert planner.saving(plan) == pytest.approx(1 - energy / base, rel=1e-12)


def test_a_profile_deeper_than_the_pipeline_is_noted_and_padded_must_be_a_bool(profile_csv, capsys):
    from perseus.cli.main import main
    from perseus.exceptions import ConfigError
    from perseus.planner import Planner
    from perseus.profiler import load_profile

    args = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "2", "--microbatches", "4"]
    assert main(args) == 0
    assert (
        "profiles 3 stages; this pipeline has 2, so it plans with the profile's stages 0-1" in capsys.readouterr().out
    )
    assert main([*args[:-4], "--stages", "3", "--microbatches", "4"]) == 0
    assert "note:" not in capsys.readouterr().out
    planner = Planner(build_schedule("1f1b", 3, 6), load_profile(profile_csv, 70.0))
    with pytest.raises(ConfigError, match="padded must be True or False, got 'yes'"):
        planner.plan(max_slowdown=1.1, padded="yes")


def test_sizes_and_slowdowns_past_what_is_worth_planning_are_refused_before_building(profile_csv, capsys):
    from perseus.cli.main import main

    base = ["plan", "--profile", str(profile_csv), "--blocking-power", "70"]
    assert main([*base, "--stages", "3", "--microbatches", "1000000000"]) == 1
    assert "6,000,000,000 instructions, over the 131,072 perseus plan solves" in capsys.readouterr().err
    assert (
        main([*base, "--schedule", "interleaved-1f1b", "--stages", "3", "--microbatches", "6", "--chunks", "20000"])
        == 1
    )
    assert "x 20000 chunks is 720,000 instructions" in capsys.readouterr().err
    assert main([*base, "--stages", "3", "--microbatches", "6", "--frontier-points", "100000"]) == 1
    assert "--frontier-points must be from 2 (the fastest and the least-energy plan) to 1000" in capsys.readouterr().err
    assert main([*base, "--stages", "3", "--microbatches", "6", "--max-slowdown", "1e6"]) == 1
    assert "--max-slowdown 1e+06 is past what is worth planning: at most 10" in capsys.readouterr().err
    assert main([*base, "--stages", "3", "--microbatches", "6", "--deadline", "1e6"]) == 1
    assert "x the all-max-clock time" in capsys.readouterr().err


def test_a_profile_of_one_row_set_per_rank_for_chunks_and_stages_without_a_common_clock_are_said(tmp_path, capsys):
    from perseus.cli.main import main
    from perseus.profiler import Profile, ProfilePoint

    rows = [ProfilePoint(f, 0.01 * 1410 / f, 2.0 * 1410 / f) for f in (1410, 1200, 1000)]
    shifted = [ProfilePoint(p.frequency + 5, p.time, p.energy) for p in rows]
    points = {(s, k): (shifted if s == 1 else rows) for s in range(2) for k in ("forward", "backward")}
    path = tmp_path / "p.json"
    save_profile(Profile(points, 50.0), path)
    args = ["plan", "--profile", str(path), "--stages", "2", "--microbatches", "4"]
    assert main(args) == 0
    assert "uniform clock               no clock every stage profiles" in capsys.readouterr().out
    assert main([*args, "--schedule", "interleaved-1f1b", "--chunks", "2"]) == 0
    assert "every chunk of a rank takes its rank's rows" in capsys.readouterr().out
    assert main([*args[:3], "--stages", "1", "--microbatches", "4", "--repeat-profile", "tile"]) == 0
    assert "(--repeat-profile tile repeats none)" in capsys.readouterr().out


def test_an_interrupted_plan_says_so(profile_csv, capsys, monkeypatch, tmp_path):
    from perseus.cli.main import main
    from perseus.planner import Planner

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the planner solves

    monkeypatch.setattr(Planner, "plan", interrupted)
    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    assert main([*args, "--out", str(out)]) == 130
    assert capsys.readouterr().err.endswith("\nperseus: interrupted\n") and not out.exists()


def test_a_profile_in_other_units_gets_a_note(profile_csv, tmp_path, caplog):
    from perseus.cli.main import main

    rows = list(csv.DictReader(profile_csv.open()))
    in_ms = tmp_path / "ms.csv"
    with in_ms.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**r, "time": repr(float(r["time"]) * 1000)} for r in rows)  # milliseconds
    args = ["--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    assert main(["plan", "--profile", str(in_ms), *args]) == 0
    assert "below the blocking power 70 W: are its times in ms? (in seconds they would draw" in caplog.text
    caplog.clear()
    assert main(["plan", "--profile", str(profile_csv), *args]) == 0
    assert "are its times" not in caplog.text


def test_a_blocking_power_in_kilowatts_or_milliwatts_gets_a_note(profile_csv, tmp_path, caplog):
    from perseus.cli.main import main

    out = tmp_path / "plan.json"
    args = ["plan", "--profile", str(profile_csv), "--stages", "3", "--microbatches", "6", "--out", str(out)]
    assert main([*args, "--blocking-power", "0.07"]) == 0
    assert "the blocking power 0.07 W is under 1/50 of the" in caplog.text and "is it in kW? (70 W)" in caplog.text
    assert any("is it in kW?" in note for note in json.loads(out.read_text())["notes"])
    caplog.clear()
    assert main([*args, "--blocking-power", "70000"]) == 0
    assert "is it in mW? (70 W)" in caplog.text
    caplog.clear()
    assert main([*args, "--blocking-power", "70"]) == 0
    assert "is it in" not in caplog.text


def test_an_instruction_missing_the_highest_clock_gets_a_note(profile_csv, tmp_path, capsys):
    from perseus.cli.main import main

    rows = list(csv.DictReader(profile_csv.open()))
    top = max(int(r["frequency"]) for r in rows)
    short = tmp_path / "short.csv"
    with short.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(r for r in rows if not (r["stage"] == "1" and int(r["frequency"]) == top))
    args = ["--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    assert main(["plan", "--profile", str(short), *args]) == 0
    err = capsys.readouterr().err
    assert f"most instructions are profiled up to {top} MHz, but stage 1 backward" in err
    assert main(["plan", "--profile", str(profile_csv), *args]) == 0
    assert "most instructions are profiled up to" not in capsys.readouterr().err


def test_a_deadline_below_the_all_max_time_says_what_its_energies_span(profile_csv, capsys):
    """Where a lower clock runs faster than the highest, a deadline can fall below the all-max-clock
    time; the table's energies still span that time (the saving is against it), and say so."""
    from perseus.cli.main import main

    args = ["plan", "--profile", str(profile_csv), "--blocking-power", "70", "--stages", "3", "--microbatches", "6"]
    assert main([*args, "--deadline", "28.3"]) == 0
    out = capsys.readouterr().out
    assert "J (over its own iteration): Perseus is within" in out
    assert "(energies and savings over an iteration of 28.533 s, the all-max-clock iteration" in out
    assert "EnvPipe                cannot meet the deadline: it slows only instructions off the all-max" in out
    assert main([*args, "--deadline", "28.1"]) == 0
    assert "uniform clock             no one clock meets the deadline" in capsys.readouterr().out


def test_a_large_frontier_says_it_takes_minutes_before_it_starts(profile_csv, tmp_path, capsys, monkeypatch):
    from perseus.cli import plan as plan_cli
    from perseus.cli.main import main

    monkeypatch.setattr(plan_cli, "LARGE_FRONTIER_INSTRUCTIONS", 10)  # this job's 36 instructions stand for 8,192
    frontier = tmp_path / "f.csv"
    args = ["--blocking-power", "70", "--stages", "3", "--microbatches", "6", "--frontier-points", "3"]
    assert main(["plan", "--profile", str(profile_csv), *args, "--frontier", str(frontier)]) == 0
    out = capsys.readouterr().out
    assert "computing the 3-point frontier of 36 instructions: minutes at this size" in out
    assert out.index("minutes at this size") < out.index("frontier point 3 of 3") < out.index("frontier (3 points)")

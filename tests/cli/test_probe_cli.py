"""`perseus probe` on simulated GPUs (real clock, in-process through `main`, short durations):
what it prints, what it keeps, one GPU per model, and bad input. What the figures recover exactly
is tests/devices/test_probe.py's job, on a virtual clock."""

from __future__ import annotations

import json

import pytest

import perseus.probe as probe
from perseus.cli.main import main
from perseus.devices.sim import sim_gpus

QUICK = ["--idle-s", "0.6", "--load-s", "0.6", "--poll-ms", "2"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    monkeypatch.setenv("PERSEUS_PROBE_DIR", str(tmp_path / "probe"))
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    return tmp_path


def test_json_lists_one_gpu_per_model_and_keeps_it(env, capsys):
    assert main(["probe", "--json", *QUICK]) == 0
    doc = json.loads(capsys.readouterr().out)
    (gpu,) = doc["gpus"]
    assert gpu["index"] == 0 and gpu["name"] == "NVIDIA A100-SXM4-40GB (simulated)"
    # A loaded machine can poll late; the counter still steps about every 100 ms, the reading is per update.
    assert 0.05 < gpu["energy_counter_update_s"] < 0.2
    assert 0.05 < gpu["power_average_window_s"] < 0.2
    assert gpu["idle_power_w"] == pytest.approx(83.64, rel=0.05)
    assert gpu["clock_switch_latency_s"] == {}
    assert gpu["supported_clocks_mhz"][0] == 1410 and gpu["supported_clocks_mhz"][-1] == 210
    kept = probe.load(sim_gpus("a100-sxm", 2)[1])
    assert kept is not None and kept.energy_counter_update_s == gpu["energy_counter_update_s"]


def test_text_with_clock_changes_names_the_pairs_and_resets(env, capsys, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_MODE", "ideal")
    args = ["probe", "--all", "--allow-clock-changes", "--clocks", "1410,705", "--no-cache"]
    assert main([*args, "--idle-s", "0.1", "--load-s", "0.1", "--poll-ms", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("GPU ") == 2 and "GPU 1: NVIDIA A100-SXM4-40GB (simulated)" in out
    assert "energy counter: updates at every poll" in out and "power reading: instantaneous" in out
    assert "1410->705" in out and "705->1410" in out and "kept in" not in out
    assert all(g.at_defaults() for g in sim_gpus("a100-sxm", 2))
    assert not (env / "probe").exists()


def test_bad_input_is_a_clear_error(env, capsys):
    assert main(["probe", "--allow-clock-changes", "--clocks", "1410,fast"]) == 1
    assert "--clocks '1410,fast'" in capsys.readouterr().err
    assert main(["probe", "--allow-clock-changes", "--clocks", "1410,1400", *QUICK]) == 1
    assert "1400" in capsys.readouterr().err
    assert main(["probe", "--poll-ms", "0"]) == 1
    assert "poll" in capsys.readouterr().err
    assert main(["probe", "--clocks", "1410,705", *QUICK]) == 1  # would be ignored: read-only
    assert "needs --allow-clock-changes" in capsys.readouterr().err


def test_a_probe_too_short_to_tell_keeps_what_an_earlier_one_measured(env, capsys):
    """0.1 s idle and under load cannot show a counter that steps every 100 ms, nor a reading's
    averaging: the probe says so, and the cache keeps the earlier probe's figures, not nulls."""
    assert main(["probe", *QUICK]) == 0
    before = probe.load(sim_gpus("a100-sxm", 1)[0])
    assert before is not None and before.energy_counter_update_s and before.power_average_window_s
    capsys.readouterr()
    assert main(["probe", "--idle-s", "0.1", "--load-s", "0.1", "--poll-ms", "2"]) == 0
    out = capsys.readouterr().out
    assert "update period unknown (it did not step twice: --idle-s too short)" in out
    assert "refreshed every at" not in out
    assert "energy_counter_update_s" in out and "as probed before" in out
    after = probe.load(sim_gpus("a100-sxm", 1)[0])
    assert after is not None
    assert after.energy_counter_update_s == before.energy_counter_update_s
    assert after.power_average_window_s == before.power_average_window_s
    assert probe.energy_counter_period_s(sim_gpus("a100-sxm", 1)[0]) == before.energy_counter_update_s

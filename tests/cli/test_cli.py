"""The `perseus` CLI on simulated GPUs: as a real subprocess where processes, signals, exit codes
or tracebacks are the point, else in-process through `main(argv)` to keep the file fast.

Slower than a unit test (each subprocess starts Python, and the monitor done-criterion sleeps
for one real second): a few seconds in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from interruptible import default_sigint

from perseus.cli.main import main
from perseus.devices.sim import sim_gpus
from perseus.devices.sim_presets import PRESETS

A100_IDLE_W = PRESETS["a100-sxm"].idle_w
# The longest a loaded machine may keep a process from running between two adjacent reads
# (a clock and an energy counter): far more than it takes, far less than a wrong reading.
STALL_S = 0.1


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100-sxm:2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return dict(os.environ)


def perseus(env, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "perseus.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `perseus ARGS` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse usage errors and --help
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def start(env, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "perseus.cli.main", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )


def test_monitor_json_reports_idle_energy_of_each_gpu(env):
    """The done-criterion: `perseus monitor --json -- sleep 1` reports about 84 J per GPU.

    At least 1 s and 84 J (the command lives that long); how much more depends on how fast a
    loaded machine starts and reaps it. The energy is the idle power over the window, up to
    what a stall between the monitor's clock read and its counter reads shifts (STALL_S)."""
    result = perseus(env, "monitor", "--json", "--", "sleep", "1")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    report = json.loads(line)
    time_s = report["time_s"]
    assert 1.0 <= time_s < 30.0
    assert report["gpu_indices"] == [0, 1]
    assert len(report["gpu_energy_j"]) == 2
    for energy in report["gpu_energy_j"]:
        assert A100_IDLE_W * 1.0 <= energy  # 83.64 J: the GPUs idled through the whole command
        assert energy == pytest.approx(A100_IDLE_W * time_s, abs=A100_IDLE_W * STALL_S)
    assert report["total_energy_j"] == pytest.approx(sum(report["gpu_energy_j"]))
    assert report["average_power_w"] == pytest.approx(report["total_energy_j"] / time_s)
    assert report["average_power_w"] == pytest.approx(2 * A100_IDLE_W, abs=2 * A100_IDLE_W * STALL_S / time_s)
    assert report["exit_code"] == 0


def test_monitor_preserves_the_exit_code_and_prints_a_summary(env):
    result = perseus(env, "monitor", "--gpu-indices", "1", "--", "sh", "-c", "echo hi; exit 3")
    assert result.returncode == 3
    assert result.stdout == "hi\n"  # the command's own output, untouched
    assert "exit code 3" in result.stderr
    assert "GPU 1" in result.stderr and "GPU 0" not in result.stderr
    assert "total" in result.stderr and "average power" in result.stderr
    assert "counters advance in steps" in result.stderr  # a short command: its reading is only so exact


def test_monitor_says_nothing_of_counter_steps_for_a_long_window():
    from perseus.cli.monitor import _short_window_note
    from perseus.measurement import Measurement

    assert _short_window_note(Measurement(10.0, {0: 836.4})) == ""
    assert "counters advance in steps" in _short_window_note(Measurement(0.5, {0: 83.6}))


def test_monitor_needs_a_command_and_reports_a_missing_one(env, capsys):
    code, _, err = cli(capsys, "monitor", "--json")
    assert code == 2
    assert "usage:" in err and "after --" in err
    result = perseus(env, "monitor", "--", "no-such-command-perseus")
    assert result.returncode == 127  # as a shell says it
    assert "command not found: 'no-such-command-perseus'" in result.stderr
    assert "Traceback" not in result.stderr
    result = perseus(env, "monitor", "--json", "--", "no-such-command-perseus")
    out = json.loads(result.stdout)  # a script reading the JSON still gets one object
    assert result.returncode == 127 and out["exit_code"] == 127 and "command not found" in out["error"]
    assert out["command"] == ["no-such-command-perseus"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_monitor_forwards_signals_to_the_command(env, sig):
    proc = start(env, "monitor", "--json", "--", "sh", "-c", "echo ready; exec sleep 30")
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, stderr
    assert json.loads(stdout)["exit_code"] == 128 + sig


def test_info_json_lists_the_gpus(env):
    result = perseus(env, "info", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["backend"] == "sim"
    assert [g["index"] for g in report["gpus"]] == [0, 1]
    gpu = report["gpus"][0]
    assert gpu["name"].startswith("NVIDIA A100-SXM4")
    assert gpu["frequencies_mhz"][0] == 1410 and gpu["frequencies_mhz"][-1] == 210
    assert gpu["power_limit_w"] == 400 and gpu["power_limit_range_w"] == [100, 400]
    assert gpu["energy_counter"] is True
    assert isinstance(gpu["can_change_clocks"], bool)
    assert set(report["cpu"]) >= {"rapl", "packages"}
    assert gpu["simulation"] == {  # the tests' mode (conftest)
        "ideal": True,
        "energy_counter_update_s": 0.0,
        "power_average_window_s": 0.0,
        "clock_switch_latency_s": [0.0],
    }


def test_info_text_and_presets(env, capsys, monkeypatch):
    code, out, err = cli(capsys, "info", "--gpu", "sim:h100-sxm")
    assert code == 0, err
    assert "GPU 0: NVIDIA H100" in out and "345-1980 MHz" in out
    assert "CPU energy (RAPL)" in out
    assert "simulation       ideal" in out  # the tests' mode (conftest); users get the realistic one
    monkeypatch.setenv("PERSEUS_SIM_MODE", "realistic")
    code, out, err = cli(capsys, "info", "--gpu", "sim:a100-sxm")
    assert code == 0, err
    assert "simulation       realistic: energy counter steps every 0.1 s" in out and "take 10-30 ms" in out
    code, out, _ = cli(capsys, "info", "--presets")
    assert code == 0
    assert all(name in out for name in PRESETS)


def test_reset_clears_a_lock_left_behind(env):
    left = sim_gpus("a100-sxm", 2)  # same PERSEUS_SIM_DIR as the subprocess
    left[1].lock_sm_clock(1005)
    left[1].set_power_limit_mw(250_000)
    assert sim_gpus("a100-sxm", 2)[1].sm_clock() == 1005  # visible to a new process's GPUs
    result = perseus(env, "reset")
    assert result.returncode == 0, result.stderr
    assert "GPU 1" in result.stdout and "1005 -> 1410 MHz" in result.stdout
    assert "250 -> 400 W" in result.stdout
    after = sim_gpus("a100-sxm", 2)[1]
    assert after.sm_clock() == 1410
    assert after.power_limit_mw() == 400_000


def test_reset_repairs_a_corrupt_state_file(env, tmp_path, capsys):
    """The sim's unreadable-state error says to run `perseus reset`: it must then succeed."""
    state = tmp_path / "sim" / "a100-sxm-0.json"
    state.parent.mkdir(parents=True)
    state.write_text("{not json")
    code, out, err = cli(capsys, "reset", "--gpu-indices", "0")
    assert code == 0, err
    assert "SM clock unlocked (unreadable -> 1410 MHz)" in out
    assert not state.exists()


def test_power_streams_one_line_per_gpu_per_sample(env, capsys):
    code, out, err = cli(capsys, "power", "--count", "3", "--interval", "0.05")
    assert code == 0, err
    header, *rows = out.strip().splitlines()
    assert header.split() == ["time_s", "gpu", "power_w", "sm_mhz", "limit_w"]
    assert [row.split()[1] for row in rows] == ["0", "1"] * 3
    assert all(float(row.split()[2]) == pytest.approx(A100_IDLE_W, abs=0.1) for row in rows)


def test_power_stops_cleanly_on_ctrl_c(env):
    proc = start(env, "power", "--interval", "0.05")
    assert proc.stdout.readline().split()[0] == "time_s"  # running
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args", [("power", "--interval", "0.01"), ("info", "--presets")])
def test_a_reader_that_leaves_ends_the_command_quietly(env, args):
    """`perseus power | head -1`: output to a closed pipe stops the command without a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "perseus.cli.main", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # before the child can write: its first write fails with EPIPE
    _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert b"Traceback" not in stderr and b"BrokenPipe" not in stderr


def test_bad_spec_is_a_clear_error_without_traceback(env):
    result = perseus(env, "info", "--gpu", "sim:nope")
    assert result.returncode == 1
    assert "unknown simulated GPU preset 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "--gpu", "bogus"], "unknown GPU spec 'bogus'"),
        (["reset", "--gpu-indices", "0,7"], "there is no GPU 7"),
        (["power", "--gpu-indices", "x"], "'x' is not a GPU index"),
        (["power", "--interval", "0"], "--interval must be a positive number"),
    ],
)
def test_bad_input_is_a_clear_error(env, capsys, args, message):
    code, _, err = cli(capsys, *args)
    assert code == 1
    assert err.startswith("perseus: error: ") and message in err


def test_help_lists_the_commands_with_examples(env, capsys):
    _, out, _ = cli(capsys, "--help")
    assert all(name in out for name in ("info", "monitor", "power", "reset"))
    _, out, _ = cli(capsys, "monitor", "--help")
    assert "examples:" in out and "-- CMD" in out

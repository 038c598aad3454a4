"""Clocks go back to default however the training process ends: normally, by an exception, by
SIGTERM/SIGINT, and (through the watchdog process) by SIGKILL. Each test runs a real trainer
subprocess that locks a simulated GPU's clock; about 0.3-0.6 s each (interpreter start-up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from interruptible import default_sigint

from perseus.devices.sim import SimGPU

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    from perseus.controller import FrequencyController
    from perseus.devices.sim import SimGPU

    mode = sys.argv[1]
    if mode == "user-handler":
        def user_handler(signum, frame):
            print("user handler ran", flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, user_handler)
    gpu = SimGPU("a100-sxm", 1)
    controller = FrequencyController(gpu, watchdog=mode == "watchdog")
    assert controller.apply_now(990, timeout=30.0)  # a loaded machine may be slow to run its worker
    assert gpu.sm_clock() == 990
    print("locked", flush=True)
    if mode == "exception":
        raise RuntimeError("training failed")
    if mode == "exit":
        sys.exit(0)
    time.sleep(60)
    """
)


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path))
    return SimGPU("a100-sxm", 1)


def start(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    line = proc.stdout.readline()
    assert line == "locked\n", proc.stderr.read()
    return proc


# How long the watchdog may take to reset on a loaded machine (it reacts at once to its parent's
# death: see perseus.safety.watchdog; how fast is benchmarks/chaos.py's killed_rank_gpu_reset_s).
RESET_DEADLINE_S = 30.0


def wait_for_default(gpu: SimGPU, limit_s: float) -> float:
    """Seconds until the GPU is back at default clocks; fails past `limit_s`."""
    start_t = time.monotonic()
    while gpu.sm_clock() != gpu.max_frequency():
        elapsed = time.monotonic() - start_t
        assert elapsed < limit_s, f"GPU still locked at {gpu.sm_clock()} MHz after {elapsed:.2f} s"
        time.sleep(0.01)
    return time.monotonic() - start_t


@pytest.mark.parametrize("mode", ["exit", "exception"])
def test_reset_on_normal_exit_and_on_exception(gpu, mode):
    proc = start(mode)
    rc = proc.wait(timeout=10)
    assert rc == (0 if mode == "exit" else 1)
    assert gpu.sm_clock() == gpu.max_frequency()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_reset_on_signal_then_default_behaviour(gpu, sig):
    proc = start("plain")
    assert gpu.sm_clock() == 990
    proc.send_signal(sig)
    rc = proc.wait(timeout=10)
    assert gpu.sm_clock() == gpu.max_frequency()
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # still killed by SIGTERM, as without Perseus
    else:
        assert "KeyboardInterrupt" in proc.stderr.read()  # Python's own SIGINT behaviour


def test_sigterm_chains_to_the_users_handler(gpu):
    proc = start("user-handler")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=10)
    assert "user handler ran" in out
    assert proc.returncode == 3
    assert gpu.sm_clock() == gpu.max_frequency()


def test_watchdog_resets_after_sigkill(gpu):
    proc = start("watchdog")
    assert gpu.sm_clock() == 990
    os.kill(proc.pid, signal.SIGKILL)
    wait_for_default(gpu, limit_s=RESET_DEADLINE_S)
    proc.wait(timeout=5)


def test_controller_watchdog_leaves_a_power_limit_it_never_set(gpu):
    gpu.set_power_limit_mw(300_000)  # e.g. an administrator's cap
    proc = start("watchdog")
    os.kill(proc.pid, signal.SIGKILL)
    wait_for_default(gpu, limit_s=RESET_DEADLINE_S)
    proc.wait(timeout=5)
    assert gpu.power_limit_mw() == 300_000
    gpu.reset_power_limit()


def test_watchdog_leaves_clocks_alone_after_a_clean_stop(gpu):
    from perseus.safety import Watchdog

    dog = Watchdog.for_gpus([gpu])
    assert dog is not None
    gpu.lock_sm_clock(1005)  # e.g. someone else's settings after this job finished cleanly
    gpu.set_power_limit_mw(300_000)
    dog.stop()
    assert gpu.sm_clock() == 1005
    assert gpu.power_limit_mw() == 300_000
    gpu.reset_sm_clock()
    gpu.reset_power_limit()

"""The demo's processes: the planner service, the torchrun job, and their simulated GPUs.

`ServiceProcess` runs `perseus serve` on loopback; `start_job` runs torchrun with one
`perseus.demo.worker` per rank (gloo on CPU, rank r on simulated GPU r, whose state lives in a
shared folder); `stop_job` and `wait_for_job` follow it; `throttle` makes a straggler's GPUs
slower and `sim_gpus_at_default` checks every GPU is back at its default clocks afterwards.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from perseus.devices.sim import SimGPU
from perseus.exceptions import PerseusError

PRESET = "a100-sxm"  # the simulated GPU every rank runs on, unless the demo is given another
SERVICE_START_TIMEOUT_S = 60.0


class ServiceProcess:
    """`perseus serve` as a child process on loopback; its log goes to `log_path`."""

    def __init__(self, state_dir: str, log_path: str, port: int | None = None) -> None:
        self.state_dir = state_dir
        self.log_path = log_path
        self.port = port
        self.address: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = SERVICE_START_TIMEOUT_S) -> str:
        """Start the service; returns its address once it listens."""
        bind = f"tcp://127.0.0.1:{self.port or 0}"
        cmd = [sys.executable, "-m", "perseus.cli.main", "serve", "--bind", bind, "--state-dir", self.state_dir]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=child_env())
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while b"\n" not in line:
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                self.stop()
                raise PerseusError(
                    f"the planner service did not start ({'exited' if left > 0 else 'timed out'}); "
                    f"its log:\n{log_tail(self.log_path)}"
                )
            if select.select([self._proc.stdout], [], [], min(left, 0.2))[0]:
                chunk = os.read(self._proc.stdout.fileno(), 4096)
                if not chunk and self._proc.poll() is not None:
                    continue
                line += chunk
        # "perseus serve: listening on tcp://127.0.0.1:PORT"
        self.address = line.decode(errors="replace").strip().split()[-1]
        return self.address

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no last state write. Idempotent; `start` again resumes."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def start_job(
    ranks: int,
    config_path: str,
    sim_dir: str,
    log_path: str,
    max_restarts: int = 0,
    preset: str = PRESET,
    agent_socket: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start torchrun with `ranks` demo workers (in their own process group), output to `log_path`.

    Rank r runs on simulated GPU r (of `preset`), whose state lives in `sim_dir`. With `max_restarts`, torchrun
    restarts the whole group that many times after a rank fails. With `agent_socket`, the ranks change
    clocks through the perseus agent there.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "--max-restarts",
        str(max_restarts),
        "-m",
        "perseus.demo.worker",
        config_path,
    ]
    env = child_env(
        PERSEUS_GPU=f"sim:{preset}:{ranks}",
        PERSEUS_SIM_DIR=sim_dir,
        OMP_NUM_THREADS="1",
        # A restarted group must not share torchrun's rendezvous store: gloo would read the
        # previous attempt's addresses from it and fail to connect (pytorch/pytorch#135712).
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PERSEUS_AGENT=agent_socket or "off",
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop_job(proc: subprocess.Popen[bytes]) -> None:
    """Stop a job `start_job` started, if it still runs: SIGTERM to torchrun (it passes it on,
    and the ranks reset their clocks), then SIGKILL to its process group if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for_job(
    proc: subprocess.Popen[bytes], predicate: Callable[[], Any], what: str, timeout_s: float, log_path: str
) -> Any:
    """Poll `predicate` while the job `proc` runs until it returns something truthy (returned);
    PerseusError with the job's log if the job exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise PerseusError(f"the demo job exited ({proc.returncode}) before {what}; its log:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise PerseusError(f"the demo job ran {timeout_s:g} s without {what}; its log:\n{log_tail(log_path)}")
        time.sleep(0.05)


def sim_gpus_at_default(ranks: int, sim_dir: str, preset: str = PRESET) -> bool:
    """True when every simulated GPU of the job is at its default clocks and power limit."""
    for i in range(ranks):
        gpu = SimGPU(preset, i, state_dir=sim_dir)
        if not gpu.at_defaults():
            return False
    return True


def throttle(gpus: list[int], factor: float, sim_dir: str, preset: str = PRESET) -> None:
    """Make the simulated GPUs `gpus` take `factor` times longer for their work (1.0: undo)."""
    for i in gpus:
        gpu = SimGPU(preset, i, state_dir=sim_dir)
        if factor == 1.0:
            gpu.reset_slowdown()
        else:
            gpu.set_slowdown(factor)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: str, lines: int = 40) -> str:
    """The last `lines` lines of the log at `path`, for an error message."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return "(no log)"

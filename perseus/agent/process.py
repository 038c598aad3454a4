"""`perseus agent` as a child process: what the demo launcher, tests and benchmarks start."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from perseus.exceptions import PerseusError

START_TIMEOUT_S = 60.0


class AgentProcess:
    """One `perseus agent` serving `gpu_spec` on `socket_path`, its log in `log_path`.

    env: extra environment (PERSEUS_SIM_DIR for simulated GPUs); args: more `perseus agent` options;
    prefix: a command that runs it (e.g. `ip netns exec NODE`).
    """

    def __init__(
        self,
        socket_path: str,
        state_path: str,
        gpu_spec: str,
        log_path: str,
        *,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.socket_path = socket_path
        self.state_path = state_path
        self.gpu_spec = gpu_spec
        self.log_path = log_path
        self.env = dict(env or {})
        self.args = args
        self.prefix = prefix
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> AgentProcess:
        """Start it and wait until it serves (its "serving" line); PerseusError with its log if it does not."""
        cmd = [*self.prefix, sys.executable, "-m", "perseus.cli.main", "agent", "--socket", self.socket_path]
        cmd += ["--state-file", self.state_path, "--gpu", self.gpu_spec, *self.args]
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("PERSEUS_AGENT", None)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True)
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or (self._proc.poll() is not None and not line):
                self.stop()
                raise PerseusError(f"the perseus agent did not start; its log:\n{self.log_tail()}")
            if select.select([self._proc.stdout], [], [], min(left, 0.2))[0]:
                chunk = os.read(self._proc.stdout.fileno(), 1)
                if not chunk:
                    self._proc.wait()
                    continue
                line += chunk
        return self

    def wait_until_free(self, timeout_s: float = 10.0) -> bool:
        """Wait until no GPU is leased: every holder gone and its GPUs reset. False on timeout."""
        from perseus.agent.client import AgentClient

        client = AgentClient(self.socket_path)
        deadline = time.monotonic() + timeout_s
        try:
            while any(gpu.holder is not None for gpu in client.status().gpus):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
            return True
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash: no reset, no socket removed. Idempotent."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._close()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (it resets the GPUs still leased), then SIGKILL if it does not exit. Its exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._close()
        return proc.returncode

    def _close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

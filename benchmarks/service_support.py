"""What the service benchmarks share: a real `perseus serve` process on loopback (with its
memory and CPU figures), and stage profiles of the simulated A100-SXM.

Used by benchmarks/service_load.py, service_fuzz.py and service_stateful_fuzz.py (and the CI fuzz tests). The
service runs exactly as an operator starts it (`python -m perseus.cli.main serve`), on a free
loopback port and a throw-away state directory.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from perseus.devices.sim_presets import SimPreset, get_preset
from perseus.devices.sim_work import Work, predict
from perseus.profiler.profile import Profile, ProfilePoint

START_TIMEOUT_S = 60.0  # the full CLI imports every command; on a loaded 2-core machine that takes seconds
PRESET = get_preset("a100-sxm")


def stage_profile(stage: int, pp: int, preset: SimPreset = PRESET) -> Profile:
    """What the rank-side profiler would measure on a simulated A100-SXM (or `preset`): every
    frequency from the highest down to three past the minimum-energy one. Later stages do a little
    more work, and the last stage (the loss) more still, so the planner finds slack to slow the others into."""
    points = {}
    for kind, base_s, intensity in (("forward", 0.010, 1.0), ("backward", 0.020, 0.9)):
        work = Work(base_s * (1.0 + 0.02 * stage + (0.15 if stage == pp - 1 else 0.0)), intensity=intensity)
        rows: list[ProfilePoint] = []
        best, rising = float("inf"), 0
        for f in preset.frequencies:
            time_s, energy_j = predict(preset, work, f)
            rows.append(ProfilePoint(f, time_s, energy_j))
            best, rising = (energy_j, 0) if energy_j < best else (best, rising + 1)
            if rising == 3:
                break
        points[(stage, kind)] = rows
    return Profile(points, preset.idle_w)


class ServeProcess:
    """`perseus serve --bind tcp://127.0.0.1:0 --state-dir STATE`; `endpoint` once started."""

    def __init__(self, state_dir: Path, log_path: Path, *, log_level: str = "warning") -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "perseus.cli.main",
                "serve",
                "--bind",
                "tcp://127.0.0.1:0",
                "--state-dir",
                str(state_dir),
                "--log-level",
                log_level,
            ],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if "listening on" not in line:
            self.stop(signal.SIGKILL)
            raise RuntimeError(
                f"perseus serve did not start within {START_TIMEOUT_S:.0f} s: {line!r}\n{self.log_tail()}"
            )
        self.endpoint = line.split()[-1]
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        if not self._log.closed:  # stop() closes it (a start that failed, too)
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def memory_mb(self) -> tuple[float, float]:
        """(current RSS, peak RSS) in MiB, from /proc/<pid>/status (VmRSS, VmHWM)."""
        values = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024  # kB
        return values["VmRSS"], values["VmHWM"]

    def cpu_s(self) -> float:
        """User + system CPU seconds the service has used (its threads included)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> int | None:
        """Stop the service (SIGTERM, then SIGKILL after `timeout_s`); its exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout_s)
            return self.proc.returncode
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._log.close()

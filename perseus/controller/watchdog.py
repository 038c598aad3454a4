"""A watchdog process that resets a GPU's clocks when the training process dies, even by SIGKILL.

The parent spawns it with subprocess (a fresh interpreter, not a fork) and keeps the write end
of its stdin. The parent's death closes that pipe (EOF); as a second signal the watchdog also
notices being re-parented, in case a forked child of the trainer inherited the pipe. The
watchdog then resets the clocks through the same backend (found by the GPU's UUID) and exits.
A clean shutdown writes "stop" first, so the watchdog exits without touching the GPU.

Started as `python -c <main()> --gpu SPEC --uuid UUID --parent PID` (not `-m`: the package
imports this module, and runpy warns about running an already-imported module).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys

from perseus.devices.gpu import GPU
from perseus.exceptions import DeviceError

logger = logging.getLogger(__name__)

READY = b"ready\n"
STOP = b"stop\n"
POLL_S = 0.1
_ENTRY = "import sys; from perseus.controller.watchdog import main; sys.exit(main())"


def backend_of(gpu: GPU) -> tuple[str, dict[str, str]]:
    """(`get_gpus` spec, extra environment) under which another process finds this GPU."""
    from perseus.devices.sim import SIM_DIR_ENV, SimGPU

    if isinstance(gpu, SimGPU):
        spec = f"sim:{gpu.preset.name}:{gpu.index + 1}"
        return spec, {SIM_DIR_ENV: os.path.dirname(gpu.state_path)}
    return "nvml", {}


class Watchdog:
    """The parent's handle on a running watchdog process."""

    def __init__(self, spec: str, uuid: str, env: dict[str, str] | None = None, ready_timeout_s: float = 30.0) -> None:
        cmd = [sys.executable, "-c", _ENTRY, "--gpu", spec, "--uuid", uuid, "--parent", str(os.getpid())]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # a Ctrl-C to the trainer's terminal must not kill it first
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], ready_timeout_s)
        line = self._proc.stdout.readline() if ready else b""
        if line != READY:
            self._proc.kill()
            self._proc.wait()
            raise DeviceError(
                f"the clock watchdog for GPU {uuid} ({spec}) did not start within {ready_timeout_s:g} s "
                f"(exit code {self._proc.returncode}); see its error above"
            )

    @classmethod
    def for_gpu(cls, gpu: GPU) -> Watchdog | None:
        """Start a watchdog for `gpu`; None (with a warning) if it cannot start."""
        try:
            spec, env = backend_of(gpu)
            return cls(spec, gpu.uuid(), env)
        except Exception as e:  # Perseus must never stop training from starting
            logger.warning("no clock watchdog for %r (%s); a SIGKILLed trainer may leave clocks locked", gpu, e)
            return None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        """Clean shutdown: the watchdog exits without resetting (the parent already did)."""
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(STOP)
            self._proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def watch(gpu: GPU, parent: int) -> int:
    """Block until the parent dies (then reset `gpu`) or says stop. Returns an exit code."""
    fd = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([fd], [], [], POLL_S)
        if readable:
            data = os.read(fd, 64)
            if data.startswith(STOP.strip()):
                return 0
            if data:
                continue
        elif os.getppid() == parent:
            continue
        try:
            gpu.reset_sm_clock()
        except Exception as e:
            print(f"perseus watchdog: resetting {gpu!r} failed: {e}", file=sys.stderr)
            return 1
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perseus-watchdog")
    parser.add_argument("--gpu", required=True, help="backend spec, as for get_gpus")
    parser.add_argument("--uuid", required=True, help="UUID of the GPU to reset")
    parser.add_argument("--parent", required=True, type=int, help="pid of the training process")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from perseus.devices import get_gpus

    matches = [g for g in get_gpus(args.gpu) if g.uuid() == args.uuid]
    if not matches:
        print(f"perseus watchdog: no GPU with UUID {args.uuid} in {args.gpu}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    return watch(matches[0], args.parent)


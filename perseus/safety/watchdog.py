"""A watchdog process that resets GPUs when the training process dies, even by SIGKILL.

The parent spawns it with subprocess (a fresh interpreter, not a fork) and keeps the write end
of its stdin. The parent's death closes that pipe (EOF); as a second signal the watchdog also
notices being re-parented, in case a forked child of the trainer inherited the pipe. The
watchdog then resets the GPUs through the same backend (found by their UUIDs) and exits.
A clean shutdown writes "stop" first, so the watchdog exits without touching the GPUs.

What it resets is what its owner changes: by default both the SM clock and the power limit
(nothing is left locked low); the frequency controller narrows it to SM clocks, so an
administrator's power limit outlives a killed trainer as it outlives a clean exit.

Started as `python -c <main()> --gpu SPEC --uuid UUID... --reset WHAT... --parent PID` (not
`-m`: the package imports this module, and runpy warns about running an already-imported module).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence

from perseus.devices.amd import AMDGPU
from perseus.devices.gpu import GPU
from perseus.devices.select import get_gpus
from perseus.devices.sim import SIM_DIR_ENV, SimGPU
from perseus.exceptions import ConfigError, DeviceError

logger = logging.getLogger(__name__)

READY = b"ready\n"
STOP = b"stop\n"
POLL_S = 0.1
SM_CLOCK = "sm_clock"
POWER_LIMIT = "power_limit"
_ENTRY = "import sys; from perseus.safety.watchdog import main; sys.exit(main())"


def backend_of(gpus: Sequence[GPU]) -> tuple[str, dict[str, str]]:
    """(`get_gpus` spec, extra environment) under which another process finds all of `gpus`."""
    sims = [g for g in gpus if isinstance(g, SimGPU)]
    if not sims:
        amd = [g for g in gpus if isinstance(g, AMDGPU)]
        if amd and len(amd) != len(gpus):
            raise ConfigError(f"one watchdog serves GPUs of one backend; got {list(gpus)}")
        # The watchdog inherits this process's environment, so it sees the same *_VISIBLE_DEVICES.
        return ("amd" if amd else "nvml"), {}
    backends = {(g.preset.name, os.path.dirname(g.state_path)) for g in sims}
    if len(sims) != len(gpus) or len(backends) != 1:
        raise ConfigError(f"one watchdog serves GPUs of one backend, preset and state folder; got {list(gpus)}")
    ((preset, folder),) = backends
    return f"sim:{preset}:{max(g.index for g in sims) + 1}", {SIM_DIR_ENV: folder}


class Watchdog:
    """The parent's handle on a running watchdog process."""

    def __init__(
        self,
        spec: str,
        uuids: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        sm_clock: bool = True,
        power_limit: bool = True,
        ready_timeout_s: float = 30.0,
    ) -> None:
        resets = [name for name, wanted in ((SM_CLOCK, sm_clock), (POWER_LIMIT, power_limit)) if wanted]
        if not uuids or not resets:
            raise ConfigError("a watchdog needs at least one GPU UUID and something to reset (sm_clock, power_limit)")
        cmd = [sys.executable, "-c", _ENTRY, "--gpu", spec, "--parent", str(os.getpid())]
        cmd += [arg for uuid in uuids for arg in ("--uuid", uuid)]
        cmd += [arg for name in resets for arg in ("--reset", name)]
        self.resets = tuple(resets)
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
                f"the watchdog for GPUs {', '.join(uuids)} ({spec}) did not start within {ready_timeout_s:g} s "
                f"(exit code {self._proc.returncode}); see its error above"
            )

    @classmethod
    def for_gpus(cls, gpus: Sequence[GPU], *, sm_clock: bool = True, power_limit: bool = True) -> Watchdog | None:
        """Start one watchdog for `gpus`; None (with a warning) if it cannot start, and None when
        the node's perseus agent resets them all after this process, however it ends."""
        if gpus and all(gpu.agent_restores_on_exit() for gpu in gpus):
            return None
        try:
            spec, env = backend_of(gpus)
            return cls(spec, [g.uuid() for g in gpus], env, sm_clock=sm_clock, power_limit=power_limit)
        except Exception as e:  # Perseus must never stop training from starting
            logger.warning("no watchdog for %r (%s); a SIGKILLed trainer may leave them changed", list(gpus), e)
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


def watch(gpus: Sequence[GPU], resets: Sequence[str], parent: int) -> int:
    """Block until the parent dies (then reset `gpus`) or says stop. Returns an exit code."""
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
        return reset(gpus, resets)


def reset(gpus: Sequence[GPU], resets: Sequence[str]) -> int:
    """Reset each of `resets` on each GPU, each tried even if another fails. Returns an exit code."""
    failed = False
    for gpu in gpus:
        for name in resets:
            try:
                getattr(gpu, f"reset_{name}")()  # reset_sm_clock, reset_power_limit
            except Exception as e:
                print(
                    f"perseus watchdog: resetting the {name.replace('_', ' ')} of {gpu!r} failed: {e}", file=sys.stderr
                )
                failed = True
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="perseus-watchdog")
    parser.add_argument("--gpu", required=True, help="backend spec, as for get_gpus")
    parser.add_argument("--uuid", required=True, action="append", help="UUID of a GPU to reset (repeatable)")
    parser.add_argument("--reset", required=True, action="append", choices=(SM_CLOCK, POWER_LIMIT))
    parser.add_argument("--parent", required=True, type=int, help="pid of the training process")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    by_uuid = {g.uuid(): g for g in get_gpus(args.gpu)}
    missing = [u for u in args.uuid if u not in by_uuid]
    if missing:
        print(f"perseus watchdog: no GPU with UUID {', '.join(missing)} in {args.gpu}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    return watch([by_uuid[u] for u in args.uuid], args.reset, args.parent)

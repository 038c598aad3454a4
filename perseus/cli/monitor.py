"""`perseus monitor -- CMD ARGS`: run a command and report the time and energy it took."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.devices.cpu import RaplCPU, rapl_cpus
from perseus.exceptions import DeviceError, DeviceNotFoundError
from perseus.measurement import Measurement, Monitor
from perseus.metrics.exporter import DEFAULT_HOST as DEFAULT_METRICS_HOST
from perseus.metrics.exporter import MetricsServer, start_metrics_server

EPILOG = """examples:
  perseus monitor -- python train.py --epochs 1
  PERSEUS_GPU=sim:a100-sxm:2 perseus monitor --json -- sleep 1
  perseus monitor --gpu-indices 0,1 -- torchrun --nproc-per-node 2 train.py
  perseus monitor --prometheus-port 9401 -- python train.py
                    the GPUs' energy, power, SM clock and power limit on http://127.0.0.1:9401/metrics
                    while the command runs

The command's exit code becomes perseus' exit code (128+N when signal N killed it; 127 when
the command is not found, 126 when it cannot be executed, as in a shell).
Ctrl-C and SIGTERM are passed on to the command; the energy up to its exit is still reported.
"""


SHORT_WINDOW_S = 2.0  # below this, one counter step (100 ms) is over 5% of the window's energy


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "monitor",
        help="run a command and report its time and energy",
        description="Run CMD, then print its wall time, the energy and average power of each GPU (and CPU "
        "package), the total energy and the average power of all of them together (on stderr, like `time`; "
        "--json prints JSON on stdout instead). "
        "Measures the GPUs (and CPU packages where RAPL is readable) from just before CMD "
        "starts until it exits.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [-h] [--gpu SPEC] [--gpu-indices I,J] [--json] [--prometheus-port PORT] -- CMD [ARGS ...]",
    )
    add_gpu_argument(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (keys time_s, gpu_energy_j as a list in GPU index order, "
        "gpu_indices, cpu_energy_j and dram_energy_j by package (null where unreadable), total_energy_j, "
        "average_power_w, command, exit_code, and error where the command could not start)",
    )
    parser.add_argument(
        "--prometheus-port",
        type=int,
        default=None,
        metavar="PORT",
        help="while CMD runs, serve the GPUs' metrics on http://HOST:PORT/metrics (0: any free port; needs "
        "pip install 'perseus-energy[metrics]')",
    )
    parser.add_argument(
        "--prometheus-host",
        default=DEFAULT_METRICS_HOST,
        metavar="HOST",
        help=f"address the metrics endpoint binds (default {DEFAULT_METRICS_HOST})",
    )
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="CMD", help="the command to run, after --")
    parser.set_defaults(func=run, _parser=parser)


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        args._parser.error("give the command to measure after --, e.g. perseus monitor -- sleep 1")
    monitor = Monitor(gpus=select_gpus(args), cpus=_readable_cpus(), sync=False)
    metrics: MetricsServer | None = None
    try:
        if args.prometheus_port is not None:
            metrics = _serve_metrics(monitor, args.prometheus_port, args.prometheus_host)
        monitor.begin_window("command")
        exit_code, error = _run_forwarding_signals(cmd)
        measurement = monitor.end_window("command", expect_short=True)  # noted below, with the command
    finally:
        if metrics is not None:
            metrics.close()
        monitor.close()
    assert measurement is not None
    if error:
        print(f"perseus monitor: {error}", file=sys.stderr)
    if args.json:
        print(json.dumps({**_as_json(measurement, cmd, exit_code), **({"error": error} if error else {})}))
    elif not error:
        _print_summary(measurement, cmd, exit_code)
    note = _short_window_note(measurement)
    if note and not error:
        print(f"perseus monitor: {note}" if args.json else f"  {note}", file=sys.stderr)
    return exit_code


def _serve_metrics(monitor: Monitor, port: int, host: str) -> MetricsServer:
    from perseus.metrics.collectors import GPUCollector  # needs prometheus-client (ConfigError naming it)

    server = start_metrics_server([GPUCollector(monitor)], port, host)
    print(f"perseus monitor: metrics on {server.url}", file=sys.stderr, flush=True)
    return server


def _readable_cpus() -> list[RaplCPU]:
    """RAPL packages, or none: CPU energy is a bonus here, never a reason not to run the command."""
    try:
        return rapl_cpus()
    except DeviceNotFoundError:
        return []
    except DeviceError as e:
        print(f"perseus monitor: not measuring CPU energy: {e}", file=sys.stderr)
        return []


def _run_forwarding_signals(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` to completion, passing SIGINT and SIGTERM on; its exit code (128+N on signal N)
    and "", or a shell's code (127: not found, 126: not executable) and why it did not start.

    The handlers go in before the command starts, so a signal can never kill perseus and leave
    the command running; one that arrives before the command exists is passed on once it does.
    A Ctrl-C at a terminal already reaches the command (same foreground process group), so
    SIGINT is only forwarded when it cannot have come from our terminal.
    """
    procs: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if signum == signal.SIGINT and _terminal_delivers_sigint():
            return
        if not procs:
            pending.append(signum)
        elif procs[0].poll() is None:
            procs[0].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            procs.append(subprocess.Popen(cmd))
        except FileNotFoundError:
            return 127, f"command not found: {cmd[0]!r} (check its name and $PATH)"
        except PermissionError:
            return 126, f"command not executable: {cmd[0]!r} (chmod +x it, or run it with its interpreter)"
        for signum in pending:
            procs[0].send_signal(signum)
        code = procs[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return (128 - code if code < 0 else code), ""


def _terminal_delivers_sigint() -> bool:
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _as_json(m: Measurement, cmd: list[str], exit_code: int) -> dict[str, Any]:
    indices = sorted(m.gpu_energy_j)
    out = m.to_dict()
    out.update(
        command=cmd,
        exit_code=exit_code,
        gpu_indices=indices,
        gpu_energy_j=[m.gpu_energy_j[i] for i in indices],
    )
    for key in ("cpu_energy_j", "dram_energy_j"):
        if out[key] is not None:
            out[key] = {str(i): e for i, e in sorted(out[key].items())}
    return out


def _print_summary(m: Measurement, cmd: list[str], exit_code: int) -> None:
    """Energy and average power of each device, then their sums; the summed power says what it
    sums (8 GPUs' 2400 W is not one GPU's)."""
    width = 14
    lines = [
        f"perseus monitor: {shlex.join(cmd)} (exit code {exit_code})",
        f"  {'time':<{width}}{m.time_s:12.3f} s",
    ]
    counted = []
    for label, energies in (("GPU", m.gpu_energy_j), ("CPU", m.cpu_energy_j), ("DRAM", m.dram_energy_j)):
        for i, e in sorted((energies or {}).items()):
            average = e / m.time_s if m.time_s > 0 else 0.0
            lines.append(f"  {f'{label} {i}':<{width}}{e:12.1f} J   average {average:8.1f} W")
        if energies:
            counted.append(f"{len(energies)} {label}{'s' if len(energies) != 1 and label != 'DRAM' else ''}")
    what = "all GPUs" if len(counted) == 1 else "sum of " + " + ".join(counted)
    lines.append(f"  {'total':<{width}}{m.total_energy_j:12.1f} J")
    lines.append(f"  {'average power':<{width}}{m.average_power_w:12.1f} W ({what})")
    print("\n".join(lines), file=sys.stderr)


def _short_window_note(m: Measurement) -> str:
    if not m.gpu_energy_j or m.time_s >= SHORT_WINDOW_S:
        return ""
    return (
        f"note: GPU energy counters advance in steps (every 100 ms on many GPUs), so a {m.time_s:.3g} s window "
        "can be off by a step's energy at each end; measure a command that runs for seconds"
    )

"""`perseus power`: stream power readings, one line per GPU per sample, until Ctrl-C."""

from __future__ import annotations

import argparse

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.exceptions import ConfigError

EPILOG = """examples:
  perseus power                         every 0.5 s until Ctrl-C
  perseus power --interval 0.1 --count 20 --gpu-indices 0
  PERSEUS_GPU=sim:a40:2 perseus power --count 3

columns: seconds since start, GPU index, power draw (W), SM clock (MHz), power limit (W)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "power",
        help="stream GPU power readings until Ctrl-C",
        description="Print the power draw of each GPU every INTERVAL seconds until Ctrl-C (or COUNT samples).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gpu_argument(parser)
    parser.add_argument(
        "--interval", type=float, default=0.5, metavar="S", help="seconds between samples (default 0.5)"
    )
    parser.add_argument(
        "--count", type=int, default=None, metavar="N", help="stop after N samples (default: until Ctrl-C)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.interval > 0:
        raise ConfigError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count must be at least 1, got {args.count}")
    gpus = select_gpus(args)
    clock = gpus[0].clock
    start = clock.now()
    try:
        print(f"{'time_s':>9} {'gpu':>4} {'power_w':>9} {'sm_mhz':>7} {'limit_w':>8}", flush=True)
        sample = 0
        while args.count is None or sample < args.count:
            if sample:
                clock.sleep(start + sample * args.interval - clock.now())
            for gpu in gpus:
                line = (
                    f"{clock.now() - start:9.2f} {gpu.index:>4} {gpu.power_mw() / 1000:9.1f} "
                    f"{gpu.sm_clock():>7} {gpu.power_limit_mw() / 1000:8.0f}"
                )
                print(line, flush=True)
            sample += 1
    except KeyboardInterrupt:
        pass
    return 0

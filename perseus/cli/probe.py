"""`perseus probe`: measure how this machine's GPUs really count energy and switch clocks."""

from __future__ import annotations

import argparse
import json

from perseus.cli.common import add_gpu_argument, select_gpus
from perseus.exceptions import ConfigError
from perseus.probe import CACHE_ENV, UNMEASURED_KEEPS, ProbeResult, ProbeSettings, cache_dir, model_key, probe_gpu, save

EPILOG = f"""examples:
  perseus probe                              read-only: counter period, power window, idle power, clocks
  sudo perseus probe --allow-clock-changes   also the clock switching latency (the default clock is restored)
  perseus probe --json
  PERSEUS_GPU=sim:h100-sxm PERSEUS_SIM_MODE=realistic perseus probe

Probes one GPU per model (--all: every selected GPU) and keeps the result per model in
{cache_dir()} (${CACHE_ENV} to change), where the runtime and planner read it. Run it on an idle
GPU: other work on it skews the figures. It takes about --idle-s + --load-s seconds per GPU
(plus about half a second per clock pair with --allow-clock-changes).
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "probe",
        help="measure energy counter period, power averaging, idle power, clock switch latency",
        description="Measure how each GPU model here counts energy and reports power (and, when "
        "allowed, how long a clock change takes), and cache it for Perseus to use.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gpu_argument(parser)
    parser.add_argument("--json", action="store_true", help='print {"gpus": [...]} as JSON')
    parser.add_argument(
        "--allow-clock-changes",
        action="store_true",
        help="lock SM clocks to time switches between them (needs privileges; the default clock is restored)",
    )
    parser.add_argument(
        "--clocks",
        metavar="MHZ,MHZ",
        default=None,
        help="clocks to time switches between (default: top, middle, bottom)",
    )
    parser.add_argument("--all", action="store_true", help="probe every selected GPU, not one per model")
    parser.add_argument("--no-cache", action="store_true", help="do not keep the results")
    defaults = ProbeSettings()
    parser.add_argument(
        "--poll-ms", type=float, default=defaults.poll_s * 1000, help="polling interval (default: %(default)g)"
    )
    parser.add_argument(
        "--idle-s", type=float, default=defaults.idle_s, help="seconds watching the idle GPU (default: %(default)g)"
    )
    parser.add_argument(
        "--load-s", type=float, default=defaults.load_s, help="seconds watching it under load (default: %(default)g)"
    )
    parser.add_argument(
        "--switch-timeout-s",
        type=float,
        default=defaults.switch_timeout_s,
        help="give up on a clock pair after this long (default: %(default)g)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.clocks is not None and not args.allow_clock_changes:
        raise ConfigError(
            "--clocks names the clocks to time switches between, which needs --allow-clock-changes "
            "(it locks SM clocks); add it, or drop --clocks for a read-only probe"
        )
    settings = ProbeSettings(
        poll_s=args.poll_ms / 1000,
        idle_s=args.idle_s,
        load_s=args.load_s,
        switch_clocks_mhz=_clocks(args.clocks),
        switch_timeout_s=args.switch_timeout_s,
    )
    gpus = select_gpus(args)
    if not args.all:
        gpus = list({model_key(g): g for g in reversed(gpus)}.values())[::-1]  # the first GPU of each model
    found = []
    for gpu in gpus:
        result = probe_gpu(gpu, settings, allow_clock_changes=args.allow_clock_changes)
        where = None if args.no_cache else save(result)
        found.append((gpu.index, result))
        if not args.json:
            print(_describe(gpu.index, result, args.allow_clock_changes))
            if where is not None:
                unmeasured = [name for name in UNMEASURED_KEEPS if getattr(result, name) is None]
                kept = f" ({', '.join(unmeasured)}: as probed before, if ever)" if unmeasured else ""
                print(f"  kept in {where}{kept}")
    if args.json:
        print(json.dumps({"gpus": [{"index": i, **r.to_dict()} for i, r in found]}))
    return 0


def _clocks(text: str | None) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--clocks {text!r}: give SM clocks in MHz separated by commas, e.g. 1410,810,210") from None


def _ms(seconds: float | None, unknown: str) -> str:
    return unknown if seconds is None else f"{seconds * 1000:.1f} ms"


def _describe(index: int, r: ProbeResult, clock_changes: bool) -> str:
    lines = [f"GPU {index}: {r.name}"]
    counter = r.energy_counter_update_s
    lines.append(
        "  energy counter: "
        + (
            "updates at every poll"
            if counter == 0
            else "update period unknown (it did not step twice: --idle-s too short)"
            if counter is None
            else f"updates every {_ms(counter, '')}"
        )
    )
    window = r.power_average_window_s
    if window is None:
        power = "averaging not measured (no load could run, or --load-s was too short to see it)"
    elif window == 0:
        power = "instantaneous"
    else:
        power = f"averages the last {_ms(window, '')}"
    refresh = (
        "continuously"
        if r.power_update_s == 0
        else "at an unknown rate (--idle-s too short to see it change twice)"
        if r.power_update_s is None
        else f"every {_ms(r.power_update_s, '')}"
    )
    lines.append(f"  power reading: {power}, refreshed {refresh}")
    lines.append(f"  idle power: {'unknown' if r.idle_power_w is None else f'{r.idle_power_w:.1f} W'}")
    clocks = r.supported_clocks_mhz
    lines.append(
        f"  SM clocks: {len(clocks)}, {clocks[0]} down to {clocks[-1]} MHz" if clocks else "  SM clocks: none reported"
    )
    if r.clock_switch_latency_s:
        pairs = ", ".join(f"{pair} {_ms(s, '')}" for pair, s in r.clock_switch_latency_s.items())
        lines.append(f"  clock switch latency: {pairs}")
    elif not clock_changes:
        lines.append("  clock switch latency: not measured (--allow-clock-changes times it)")
    return "\n".join(lines)

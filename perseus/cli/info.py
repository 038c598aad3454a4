"""`perseus info`: what hardware Perseus sees and what this user may do with it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from perseus.cli.common import add_gpu_argument, backend_name, select_gpus
from perseus.devices.cpu import rapl_cpus
from perseus.devices.gpu import GPU
from perseus.devices.select import gpu_backend
from perseus.devices.sim import SimGPU
from perseus.devices.sim_presets import PRESETS
from perseus.devices.sim_realism import IDEAL
from perseus.exceptions import DeviceError

EPILOG = """examples:
  perseus info                                  real GPUs: NVIDIA through NVML, else AMD through amdsmi
  PERSEUS_GPU=amd perseus info                  AMD GPUs through amdsmi
  PERSEUS_GPU=sim:a100-sxm:4 perseus info       four simulated A100s
  PERSEUS_GPU=sim:mi300x:4 perseus info         four simulated AMD Instinct MI300X
  perseus info --gpu sim:h100-sxm --json        machine-readable
  perseus info --presets                        list the simulated GPU models
"""


PRIVILEGES = {
    "nvml": "needs root or CAP_SYS_ADMIN",
    "amd": "needs root, or write access to amdgpu's sysfs files",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info",
        help="show GPUs, frequencies, power limits and permissions",
        description="Show the GPUs Perseus sees (backend, name, SM frequencies, power limit and "
        "range, energy counter, whether this user may change clocks) and CPU energy (RAPL).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_gpu_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--presets", action="store_true", help="list simulated GPU presets and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.presets:
        return _print_presets(args.json)
    report: dict[str, Any] = {"backend": backend_name(args)}
    code = 0
    try:
        gpus = select_gpus(args)
        if report["backend"] == "auto" and gpus:
            report["backend"] = gpu_backend(gpus)  # what auto-detection found
        report["gpus"] = [_describe(gpu) for gpu in gpus]
    except DeviceError as e:
        report["gpus"], report["gpu_error"] = [], str(e)
        code = 1
    report["cpu"] = _describe_cpus()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return code


def _describe(gpu: GPU) -> dict[str, Any]:
    info: dict[str, Any] = {"index": gpu.index, "name": gpu.name(), "uuid": gpu.uuid()}
    unavailable: dict[str, str] = {}

    def read(key: str, fn: Callable[[], Any]) -> None:
        try:
            info[key] = fn()
        except DeviceError as e:
            info[key] = None
            unavailable[key] = str(e)

    read("frequencies_mhz", gpu.supported_frequencies)
    read("sm_clock_mhz", gpu.sm_clock)
    read("power_w", lambda: gpu.power_mw() / 1000)
    read("power_limit_w", lambda: gpu.power_limit_mw() / 1000)
    read("power_limit_range_w", lambda: [mw / 1000 for mw in gpu.power_limit_range_mw()])
    read("default_power_limit_w", lambda: gpu.default_power_limit_mw() / 1000)
    read("energy_counter", gpu.has_energy_counter)
    read("can_change_clocks", gpu.can_change_clocks)
    if isinstance(gpu, SimGPU):
        info["simulation"] = _simulation(gpu)
    if unavailable:
        info["unavailable"] = unavailable
    return info


def _simulation(gpu: SimGPU) -> dict[str, Any]:
    """How far a simulated GPU behaves like a real one ($PERSEUS_SIM_MODE, perseus.devices.sim_realism)."""
    r = gpu.realism
    clocks = gpu.supported_frequencies()
    switch = sorted({r.switch_latency_for(gpu.preset, f) for f in (clocks[0], clocks[-1])})
    return {
        "ideal": r == IDEAL,
        "energy_counter_update_s": r.counter_period_s,
        "power_average_window_s": r.power_window_s,
        "clock_switch_latency_s": switch,
    }


def _describe_cpus() -> dict[str, Any]:
    try:
        cpus = rapl_cpus()
    except DeviceError as e:
        return {"rapl": False, "reason": str(e), "packages": []}
    return {"rapl": True, "packages": [{"index": c.index, "dram": c.has_dram()} for c in cpus]}


def _print_report(report: dict[str, Any]) -> None:
    gpus = report["gpus"]
    print(f"GPU backend: {report['backend']} ({len(gpus)} GPU{'s' if len(gpus) != 1 else ''})")
    if "gpu_error" in report:
        print(f"  error: {report['gpu_error']}")
    for g in gpus:
        print(f"GPU {g['index']}: {g['name']}  {g['uuid']}")
        freqs = g["frequencies_mhz"]
        if freqs:
            now = _show(g["sm_clock_mhz"], "MHz")
            print(f"  SM frequencies   {freqs[-1]}-{freqs[0]} MHz, {len(freqs)} steps (now {now})")
        else:
            print("  SM frequencies   unavailable")
        low_high = g["power_limit_range_w"]
        limits = f"{low_high[0]:g}-{low_high[1]:g} W" if low_high else "unavailable"
        print(
            f"  power limit      {_show(g['power_limit_w'], 'W')} (range {limits}, "
            f"default {_show(g['default_power_limit_w'], 'W')}); drawing {_show(g['power_w'], 'W')}"
        )
        counter = {True: "yes", False: "no (energy from sampled power)", None: "unknown"}[g["energy_counter"]]
        print(f"  energy counter   {counter}")
        needs = PRIVILEGES.get(report["backend"], "needs privileges")
        may = {True: "yes", False: f"no ({needs})", None: "unknown"}[g["can_change_clocks"]]
        print(f"  may set clocks   {may}")
        sim = g.get("simulation")
        if sim is not None:
            if sim["ideal"]:
                print("  simulation       ideal: exact energy counter and power, clock changes at once")
            else:
                latency = "-".join(f"{1000 * s:g}" for s in sim["clock_switch_latency_s"])
                print(
                    f"  simulation       realistic: energy counter steps every {sim['energy_counter_update_s']:g} s, "
                    f"power averaged over {sim['power_average_window_s']:g} s, clock changes take {latency} ms"
                )
        for key, why in g.get("unavailable", {}).items():
            print(f"  ({key}: {why})")
    cpu = report["cpu"]
    if cpu["rapl"]:
        parts = [f"package {p['index']}{' + DRAM' if p['dram'] else ''}" for p in cpu["packages"]]
        print(f"CPU energy (RAPL): {', '.join(parts)}")
    else:
        print(f"CPU energy (RAPL): {cpu['reason']}")


def _show(value: float | int | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:g} {unit}"


def _print_presets(as_json: bool) -> int:
    if as_json:
        print(json.dumps({name: dataclasses.asdict(p) for name, p in PRESETS.items()}, indent=2))
        return 0
    print(f"{'preset':<12} {'product':<26} {'SM MHz':>10} {'TDP W':>6} {'limit W':>9} {'idle W':>7}")
    for name, p in PRESETS.items():
        print(
            f"{name:<12} {p.product:<26} {p.min_mhz:>4}-{p.max_mhz:<5} {p.tdp_w:>6g} "
            f"{p.min_power_limit_w:>4g}-{p.max_power_limit_w:<4g} {p.idle_w:>7g}"
        )
    print("use: PERSEUS_GPU=sim:PRESET[:COUNT], e.g. PERSEUS_GPU=sim:a100-sxm:4")
    return 0

"""Python overhead of one Monitor window (begin_window + end_window), side by side with zeus.

Prints the median over N windows (default 10,000) of:
  1. Perseus on simulated GPUs (target: under 50 us),
  2. Perseus on the NVML backend over the fake `pynvml` (perseus.testing.fake_nvml),
  3. zeus' ZeusMonitor over the same fake NVML, in the same run, and the ratio Perseus/zeus.
The NVML rows run with sync off on both sides: zeus' torch sync raises on a CPU-only torch,
and NVML GPUs have nothing else to wait for. zeus is optional (`pip install zeus`).

    python benchmarks/monitor_overhead.py [--gpus 4] [--windows 10000]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

from perseus.devices.sim import sim_gpus
from perseus.measurement import Monitor

Window = tuple[Callable[[str], object], Callable[[str], object]]


def median_windows_us(contenders: dict[str, Window], windows: int, rounds: int = 10) -> dict[str, float]:
    """Median time of begin+end per contender, timed in interleaved rounds so that load from
    other processes on a shared machine hits every contender alike."""
    clock = time.perf_counter_ns
    samples: dict[str, list[int]] = {name: [] for name in contenders}
    for begin, end in contenders.values():  # warm caches and lazy lookups
        for _ in range(min(1000, windows)):
            begin("w")
            end("w")
    per_round = max(1, windows // rounds)
    for _ in range(rounds):
        for name, (begin, end) in contenders.items():
            out = samples[name]
            for _ in range(per_round):
                t0 = clock()
                begin("w")
                end("w")
                out.append(clock() - t0)
    return {name: statistics.median(s) / 1000.0 for name, s in samples.items()}


def measure(gpus: int, windows: int) -> tuple[dict[str, float], str | None]:
    from perseus.devices import nvml
    from perseus.testing.fake_nvml import FakeGPU, installed

    sim = Monitor(gpus=sim_gpus("a100-sxm", gpus), cpus=[])
    contenders: dict[str, Window] = {"sim": (sim.begin_window, sim.end_window)}
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    with installed([FakeGPU() for _ in range(gpus)]), warnings.catch_warnings():
        # zeus warns on every window whose integer-mJ counter did not move; the bench only times.
        warnings.simplefilter("ignore")
        ours = Monitor(gpus=nvml.nvml_gpus(), cpus=[], sync=False)
        contenders["nvml"] = (ours.begin_window, ours.end_window)
        try:
            import zeus  # imported here: zeus binds pynvml at import time
        except ImportError:
            return median_windows_us(contenders, windows), None
        logging.getLogger("zeus").setLevel(logging.ERROR)
        from zeus.monitor import ZeusMonitor

        theirs = ZeusMonitor(gpu_indices=list(range(gpus)), cpu_indices=[])
        contenders["zeus"] = (
            lambda key: theirs.begin_window(key, sync_execution=False),
            lambda key: theirs.end_window(key, sync_execution=False),
        )
        return median_windows_us(contenders, windows), f"zeus {zeus.__version__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=4, help="GPUs per monitor (default 4)")
    parser.add_argument("--windows", type=int, default=10_000, help="windows to time (default 10000)")
    args = parser.parse_args()
    os.environ["PERSEUS_SIM_DIR"] = tempfile.mkdtemp(prefix="perseus-bench-")

    result, zeus_version = measure(args.gpus, args.windows)
    sim_us, ours = result["sim"], result["nvml"]
    print(f"Monitor overhead: median of {args.windows} begin_window+end_window, {args.gpus} GPUs")
    print(
        f"  perseus, simulated GPUs         {sim_us:8.1f} us   (target < 50 us: {'met' if sim_us < 50 else 'MISSED'})"
    )
    print(f"  perseus, NVML over fake pynvml  {ours:8.1f} us")
    if zeus_version is None:
        print("  zeus ZeusMonitor                  n/a      (zeus not installed: pip install zeus)")
    else:
        theirs = result["zeus"]
        print(f"  zeus ZeusMonitor, fake pynvml   {theirs:8.1f} us   ({zeus_version})")
        print(f"  ratio perseus/zeus (NVML)       {ours / theirs:8.2f}   (below 1: Perseus is cheaper)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

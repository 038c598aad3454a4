"""Speed and memory of `load_profile` on a large CSV, next to the plain csv module's floor.

Writes a CSV of N rows (default 1,000,000: ten times the loader's MAX_ROWS, which this run lifts
so that the whole file is read), then loads it in fresh interpreters:
  1. csv module: csv.reader and float() on every cell, rows kept as tuples -- no checks at all,
  2. perseus: perseus.profiler.load_profile, every value checked against LIMITS,
and prints rows/s and peak RSS (with the interpreter's own RSS after imports) for each, and the
ratio. With the cap in place a file over MAX_ROWS rows or MAX_BYTES is refused; the last line
times that refusal.

    python benchmarks/profile_load.py [--rows 1000000]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("forward", "backward", "backward_input", "backward_weight")


def write_csv(path: Path, rows: int) -> None:
    """`rows` distinct rows: 250 frequencies per (stage, kind), as many stages as it takes."""
    with path.open("w") as f:
        f.write("stage,instruction,frequency,time,energy\n")
        for i in range(rows):
            stage, kind, freq = i // 1000, KINDS[i // 250 % 4], 1500 - i % 250
            f.write(f"{stage},{kind},{freq},{0.01 + freq * 1e-9!r},{1.5 + freq * 1e-7!r}\n")


def child(mode: str, path: str, lift: bool) -> None:
    import csv

    from perseus.profiler import profile

    base_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if lift:
        profile.MAX_ROWS, profile.MAX_BYTES = 1 << 40, Path(path).stat().st_size  # the read allocates MAX_BYTES
    start = time.perf_counter()
    if mode == "csv":
        with open(path, newline="") as f:
            reader = csv.reader(f)
            next(reader)
            rows = len([(int(s), k, int(q), float(t), float(e)) for s, k, q, t, e in reader])
        outcome = "loaded"
    else:
        try:
            loaded = profile.load_profile(path, 80.0)
            rows, outcome = sum(map(len, loaded.points.values())), "loaded"
        except profile.ProfileError as e:
            rows, outcome = 0, f"refused ({str(e).split(': ', 1)[1].split(';')[0]})"
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": rows, "seconds": seconds, "peak_mb": peak_mb, "base_mb": base_mb, "outcome": outcome}))


def measure(mode: str, path: Path, lift: bool) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(path), "1" if lift else "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2] == "1")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.csv"
        write_csv(path, args.rows)
        print(f"{args.rows} rows, {path.stat().st_size / 2**20:.1f} MiB")
        results = {
            name: measure(mode, path, lift=True) for name, mode in (("csv module", "csv"), ("perseus", "perseus"))
        }
        for name, r in results.items():
            print(
                f"{name:<12} {r['rows'] / r['seconds']:>12,.0f} rows/s  {r['seconds']:6.2f} s  "
                f"peak RSS {r['peak_mb']:6.0f} MB (after imports {r['base_mb']:.0f} MB)"
            )
        floor, ours = results["csv module"], results["perseus"]
        print(
            f"perseus / csv module: {ours['seconds'] / floor['seconds']:.2f}x the time, "
            f"{(ours['peak_mb'] - ours['base_mb']) / (floor['peak_mb'] - floor['base_mb']):.2f}x "
            "the memory above imports"
        )
        capped = measure("perseus", path, lift=False)
        print(
            f"with the limits: {capped['outcome']} in {capped['seconds'] * 1000:.0f} ms, "
            f"peak RSS {capped['peak_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()

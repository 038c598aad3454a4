"""What the frequency controller costs the training thread per instruction (target: <= 20 us).

Prints the median and 99th percentile, over N instructions (default 20,000), of the training
thread's time in one instruction's hook, side by side, in the same run:
  1. a no-op hook (a Python method call: the floor any hook pays),
  2. FrequencyController.before_instruction, plan unchanged from the last instruction (skipped),
  3. FrequencyController.before_instruction, a new clock on every instruction (worst case:
     hand-off to the worker thread, which then locks the simulated GPU),
  4. PerseusRank.on_instruction_begin + on_instruction_end in the planned phase, new clock on
     every instruction (what `perseus.instrument` adds around each torch instruction),
  5. a direct, synchronous lock_sm_clock on the simulated GPU (what the training thread would
     pay without the worker thread),
  6. for scale, the per-iteration boundary (PerseusRank step end + begin: energy read, sync,
     assignment lookup), paid once per iteration, not per instruction,
with each row's ratio to rows 1 and 5, and the mean CPU per instruction of the training thread
and of the process's other threads (for rows 3-4, the controller's worker thread making the
clock change: CPU taken from training threads on a busy host). Timed in interleaved rounds so
load from other processes hits every row alike; on a shared machine the absolute numbers are noisy.

    python benchmarks/controller_overhead.py [--instructions 20000]

Exits 1 if row 4's median exceeds 20 us.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from perseus.controller import FrequencyController
from perseus.devices.sim import SimGPU
from perseus.runtime import PerseusRank
from perseus.schedules import build_schedule

TARGET_US = 20.0
MICROBATCHES = 8


class _Planned:
    """A planner client stand-in that hands out one fixed plan (no service needed here)."""

    def __init__(self, frequencies: list[int]) -> None:
        from perseus.client import Assignment
        from perseus.wire import Phase

        self._assignment = Assignment(Phase.PLANNED, frequencies, None, 1)

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        return None

    def assignment(self, iteration):
        return self._assignment

    def upload_profile(self, *args):
        return None

    def report_iteration(self, *args, **kwargs):
        return None


def alternating(order, freqs: list[int]) -> list[int]:
    return [freqs[i % 2] for i in range(len(order))]


def build(state_dir: str) -> tuple[dict[str, Callable[[], Callable[[], None]]], list]:
    """Each contender: a factory of a per-round step function doing one instruction's hook."""
    schedule = build_schedule("1f1b", 4, MICROBATCHES)
    order = schedule.stages[0]
    keys = [(i.kind.value, i.microbatch, i.chunk) for i in order]
    closers: list = []

    def noop_row():
        class Hook:
            def before_instruction(self, kind, microbatch, chunk=0):
                return None

        hook = Hook()
        it = iter(())

        def step():
            nonlocal it
            k = next(it, None)
            if k is None:
                it = iter(keys)
                k = next(it)
            hook.before_instruction(*k)

        return step

    def controller_row(change: bool):
        gpu = SimGPU("a100-sxm", 1 if change else 2, state_dir=state_dir)
        c = FrequencyController(gpu, handle_signals=False, watchdog=False)
        closers.append(c.close)
        freqs = alternating(order, [1410, 1200]) if change else [1200] * len(order)
        c.set_plan(keys, freqs)
        it = iter(())

        def step():
            nonlocal it
            k = next(it, None)
            if k is None:
                c.begin_iteration()
                it = iter(keys)
                k = next(it)
            c.before_instruction(*k)

        return step

    def rank_row():
        gpu = SimGPU("a100-sxm", 3, state_dir=state_dir)
        r = PerseusRank(
            gpu,
            schedule,
            0,
            client=_Planned(alternating(order, [1410, 1005])),
            progress=False,
            handle_signals=False,
            watchdog=False,
        )
        r._registrar.join(5)
        closers.append(r.close)
        pending: list = []

        def boundary():  # untimed: per iteration, not per instruction (see the boundary row)
            if not pending:
                r.on_step_begin()
                pending.extend(reversed(keys))

        def step():
            k = pending.pop()
            r.on_instruction_begin(*k)
            r.on_instruction_end(*k)

        step.untimed = boundary
        return step

    def boundary_row():
        gpu = SimGPU("a100-sxm", 5, state_dir=state_dir)
        r = PerseusRank(
            gpu,
            schedule,
            0,
            client=_Planned(alternating(order, [1410, 1005])),
            progress=False,
            handle_signals=False,
            watchdog=False,
        )
        r._registrar.join(5)
        closers.append(r.close)

        def untimed():  # one iteration's instructions, so every boundary has real work to close
            for k in keys:
                r.on_instruction_begin(*k)
                r.on_instruction_end(*k)

        def step():
            r.on_step_begin()  # ends the previous iteration too

        step.untimed = untimed
        return step

    def direct_row():
        gpu = SimGPU("a100-sxm", 4, state_dir=state_dir)
        closers.append(gpu.reset_sm_clock)
        freqs = [1410, 1200]
        n = 0

        def step():
            nonlocal n
            n += 1
            gpu.lock_sm_clock(freqs[n % 2])

        return step

    rows = {
        "no-op hook": noop_row,
        "controller, clock unchanged (skipped)": lambda: controller_row(False),
        "controller, new clock every instruction": lambda: controller_row(True),
        "PerseusRank begin+end, planned, new clock each": rank_row,
        "direct synchronous lock_sm_clock (sim GPU)": direct_row,
        "iteration boundary (step end + begin), per iteration": boundary_row,
    }
    return rows, closers


def measure(rows: dict, instructions: int, rounds: int = 20) -> tuple[dict[str, list[int]], dict[str, tuple[int, int]]]:
    """Per row: each instruction's wall time (ns), and (this thread's, other threads') CPU (ns)
    over all its rounds, the worker threads' drain after each round included."""
    clock = time.perf_counter_ns
    steps = {name: make() for name, make in rows.items()}
    for step in steps.values():  # warm up lazy lookups and the worker threads
        for _ in range(200):
            getattr(step, "untimed", lambda: None)()
            step()
    samples: dict[str, list[int]] = {name: [] for name in rows}
    cpu = dict.fromkeys(rows, (0, 0))
    per_round = max(1, instructions // rounds)
    for _ in range(rounds):
        for name, step in steps.items():
            out = samples[name]
            untimed = getattr(step, "untimed", None)
            process0, thread0 = time.process_time_ns(), time.thread_time_ns()
            for _ in range(per_round):
                if untimed is not None:
                    untimed()
                t0 = clock()
                step()
                out.append(clock() - t0)
            time.sleep(0.002)  # let the worker threads drain between rows
            mine = time.thread_time_ns() - thread0
            others = time.process_time_ns() - process0 - mine
            cpu[name] = (cpu[name][0] + mine, cpu[name][1] + others)
    return samples, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instructions", type=int, default=20_000, help="instructions timed per row")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as state_dir:
        os.environ["PERSEUS_SIM_DIR"] = state_dir
        rows, closers = build(state_dir)
        try:
            samples, cpu = measure(rows, args.instructions)
        finally:
            for close in closers:
                close()
    med = {name: statistics.median(s) / 1000 for name, s in samples.items()}
    p99 = {name: sorted(s)[int(0.99 * (len(s) - 1))] / 1000 for name, s in samples.items()}
    noop = med["no-op hook"]
    direct = med["direct synchronous lock_sm_clock (sim GPU)"]
    width = max(map(len, med))
    print(f"Training-thread cost per instruction, {args.instructions} instructions per row (us)")
    header = ("median", "p99", "x no-op", "x direct", "cpu", "bg cpu")
    print(f"{'':{width}}" + "".join(f"  {h:>8}" for h in header))
    for name in med:
        mine, others = (ns / len(samples[name]) / 1000 for ns in cpu[name])
        print(
            f"{name:{width}}  {med[name]:8.2f}  {p99[name]:8.2f}  {med[name] / noop:8.1f}  "
            f"{med[name] / direct:8.3f}  {mine:8.2f}  {others:8.2f}"
        )
    worst = med["PerseusRank begin+end, planned, new clock each"]
    ok = worst <= TARGET_US
    print(
        f"\nPerseusRank per instruction: {worst:.2f} us median (target <= {TARGET_US:g} us): "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

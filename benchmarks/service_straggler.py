"""Straggler re-planning latency of the planner service, for a large pipeline.

    python benchmarks/service_straggler.py [--stages 8] [--microbatches 96] [--dp 2] [--factor 1.2]

A service (in this process, on loopback) plans a job of `dp` pipelines (GPT-3 175B on A100
stage profiles from ../shared/data/perseus-sosp24 when present, else simulated ones, tiled over
the stages; 1F1B). Then an operator declares pipeline dp-1 a straggler and later clears it.
Printed side by side:
  - the first plan (the service builds the planner and solves the no-slowdown plan),
  - the declared straggler: from the request (ranks iterating every millisecond, so the
    figure includes the plan's start lead of a few iterations) until every rank of the other pipelines holds the
    new plan, against a fresh Planner solving the same deadline from scratch (what the service
    would pay without keeping its planner per job), and a kept Planner answering another deadline,
  - the recovery: back to the no-slowdown plan, which the service kept (no solve at all).
Timings are wall-clock and noisy when other processes share the CPUs.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO.parent / "shared" / "data" / "perseus-sosp24" / "stage_profiles" / "gpt3-175b+a100_sxm_bf16.csv"
GPU = "A100-SXM4-40GB"


def stage_profiles(stages: int):
    """{stage: its rows} over `stages` stages: the paper's profile tiled, or a simulated one."""
    from perseus.profiler import Profile, load_profile

    if PROFILE.exists():
        source = load_profile(PROFILE, 83.64)
        print(f"profile: {PROFILE.name}")
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from planner import simulated_profile

        source = simulated_profile("a100-sxm", stages)
        print("profile: simulated A100 (no shared data)")
    have = source.stages()
    return {
        s: Profile(
            {(s, k): source.points[(have[s % len(have)], k)] for k in ("forward", "backward")}, source.blocking_power_w
        )
        for s in range(stages)
    }


def wait_for_version(clients, version: int, iteration: list[int], timeout_s: float = 300.0) -> float:
    """Seconds until every client runs plan `version`, the ranks advancing one iteration per ms."""
    start = time.perf_counter()
    while True:
        iteration[0] += 1
        if all(c.assignment(iteration[0]).plan_version == version for c in clients):
            return time.perf_counter() - start
        if time.perf_counter() - start > timeout_s:
            raise SystemExit(f"plan v{version} did not reach every rank in {timeout_s} s")
        time.sleep(0.001)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=96)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--factor", type=float, default=1.2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import tempfile

    from perseus.client import PlannerClient
    from perseus.planner import Planner
    from perseus.schedules import build_schedule
    from perseus.service import PlannerService
    from perseus.service.planning import merge_profiles
    from perseus.wire import JobSpec, RankInfo

    pp, dp = args.stages, args.dp
    profiles = stage_profiles(pp)
    freqs = sorted({p.frequency for pts in profiles[0].points.values() for p in pts}, reverse=True)
    with tempfile.TemporaryDirectory() as state:
        service = PlannerService("tcp://127.0.0.1:0", state)
        endpoint = service.bind()
        loop = threading.Thread(target=service.serve_forever, daemon=True)
        loop.start()
        spec = JobSpec(
            pp * dp,
            pp,
            dp=dp,
            schedule_name="1f1b",
            num_microbatches=args.microbatches,
            gpu_model=GPU,
            rank_mapping="torch",
        )
        clients = [PlannerClient(endpoint, timeout_s=5.0, poll_interval_s=0.05) for _ in range(pp * dp)]
        try:
            job_id = clients[0].register_job(spec)
            for r, c in enumerate(clients):
                c.register_rank(job_id, RankInfo(r, r % pp, dp_index=r // pp, gpu_model=GPU, frequencies=freqs))
            for s in range(pp):
                clients[s].upload_profile(job_id, s, profiles[s])
            iteration = [0]
            first = wait_for_version(clients, 1, iteration)
            base_time = clients[0].status(job_id).jobs[0].pipelines[0].predicted_iteration_time_s

            others = [c for r, c in enumerate(clients) if r // pp != dp - 1]
            t0 = time.perf_counter()
            assert clients[0].declare_straggler(job_id, dp - 1, args.factor)
            declared = time.perf_counter() - t0 + wait_for_version(others, 2, iteration)

            schedule = build_schedule("1f1b", pp, args.microbatches)
            t0 = time.perf_counter()
            planner = Planner(schedule, merge_profiles(profiles, None))
            planner.plan(deadline=args.factor * base_time)
            fresh = time.perf_counter() - t0
            t0 = time.perf_counter()
            planner.plan(deadline=args.factor * 1.05 * base_time)
            kept = time.perf_counter() - t0

            t0 = time.perf_counter()
            assert clients[0].declare_straggler(job_id, dp - 1, None)
            recovered = time.perf_counter() - t0 + wait_for_version(others, 3, iteration)
        finally:
            for c in clients:
                c.close()
            service.stop()
            loop.join()
            service.close()

    print(f"{pp} stages x {args.microbatches} microbatches, dp {dp}, straggler factor {args.factor}")
    print(f"{'step':<44}{'seconds':>10}")
    print(f"{'first plan (planner built, no slowdown)':<44}{first:>10.3f}")
    print(f"{'declared straggler -> all ranks re-planned':<44}{declared:>10.3f}")
    print(
        f"{'  fresh Planner + plan(deadline), no service':<44}{fresh:>10.3f}   "
        f"ratio service/fresh {declared / fresh:.2f}"
    )
    print(f"{'  kept Planner, another deadline, no service':<44}{kept:>10.3f}")
    print(f"{'recovery -> no-slowdown plan (kept)':<44}{recovered:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

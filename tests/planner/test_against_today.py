"""The planner against the one before issue 15 ("today's", commit TODAY_REF, extracted with git
and run in its own process through benchmarks/planner_child.py, as the benchmark does): never
more energy at any deadline. Skips where the repository's history is not at hand."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark
from test_solver import GPT3, random_profile

from perseus.planner import Planner
from perseus.profiler import load_profile
from perseus.schedules import build_schedule

bench = load_benchmark("planner")
FACTORS = (1.0, 1.05, 1.2)


@pytest.fixture(scope="module")
def today_tree():
    with tempfile.TemporaryDirectory() as scratch:
        tree = None
        try:
            tree = bench.extract_tree(bench.TODAY_REF, Path(scratch))
        except (OSError, subprocess.SubprocessError):
            pass
        if tree is None:
            pytest.skip(f"today's planner (commit {bench.TODAY_REF}) is not in this checkout's history")
        yield tree


def compare(today_tree, schedule, profile) -> None:
    today = bench.run_child(
        today_tree,
        {
            "task": "plans",
            "profile": bench.profile_doc(profile),
            "schedule": [schedule.name, schedule.num_stages, schedule.num_microbatches],
            "factors": list(FACTORS),
        },
        600,
    )
    planner = Planner(schedule, profile)
    blocking = profile.blocking_power_w * schedule.num_stages
    for factor, theirs in zip(FACTORS, today["rows"]):
        deadline = factor * planner.max_frequency_time_s
        plan = planner.plan(deadline=deadline, padded=factor > 1.0)
        ours = planner.evaluator.evaluate(plan.frequencies)
        assert ours.iteration_time_s <= deadline
        energy = ours.energy_j + (blocking * (deadline - ours.iteration_time_s) if factor > 1.0 else 0.0)
        assert energy <= theirs["energy_j"] * (1 + 1e-9), (schedule.name, factor, energy, theirs["energy_j"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,stages,microbatches,seed", [("1f1b", 4, 16, 1), ("1f1b", 4, 16, 2), ("gpipe", 3, 8, 3), ("zb-h1", 3, 8, 4)]
)
def test_never_more_energy_than_today_on_random_dags(today_tree, name, stages, microbatches, seed):
    compare(today_tree, build_schedule(name, stages, microbatches), random_profile(seed, stages, 10))


@pytest.mark.slow
@pytest.mark.skipif(not GPT3.exists(), reason="shared Perseus profiles not present")
def test_never_more_energy_than_today_on_gpt3(today_tree):
    compare(today_tree, build_schedule("1f1b", 8, 12), load_profile(GPT3, 83.64))

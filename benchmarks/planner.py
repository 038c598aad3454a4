"""Planner benchmark: energy savings, gap to the certified bound and planning time, ours side by
side with today's planner (an earlier commit, run from its own tree) and lowtime in one run.

    python benchmarks/planner.py [PROFILES] [--microbatches 12,24,48,96] [--skip-lowtime] [--today REF]

PROFILES is a folder of `MODEL+GPU_bf16.csv` stage profiles (default: ../shared/data/perseus-sosp24/
stage_profiles next to the repo; when absent, profiles generated from the simulated GPU presets).
Two synthetic noisy profiles are added (the GPT-3 A100 one with every point's time and energy
jittered, seeded). For every workload and microbatch count, one row per deadline T' (no
slowdown, 1.05, 1.1, 1.2 x the all-max-frequency time T) with: our time (setup + that plan),
today's, lowtime's (one sweep gives all its deadlines), the energy saving of each and of EnvPipe
and the best uniform clock against every GPU at its maximum clock, and the gap to the certified
bound (ours; today's as it claims it).

Savings at T' are over one iteration that lasts T' (a straggler sets the pace, so a plan that
finishes early blocks until T'): E(plan) + P_block * N * (T' - T(plan)) against the same for the
all-max plan. Past no slowdown ours plans for exactly that objective (`padded=True`); today's
planner plans without the padding, so its claimed gap is against another objective's bound.

Speed (each in a fresh child process, benchmarks/planner_child.py, ours and today's alike, GPT-3
A100 stage profile tiled over the stages, 1F1B): 8 x 96 setup + no-slowdown plan, its 50-point
frontier, a re-plan of the kept planner at a new deadline and the same re-plan inside the service
(the plan made followable at realistic switch latencies); 16 x 256 and 32 x 512 setup + plan
with peak RSS; each no-slowdown plan's CPU time split into LP solves, pair exchanges, rounding,
the exact MILP and the rest (calls in parentheses), and at 8 x 96 the re-plans' and the
frontier's too. Timings are wall-clock on this machine; CPU
contention from other processes inflates them. Every target prints its figure and [ok] or
[miss]; exits 1 if one is missed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILES = REPO.parent / "shared" / "data" / "perseus-sosp24" / "stage_profiles"
BLOCKING_POWER_W = {"a100_sxm": 83.64, "a40": 70.38}
FACTORS = (1.0, 1.05, 1.1, 1.2)
# GPT-3 175B, A100-SXM, 8 stages, 1F1B (Perseus SOSP'24, Table 6 and Figure 7).
PAPER_NO_SLOWDOWN = {12: 15.2, 24: 14.2, 48: 13.6, 96: 13.3}
PAPER_STRAGGLER_96 = 27.0
TARGET_WORKLOAD = "gpt3-175b+a100_sxm"
# The planner before issue 15's work: what "today's" means by default.
TODAY_REF = "34a3ec5"
NOISY_SEEDS = (1, 2)
# Issue 15's targets.
LARGE = ((16, 256, 3.0), (32, 512, 20.0))
LARGE_RSS_MB = 1024
PLAN_8X96_S, FRONTIER_8X96_S, REPLAN_8X96_S = 0.2, 2.0, 0.1
GAP_A100, GAP_NOISY = 0.1, 0.25


@dataclass
class Row:
    workload: str
    microbatches: int
    factor: float
    ours_s: float
    ours: float  # saving %
    gap: float  # %
    met: bool
    lowtime: float | None
    envpipe: float
    uniform: float
    ours_energy: float
    lowtime_energy: float | None
    today_s: float | None = None
    today: float | None = None  # saving %
    today_gap: float | None = None  # % as today's planner claims it
    today_energy: float | None = None


def load_profiles(folder: Path | None, stages: int):
    """{workload name: Profile} from CSV files, or from the simulated presets."""
    from perseus.profiler import load_profile

    if folder is not None and folder.is_dir() and list(folder.glob("*.csv")):
        profiles = {}
        for path in sorted(folder.glob("*.csv")):
            name = path.stem.removesuffix("_bf16")
            gpu = name.split("+")[-1]
            power = BLOCKING_POWER_W.get(gpu)
            if power is None:
                print(f"skipping {path.name}: unknown GPU {gpu!r} (blocking power known for {list(BLOCKING_POWER_W)})")
                continue
            profiles[name] = load_profile(path, power)
        return profiles
    print(f"no profiles at {folder}; generating them from the simulated GPU presets")
    return {f"sim+{preset}": simulated_profile(preset, stages) for preset in ("a100-sxm", "a40")}


def simulated_profile(preset_name: str, stages: int):
    """A pipeline of unequal stages (the last carries the loss head) on a simulated GPU."""
    from perseus.devices.sim_presets import get_preset
    from perseus.devices.sim_work import Work, predict
    from perseus.profiler import Profile, ProfilePoint

    preset = get_preset(preset_name)
    freqs = [f for f in preset.frequencies if f >= preset.max_mhz // 2]
    points = {}
    for s in range(stages):
        forward = 0.050 * (1.0 + 0.04 * ((s * 3) % 5)) * (1.15 if s == stages - 1 else 1.0)
        for kind, work in (
            ("forward", Work(forward, alpha=0.75, intensity=0.9)),
            ("backward", Work(2.0 * forward, alpha=0.8, intensity=1.0)),
        ):
            points[(s, kind)] = [ProfilePoint(f, *predict(preset, work, f)) for f in freqs]
    return Profile(points, preset.idle_w, {"source": f"simulated {preset_name}"})


def noisy_profile(profile, seed: int, time_noise: float = 0.01, energy_noise: float = 0.02):
    """`profile` with every point's time and energy jittered (seeded): measurement noise that
    makes the time-energy curves non-convex and non-monotone, as on the A40."""
    from perseus.profiler import Profile, ProfilePoint

    rng = np.random.default_rng(seed)
    points = {}
    for key, pts in sorted(profile.points.items()):
        jitter_t = rng.uniform(1 - time_noise, 1 + time_noise, len(pts))
        jitter_e = rng.uniform(1 - energy_noise, 1 + energy_noise, len(pts))
        points[key] = [ProfilePoint(p.frequency, p.time * a, p.energy * b) for p, a, b in zip(pts, jitter_t, jitter_e)]
    return Profile(points, profile.blocking_power_w)


def padded(energy: float, time_s: float, deadline: float, power: float, stages: int) -> float:
    """Energy of an iteration stretched to `deadline`: the GPUs block until the straggler ends."""
    return energy + power * stages * (deadline - time_s)


def profile_doc(profile) -> dict:
    """A profile as JSON for benchmarks/planner_child.py."""
    return {
        "blocking_power_w": profile.blocking_power_w,
        "points": [[s, k, [[p.frequency, p.time, p.energy] for p in pts]] for (s, k), pts in profile.points.items()],
    }


def extract_tree(ref: str, into: Path) -> Path | None:
    """The perseus package as of commit `ref` (git archive), for today's planner, with its C
    extension built where that commit has one (else a recent commit's planner runs its Python
    fallback, 3-5x slower: no peer for speed); None if git or the commit is not there."""
    done = subprocess.run(["git", "-C", str(REPO), "archive", ref, "perseus"], capture_output=True)
    if done.returncode != 0:
        print(f"today's planner: cannot extract {ref!r} ({done.stderr.decode().strip()}); running without it")
        return None
    archive = into / "tree.tar"
    archive.write_bytes(done.stdout)
    tree = into / "tree"
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+ refuses unsafe members with it
            tar.extractall(tree, filter="data")
        else:
            tar.extractall(tree)
    setup = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:setup.py"], capture_output=True)
    if setup.returncode == 0 and (tree / "perseus" / "planner" / "_flow.c").exists():
        (tree / "setup.py").write_bytes(setup.stdout)
        built = subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, capture_output=True, text=True
        )
        if built.returncode != 0 or not list((tree / "perseus" / "planner").glob("_flow*.so")):
            print(f"today's planner: its C extension did not build, so it runs in Python:\n{built.stderr[-2000:]}")
    return tree


def run_child(tree: Path, task: dict, timeout_s: float) -> dict | None:
    """Run one planner_child task with `tree` first on sys.path; None if it ran past the timeout."""
    child = Path(__file__).resolve().parent / "planner_child.py"
    try:
        done = subprocess.run(
            [sys.executable, str(child)],
            input=json.dumps(task),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise SystemExit(f"planner child failed ({tree}):\n{done.stderr}")
    return json.loads(done.stdout)


def bench_case(name, profile, stages, microbatches, schedule_name, lowtime_budget, skip_lowtime):
    from perseus.planner import Planner
    from perseus.planner.baselines import envpipe_plan, max_frequency_plan, uniform_plan
    from perseus.schedules import build_schedule

    schedule = build_schedule(schedule_name, stages, microbatches)
    started = time.perf_counter()
    planner = Planner(schedule, profile)
    setup_s = time.perf_counter() - started
    ev = planner.evaluator
    power, n = ev.blocking_power_w, stages
    base = max_frequency_plan(ev)
    run = None
    if not skip_lowtime:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from lowtime_adapter import run_lowtime

        run = run_lowtime(ev, lowtime_budget)
    rows = []
    for factor in FACTORS:
        deadline = base.iteration_time_s * factor
        tick = time.perf_counter()
        plan = planner.plan(deadline=deadline, padded=factor > 1.0)
        ours_s = time.perf_counter() - tick
        evaluation = ev.evaluate(plan.frequencies)

        def saving(energy, t, deadline=deadline):
            return 100.0 * (
                1.0
                - padded(energy, t, deadline, power, n)
                / padded(base.energy_j, base.iteration_time_s, deadline, power, n)
            )

        env = envpipe_plan(ev, deadline)
        uni = uniform_plan(ev, deadline)
        lt = lt_energy = None
        if run is not None and (k := run.best_within(deadline)) is not None:
            lt = saving(run.energies_j[k], run.times_s[k])
            lt_energy = padded(run.energies_j[k], run.times_s[k], deadline, power, n)
        rows.append(
            Row(
                name,
                microbatches,
                factor,
                ours_s,
                saving(evaluation.energy_j, evaluation.iteration_time_s),
                100.0 * plan.gap,
                evaluation.iteration_time_s <= deadline,
                lt,
                saving(env.energy_j, env.iteration_time_s),
                saving(uni.energy_j, uni.iteration_time_s),
                padded(evaluation.energy_j, evaluation.iteration_time_s, deadline, power, n),
                lt_energy,
            )
        )
    return planner, run, setup_s, rows, base


def add_today(rows: list[Row], today: dict, base, power: float, stages: int) -> None:
    """Today's figures for the same deadlines, from its child run."""
    for r, t in zip(rows, today["rows"]):
        deadline = base.iteration_time_s * r.factor
        r.today_s = today["setup_s"] + t["plan_s"]
        # The child pads past 1.0T only; the table pads every row (an iteration of T').
        r.today_energy = (
            t["energy_j"] if r.factor > 1.0 else padded(t["energy_j"], t["time_s"], deadline, power, stages)
        )
        full = padded(base.energy_j, base.iteration_time_s, deadline, power, stages)
        r.today = 100.0 * (1.0 - r.today_energy / full)
        r.today_gap = 100.0 * t["claimed_gap"]


def fmt(x, spec=".2f", none="n/a"):
    return none if x is None else format(x, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profiles", nargs="?", type=Path, default=DEFAULT_PROFILES, help="folder of stage profile CSVs")
    parser.add_argument("--workloads", default="", help="comma-separated workload names to run (default: all)")
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", default="12,24,48,96")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--skip-lowtime", action="store_true", help="do not run lowtime")
    parser.add_argument(
        "--lowtime-microbatches",
        default="12,32",
        help="microbatch counts that also run lowtime (8 x 32 is the speed target)",
    )
    parser.add_argument("--lowtime-budget", type=float, default=600.0, help="seconds of lowtime solver time per case")
    parser.add_argument("--today", default=TODAY_REF, help="commit of today's planner ('none': leave it out)")
    parser.add_argument("--skip-speed", action="store_true", help="leave out the 8x96, 16x256 and 32x512 speed runs")
    parser.add_argument(
        "--large-timeout", type=float, default=900.0, help="seconds a 16x256 or 32x512 child may run before it is cut"
    )
    args = parser.parse_args()

    profiles = load_profiles(args.profiles, args.stages)
    source = TARGET_WORKLOAD if TARGET_WORKLOAD in profiles else next(iter(profiles))
    for seed in NOISY_SEEDS:
        profiles[f"{source}~noisy{seed}"] = noisy_profile(profiles[source], seed)
    if args.workloads:
        wanted = set(args.workloads.split(","))
        profiles = {k: v for k, v in profiles.items() if k in wanted}
    mbs = [int(m) for m in args.microbatches.split(",") if m]
    lowtime_mbs = set() if args.skip_lowtime else {int(m) for m in args.lowtime_microbatches.split(",") if m}
    if not args.skip_lowtime:
        if importlib.util.find_spec("lowtime") is None:
            print("lowtime is not installed (pip install lowtime==0.3.0); running without it")
            lowtime_mbs = set()

    with tempfile.TemporaryDirectory() as scratch:
        today_tree = None if args.today == "none" else extract_tree(args.today, Path(scratch))
        trees = {"ours": REPO} | ({"today": today_tree} if today_tree is not None else {})
        rows = savings_table(args, profiles, mbs, lowtime_mbs, today_tree)
        speed = {} if args.skip_speed else speed_runs(profiles, trees, args.large_timeout)
    print()
    return report_targets(rows, speed)


def savings_table(args, profiles, mbs, lowtime_mbs, today_tree) -> list[Row]:
    rows: list[Row] = []
    header = (
        f"{'workload':<28} {'SxM':>6} {'nodes':>6} {'T_prime':>7} {'ours s':>7} {'today s':>7} {'lowtime s':>9} "
        f"{'ours %':>7} {'today %':>7} {'lowtime %':>9} {'EnvPipe %':>9} {'uniform %':>9} {'gap %':>6} {'today gap':>9}"
    )
    print("Energy saving vs all GPUs at max clock, over an iteration of T' (see docstring); gap to the certified bound")
    print(header)
    print("-" * len(header))
    for name, profile in profiles.items():
        for m in sorted(set(mbs) | (lowtime_mbs & {32} if name == TARGET_WORKLOAD else set())):
            with_lowtime = m in lowtime_mbs and name == TARGET_WORKLOAD
            planner, run, setup_s, case_rows, base = bench_case(
                name, profile, args.stages, m, args.schedule, args.lowtime_budget, not with_lowtime
            )
            if today_tree is not None:
                task = {
                    "task": "plans",
                    "profile": profile_doc(profile),
                    "schedule": [args.schedule, args.stages, m],
                    "factors": list(FACTORS),
                }
                today = run_child(today_tree, task, 3600)
                if today is not None:
                    add_today(case_rows, today, base, planner.evaluator.blocking_power_w, args.stages)
            lt_s = None if run is None else run.solve_time_s
            for r in case_rows:
                lt_note = "" if run is None or run.finished else "*"
                print(
                    f"{name:<28} {args.stages:>3}x{m:<3} {planner.problem.num_nodes:>6} {r.factor:>6.2f}T "
                    f"{setup_s + r.ours_s:>7.2f} {fmt(r.today_s):>7} {fmt(lt_s, '.1f') + lt_note:>9} "
                    f"{r.ours:>7.2f} {fmt(r.today):>7} {fmt(r.lowtime):>9} {r.envpipe:>9.2f} {r.uniform:>9.2f} "
                    f"{r.gap:>6.3f} {fmt(r.today_gap, '.3f'):>9}"
                )
                r.ours_s += setup_s
            rows.extend(case_rows)
    print(
        "(ours s / today s = planner setup + that deadline's plan; lowtime s = one full sweep, * = cut by "
        "--lowtime-budget; today gap = against the unpadded bound past 1.0T)"
    )
    return rows


def speed_runs(profiles, trees: dict, large_timeout: float) -> dict:
    """The speed targets' runs, each in a fresh child, for every tree (ours, today's)."""
    base = profiles.get(TARGET_WORKLOAD) or next(iter(profiles.values()))
    speed: dict = {}
    print()
    for label, tree in trees.items():
        task = {"task": "speed", "profile": profile_doc(base.repeated(8, "tile")), "schedule": ["1f1b", 8, 96]}
        out = run_child(tree, task, 3600)
        assert out is not None
        speed[(label, "8x96")] = out
        print(
            f"{label:>5} 8x96: setup + no-slowdown plan {out['setup_s'] + out['plan_s']:.3f} s (gap "
            f"{100 * out['plan']['claimed_gap']:.3f}%), re-plan at a new deadline {out['replan_s']:.3f} s "
            "(median of 5), "
            f"50-point frontier {out['frontier_s']:.2f} s (largest gap {100 * out['frontier_gap']:.3f}%)"
        )
        if out.get("service_replan_s") is not None:
            print(
                f"{'':>5}   re-plan inside the service (plan_pipeline: the plan made followable at realistic "
                f"A100 switch latencies, 10-30 ms) {out['service_replan_s']:.3f} s (median of 5)"
            )
        print(f"{'':>5}   {phases_line(out)}")
        if "replan_phases" in out:
            print(f"{'':>5}   {phases_line({'phases': out['replan_phases']}, 're-plan CPU (mean of 5)')}")
            print(f"{'':>5}   {phases_line({'phases': out['frontier_phases']}, 'frontier CPU')}")
    for stages, microbatches, _ in LARGE:
        for label, tree in trees.items():
            task = {
                "task": "large",
                "profile": profile_doc(base.repeated(stages, "tile")),
                "schedule": ["1f1b", stages, microbatches],
            }
            tick = time.perf_counter()
            out = run_child(tree, task, large_timeout)
            speed[(label, f"{stages}x{microbatches}")] = out
            if out is None:
                print(f"{label:>5} {stages}x{microbatches}: cut after {time.perf_counter() - tick:.0f} s")
                continue
            print(
                f"{label:>5} {stages}x{microbatches} ({out['nodes']} instructions): setup + no-slowdown plan "
                f"{out['setup_s'] + out['plan_s']:.1f} s (setup {out['setup_s']:.1f} s), "
                f"peak RSS {out['rss_mb']:.0f} MB, "
                f"saving {100 * out['saving']:.2f}%, gap {100 * out['plan']['claimed_gap']:.3f}%"
            )
            print(f"{'':>5}   {phases_line(out)}")
    return speed


def phases_line(out: dict, label: str = "plan CPU") -> str:
    """Where a run's CPU time went (the no-slowdown plan's unless told), from planner_child's
    phase clock."""
    names = {"lp": "LP solves", "exchange": "pair exchanges", "rounding": "rounding", "milp": "exact MILP"}
    phases = out.get("phases", {})
    parts = [f"{label} {phases[key][0]:.2f} s ({phases[key][1]})" for key, label in names.items() if key in phases]
    if "other" in phases:
        parts.append(f"other {phases['other'][0]:.2f} s")
    return f"{label} {phases.get('total', [0.0])[0]:.2f} s: " + ", ".join(parts)


def _side(speed: dict, key: str, figure) -> str:
    today = speed.get(("today", key))
    return "" if ("today", key) not in speed else f" (today's: {'cut' if today is None else figure(today)})"


def report_targets(rows: list[Row], speed: dict) -> int:
    checks: list[tuple[str, bool]] = []
    target = [r for r in rows if r.workload == TARGET_WORKLOAD]
    for r in target:
        if r.factor == 1.0 and r.microbatches in PAPER_NO_SLOWDOWN:
            want = PAPER_NO_SLOWDOWN[r.microbatches]
            checks.append(
                (f"GPT-3 A100 8x{r.microbatches} no-slowdown saving {r.ours:.2f}% >= paper {want}%", r.ours >= want)
            )
        if r.factor == 1.2 and r.microbatches == 96:
            checks.append(
                (
                    f"GPT-3 A100 8x96 saving at T'=1.2T {r.ours:.2f}% >= {PAPER_STRAGGLER_96}%",
                    r.ours >= PAPER_STRAGGLER_96,
                )
            )
    for label, limit, chosen in (
        ("GPT-3 and Bloom A100", GAP_A100, [r for r in rows if "a100" in r.workload and "~" not in r.workload]),
        ("noisy (A40, synthetic)", GAP_NOISY, [r for r in rows if "a40" in r.workload or "~" in r.workload]),
    ):
        if chosen:
            worst = max(chosen, key=lambda r: r.gap)
            today_worst = max((r.today_gap for r in chosen if r.today_gap is not None), default=None)
            checks.append(
                (
                    f"gap <= {limit}% on {label} profiles at all {len(chosen)} deadlines (worst {worst.gap:.3f}% "
                    f"{worst.workload} 8x{worst.microbatches} {worst.factor}T; today's worst claimed "
                    f"{fmt(today_worst, '.3f')}%)",
                    worst.gap <= limit,
                )
            )
    if rows:
        checks.append((f"every one of {len(rows)} plans meets its deadline", all(r.met for r in rows)))
        compared = [r for r in rows if r.today_energy is not None]
        if compared:
            worse = [r for r in compared if r.ours_energy > r.today_energy * (1 + 1e-9)]
            best = max(100 * (1 - r.ours_energy / r.today_energy) for r in compared)
            checks.append(
                (
                    f"energy <= today's at all {len(compared)} deadlines ({len(worse)} worse; up to {best:.2f}% less)",
                    not worse,
                )
            )
        compared = [r for r in rows if r.lowtime_energy is not None]
        if compared:
            bad = [r for r in compared if r.ours_energy > r.lowtime_energy * (1 + 1e-9)]
            checks.append((f"energy <= lowtime's at all {len(compared)} deadlines it reached", not bad))
    if ("ours", "8x96") in speed:
        ours = speed[("ours", "8x96")]
        plan_s = ours["setup_s"] + ours["plan_s"]
        checks.append(
            (
                f"8x96 no-slowdown plan in-process {plan_s:.3f} s <= {PLAN_8X96_S} s"
                + _side(speed, "8x96", lambda t: f"{t['setup_s'] + t['plan_s']:.3f} s"),
                plan_s <= PLAN_8X96_S,
            )
        )
        checks.append(
            (
                f"8x96 50-point frontier {ours['frontier_s']:.2f} s <= {FRONTIER_8X96_S} s"
                + _side(speed, "8x96", lambda t: f"{t['frontier_s']:.2f} s"),
                ours["frontier_s"] <= FRONTIER_8X96_S,
            )
        )
        checks.append(
            (
                f"8x96 warm re-plan (same planner, new deadline) {1000 * ours['replan_s']:.0f} ms <= "
                f"{1000 * REPLAN_8X96_S:.0f} ms" + _side(speed, "8x96", lambda t: f"{1000 * t['replan_s']:.0f} ms"),
                ours["replan_s"] <= REPLAN_8X96_S,
            )
        )
        if ours.get("service_replan_s") is not None:
            checks.append(
                (
                    f"8x96 re-plan inside the service (plan made followable at realistic switch latencies) "
                    f"{1000 * ours['service_replan_s']:.0f} ms <= {1000 * REPLAN_8X96_S:.0f} ms"
                    + _side(
                        speed,
                        "8x96",
                        lambda t: (
                            "n/a" if t.get("service_replan_s") is None else f"{1000 * t['service_replan_s']:.0f} ms"
                        ),
                    ),
                    ours["service_replan_s"] <= REPLAN_8X96_S,
                )
            )
    for stages, microbatches, limit in LARGE:
        key = f"{stages}x{microbatches}"
        if ("ours", key) not in speed:
            continue
        ours = speed[("ours", key)]
        took = None if ours is None else ours["setup_s"] + ours["plan_s"]
        figure = "cut" if took is None else f"{took:.1f} s"
        checks.append(
            (
                f"{key} no-slowdown plan {figure} <= {limit:.0f} s"
                + _side(speed, key, lambda t: f"{t['setup_s'] + t['plan_s']:.1f} s"),
                took is not None and took <= limit,
            )
        )
        if stages == 32:
            rss = None if ours is None else ours["rss_mb"]
            checks.append(
                (
                    f"{key} peak memory {fmt(rss, '.0f')} MB <= {LARGE_RSS_MB} MB"
                    + _side(speed, key, lambda t: f"{t['rss_mb']:.0f} MB"),
                    rss is not None and rss <= LARGE_RSS_MB,
                )
            )
    print("Targets:")
    for text, ok in checks:
        print(f"  [{'ok' if ok else 'miss'}] {text}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

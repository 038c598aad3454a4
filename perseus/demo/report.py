"""The demo's report: the ranks' measurements against the service's prediction, as a result
document (`perseus demo --json`), as text (`format_report`) and as a timeline picture.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from typing import Any

from perseus.atomic import write_bytes_atomic, write_json_atomic
from perseus.demo.results import Iteration, phase_stats, split_phases
from perseus.demo.watch import describe_calibration, describe_verification
from perseus.schedules.instruction import KIND_LETTERS


def summarize(iterations: list[Iteration], status: Any, phases: dict[str, list[Iteration]] | None = None) -> dict:
    """Per-phase figures, the service's prediction (`status`: its JobStatus, or None) against
    the measured saving, how its calibrated model fits the baseline it measured and what its
    verification decided of the plan, what its own measurements say (as `perseus status`
    shows them), and whether the planned clocks ran as assigned. `phases`: the iterations
    split by `split_phases` (default: split here)."""
    phases = split_phases(iterations) if phases is None else phases
    stats = {name: phase_stats(its) for name, its in phases.items()}
    baseline, planned = stats["baseline"], stats["planned"]
    result: dict = {name: (s.to_json() if s else None) for name, s in stats.items()}
    result["iterations_run"] = len(iterations)
    result["profiled"] = bool(phases["profiling"])
    result["measured_saving"] = _saving(baseline, planned)
    result["iteration_time_change"] = (
        (planned.iteration_time_s / baseline.iteration_time_s - 1.0) if baseline and planned else None
    )
    result["predicted_saving"] = status.predicted_saving if status is not None else None
    result["predicted"] = None
    if status is not None and status.predicted_energy_j is not None:
        result["predicted"] = {
            "iteration_time_s": status.predicted_iteration_time_s,
            "energy_j": status.predicted_energy_j,
            "baseline_energy_j": status.predicted_baseline_energy_j,
            "plan_version": status.plan_version,
        }
    result.update(service_fields(status))
    last = phases["planned"][-1] if phases["planned"] else None
    result["plan_frequencies"] = list(last.plans) if last is not None else None
    result["plan_applied"] = plan_applied(phases["planned"])
    result["off_clock_instructions"] = getattr(status, "off_clock_instructions", None)
    return result


def summarize_straggler(
    iterations: list[Iteration], status: Any, stages: int, dp: int, slowdown: float, record: dict | None
) -> dict:
    """A job of `dp` pipelines of `stages` stages, the last one a straggler whose GPUs are
    `slowdown` times slower: per pipeline, its baseline, its intrinsic
    plan (no slowdown) and its straggler-aware plan, measured and predicted. The top-level
    figures are those of the other pipelines together -- the ones Perseus slows to the
    straggler's pace --; `pipelines` lists every pipeline, the straggler included.

    Predictions are the service's plans (`record`: its job record, see `job_record`), each put
    at the straggler's pace T' (the straggler-aware plan's deadline): a plan of time T and
    energy E costs E + P_block x stages x (T' - T) when it waits for the straggler."""
    pp = stages
    slow = dp - 1
    ranks_of = {k: [k * pp + s for s in range(pp)] for k in range(dp)}
    phases = split_phases(iterations, ranks_of[slow])
    predicted = predict_at_pace(record, pp, slow)
    rows = []
    for k, ranks in ranks_of.items():
        stats = {
            name: phase_stats([it.of_ranks(ranks) for it in phases[name]])
            for name in ("baseline", "intrinsic", "planned")
        }
        row: dict = {"pipeline": k, "straggler": k == slow, "slowdown": slowdown if k == slow else 1.0}
        for name, st in stats.items():
            row[name] = (
                None
                if st is None
                else {
                    **st.to_json(),
                    "compute_time_s": statistics.median(it.of_ranks(ranks).compute_time_s() for it in phases[name]),
                }
            )
        row["measured_intrinsic_saving"] = _saving(stats["baseline"], stats["intrinsic"])
        row["measured_saving"] = _saving(stats["baseline"], stats["planned"])
        row.update(predicted.get(k, {"predicted_intrinsic_saving": None, "predicted_saving": None}))
        rows.append(row)

    fast = [r for k in range(dp) if k != slow for r in ranks_of[k]]
    fast_phases = {name: [it.of_ranks(fast) for it in its] for name, its in phases.items()}
    result = summarize(iterations, None, fast_phases)
    for key in ("predicted_intrinsic_saving", "predicted_saving"):
        values = [row[key] for row in rows if not row["straggler"]]
        result[key] = statistics.mean(values) if None not in values else None
    result["measured_intrinsic_saving"] = _saving(
        phase_stats(fast_phases["baseline"]), phase_stats(fast_phases["intrinsic"])
    )
    result.update(service_fields(status))
    result["pipelines"] = rows
    result["saving_scope"] = f"pipelines {', '.join(str(k) for k in range(dp) if k != slow)} (not the straggler)"
    pipeline = status.pipelines[slow] if status is not None and len(status.pipelines) > slow else None
    result["straggler"] = {
        "pipeline": slow,
        "slowdown": slowdown,
        "source": (pipeline.straggler or None) if pipeline is not None else None,  # "detected" or "declared"
        "factor": pipeline.straggler_factor if pipeline is not None else None,  # as the service sees it
        "deadline_s": predicted.get("deadline_s"),
    }
    return result


def predict_at_pace(record: dict | None, stages: int, slow: int) -> dict:
    """Per pipeline (not the straggler): the predicted intrinsic and straggler-aware savings at
    the straggler's pace, from the service's job record; the straggler: its plan's saving."""
    if not record or not record.get("plans") or record.get("blocking_power_w") is None:
        return {}
    plans = {int(k): {**p, **p.get("checks", {})} for k, p in record["plans"].items()}  # a reference: its plan
    block = record["blocking_power_w"] * stages
    paced = [p for k, p in plans.items() if k != slow and p.get("deadline_s") is not None]
    out: dict = {}
    if slow in plans:
        p = plans[slow]
        out[slow] = {
            "predicted_intrinsic_saving": 1 - p["energy_j"] / p["baseline_energy_j"],
            "predicted_saving": 1 - p["energy_j"] / p["baseline_energy_j"],
        }
    base = next((p for p in plans.values() if p.get("deadline_s") is None), None)
    if base is None:
        return out
    pace = max((p["deadline_s"] for p in paced), default=None)
    out["deadline_s"] = pace
    at = (lambda e, t: e + block * (pace - t)) if pace is not None else (lambda e, t: e)
    baseline = at(base["baseline_energy_j"], base["baseline_iteration_time_s"])
    intrinsic = 1 - at(base["energy_j"], base["iteration_time_s"]) / baseline
    for k, p in plans.items():
        if k != slow:
            final = 1 - at(p["energy_j"], p["iteration_time_s"]) / baseline if p.get("deadline_s") is not None else None
            out[k] = {"predicted_intrinsic_saving": intrinsic, "predicted_saving": final}
    return out


def job_record(state_dir: str, job_id: str | None) -> dict | None:
    """The service's saved record of `job_id` (its published plans), with the blocking power per
    GPU its planner used (the job's, else the mean of its stage profiles'); None if missing."""
    if job_id is None:
        return None
    folder = os.path.join(state_dir, "jobs", job_id)
    try:
        with open(os.path.join(folder, "job.json"), encoding="utf-8") as f:
            record = json.load(f)
        powers = []
        for path in sorted(glob.glob(os.path.join(folder, "stage-*.json"))):
            with open(path, encoding="utf-8") as f:
                powers.append(float(json.load(f)["blocking_power_w"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    declared = record.get("spec", {}).get("blocking_power_w")
    record["blocking_power_w"] = declared if declared is not None else (statistics.mean(powers) if powers else None)
    return record


def service_fields(status: Any) -> dict:
    """What the service says of the job (`status`: its JobStatus, or None): the model it fitted
    on the job's own baseline timeline, its verification of each pipeline's plan, and its own
    measurements."""
    return {
        "calibration": [c.to_wire() for c in status.calibrations] if status is not None else [],
        "verification": [p.to_wire() for p in status.pipelines if p.plan_version] if status is not None else [],
        "service": _service_view(status),
    }


def _service_view(status: Any) -> dict | None:
    """The service's own measurements of the job (means over the iterations every rank reported:
    its baseline iterations at default clocks, and those of the current plan), as `perseus
    status` shows them; None without a status."""
    if status is None:
        return None
    return {
        "baseline_iterations": status.baseline_iterations,
        "baseline_iteration_time_s": status.baseline_iteration_time_s,
        "baseline_energy_j": status.baseline_energy_j,
        "planned_iterations": status.planned_iterations,
        "planned_iteration_time_s": status.planned_iteration_time_s,
        "planned_energy_j": status.planned_energy_j,
        "measured_saving": status.measured_saving,
        "withheld": status.saving_withheld,
    }


def _saving(baseline: Any, planned: Any) -> float | None:
    return (1.0 - planned.energy_j / baseline.energy_j) if baseline and planned else None


def plan_applied(planned: list[Iteration]) -> float | None:
    """Fraction of planned instructions whose GPU work ran (mostly) at the clock assigned to it."""
    total = hits = 0
    for it in planned:
        for spans, want in zip(it.spans, it.plans):
            want = want or []
            total += max(len(spans), len(want))
            hits += sum(1 for s, f in zip(spans, want) if s["frequency"] == f)
    return hits / total if total else None


def format_report(result: dict) -> str:
    """The human-readable summary `perseus demo` prints."""
    lines = []
    if result.get("pipelines"):
        lines += _straggler_report(result)
    lines.append(f"{'phase':<10} {'iterations':>10} {'iteration time':>15} {'energy':>16}")
    for name in ("baseline", "profiling", "intrinsic", "planned"):
        if name not in result:
            continue
        s = result.get(name)
        if s:
            lines.append(f"{name:<10} {s['iterations']:>10} {s['iteration_time_s']:>13.3f} s {s['energy_j']:>14.1f} J")
        else:
            lines.append(f"{name:<10} {'-':>10}")
    before, after = result.get("before"), result.get("after")
    if before and after:
        lines.append(
            f"  the baseline on both sides: before Perseus {before['iteration_time_s']:.3f} s "
            f"{before['energy_j']:.1f} J, after it closed {after['iteration_time_s']:.3f} s {after['energy_j']:.1f} J"
        )
    scope = f" of {result['saving_scope']}" if result.get("saving_scope") else ""
    predicted, measured = result.get("predicted_saving"), result.get("measured_saving")
    if predicted is not None and measured is not None:
        ratio = f" ({measured / predicted:.0%} of predicted)" if predicted > 0 else ""
        lines.append(f"energy saving{scope}: predicted {predicted:.1%}, measured {measured:.1%}{ratio}")
    elif measured is not None:
        lines.append(f"energy saving{scope}: measured {measured:.1%} (the service reported no prediction)")
    else:
        lines.append("energy saving: not measured (a phase has no measured iterations)")
    if result.get("iteration_time_change") is not None:
        lines.append(f"iteration time: {result['iteration_time_change']:+.1%} planned against baseline")
    lines += _service_report(result)
    if result.get("plan_applied") is not None:
        lines.append(f"planned clocks applied on time: {result['plan_applied']:.0%} of instructions")
    if result.get("off_clock_instructions") is not None:
        lines.append(
            f"instructions at a clock other than planned (service status): "
            f"{result['off_clock_instructions']:.1f} per iteration"
        )
    if not result.get("profiled"):
        lines.append("profiling: skipped (the state directory held this job's profile)")
    lines.append(f"clocks reset at the end: {'yes' if result['clocks_reset'] else 'NO'}")
    for path in result.get("plots", []):
        lines.append(f"written: {path}")
    lines.append(f"wall time: {result['wall_time_s']:.0f} s")
    return "\n".join(lines)


def _service_report(result: dict) -> list[str]:
    """The service's side: its model's fit on the job's baseline (per stage), its verification of
    each pipeline's plan, and its own measurements of the job."""
    lines = []
    for c in result.get("calibration") or []:
        lines.append(f"calibration ({c['models']}): {describe_calibration(c, reason=False)}")
        if c.get("reason"):
            lines.append(f"  {c['reason']}")
        stages = [
            f"{s['stage']}: {s['model_s']:.4f}/{s['measured_s']:.4f} s ({s['model_s'] / s['measured_s'] - 1:+.2%})"
            for s in c.get("stages") or []
            if s.get("model_s") is not None and s.get("measured_s")
        ]
        if stages:
            lines.append(f"  per stage, model/measured instruction window: {'; '.join(stages)}")
    for p in result.get("verification") or []:
        lines.append(f"verification: {describe_verification(p, reason=False)}")
        if p.get("reason"):
            lines.append(f"  last re-plan: {p['reason']}")
    service = result.get("service")
    if service and service.get("baseline_iteration_time_s") is not None:
        scope = ", every pipeline" if result.get("saving_scope") else ""
        line = (
            f"the service's measurements (perseus status, means{scope}): "
            f"baseline {service['baseline_iteration_time_s']:.3f} s {service['baseline_energy_j']:.1f} J "
            f"({service['baseline_iterations']} iterations)"
        )
        if service.get("planned_iteration_time_s") is not None:
            saving = service.get("measured_saving")
            claimed = f"saving {saving:.1%}" if saving is not None else f"no saving claimed: {service['withheld']}"
            line += (
                f", plan {service['planned_iteration_time_s']:.3f} s {service['planned_energy_j']:.1f} J "
                f"({service['planned_iterations']} iterations), {claimed}"
            )
        lines.append(line)
    return lines


def _straggler_report(result: dict) -> list[str]:
    """Per pipeline: baseline, intrinsic and straggler-aware energy, savings measured (predicted)."""
    straggler = result["straggler"]
    how = {"detected": "detected by the service", "declared": "declared"}.get(straggler["source"] or "", "NOT detected")
    seen = f" at {straggler['factor']:.2f}x" if straggler.get("factor") else ""
    lines = [
        f"straggler: pipeline {straggler['pipeline']} on GPUs {straggler['slowdown']:g}x slower, {how}{seen}",
        f"{'pipeline':<14} {'compute':>8} {'baseline':>10} {'intrinsic plan: saving':>32} "
        f"{'straggler-aware plan: saving':>36}",
    ]

    def cell(row: dict, phase: str, saving: str, predicted: str) -> str:
        if not row.get(phase):
            return "-"
        pred = f" (predicted {row[predicted]:.1%})" if row.get(predicted) is not None else ""
        return f"{row[phase]['energy_j']:.0f} J {row[saving]:.1%}{pred}"

    for row in result["pipelines"]:
        name = f"{row['pipeline']}{' (straggler)' if row['straggler'] else ''}"
        compute = f"{row['baseline']['compute_time_s']:.2f} s" if row.get("baseline") else "-"
        base = f"{row['baseline']['energy_j']:.0f} J" if row.get("baseline") else "-"
        lines.append(
            f"{name:<14} {compute:>8} {base:>10} "
            f"{cell(row, 'intrinsic', 'measured_intrinsic_saving', 'predicted_intrinsic_saving'):>32} "
            f"{cell(row, 'planned', 'measured_saving', 'predicted_saving'):>36}"
        )
    return lines


def write_timeline(panels: list[tuple[str, Iteration]], out_dir: str) -> list[str]:
    """Write `timeline.png` (a Gantt panel per (title, iteration): a box per instruction on its
    rank's row, coloured by the SM clock it ran at) and `timeline.json` (the spans plotted) to
    `out_dir`; returns the paths written."""
    # Deliberately lazy: only --plot needs the planner's plot module, which loads scipy and HiGHS.
    from perseus.planner.plot import Bar, Panel, plot_gantt

    gantt = [
        Panel(
            f"{title}: iteration {it.index}, {it.time_s:.3f} s, {it.energy_j:.0f} J (all GPUs)",
            [
                Bar(rank, s["start"], s["end"], f"{KIND_LETTERS.get(s['kind'], '?')}{s['microbatch']}", s["frequency"])
                for rank, spans in enumerate(it.spans)
                for s in spans
            ],
        )
        for title, it in panels
    ]
    rows = [f"rank {r}" for r in range(len(panels[0][1].spans))]
    os.makedirs(out_dir, exist_ok=True)
    png, data = os.path.join(out_dir, "timeline.png"), os.path.join(out_dir, "timeline.json")
    write_bytes_atomic(png, plot_gantt(gantt, rows, "SM clock (MHz)", "seconds since the iteration started"))
    write_json_atomic(
        data,
        [
            {
                "panel": title,
                "iteration": it.index,
                "time_s": it.time_s,
                "energy_j": it.energy_j,
                "ranks": [list(r) for r in it.spans],
            }
            for title, it in panels
        ],
    )
    return [png, data]


def write_frontier(phases: dict[str, list[Iteration]], status: Any, out_dir: str) -> list[str]:
    """Write `frontier.png`: each phase's measured iterations as (time, energy) points -- the
    profiling sweep's clocks trace the time-energy trade-off, the planned ones sit below it --
    with the plan's predicted point (from `status`, a JobStatus, when the service gave one);
    returns the path written."""
    from perseus.planner.plot import plot_measured  # lazy, as in write_timeline

    groups = {name: [(it.time_s, it.energy_j) for it in its] for name, its in phases.items() if its}
    predictions = {}
    if status is not None and status.predicted_iteration_time_s is not None and status.predicted_energy_j is not None:
        predictions["plan"] = (status.predicted_iteration_time_s, status.predicted_energy_j)
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "frontier.png")
    write_bytes_atomic(png, plot_measured(groups, predictions))
    return [png]

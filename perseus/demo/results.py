"""Demo results: per-rank records in, per-phase iteration time and energy out."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass

from perseus.exceptions import MeasurementError


@dataclass(frozen=True)
class PhaseStats:
    """Medians over a phase's measured iterations (the slowest rank's time, the energy summed
    over ranks): a scheduling stall of one iteration on a busy machine does not sway them."""

    iterations: int
    iteration_time_s: float
    energy_j: float

    def to_json(self) -> dict:
        return {"iterations": self.iterations, "iteration_time_s": self.iteration_time_s, "energy_j": self.energy_j}


@dataclass(frozen=True)
class Iteration:
    """One iteration of the whole job, as every rank measured it."""

    index: int
    phases: tuple[str, ...]  # per rank
    time_s: float  # the slowest rank's window
    energy_j: float  # sum over ranks
    spans: tuple[tuple[dict, ...], ...]  # per rank: instruction spans, times relative to `start`
    start: float
    plans: tuple[list[int] | None, ...] = ()  # per rank: the planned clock of each instruction
    versions: tuple[int | None, ...] = ()  # per rank: the plan version run (None: not planned)
    windows: tuple[tuple[float, float], ...] = ()  # per rank: (time_s, energy_j)

    def of_ranks(self, ranks: list[int]) -> Iteration:
        """This iteration as the ranks `ranks` (one pipeline) measured it."""
        return Iteration(
            index=self.index,
            phases=tuple(self.phases[r] for r in ranks),
            time_s=max(self.windows[r][0] for r in ranks),
            energy_j=sum(self.windows[r][1] for r in ranks),
            spans=tuple(self.spans[r] for r in ranks),
            start=self.start,
            plans=tuple(self.plans[r] for r in ranks),
            versions=tuple(self.versions[r] for r in ranks),
            windows=tuple(self.windows[r] for r in ranks),
        )

    def compute_time_s(self) -> float:
        """From the iteration's start to the end of its last instruction on any rank: the time
        before the gradient synchronization, which a straggler stretches."""
        return max((s["end"] for rank in self.spans for s in rank), default=0.0)

    @property
    def label(self) -> str:
        """The job's phase in this iteration: the phase shared by every rank, else `mixed`."""
        return self.phases[0] if len(set(self.phases)) == 1 else "mixed"


def rank_record_path(out_dir: str, rank: int) -> str:
    """Where rank `rank` of the demo job writes its record (see perseus.demo.worker)."""
    return os.path.join(out_dir, f"rank{rank}.json")


def read_rank_record(out_dir: str, rank: int) -> dict | None:
    """Rank `rank`'s record as it stands (the rank rewrites it every iteration), or None if it
    has written none yet."""
    try:
        with open(rank_record_path(out_dir, rank), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_iterations(out_dir: str, world_size: int) -> list[Iteration]:
    """Join the ranks' records (rank<R>.json in `out_dir`) iteration by iteration."""
    docs = []
    for rank in range(world_size):
        path = rank_record_path(out_dir, rank)
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            raise MeasurementError(
                f"demo rank {rank} left no readable results in {path} ({e}); see its log above"
            ) from e
    count = min(len(d["iterations"]) for d in docs)
    iterations = []
    for i in range(count):
        rows = [d["iterations"][i] for d in docs]
        start = min(r["start"] for r in rows)
        iterations.append(
            Iteration(
                index=i,
                phases=tuple(r["phase"] for r in rows),
                time_s=max(r["end"] - r["start"] for r in rows),
                energy_j=sum(r["energy_j"] for r in rows),
                spans=tuple(
                    tuple({**s, "start": s["start"] - start, "end": s["end"] - start} for s in r["spans"]) for r in rows
                ),
                start=start,
                plans=tuple(r.get("plan") for r in rows),
                versions=tuple(r.get("plan_version") for r in rows),
                windows=tuple((r["end"] - r["start"], r["energy_j"]) for r in rows),
            )
        )
    return iterations


def pipeline_hops(iterations: list[Iteration]) -> list[float]:
    """Every measured pipeline hop that nothing else delayed: from the end of a stage's forward
    (backward) GPU work to the start of the next (previous) stage's work on the same microbatch,
    where the receiving stage sat idle waiting for it. It holds what the planner's model leaves
    out between dependent instructions: the send, the receive, and both ranks' host work."""
    hops = []
    for it in iterations:
        for sender, receiver, kind in [(s, s + 1, "forward") for s in range(len(it.spans) - 1)] + [
            (s + 1, s, "backward") for s in range(len(it.spans) - 1)
        ]:
            sent = {x["microbatch"]: x for x in it.spans[sender] if x["kind"] == kind}
            row = it.spans[receiver]
            for i, x in enumerate(row):
                before = sent.get(x["microbatch"])
                if x["kind"] == kind and before is not None and (i == 0 or row[i - 1]["end"] <= before["end"]):
                    hops.append(x["start"] - before["end"])
    return hops


def instruction_gaps(iterations: list[Iteration]) -> list[float]:
    """Every gap between consecutive instructions on a stage where the next one waited for no
    other stage (its input was in before the previous one ended): host work -- sends, receives,
    the loss, the schedule's bookkeeping -- that the planner's model also leaves out."""
    gaps = []
    for it in iterations:
        last = len(it.spans) - 1
        ends = [{(x["kind"], x["microbatch"]): x["end"] for x in row} for row in it.spans]
        for s, row in enumerate(it.spans):
            for prev, x in zip(row, row[1:]):
                source = s - 1 if x["kind"] == "forward" else s + 1  # the stage its input comes from
                if 0 <= source <= last:
                    ready = ends[source].get((x["kind"], x["microbatch"]))
                    if ready is None or ready > prev["end"]:
                        continue
                gaps.append(x["start"] - prev["end"])
    return gaps


def model_overheads(iterations: list[Iteration], num_stages: int) -> tuple[float, float]:
    """(host gap between a stage's instructions, what a hop takes beyond it), in seconds, from
    the medians of `instruction_gaps` and `pipeline_hops` over the baseline iterations of every
    pipeline (ranks `num_stages * k` onwards); 0.0 where none was measured. What the demo tells
    the planner: a measured hop already holds both ranks' host work, and the sender's
    instruction carries the host gap, so the receiver's adds only the rest."""
    baseline = split_phases(iterations)["baseline"]
    gaps: list[float] = []
    hops: list[float] = []
    pipelines = len(baseline[0].phases) // num_stages if baseline else 0
    for k in range(pipelines):
        ranks = list(range(k * num_stages, (k + 1) * num_stages))
        own = [it.of_ranks(ranks) for it in baseline]
        gaps += instruction_gaps(own)
        hops += pipeline_hops(own)
    gap = statistics.median(gaps) if gaps else 0.0
    return gap, (max(0.0, statistics.median(hops) - gap) if hops else 0.0)


def gloo_latency(out_dir: str, world_size: int) -> float | None:
    """The median over ranks of the measured one-way gloo latency to the next stage (see
    perseus.demo.worker.gloo_latency), or None if no rank measured one."""
    docs = (read_rank_record(out_dir, rank) for rank in range(world_size))
    values = [doc["gloo_latency_s"] for doc in docs if doc and doc.get("gloo_latency_s") is not None]
    return statistics.median(values) if values else None


def split_phases(iterations: list[Iteration], straggler_ranks: list[int] | None = None) -> dict[str, list[Iteration]]:
    """The measured iterations of each phase.

    baseline: before Perseus, at maximum clocks, without the first iteration (it warms up the
    pipeline). profiling: any rank sweeping clocks. planned: every rank running the plan,
    without the first such iteration (the switch). With a straggler pipeline (its ranks
    `straggler_ranks`), planned iterations split in two, each without its switch: `intrinsic`,
    every rank on the first plan (no slowdown), and `planned`, every other rank on a later plan
    (the straggler-aware one).
    """
    out: dict[str, list[Iteration]] = {"baseline": [], "profiling": [], "planned": []}
    planned = []
    for it in iterations:
        phases = set(it.phases)
        if phases == {"baseline"} and it.index > 0:
            out["baseline"].append(it)
        elif "profiling" in phases:
            out["profiling"].append(it)
        elif phases == {"planned"}:
            planned.append(it)
    if straggler_ranks is None:
        out["planned"] = planned[1:]
        return out
    first = min((v for it in planned for v in it.versions if v is not None), default=None)
    others = [r for r in range(len(iterations[0].phases)) if r not in straggler_ranks] if iterations else []
    intrinsic = [it for it in planned if set(it.versions) == {first}]
    final = [it for it in planned if all(it.versions[r] != first for r in others)]
    out["intrinsic"], out["planned"] = intrinsic[1:], final[1:]
    return out


def phase_stats(iterations: list[Iteration]) -> PhaseStats | None:
    if not iterations:
        return None
    return PhaseStats(
        len(iterations),
        statistics.median(i.time_s for i in iterations),
        statistics.median(i.energy_j for i in iterations),
    )


def median_iteration(iterations: list[Iteration]) -> Iteration:
    """The iteration of median time: the one a timeline plot shows as typical."""
    ordered = sorted(iterations, key=lambda i: i.time_s)
    return ordered[(len(ordered) - 1) // 2]

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
    """Where rank `rank` of the demo job writes its record (see perseus.demo.worker): JSON lines,
    the rank's details (a line with "rank"; a later one updates them) and one line per iteration,
    appended as it ends -- rewriting the whole record every iteration would cost more host time
    in every iteration than in the one before, tilting later phases against earlier ones."""
    return os.path.join(out_dir, f"rank{rank}.jsonl")


def verdicts_path(out_dir: str) -> str:
    """Where the launcher writes, per pipeline, the plan version the service's verification has
    decided on (see perseus.demo.watch); the ranks read it to know when to stop."""
    return os.path.join(out_dir, "verified.json")


def read_verdicts(out_dir: str) -> dict[int, int]:
    """{pipeline: plan version verified (held, or fallen back to maximum clocks)}; empty until written."""
    try:
        with open(verdicts_path(out_dir), encoding="utf-8") as f:
            return {int(k): int(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def read_rank_record(out_dir: str, rank: int) -> dict | None:
    """Rank `rank`'s record as it stands: its details and `iterations`, the iterations it has
    finished (a line it is still writing left out); None if it has written none yet."""
    try:
        with open(rank_record_path(out_dir, rank), encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError:
        return None
    doc: dict | None = None
    iterations = []
    for line in lines[:-1]:  # the last is "" or a line being written
        try:
            entry = json.loads(line)
        except ValueError:
            return None
        if "rank" in entry:
            doc = {**(doc or {}), **entry}
        else:
            iterations.append(entry)
    return None if doc is None else {**doc, "iterations": iterations}


def load_iterations(out_dir: str, world_size: int) -> list[Iteration]:
    """Join the ranks' records (see `rank_record_path`) iteration by iteration."""
    docs = []
    for rank in range(world_size):
        doc = read_rank_record(out_dir, rank)
        if doc is None:
            raise MeasurementError(
                f"demo rank {rank} left no readable results in {rank_record_path(out_dir, rank)}; see its log above"
            )
        docs.append(doc)
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


def split_phases(iterations: list[Iteration], straggler_ranks: list[int] | None = None) -> dict[str, list[Iteration]]:
    """The measured iterations of each phase.

    baseline: without Perseus, at maximum clocks: `before` it attached and `after` it closed,
    each without its first iteration (it warms up the pipeline, or the clocks' reset lands in
    it); either side alone would let a machine's changing load tilt the comparison. profiling:
    any rank sweeping clocks. planned: every rank running the last plan (a plan the service's
    verification replaced is not what the job runs), without the first such iteration (the
    switch). With a straggler pipeline (its ranks `straggler_ranks`), planned iterations split
    in two, each without its switch: `intrinsic`, every rank on the first plan (no slowdown),
    and `planned`, every other rank on a later plan (the straggler-aware one).
    """
    out: dict[str, list[Iteration]] = {"baseline": [], "profiling": [], "planned": []}
    planned = []
    sides: dict[str, list[Iteration]] = {"baseline": [], "after": []}
    for it in iterations:
        phases = set(it.phases)
        if len(phases) == 1 and phases <= sides.keys():
            sides[it.phases[0]].append(it)
        elif "profiling" in phases:
            out["profiling"].append(it)
        elif phases == {"planned"}:
            planned.append(it)
    out["before"], out["after"] = sides["baseline"][1:], sides["after"][1:]
    out["baseline"] = out["before"] + out["after"]
    if straggler_ranks is None:
        last = planned[-1].versions if planned else ()
        out["planned"] = [it for it in planned if it.versions == last][1:]
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

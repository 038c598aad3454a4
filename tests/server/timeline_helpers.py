"""A pipeline simulated with host gaps and stage-to-stage hops, and its timelines as ranks send
them: what the calibration and verification tests feed the service."""

from __future__ import annotations

import random

import networkx as nx
from server_helpers import FREQUENCIES, rank_info, wait_until

from perseus.planner.dag import build_dag
from perseus.profiler.profile import Profile, ProfilePoint
from perseus.schedules import Schedule
from perseus.service.timelines import Timeline
from perseus.wire.spans import ReportSpans

BLOCKING_W = 83.64
GAP_S = 0.0006  # host work between a stage's instructions
HOP_S = 0.0009  # a stage-to-stage hop, sender's end to receiver's begin
STAGES = 4


def profile(num_virtual: int, work_s: float = 0.006) -> Profile:
    """Forward `work_s`, backward twice that (each half for zero bubble), later ranks 25% heavier."""
    points = {}
    for v in range(num_virtual):
        scale = 1.25 if v % STAGES >= STAGES // 2 else 1.0
        for kind, base in (("forward", 1.0), ("backward", 2.0), ("backward_input", 1.0), ("backward_weight", 1.0)):
            pts = []
            for f in FREQUENCIES:
                time_s = max(work_s * base * scale * (0.78 * 1410 / f + 0.22), 2e-5)
                power_w = 90.0 + 310.0 * (f / 1410) ** 2.5
                pts.append(ProfilePoint(f, time_s, power_w * time_s))
            points[(v, kind)] = pts
    return Profile(points, BLOCKING_W)


def simulate(
    schedule: Schedule, prof: Profile, frequencies: dict | None = None, host_s: float = 0.0, gap_s: float = GAP_S
):
    """(begin, end) of every instruction in one timeline: each waits `gap_s` after its rank's
    previous instruction and HOP_S after an input from another rank; spans take the profile's
    time at their clock (the highest by default) plus `host_s` of host work inside them."""
    graph = build_dag(schedule)
    previous = {b: a for row in schedule.stages for a, b in zip(row, row[1:])}
    begin, end = {}, {}
    for ins in nx.topological_sort(graph):
        start = begin_floor = gap_s if ins not in previous else end[previous[ins]] + gap_s
        for pred in graph.predecessors(ins):
            if pred.stage != ins.stage:
                start = max(start, end[pred] + HOP_S)
            elif pred is not previous.get(ins):
                start = max(start, end[pred] + gap_s)
        start = max(start, begin_floor)
        f = FREQUENCIES[0] if frequencies is None else frequencies[ins]
        begin[ins] = start
        end[ins] = start + prof.lookup(prof.stage_for(ins, schedule), ins.kind, f).time + host_s
    return begin, end


def timelines(schedule: Schedule, prof: Profile, count: int = 8, seed: int = 0, gap_s: float = GAP_S) -> list[Timeline]:
    """Baseline iterations as ranks send them: each rank's times from its own step start (the
    ranks start together, give or take a random skew no other rank sees), with noise; `gap_s`:
    the host work between a stage's instructions (a busier host: longer)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        begin, end = simulate(schedule, prof, host_s=0.0001, gap_s=gap_s)
        begins, ends, steps = [], [], []
        for row in schedule.stages:
            start = -0.0005 - rng.uniform(0.0, 0.0003)
            jitter = [rng.gauss(0, 0.00005) for _ in row]
            begins.append(tuple(begin[i] - start + j for i, j in zip(row, jitter)))
            ends.append(tuple(end[i] - start + j for i, j in zip(row, jitter)))
            steps.append(ends[-1][-1] + 0.0005)
        out.append(Timeline(tuple(begins), tuple(ends), tuple(steps)))
    return out


def spans(job_id: str, rank: int, iteration: int, timeline: Timeline) -> ReportSpans:
    """Rank `rank`'s report of one baseline iteration (default clocks, phase planning)."""
    return ReportSpans(
        job_id,
        rank,
        iteration,
        "planning",
        None,
        round(timeline.steps[rank] * 1e6),
        tuple(round(t * 1e6) for t in timeline.begins[rank]),
        tuple(round(t * 1e6) for t in timeline.ends[rank]),
    )


def register_profiled(served, clients, spec) -> tuple[str, Profile]:
    """Register `spec` with one client per stage (ranks that send timelines), wait until the service
    asks for spans, and upload each stage's share of `profile(STAGES)`: (job id, the profile)."""
    job_id = clients[0].register_job(spec)
    for r, client in enumerate(clients):
        client.register_rank(job_id, rank_info(r, timeline=True))
    wait_until(lambda: all(c.assignment(0).spans for c in clients))  # the service asks for spans
    prof = profile(STAGES)
    for r, client in enumerate(clients):
        client.upload_profile(job_id, r, Profile({k: v for k, v in prof.points.items() if k[0] == r}, BLOCKING_W))
    wait_until(lambda: served.log().count("profiled on") >= STAGES)
    return job_id, prof


def send_baseline(clients, job_id: str, schedule: Schedule, prof: Profile, count: int) -> None:
    """`count` baseline iterations (from iteration 1): every rank's spans and its iteration report."""
    for it, timeline in enumerate(timelines(schedule, prof, count=count), start=1):
        for r, client in enumerate(clients):
            client.report_spans(spans(job_id, r, it, timeline))
            client.report_iteration(job_id, r, it, timeline.steps[r], 100.0, compute_time_s=timeline.compute_s)

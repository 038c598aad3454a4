"""A rank whose profile could not be built at the end of its sweep: it says so at ERROR, keeps
training at default clocks, and sweeps afresh when the service asks a later sweep round (the
client's RankState follows it even after an upload); the same round never sweeps twice.
Simulated GPU on a virtual clock; the tables are the service's, applied by hand."""

from __future__ import annotations

import dataclasses
import io
import logging

import pytest
from test_rank import make_rank, run

from perseus.client.assignments import RankState
from perseus.clock import VirtualClock
from perseus.devices.sim import SimGPU
from perseus.exceptions import ProfileError
from perseus.profiler.online import OnlineProfiler
from perseus.runtime import ProfilingSettings
from perseus.runtime.progress import Progress
from perseus.service.sweep import design_steps
from perseus.wire.messages import Table
from perseus.wire.phases import Phase
from perseus.wire.spec import RankInfo

FREQUENCIES = (1410, 1110, 810)
SETTINGS = ProfilingSettings(warmup_iterations=1, iterations_per_frequency=2, frequencies=FREQUENCIES)


def table(sweep_round: int, profiled: tuple[int, ...] = ()) -> Table:
    return Table(
        phase="profiling",
        warmup_iterations=SETTINGS.warmup_iterations,
        iterations_per_frequency=SETTINGS.iterations_per_frequency,
        sweep_frequencies=FREQUENCIES,
        profiled_stages=profiled,
        plan_version=0,
        plan_start_iteration=0,
        frequencies=None,
        sweep_steps=() if 1 in profiled else design_steps(FREQUENCIES, SETTINGS.iterations_per_frequency),
        sweep_round=sweep_round,
    )


class TableClient:
    """The planner client's rank side (RankState) fed tables by the test, counting uploads."""

    def __init__(self) -> None:
        self.state = RankState()
        self.uploads: list[object] = []

    def register_job(self, spec):
        return spec.job_id()

    def register_rank(self, job_id, info):
        self.state.job_id, self.state.info = job_id, info

    def assignment(self, iteration):
        return self.state.assignment(iteration)

    def upload_profile(self, job_id, stage, profile):
        self.state.offered()
        self.uploads.append(profile)

    def report_iteration(self, *args, **kwargs):
        pass

    def report_spans(self, spans):
        pass


@pytest.fixture
def gpu(tmp_path):
    return SimGPU("a100-sxm", 1, clock=VirtualClock(), state_dir=str(tmp_path))


def sweep_until_over(rank, gpu, limit: int = 40) -> int:
    """Iterations run until the rank's sweep is over."""
    for n in range(1, limit + 1):
        run(rank, gpu)
        if rank.sweep.done:
            return n
    raise AssertionError(f"the sweep did not end in {limit} iterations")


def test_a_failed_profile_is_an_error_and_a_later_round_sweeps_afresh(gpu, monkeypatch, caplog):
    client = TableClient()
    rank = make_rank(gpu, client, profiling=SETTINGS)
    real_profile = OnlineProfiler.profile
    failures = iter([ProfileError("stage 1: no clock was profiled for every instruction kind; profile longer")])

    def profile_once_failing(self):
        for error in failures:
            raise error
        return real_profile(self)

    monkeypatch.setattr(OnlineProfiler, "profile", profile_once_failing)
    client.state.apply_table(table(0))
    try:
        with caplog.at_level(logging.INFO):
            sweep_until_over(rank, gpu)
            assert client.uploads == []
            assert "stage 1 could not build its profile at the end of its sweep" in caplog.text
            assert any(r.levelno == logging.ERROR for r in caplog.records)
            run(rank, gpu, 3)  # training goes on at default clocks: the same round does not sweep again
            assert rank.phase is Phase.PROFILING and rank.last_iteration.frequency is None
            assert rank.sweep.done and client.uploads == []

            client.state.apply_table(table(1))  # the service's overdue rule asks for a fresh sweep
            sweep_until_over(rank, gpu)
            assert len(client.uploads) == 1 and "asks stage 1 to profile again (sweep round 1)" in caplog.text
            assert client.state.assignment(rank.iteration).phase is Phase.PLANNING  # offered in round 1

            client.state.apply_table(table(1))
            run(rank, gpu, 3)
            assert len(client.uploads) == 1  # round 1's profile was offered: no sweep again
            client.state.apply_table(table(2))  # ... unless it never arrived and the service asks again
            assert client.state.assignment(rank.iteration + 1).phase is Phase.PROFILING
            client.state.apply_table(table(2, profiled=(0, 1)))
            assert client.state.assignment(rank.iteration + 1).phase is Phase.PLANNING  # it did arrive after all
    finally:
        rank.close()


def test_rank_state_sweeps_again_only_for_a_later_round():
    state = RankState()
    state.info = RankInfo(1, 1, gpu_model="sim-a100", frequencies=FREQUENCIES)
    state.apply_table(table(3))  # a rank that joins late starts in the service's round
    assert state.assignment(5).phase is Phase.PROFILING and state.assignment(5).sweep_round == 3
    state.offered()
    state.apply_table(table(2))  # a restarted service that lost the round does not repeat a sweep
    assert state.assignment(6).phase is Phase.PLANNING
    state.apply_table(table(4))
    assert state.assignment(7).phase is Phase.PROFILING


def test_the_progress_line_names_the_stages_the_plan_waits_for(gpu):
    out = io.StringIO()
    client = TableClient()
    rank = make_rank(gpu, client, profiling=SETTINGS, progress=Progress(out, tty=False))
    client.state.apply_table(table(0, profiled=(1,)))  # this rank's stage is profiled, stage 0 is not
    try:
        run(rank, gpu, 3)
        client.state.apply_table(table(0, profiled=(0, 1)))
        run(rank, gpu, 1)
    finally:
        rank.close()
    lines = out.getvalue().splitlines()
    assert lines[-2].endswith("planning at default clocks, waiting for stage 0 to be profiled"), lines
    assert lines[-1].endswith("planning at default clocks"), lines


def test_the_progress_line_never_has_a_rank_wait_for_its_own_stage(gpu):
    """A rank that is planning has swept its stage and sent the profile; a table from before the
    service got it lists the stage as unprofiled, and the rank said it waited for itself."""
    out = io.StringIO()
    client = TableClient()
    rank = make_rank(gpu, client, profiling=SETTINGS, progress=Progress(out, tty=False))
    # Stage 1 (this rank's) swept: no steps for it, though the service lists only stage 0 as profiled.
    client.state.apply_table(dataclasses.replace(table(0, profiled=(1,)), profiled_stages=(0,)))
    try:
        run(rank, gpu, 3)
    finally:
        rank.close()
    lines = out.getvalue().splitlines()
    assert lines[-1].endswith("planning at default clocks"), lines
    assert not any("waiting for stage" in line for line in lines), lines

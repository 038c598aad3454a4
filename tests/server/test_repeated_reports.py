"""A client sends a report again when the service did not answer it in time: the service counts
each iteration, and each baseline timeline, once however many copies arrive."""

from __future__ import annotations

from server_helpers import rank_info
from timeline_helpers import STAGES, profile, spans, timelines

from perseus.schedules import build_schedule
from perseus.service.tally import COMPLETED_KEPT, IterationTally
from perseus.service.timelines import SpanBook
from perseus.wire.spec import JobSpec


def test_a_repeat_of_a_completed_iteration_is_not_counted_again():
    tally = IterationTally(2)
    assert tally.add(0, 5, 0.2, 10.0) is None
    assert tally.add(0, 5, 0.3, 12.0) is None  # a repeat before completion overwrites
    done = tally.add(1, 5, 0.25, 11.0)
    assert done is not None and done.time_s == 0.3 and done.energy_j == 23.0
    assert tally.add(0, 5, 0.2, 10.0) is None and tally.add(1, 5, 0.25, 11.0) is None  # copies: ignored
    for it in range(6, 6 + COMPLETED_KEPT):
        tally.add(0, it, 0.2, 1.0)
        tally.add(1, it, 0.2, 1.0)
    tally.add(0, 5, 0.2, 1.0)  # long forgotten: memory stays bounded, the iteration may run again
    assert tally.add(1, 5, 0.2, 1.0) is not None


def test_spans_sent_twice_make_one_baseline_timeline():
    schedule = build_schedule("1f1b", STAGES, 8)
    spec = JobSpec(STAGES, STAGES, schedule_name="1f1b", num_microbatches=8, gpu_model="sim-a100")
    book = SpanBook(spec)
    (timeline,) = timelines(schedule, profile(STAGES), count=1)
    for copy in range(2):
        for r in range(STAGES):
            added = book.add(rank_info(r, timeline=True), spans(spec.job_id(), r, 1, timeline), len(schedule.stages[r]))
            assert (added == 0) == (copy == 0 and r == STAGES - 1)
    assert book.added == [1] and len(book.timelines[0]) == 1

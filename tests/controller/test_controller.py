"""FrequencyController: skip unchanged clocks, apply off the training thread, fall back on a
mismatched order, refuse unsupported clocks, reset on close."""

from __future__ import annotations

import threading

import pytest

from perseus.clock import VirtualClock
from perseus.controller import FrequencyController
from perseus.devices.sim import SimGPU
from perseus.devices.sim_realism import SimRealism
from perseus.devices.sim_work import Work
from perseus.exceptions import PlanError


class RecordingGPU(SimGPU):
    """A simulated GPU that records which thread made each clock call."""

    def __init__(self, state_dir: str) -> None:
        super().__init__("a100-sxm", 0, state_dir=state_dir)
        self.calls: list[tuple[str, int | None, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def lock_sm_clock(self, mhz: int) -> None:
        self.gate.wait()
        self.calls.append(("lock", mhz, threading.current_thread().name))
        super().lock_sm_clock(mhz)

    def reset_sm_clock(self) -> None:
        self.calls.append(("reset", None, threading.current_thread().name))
        super().reset_sm_clock()


@pytest.fixture
def gpu(tmp_path):
    return RecordingGPU(str(tmp_path))


@pytest.fixture
def controller(gpu):
    c = FrequencyController(gpu, handle_signals=False, watchdog=False)
    yield c
    c.close()


ORDER = [("forward", 0, 0), ("forward", 1, 0), ("backward", 0, 0), ("backward", 1, 0)]
# How long the worker thread may take to apply a clock on a loaded machine (the wait ends as
# soon as it has; the default, 1 s, is what training waits at most).
WAIT_S = 30.0


def run_iteration(c: FrequencyController, order=ORDER) -> None:
    c.begin_iteration()
    for kind, mb, chunk in order:
        c.before_instruction(kind, mb, chunk)


def test_plan_applies_each_instruction_frequency(gpu, controller):
    controller.set_plan(ORDER, [1410, 1200, 1200, 990])
    seen = []
    controller.begin_iteration()
    for key in ORDER:
        controller.before_instruction(*key)
        assert controller.wait_applied(WAIT_S)
        seen.append(gpu.sm_clock())
    assert seen == [1410, 1200, 1200, 990]


def test_unchanged_frequencies_are_skipped(gpu, controller):
    controller.set_plan(ORDER, [1200, 1200, 1200, 1200])
    for _ in range(3):
        run_iteration(controller)
    assert controller.wait_applied(WAIT_S)
    assert controller.stats.instructions == 12
    assert controller.stats.requests == 1
    assert [c[:2] for c in gpu.calls] == [("lock", 1200)]


def test_gpu_calls_run_on_the_worker_not_the_training_thread(gpu, controller):
    gpu.gate.clear()  # the GPU call blocks until released...
    controller.set_plan(ORDER, [1410, 1200, 1005, 990])
    run_iteration(controller)  # ...yet the training thread gets through the whole iteration
    assert controller.stats.instructions == 4
    gpu.gate.set()
    assert controller.wait_applied(WAIT_S)
    assert gpu.sm_clock() == 990  # the newest target wins; stale ones were coalesced away
    assert {thread for _, _, thread in gpu.calls} == {"perseus-controller-0"}
    assert threading.current_thread().name != "perseus-controller-0"


def test_mismatched_order_falls_back_to_default_clocks_for_the_rest_of_the_plan(gpu, controller, caplog):
    controller.set_plan(ORDER, [1200, 1200, 990, 990])
    controller.begin_iteration()
    controller.before_instruction("forward", 0, 0)
    controller.before_instruction("backward", 0, 0)  # the plan expects forward 1 here
    assert controller.fallen_back
    assert controller.wait_applied(WAIT_S)
    assert gpu.sm_clock() == gpu.max_frequency()
    run_iteration(controller)  # a correct order later does not bring the plan back...
    assert controller.wait_applied(WAIT_S)
    assert gpu.sm_clock() == gpu.max_frequency()
    assert sum("does not match plan" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert controller.stats.mismatches == 1
    controller.set_plan(ORDER, [1005, 1005, 1005, 1005], version=2)  # ...a new plan does
    run_iteration(controller)
    assert controller.wait_applied(WAIT_S)
    assert gpu.sm_clock() == 1005


def test_extra_instruction_beyond_the_plan_is_a_mismatch(controller):
    controller.set_plan(ORDER, [1200] * 4)
    run_iteration(controller, ORDER + [("forward", 2, 0)])
    assert controller.fallen_back


def test_unsupported_frequency_is_refused_and_never_set(gpu, controller):
    with pytest.raises(PlanError, match="1234"):
        controller.set_plan(ORDER, [1410, 1234, 1200, 990])
    with pytest.raises(PlanError, match="2000"):
        controller.set_uniform(2000)
    with pytest.raises(PlanError, match="3 frequencies for 4 instructions"):
        controller.set_plan(ORDER, [1410, 1200, 990])
    run_iteration(controller)
    assert controller.wait_applied(WAIT_S)
    assert all(mhz in gpu.supported_frequencies() for op, mhz, _ in gpu.calls if op == "lock")
    assert gpu.sm_clock() == gpu.max_frequency()


def test_uniform_and_default(gpu, controller):
    controller.set_uniform(1005)
    run_iteration(controller)
    assert controller.wait_applied(WAIT_S) and gpu.sm_clock() == 1005
    controller.set_uniform(None)
    run_iteration(controller)
    assert controller.wait_applied(WAIT_S) and gpu.sm_clock() == gpu.max_frequency()


def test_gpu_errors_never_reach_training(gpu, controller):
    def broken(mhz):
        raise RuntimeError("driver fell over")

    gpu.lock_sm_clock = broken
    controller.set_uniform(1005)
    run_iteration(controller)
    assert controller.wait_applied(WAIT_S)
    assert controller.stats.errors == 1


def test_close_resets_and_is_idempotent(gpu):
    c = FrequencyController(gpu, handle_signals=False, watchdog=False)
    c.set_uniform(990)
    run_iteration(c)
    assert c.wait_applied(WAIT_S) and gpu.sm_clock() == 990
    c.close()
    c.close()
    assert gpu.sm_clock() == gpu.max_frequency()
    assert not c._worker.is_alive()


# Switch latency (a GPU whose clock changes take a while to come into force), on a virtual clock.


def latent_gpu(tmp_path, latency=0.01):
    return SimGPU(
        "a100-sxm", 0, clock=VirtualClock(), state_dir=str(tmp_path), realism=SimRealism(switch_latency_s=latency)
    )


def run_planned(c, gpu, order, works, gap=0.002):
    """One planned iteration: each instruction's work after its hook; the clock in force at each start.
    (The hook's GPU call is waited for, as PerseusRank(wait_for_clock=True) does: on a virtual clock
    the worker thread would otherwise make it at whatever time the test had reached.)"""
    c.begin_iteration()
    started = []
    for key in order:
        c.before_instruction(*key)
        assert c.wait_applied(WAIT_S)
        started.append(gpu.sm_clock())
        gpu.execute(works[key[0]])
        c.after_instruction()
        gpu.clock.sleep(gap)
    return started


def test_settle_waits_until_the_clock_is_in_force(tmp_path):
    gpu = latent_gpu(tmp_path, 0.02)
    c = FrequencyController(gpu, handle_signals=False, watchdog=False)
    c.set_uniform(1005)
    c.before_instruction("forward", 0)
    asked = gpu.clock.now()
    assert gpu.sm_clock() == 1410  # asked for, not in force yet
    in_force, mhz = c.settle(WAIT_S)
    assert (in_force, mhz) == (pytest.approx(asked + 0.02), 1005)
    assert gpu.clock.now() == pytest.approx(asked + 0.02) and gpu.sm_clock() == 1005
    assert c.settle(WAIT_S) == (in_force, mhz)  # nothing new: at once
    c.close()


def test_a_higher_clock_is_issued_ahead_and_off_clock_instructions_are_counted(tmp_path):
    gpu = latent_gpu(tmp_path, 0.01)
    c = FrequencyController(gpu, handle_signals=False, watchdog=False)
    plan = [1410, 990, 1410, 990]
    c.set_plan(ORDER, plan)
    works = {"forward": Work(0.03), "backward": Work(0.03)}
    first = run_planned(c, gpu, ORDER, works)
    assert first == [1410, 1410, 990, 1410]  # a change comes into force 10 ms into its instruction
    assert c.off_clock == 0  # ... and so each ran mostly at its clock
    second = run_planned(c, gpu, ORDER, works)
    assert second == [990, 1410, 1410, 1410]  # raised ahead of time (the first is the last one's, 990)
    assert c.stats.early >= 2 and c.off_clock == 0
    # An instruction shorter than the latency never runs at a lower clock asked for as it starts.
    c.set_plan(ORDER, [1410, 990, 1410, 1410])
    short = {"forward": Work(0.005), "backward": Work(0.03)}  # forward 1 at 990: 5 ms, under the latency
    run_planned(c, gpu, ORDER, short)
    assert c.off_clock == 1
    assert FrequencyController(gpu, handle_signals=False, watchdog=False).off_clock is None  # no plan: not counted
    c.close()


def test_a_raise_after_short_instructions_is_issued_from_an_earlier_one(tmp_path):
    """Four 6 ms forwards at a low clock (8 ms apart), then a backward at the top clock, with a
    10 ms switch: the last forward starts too late to raise the clock in time, so the change goes
    out during the one before, timed to land as the backward starts; the last one leaves it alone."""
    gpu = latent_gpu(tmp_path, 0.01)
    c = FrequencyController(gpu, handle_signals=False, watchdog=False)
    order = [("forward", m, 0) for m in range(4)] + [("backward", 0, 0)]
    c.set_plan(order, [810, 810, 810, 810, 1410])
    works = {"forward": Work(0.006), "backward": Work(0.012)}
    run_planned(c, gpu, order, works)  # the first iteration: no timing to go by yet
    for _ in range(3):
        started = run_planned(c, gpu, order, works)
        assert started[2:] == [810, 810, 1410]  # the backward starts at its clock, the forwards keep theirs
    assert c.stats.early >= 3


def test_next_changes_wrap_into_the_next_iteration():
    from perseus.controller.controller import _next_changes

    assert _next_changes([810, 810, 1410, 810]) == (2, 2, 3, 6)
    assert _next_changes([1410, 810, 810]) == (1, 3, 3)
    assert _next_changes([990, 990]) == (None, None)
    assert _next_changes([]) == ()

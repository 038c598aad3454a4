"""FrequencyController: skip unchanged clocks, apply off the training thread, fall back on a
mismatched order, refuse unsupported clocks, reset on close."""

from __future__ import annotations

import threading

import pytest

from perseus.controller import FrequencyController
from perseus.devices.sim import SimGPU
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

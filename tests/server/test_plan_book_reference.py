"""A reference window survives a restart of the service as the plan it checks, not as maximum clocks."""

from __future__ import annotations

import json

from perseus.service.planning import PlanResult
from perseus.service.plans import PlanBook, PublishedPlan, plan_result

MODELS = ("a100", "a100")
PLAN = PlanResult(((1200, 1410), (1410, 1305)), 0.2, 180.0, 170.0, 0.2, 200.0)
MAX = PlanResult(((1410, 1410), (1410, 1410)), 0.2, 200.0, 200.0, 0.2, 200.0)


def book() -> PlanBook:
    return PlanBook(1, lambda k: MODELS)


def test_a_reference_window_is_saved_with_the_plan_it_checks_and_restored_as_that_plan():
    live = book()
    live.results[(MODELS, None)] = PLAN
    assert live.publish({0: (MODELS, None)}, 10) == [0]
    live.references[0] = MAX  # verification asked for a window at maximum clocks
    assert live.publish({0: (MODELS, None)}, 20) == [0]
    assert live.plans[0].reference and live.plans[0].energy_j == 200.0
    assert live.predicted()[1] == 180.0  # status tells the plan's figures meanwhile
    assert live.predicted(running=True)[1] == 200.0  # what the window's iterations should measure

    saved = json.loads(json.dumps(live.record(0)))  # as the job record keeps it
    assert saved["reference"] is True and plan_result(saved["checks"]) == PLAN

    restarted = book()
    restarted.last_version = live.last_version  # as perseus.service.persistence restores it
    checks = saved.pop("checks")
    restarted.restore(0, PublishedPlan.from_record(saved), plan_result(checks))
    assert restarted.results[(MODELS, None)] == PLAN  # not maximum clocks
    assert restarted.publish({0: (MODELS, None)}, 30) == [0]  # no reference pending: the plan again
    assert not restarted.plans[0].reference and restarted.plans[0].result() == PLAN
    assert restarted.plans[0].version > live.plans[0].version  # ranks holding the window fetch it

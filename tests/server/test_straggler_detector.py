"""The straggler detector on noisy, seeded iteration-time sequences (pure, no service)."""

from __future__ import annotations

import random

import pytest

from perseus.exceptions import ConfigError
from perseus.service.straggler import Straggler, StragglerDetector


def _feed(
    detector: StragglerDetector, rng: random.Random, means: list[float], iterations: int, noise: float = 0.02
) -> list[Straggler | None]:
    """`iterations` rounds of one noisy value per pipeline; the decision after each round."""
    decisions = []
    for _ in range(iterations):
        for k, mean in enumerate(means):
            detector.add(k, mean * (1 + rng.gauss(0, noise)))
        decisions.append(detector.update())
    return decisions


@pytest.mark.parametrize("pipelines", [2, 4, 8])
def test_equal_pipelines_with_noise_never_straggle(pipelines):
    rng = random.Random(pipelines)
    decisions = _feed(StragglerDetector(pipelines), rng, [1.0] * pipelines, 2000, noise=0.02)
    assert decisions.count(None) == len(decisions)


@pytest.mark.parametrize("pipelines,slow", [(2, 1), (4, 0), (8, 5)])
def test_a_persistently_slow_pipeline_is_found_with_its_factor(pipelines, slow):
    rng = random.Random(11)
    means = [1.0] * pipelines
    means[slow] = 1.2
    detector = StragglerDetector(pipelines)
    decisions = _feed(detector, rng, means, 40, noise=0.02)
    assert decisions[: detector.min_samples - 1] == [None] * (detector.min_samples - 1)  # not before enough samples
    assert all(d is not None and d.pipeline == slow for d in decisions[detector.window :])
    assert decisions[-1].factor == pytest.approx(1.2, abs=0.03)


def test_single_slow_iterations_are_not_stragglers():
    rng = random.Random(3)
    detector = StragglerDetector(4)
    for i in range(400):
        for k in range(4):
            spike = 2.5 if (i % 9 == 0 and k == i % 4) else 1.0  # a checkpoint, a hiccup: one iteration
            detector.add(k, spike * (1 + rng.gauss(0, 0.02)))
        assert detector.update() is None


def test_recovery_clears_the_straggler_and_hysteresis_keeps_it_steady():
    rng = random.Random(5)
    detector = StragglerDetector(2)
    assert _feed(detector, rng, [1.0, 1.2], 20)[-1].pipeline == 1
    # Near the threshold (4% slower, between threshold/2 and threshold): the straggler stays,
    # it does not flap, and its factor is revised once it moved by more than the threshold.
    steady = _feed(detector, rng, [1.0, 1.04], 40, noise=0.005)
    assert all(d is not None and d.pipeline == 1 for d in steady)
    assert steady[-1].factor == pytest.approx(1.04, abs=0.026)
    after = _feed(detector, rng, [1.0, 1.0], 20)
    assert after[-1] is None and after.index(None) <= detector.window


def test_a_small_factor_change_keeps_the_same_decision_object():
    detector = StragglerDetector(2, window=4, min_samples=4)
    for value in (1.0, 1.0, 1.0, 1.0):
        detector.add(0, value)
    for value in (1.20, 1.20, 1.20, 1.20):
        detector.add(1, value)
    first = detector.update()
    assert first == Straggler(1, pytest.approx(1.2))
    for value in (1.23, 1.23, 1.23):
        detector.add(1, value)  # within the threshold of 1.2: no new decision, so no re-plan
    assert detector.medians()[1] == pytest.approx(1.23) and detector.update() is first
    for _ in range(4):
        detector.add(1, 1.30)
    assert detector.update().factor == pytest.approx(1.3)


def test_one_pipeline_cannot_straggle_and_bad_input_is_refused():
    detector = StragglerDetector(1)
    _feed(detector, random.Random(0), [1.0], 20)
    assert detector.update() is None
    with pytest.raises(ConfigError, match="pipeline 3"):
        detector.add(3, 1.0)
    with pytest.raises(ConfigError, match="positive"):
        detector.add(0, 0.0)
    with pytest.raises(ConfigError, match="min_samples"):
        StragglerDetector(2, window=4, min_samples=5)

"""The README's metrics table and what the collectors export agree both ways: every metric a
scrape of `perseus serve` or `perseus monitor` can hold is a row with its type, unit and labels,
and every row is exported. The exported side is enumerated by rendering both collectors
(a service snapshot with a job, pipeline and stage where every figure is set; simulated GPUs)
in the Prometheus text format and parsing it back with prometheus_client.parser."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from perseus.clock import VirtualClock
from perseus.devices.sim import sim_gpus
from perseus.measurement import Monitor
from perseus.metrics.board import SnapshotBoard
from perseus.metrics.collectors import CollectorRegistry, GPUCollector, ServiceCollector
from perseus.metrics.service import LATENCY_BUCKETS_S, Histogram, JobFigures, ServiceSnapshot
from perseus.wire.calibration import CalibrationStatus, StageFitStatus
from perseus.wire.messages import JobStatus, PipelineStatus

README = Path(__file__).parents[2] / "README.md"
SECTION = "### Metrics for Prometheus and Grafana"
UNITS = {"_seconds": "s", "_joules": "J", "_watts": "W", "_hertz": "Hz", "_ratio": "1"}  # name suffix: unit
PER_SAMPLE = {"le", "quantile"}  # labels the text format adds to a histogram's or summary's samples


@pytest.fixture(autouse=True)
def sim_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSEUS_SIM_DIR", str(tmp_path / "sim"))


def readme_rows() -> dict[str, tuple[str, str, frozenset[str]]]:
    """metric -> (type, unit, labels), from the table of the README's metrics section."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text
    section = text.split(SECTION, 1)[1].split("\n#", 1)[0]
    rows: dict[str, tuple[str, str, frozenset[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 5, f"README metrics row needs metric | type | unit | labels | meaning: {line}"
        name, kind, unit, labels, meaning = cells
        assert meaning, f"README metrics row without a meaning: {line}"
        assert name.strip("`") not in rows, f"{name} listed twice"
        rows[name.strip("`")] = (kind, unit, frozenset(x.strip(" `") for x in labels.split(",") if x.strip()))
    return rows


def full_snapshot() -> ServiceSnapshot:
    """A service holding one job with every optional figure set (so every family has samples)."""
    pipeline = PipelineStatus(
        pipeline=0,
        plan_version=2,
        deadline_s=0.3,
        predicted_iteration_time_s=0.25,
        measured_iteration_time_s=0.26,
        straggler="detected",
        straggler_factor=1.2,
    )
    status = JobStatus(
        job_id="job-00ff",
        phase="planned",
        world_size=2,
        ranks_registered=2,
        profiled_stages=(0, 1),
        plan_version=2,
        last_iteration=40,
        predicted_iteration_time_s=0.25,
        predicted_energy_j=50.0,
        predicted_baseline_energy_j=60.0,
        baseline_iterations=5,
        baseline_iteration_time_s=0.24,
        baseline_energy_j=60.0,
        planned_iterations=10,
        planned_iteration_time_s=0.25,
        planned_energy_j=52.0,
        pipelines=(pipeline,),
        calibrations=(
            CalibrationStatus(
                "sim-a100", "fitted", 8, measured_s=0.24, model_s=0.246, stages=(StageFitStatus(0, 0.2, 0.19),)
            ),
        ),
    )
    latency = Histogram(tuple([0] * len(LATENCY_BUCKETS_S) + [1]), 0.5)
    job = JobFigures(status, 1, {(0, 0): 300.0, (0, 1): 310.0}, {(0, 0): 10, (0, 1): 10})
    return ServiceSnapshot(0.0, (job,), 8, {("status", "ok"): 3}, latency, latency, 2, 0.8)


def exported() -> dict[str, tuple[str, frozenset[str]]]:
    """metric as queried (counters with `_total`) -> (type, labels), from a rendered scrape."""
    board: SnapshotBoard[ServiceSnapshot] = SnapshotBoard()
    board.publish(full_snapshot())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(board, timeout_s=0.01))  # no loop ticks here: the published snapshot
    monitor = Monitor(gpus=sim_gpus("a100-sxm", 2, VirtualClock()), cpus=[])
    registry.register(GPUCollector(monitor))
    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        assert family.samples, f"{family.name} has no sample: give full_snapshot() the figure it shows"
        name = family.name + ("_total" if family.type == "counter" else "")
        families[name] = (family.type, frozenset(k for s in family.samples for k in s.labels) - PER_SAMPLE)
    monitor.close()
    return families


def test_the_readme_lists_every_exported_metric_and_nothing_else():
    rows, metrics = readme_rows(), exported()
    assert sorted(set(metrics) - set(rows)) == [], "exported but not in the README's metrics table"
    assert sorted(set(rows) - set(metrics)) == [], "in the README's metrics table but not exported"
    for name, (kind, labels) in metrics.items():
        readme_kind, unit, readme_labels = rows[name]
        assert readme_kind == kind, f"{name}: README says {readme_kind}, exported as {kind}"
        assert readme_labels == labels, f"{name}: README labels {sorted(readme_labels)}, exported {sorted(labels)}"
        base = name.removesuffix("_total")
        for suffix, want in UNITS.items():
            if base.endswith(suffix):
                assert unit == want, f"{name}: unit {unit!r} in the README, {want!r} by its name"
        assert unit, f"{name}: no unit in the README"

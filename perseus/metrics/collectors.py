"""Metric families from a service snapshot or a Monitor's GPUs (prometheus-client collectors).

Every family is declared in `FAMILIES` (name, type, help) so the dashboard test and the docs
have one list; `exported_metrics()` gives the sample names a scrape can contain.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from perseus.exceptions import ConfigError, DeviceError

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
        SummaryMetricFamily,
    )
    from prometheus_client.exposition import start_http_server
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError:  # an optional dependency: the metrics extra
    raise ConfigError("Prometheus metrics need prometheus-client: pip install 'perseus-energy[metrics]'") from None

from perseus.devices.gpu import GPU
from perseus.measurement.monitor import Monitor
from perseus.metrics.board import SnapshotBoard
from perseus.metrics.service import LATENCY_BUCKETS_S, Histogram, JobFigures, ServiceSnapshot
from perseus.wire.calibration import CalibrationStatus

__all__ = ["CollectorRegistry", "GPUCollector", "ServiceCollector", "exported_metrics", "start_http_server"]

GPU_LABELS = ("gpu", "UUID", "modelName")  # dcgm-exporter's labels, so queries can join them

#: name -> (type, help). Counters are named without `_total` here, as prometheus-client wants.
FAMILIES: dict[str, tuple[str, str]] = {
    # the service
    "perseus_service_requests": ("counter", "Requests answered, by type and code (ok or the error code)"),
    "perseus_service_request_duration_seconds": ("histogram", "Time the service loop took to answer one request"),
    "perseus_service_loop_tick_duration_seconds": (
        "histogram",
        "Time of the loop's work between requests (taking plans, saving, evicting)",
    ),
    "perseus_service_jobs": ("gauge", "Jobs held, by phase"),
    "perseus_service_max_jobs": ("gauge", "Jobs the service may hold (--max-jobs)"),
    "perseus_service_planning_duration_seconds": ("summary", "Time to solve one pipeline plan (worker threads)"),
    # each job
    "perseus_job_info": ("gauge", "1 per job, its phase as a label"),
    "perseus_job_world_size": ("gauge", "Ranks of the job"),
    "perseus_job_ranks_registered": ("gauge", "Ranks registered so far"),
    "perseus_job_last_iteration": ("gauge", "Last iteration every rank reported"),
    "perseus_job_plan_version": ("gauge", "Newest plan version in force"),
    "perseus_job_plan_changes": (
        "counter",
        "Plan versions published after the first: reference windows and their resumes, stragglers, recoveries, "
        "re-plans, restarts (verification's re-plans alone: perseus_pipeline_replans)",
    ),
    "perseus_job_iteration_seconds": (
        "gauge",
        "Iteration time: measured mean at default clocks (baseline), measured mean under the plan (planned), "
        "the plan's prediction (predicted)",
    ),
    "perseus_job_iteration_energy_joules": (
        "gauge",
        "Energy of one iteration over all ranks: baseline, planned (measured means), predicted, "
        "predicted_baseline (the evaluator at max clocks)",
    ),
    "perseus_job_predicted_saving_ratio": ("gauge", "1 - predicted energy / predicted max-clock energy"),
    "perseus_job_measured_saving_ratio": ("gauge", "1 - measured planned energy / measured baseline energy"),
    "perseus_job_saving_withheld": (
        "gauge",
        "1 while no measured saving is claimed (none measured yet, or withheld: perseus status --json's "
        "saving_withheld says why), else 0",
    ),
    # each pipeline
    "perseus_pipeline_plan_version": ("gauge", "Plan version of the pipeline"),
    "perseus_pipeline_iteration_seconds": (
        "gauge",
        "Pipeline iteration time: measured (median of recent iterations) and predicted (its plan)",
    ),
    "perseus_pipeline_deadline_seconds": ("gauge", "Iteration time the pipeline's plan was solved for"),
    "perseus_pipeline_straggler_factor": (
        "gauge",
        "How much slower than planned the pipeline runs (1: not a straggler)",
    ),
    "perseus_pipeline_replans": ("gauge", "Verification's re-plans of the pipeline's plan this run (status: replans)"),
    # each pipeline model's calibration (a model per set of GPU models; stages: its pipelines' stages)
    "perseus_model_iteration_seconds": (
        "gauge",
        "Baseline iteration time of the pipeline model: measured (median on the job's timeline) and its model",
    ),
    "perseus_model_fit_ratio": ("gauge", "Model / measured baseline iteration time - 1 (+: the model is slower)"),
    "perseus_model_stage_fit_ratio": ("gauge", "Model / measured instruction window of one stage - 1"),
    # each stage of each pipeline
    "perseus_stage_energy_joules": ("counter", "GPU energy its ranks reported, summed over iterations"),
    "perseus_stage_iteration_reports": ("counter", "Iteration reports of its ranks"),
    # GPUs (perseus monitor)
    "perseus_gpu_energy_joules": (
        "counter",
        "GPU energy since the monitor started (DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, in J)",
    ),
    "perseus_gpu_power_watts": ("gauge", "GPU power draw (DCGM_FI_DEV_POWER_USAGE)"),
    "perseus_gpu_sm_clock_hertz": ("gauge", "GPU SM clock (DCGM_FI_DEV_SM_CLOCK, in Hz)"),
    "perseus_gpu_power_limit_watts": ("gauge", "GPU power limit in force"),
}

_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
}


def exported_metrics() -> set[str]:
    """Every sample name a scrape of Perseus can contain."""
    return {name + suffix for name, (kind, _) in FAMILIES.items() for suffix in _SUFFIXES[kind]}


def _family(name: str, labels: Sequence[str] = ()) -> Any:  # the family's own class, with its add_metric
    kind, text = FAMILIES[name]
    if kind == "counter":
        return CounterMetricFamily(name, text, labels=labels)
    if kind == "gauge":
        return GaugeMetricFamily(name, text, labels=labels)
    if kind == "histogram":
        return HistogramMetricFamily(name, text, labels=labels)
    return SummaryMetricFamily(name, text, labels=labels)


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    bounds = [repr(b) for b in LATENCY_BUCKETS_S] + ["+Inf"]
    return [(bound, float(count)) for bound, count in zip(bounds, h.counts)]


class ServiceCollector(Collector):
    """The planner service's families, from the snapshot its loop publishes when scraped."""

    def __init__(self, board: SnapshotBoard[ServiceSnapshot], timeout_s: float = 2.0) -> None:
        self.board = board
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        snapshot = self.board.latest(self.timeout_s)
        if snapshot is None:
            return
        yield from _service_families(snapshot)
        yield from _job_families(snapshot.jobs)


def _service_families(s: ServiceSnapshot) -> Iterator[Metric]:
    requests = _family("perseus_service_requests", ("type", "code"))
    for (kind, code), count in sorted(s.requests.items()):
        requests.add_metric([kind, code], count)
    yield requests
    for name, h in (
        ("perseus_service_request_duration_seconds", s.request_seconds),
        ("perseus_service_loop_tick_duration_seconds", s.tend_seconds),
    ):
        family = _family(name)
        assert isinstance(family, HistogramMetricFamily)
        family.add_metric([], _buckets(h), h.sum_s)
        yield family
    jobs = _family("perseus_service_jobs", ("phase",))
    phases = sorted(f.status.phase for f in s.jobs)
    for phase, group in itertools.groupby(phases):
        jobs.add_metric([phase], len(list(group)))
    yield jobs
    limit = _family("perseus_service_max_jobs")
    limit.add_metric([], s.max_jobs)
    yield limit
    planning = _family("perseus_service_planning_duration_seconds")
    assert isinstance(planning, SummaryMetricFamily)
    planning.add_metric([], s.plans_solved, s.planning_s)
    yield planning


def _job_families(jobs: Sequence[JobFigures]) -> Iterator[Metric]:
    f = {name: _family(name, ("job",)) for name in FAMILIES if name.startswith("perseus_job_")}
    f["perseus_job_info"] = _family("perseus_job_info", ("job", "phase"))
    for name in ("perseus_job_iteration_seconds", "perseus_job_iteration_energy_joules"):
        f[name] = _family(name, ("job", "kind"))
    pipeline = {name: _family(name, ("job", "pipeline")) for name in FAMILIES if name.startswith("perseus_pipeline_")}
    pipeline["perseus_pipeline_iteration_seconds"] = _family(
        "perseus_pipeline_iteration_seconds", ("job", "pipeline", "kind")
    )
    stage = {
        name: _family(name, ("job", "pipeline", "stage")) for name in FAMILIES if name.startswith("perseus_stage_")
    }
    model = {
        "perseus_model_iteration_seconds": _family("perseus_model_iteration_seconds", ("job", "model", "kind")),
        "perseus_model_fit_ratio": _family("perseus_model_fit_ratio", ("job", "model")),
        "perseus_model_stage_fit_ratio": _family("perseus_model_stage_fit_ratio", ("job", "model", "stage")),
    }
    for figures in jobs:
        st = figures.status
        job = st.job_id
        f["perseus_job_info"].add_metric([job, st.phase], 1)
        f["perseus_job_world_size"].add_metric([job], st.world_size)
        f["perseus_job_ranks_registered"].add_metric([job], st.ranks_registered)
        f["perseus_job_last_iteration"].add_metric([job], st.last_iteration)
        f["perseus_job_plan_version"].add_metric([job], st.plan_version)
        f["perseus_job_plan_changes"].add_metric([job], figures.plan_changes)
        for kind, value in (
            ("baseline", st.baseline_iteration_time_s),
            ("planned", st.planned_iteration_time_s),
            ("predicted", st.predicted_iteration_time_s),
        ):
            if value is not None:
                f["perseus_job_iteration_seconds"].add_metric([job, kind], value)
        for kind, value in (
            ("baseline", st.baseline_energy_j),
            ("planned", st.planned_energy_j),
            ("predicted", st.predicted_energy_j),
            ("predicted_baseline", st.predicted_baseline_energy_j),
        ):
            if value is not None:
                f["perseus_job_iteration_energy_joules"].add_metric([job, kind], value)
        for name, ratio in (
            ("perseus_job_predicted_saving_ratio", st.predicted_saving),
            ("perseus_job_measured_saving_ratio", st.measured_saving),
        ):
            if ratio is not None:
                f[name].add_metric([job], ratio)
        f["perseus_job_saving_withheld"].add_metric([job], 1 if st.measured_saving is None else 0)
        for p in st.pipelines:
            labels = [job, str(p.pipeline)]
            pipeline["perseus_pipeline_plan_version"].add_metric(labels, p.plan_version)
            for kind, value in (("measured", p.measured_iteration_time_s), ("predicted", p.predicted_iteration_time_s)):
                if value is not None:
                    pipeline["perseus_pipeline_iteration_seconds"].add_metric([*labels, kind], value)
            if p.deadline_s is not None:
                pipeline["perseus_pipeline_deadline_seconds"].add_metric(labels, p.deadline_s)
            factor = p.straggler_factor if p.straggler_factor is not None else 1.0
            pipeline["perseus_pipeline_straggler_factor"].add_metric(labels, factor)
            pipeline["perseus_pipeline_replans"].add_metric(labels, p.replans)
        for c in st.calibrations:
            _add_calibration(model, job, c)
        for (k, s), energy_j in sorted(figures.stage_energy_j.items()):
            labels = [job, str(k), str(s)]
            stage["perseus_stage_energy_joules"].add_metric(labels, energy_j)
            stage["perseus_stage_iteration_reports"].add_metric(labels, figures.stage_iterations.get((k, s), 0))
    yield from f.values()
    yield from pipeline.values()
    yield from stage.values()
    yield from model.values()


def _add_calibration(families: dict[str, Any], job: str, c: CalibrationStatus) -> None:
    """One pipeline model's fit: its baseline times and errors, where measured and modelled."""
    for kind, value in (("measured", c.measured_s), ("model", c.model_s)):
        if value is not None:
            families["perseus_model_iteration_seconds"].add_metric([job, c.models, kind], value)
    if c.error is not None:
        families["perseus_model_fit_ratio"].add_metric([job, c.models], c.error)
    for s in c.stages:
        if s.error is not None:
            families["perseus_model_stage_fit_ratio"].add_metric([job, c.models, str(s.stage)], s.error)


class GPUCollector(Collector):
    """A Monitor's GPUs, read at each scrape: energy since the collector started, power, SM
    clock and power limit. A GPU that fails a read is left out of that family for this scrape."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._lock = threading.Lock()  # scrapes may overlap; windows are renamed one at a time
        self._energy_j = {g.index: 0.0 for g in monitor.gpus}
        self._window = 0
        monitor.begin_window(self._name(0), sync=False)

    def _name(self, n: int) -> str:
        return f"perseus.metrics.gpu.{id(self)}.{n}"

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            # The next window opens before this one closes: no energy falls between the two.
            self.monitor.begin_window(self._name(self._window + 1), sync=False)
            m = self.monitor.end_window(self._name(self._window), sync=False, expect_short=True)  # summed
            self._window += 1
            for index, joules in m.gpu_energy_j.items():
                self._energy_j[index] += joules
            energy = dict(self._energy_j)
        families = {name: _family(name, GPU_LABELS) for name in FAMILIES if name.startswith("perseus_gpu_")}
        for gpu in self.monitor.gpus:
            labels = _gpu_labels(gpu)
            families["perseus_gpu_energy_joules"].add_metric(labels, energy[gpu.index])
            for name, read in (
                ("perseus_gpu_power_watts", lambda g: g.power_mw() / 1000),
                ("perseus_gpu_sm_clock_hertz", lambda g: g.sm_clock() * 1e6),
                ("perseus_gpu_power_limit_watts", lambda g: g.power_limit_mw() / 1000),
            ):
                try:
                    families[name].add_metric(labels, read(gpu))
                except DeviceError:
                    continue
        yield from families.values()


def _gpu_labels(gpu: GPU) -> list[str]:
    try:
        uuid = gpu.uuid()
    except DeviceError:
        uuid = ""
    return [str(gpu.index), uuid, gpu.name()]

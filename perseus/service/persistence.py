"""A job as its job.json record holds it (see perseus.service.state), and back.

`to_record` is everything a restarted service needs besides the uploaded profiles (saved beside
it) and the signature cache: measurements are mostly not kept (the ranks report again), but the job's
measured baseline (what its saving is measured against: the ranks never run it again; each
pipeline's too, which tells whether a straggler slowed it), the mean of the plans in force and
the latest iteration (saved every MEASURED_SAVE_S while iterations come: a finished job's status
tells them after a restart), and each
pipeline model's calibration, verification margin and measured baseline are, each pipeline's
latest reference window at maximum clocks (its plan's target, until a fresh one is measured) and
re-plans so far (their cap holds across restarts), and
the straggler detected last (the plans in force were made for it: the detector starts from it, so a
restart neither forgets it until it is detected again nor keeps its plans after it recovered).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from perseus.exceptions import ConfigError, ServiceError
from perseus.profiler.profile import Profile
from perseus.service.planning import job_schedule
from perseus.service.plans import PublishedPlan, plan_result
from perseus.service.tally import Mean
from perseus.service.text import clip
from perseus.service.timelines import ModelState
from perseus.service.verification import MAX_REPLANS
from perseus.wire.spec import RankInfo

if TYPE_CHECKING:  # annotations only: job.py imports this module
    from perseus.service.job import Job

log = logging.getLogger(__name__)


def to_record(job: Job) -> dict[str, Any]:
    profiling = job.profiling
    return {
        "job_id": job.job_id,
        "spec": job.spec_record,
        "ranks": [job.ranks[r].to_wire() for r in sorted(job.ranks)],
        "sweep": None if profiling.sweep is None else list(profiling.sweep),
        "cached": job.spec.gpu_model in profiling.cached,
        "cached_models": sorted(m for m in profiling.cached if m != job.spec.gpu_model),
        "uploads": [[m, s, t, name] for (m, s, t), name in sorted(profiling.upload_names.items())],
        "error": job.error,
        "error_retryable": job.error_retryable,
        "inherited": sorted(profiling.inherited),
        "profile_dropped": job.profile_dropped,
        "sweep_rounds": [[m, s, e.round] for (m, s), e in sorted(job.sweeps.stages.items()) if e.round],
        "last_version": job.plan_book.last_version,
        "plans": {str(k): job.plan_book.record(k) for k in sorted(job.plans)},
        "declared": {str(k): f for k, f in sorted(job.measurements.declared.items())},
        "detected": job.measurements.detected_record(),
        "baseline": job.measurements.baseline.to_record(),
        "baseline_pipelines": [m.to_record() for m in job.measurements.baseline_pipelines],
        "planned": job.measurements.planned.to_record(),
        "last_iteration": max(job.last_iteration, job.measurements.saved_iteration),
        "models": [[list(m), state.to_record()] for m, state in job.model.calibrations.states.items()],
        "references": [None if c.reference_s is None else [c.reference_s, c.reference_noise] for c in job.model.checks],
        "replans": [c.replans for c in job.model.checks],
    }


def restore(job: Job, doc: dict[str, Any], stage_profiles: dict[str, Profile], cached: dict[str, Profile]) -> None:
    """Fill `job`, new from the spec of `doc` (a `to_record`), from `doc`, its uploads (by
    state-file name) and the cached profiles of its GPU models. Pipelines whose plans are lost
    re-plan if their profiles are complete, else the missing stages are profiled. Records of
    earlier releases (one "plan", uploads as stage-<s>) load too."""
    spec = job.spec
    profiling = job.profiling
    try:
        job.set_schedule(job_schedule(spec))
    except ConfigError as e:
        job.fail(f"invalid job: {e}")  # as when it registered: it stays failed, and says why
    saved_sweep = doc.get("sweep")
    if saved_sweep is not None:  # before the ranks: they were checked against it in their order
        profiling.sweep = tuple(int(f) for f in saved_sweep)
    for info in doc.get("ranks", []):
        try:
            job.add_rank(RankInfo.from_wire(info))
        except ServiceError as e:  # the rank registers again when it next reaches the service
            log.warning("job %s: rank record not resumed: %s", job.job_id, e.message)
    for model in ([spec.gpu_model] if doc.get("cached") else []) + list(doc.get("cached_models", [])):
        if model in cached:
            job.add_cached(model, cached[model])
    uploads = doc.get("uploads")
    if uploads is None:  # an earlier release: stage-<s> files of the job's model
        uploads = [
            [spec.gpu_model, int(n.removeprefix("stage-")), 0, n]
            for n in stage_profiles
            if n.removeprefix("stage-").isdigit()
        ]
    for model, stage, tp_index, name in uploads:
        if (
            name in stage_profiles
            and 0 <= stage < spec.pp
            and 0 <= tp_index < spec.tp
            and stage not in profiling.stages_of(model)
        ):
            profiling.take(model, stage, tp_index, stage_profiles[name], name)
    if spec.gpu_model in profiling.cached:
        profiling.sweep = ()
    elif saved_sweep is None:
        profiling.sweep = spec.sweep_frequencies or (job.ranks[min(job.ranks)].frequencies if job.ranks else None)
    job.plan_book.last_version = int(doc.get("last_version", 0))
    plans = doc.get("plans")
    if plans is None and doc.get("plan") is not None:  # an earlier release: one plan for all pipelines
        plans = {str(k): {**doc["plan"], "models": list(job.models(k))} for k in range(spec.dp)}
    for k, record in (plans or {}).items():
        checks = record.pop("checks", None)  # a reference window's: the plan it checks
        checked = None if checks is None else plan_result(checks)
        job.plan_book.restore(int(k), PublishedPlan.from_record(record), checked)
    job.measurements.declared = {int(k): float(f) for k, f in doc.get("declared", {}).items()}
    for models, state in doc.get("models", []):  # the calibrations plans were made on, and their checks
        job.model.calibrations.states[tuple(models)] = ModelState.from_record(state)
    job.error = clip(str(doc["error"])) if doc.get("error") else ""
    job.error_retryable = bool(doc.get("error_retryable", False))
    job.profile_dropped = clip(str(doc.get("profile_dropped", "")))
    for model, stage, sweep_round in doc.get("sweep_rounds", []):  # ranks that uploaded follow only a later round
        if 0 <= int(stage) < spec.pp:
            job.sweeps.restore(str(model), int(stage), int(sweep_round))
    if "inherited" in doc:  # else (an earlier release) every cached profile is checked, as add_cached left it
        profiling.inherited = {str(m) for m in doc["inherited"]}
    job.measurements.restart(job.plans)
    if doc.get("detected") is not None:
        try:
            job.measurements.resume_detected(doc["detected"])
        except (TypeError, ValueError) as e:  # detected again from the ranks' next iterations
            log.warning("job %s: detected straggler not resumed: %s", job.job_id, e)
    if doc.get("baseline") is not None:
        try:
            baseline = Mean.from_record(doc["baseline"])
            pipelines = [Mean.from_record(m) for m in doc.get("baseline_pipelines", [Mean().to_record()] * spec.dp)]
            if len(pipelines) != spec.dp:
                raise ValueError(f"{len(pipelines)} pipelines' baselines for dp={spec.dp}")
            job.measurements.baseline, job.measurements.baseline_pipelines = baseline, pipelines
        except (TypeError, ValueError) as e:
            log.warning("job %s: measured baseline not resumed: %s", job.job_id, e)
    try:
        if doc.get("planned") is not None and job.plans:  # the plans in force go on: so does their mean
            job.measurements.planned = Mean.from_record(doc["planned"])
            job.measurements.planned_in_force = job.plans_in_force()
        job.measurements.saved_iteration = max(-1, int(doc.get("last_iteration", -1)))
    except (TypeError, ValueError) as e:
        log.warning("job %s: measured planned iterations not resumed: %s", job.job_id, e)
    job.model.plans_published(job.plans, sorted(job.plans), job.pipelines_of)
    _resume_references(job, doc.get("references"))
    _resume_replans(job, doc.get("replans"))


def _resume_references(job: Job, records: Any) -> None:
    """Each pipeline's latest reference window (see PlanCheck.resume_reference); none where the
    record has none (an earlier release) or a malformed one (each is measured again before a plan
    is judged, as ever)."""
    if records is None:
        return
    try:
        references = [_reference(r) for r in records]
        if len(references) != job.spec.dp:
            raise ValueError(f"{len(references)} pipelines' references for dp={job.spec.dp}")
    except (TypeError, ValueError) as e:
        log.warning("job %s: verification's reference windows not resumed: %s", job.job_id, e)
        return
    for check, reference in zip(job.model.checks, references):
        if reference is not None:
            check.resume_reference(*reference)


def _resume_replans(job: Job, records: Any) -> None:
    """Each pipeline's re-plans so far: the cap on them holds across restarts. None where the record
    has none (an earlier release) or a malformed one (counted from 0 again)."""
    if records is None:
        return
    try:
        replans = [int(r) for r in records]
        if len(replans) != job.spec.dp or not all(0 <= r <= MAX_REPLANS for r in replans):
            raise ValueError(f"not {job.spec.dp} pipelines' re-plans, each 0 to {MAX_REPLANS}: {records!r}")
    except (TypeError, ValueError) as e:
        log.warning("job %s: verification's re-plan counts not resumed: %s", job.job_id, e)
        return
    for check, count in zip(job.model.checks, replans):
        check.replans = count


def _reference(record: Any) -> tuple[float, float] | None:
    """(median, noise) of a saved reference window, or None; ValueError or TypeError if malformed."""
    if record is None:
        return None
    reference_s, noise = (float(v) for v in record)
    if not (0 < reference_s < math.inf and 0 <= noise < math.inf):
        raise ValueError(f"not a reference window's median and noise: {record!r}")
    return reference_s, noise

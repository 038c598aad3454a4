"""A job's plans: the plan each pipeline should run, the plans solved so far, and the plans
published to the ranks.

Each pipeline has its own plan (the tensor-parallel ranks of a stage share the stage's
frequencies): the no-slowdown plan of its GPU models, or, while another pipeline straggles, the
least-energy plan at the straggler's pace. Every plan change gets a new `plan_version` and a
start iteration shared by all ranks of the pipeline, a lead ahead of the latest iteration.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from perseus.profiler.profile import Profile
from perseus.service.planning import PlanResult
from perseus.service.ranks import Models
from perseus.wire.spec import JobSpec

# A new plan starts this many iterations after the latest one any rank has reached, and at least
# PLAN_LEAD_S later at the measured iteration time, so that every rank (polling a few times a
# second) switches at the same iteration boundary.
PLAN_LEAD_ITERATIONS = 2
PLAN_LEAD_S = 1.0
MAX_PLAN_LEAD = 10_000
MAX_RESULTS = 64  # solved plans kept per job (no-slowdown and in-force plans are always kept)

PlanKey = tuple[Models, float | None]  # (models, deadline in s or None: no slowdown)
Straggling = tuple[int, float, str]  # (pipeline, factor, "declared" or "detected")


def deadline_key(deadline_s: float | None) -> float | None:
    return None if deadline_s is None else round(deadline_s, 6)


@dataclass(frozen=True)
class PublishedPlan(PlanResult):
    """A pipeline's plan as its ranks see it: its version, the iteration it applies from, the GPU
    models it was planned for and its deadline (None: no slowdown) -- job.json's "plans"."""

    version: int
    start_iteration: int
    models: Models = ()
    deadline_s: float | None = None
    reference: bool = False  # maximum clocks for one window: verification's fresh target
    # The first version of the clocks it runs (a reference window: of the plan it checks): a plan
    # that resumes after a reference window keeps it, a re-plan to other clocks starts it anew.
    # 0 in records saved before it was kept: `version` then.
    since_version: int = 0

    @property
    def since(self) -> int:
        return self.since_version or self.version

    @property
    def key(self) -> PlanKey:
        return self.models, deadline_key(self.deadline_s)

    def result(self) -> PlanResult:
        """The solved plan this was published from."""
        return PlanResult(**{f.name: getattr(self, f.name) for f in fields(PlanResult)})

    @classmethod
    def from_record(cls, doc: dict[str, Any]) -> PublishedPlan:
        return cls(**{**doc, "stage_frequencies": _frequencies(doc), "models": tuple(doc.get("models", ()))})


def plan_result(doc: dict[str, Any]) -> PlanResult:
    """A solved plan from its saved record (JSON lists where it holds tuples)."""
    return PlanResult(**{**{f.name: doc[f.name] for f in fields(PlanResult)}, "stage_frequencies": _frequencies(doc)})


def _frequencies(doc: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(f) for f in row) for row in doc["stage_frequencies"])


def document_name(spec: JobSpec, key: PlanKey) -> str:
    """File name (without .json) of a plan document: "plan" for the job's own GPU model with no
    slowdown, else "plan-<hash>" per distinct (models, deadline)."""
    models, deadline = key
    if deadline is None and set(models) == {spec.gpu_model}:
        return "plan"
    return "plan-" + hashlib.sha256(repr(key).encode()).hexdigest()[:12]


def plan_lead(recent_time_s: float | None) -> int:
    """Iterations between the latest one reached and a new plan's start, at `recent_time_s` per iteration."""
    lead = PLAN_LEAD_ITERATIONS
    if recent_time_s:  # bounded below by the protocol; the min() keeps the ceil finite regardless
        lead = max(lead, math.ceil(min(PLAN_LEAD_S / recent_time_s, MAX_PLAN_LEAD)))
    return min(lead, MAX_PLAN_LEAD)


class PlanBook:
    """The plans of one job of `dp` pipelines. `models` gives each pipeline's stage models."""

    def __init__(self, dp: int, models: Callable[[int], Models]) -> None:
        self.dp = dp
        self.models = models
        self.plans: dict[int, PublishedPlan] = {}  # pipeline -> the plan its ranks run
        self.results: dict[PlanKey, PlanResult | str] = {}  # solved plans; str: why the planner could not
        # Pipelines measuring a reference window: they run this (maximum clocks) in place of their plan.
        self.references: dict[int, PlanResult] = {}
        # Pipeline -> the clocks of its last plan other than a reference window (`since_version`).
        self.clocks: dict[int, tuple[tuple[int, ...], ...]] = {}
        self.last_version = 0

    def base(self, pipeline: int) -> PlanResult | None:
        """The pipeline's solved no-slowdown plan, if any."""
        result = self.results.get((self.models(pipeline), None))
        return result if isinstance(result, PlanResult) else None

    def base_keys(self) -> list[PlanKey]:
        return [(self.models(k), None) for k in range(self.dp)]

    def wanted(self, straggler: Straggling | None) -> dict[int, PlanKey]:
        """The plan each pipeline should run: its models and deadline (None: no slowdown; also
        while any base plan is unsolved, since deadlines are relative to them)."""
        keys: dict[int, PlanKey] = dict(enumerate(self.base_keys()))
        if straggler is None:
            return keys
        pace = self.pace(straggler)
        if pace is None:  # a base plan is unsolved
            return keys
        for k in keys:
            base = self.base(k)
            if k != straggler[0] and base is not None and pace > base.iteration_time_s:
                keys[k] = (self.models(k), deadline_key(pace))
        return keys

    def pace(self, straggler: Straggling) -> float | None:
        """The straggler's iteration time on the model's scale: its factor times its own
        no-slowdown plan's (declared: its planned time) or the others' median (detected: their
        measured time is what it was compared with); None while a base plan is unsolved."""
        slow, factor, source = straggler
        bases = {k: b for k in range(self.dp) if (b := self.base(k)) is not None}
        if len(bases) < self.dp:
            return None
        if source == "declared" or self.dp == 1:
            return factor * bases[slow].iteration_time_s
        return factor * statistics.median(b.iteration_time_s for k, b in bases.items() if k != slow)

    def missing(
        self, wanted: dict[int, PlanKey], profile: Callable[[Models], Profile | None]
    ) -> list[tuple[PlanKey, Profile]]:
        """Plans to solve (with their profile, once complete): base plans first, then `wanted` deadlines."""
        missing: dict[PlanKey, Profile] = {}
        for key in self.base_keys() + list(wanted.values()):
            if key not in self.results and key not in missing:
                rows = profile(key[0])
                if rows is not None:
                    missing[key] = rows
        return list(missing.items())

    def add_result(self, key: PlanKey, result: PlanResult | str) -> None:
        """A solved plan, or the planner's reason it could not; the oldest deadlines are forgotten
        past MAX_RESULTS (many declared factors)."""
        self.results[key] = result
        if len(self.results) > MAX_RESULTS:
            keep = {plan.key for plan in self.plans.values()} | {key}
            for old in [k for k in self.results if k[1] is not None and k not in keep][
                : len(self.results) - MAX_RESULTS
            ]:
                del self.results[old]

    def publish(self, wanted: dict[int, PlanKey], start_iteration: int) -> list[int]:
        """Publish, with one new version starting at `start_iteration`, the wanted plan of every
        pipeline whose clocks change (another key, or the same key solved anew: a re-plan after
        verification) and is solved; the pipelines changed."""
        changed: dict[int, tuple[PlanKey, PlanResult]] = {}
        for k, key in wanted.items():
            result = self.results.get(key)
            if result is None:
                continue  # being solved: keep the current plan meanwhile
            if isinstance(result, str):
                key = (self.models(k), None)  # the deadline failed: run the no-slowdown plan
                result = self.results.get(key)
            if isinstance(result, PlanResult):
                result = self.references.get(k, result)
                if not self.runs(k, key, result):
                    changed[k] = (key, result)
        if not changed:
            return []
        self.last_version += 1
        for k, ((models, deadline), result) in changed.items():
            base = {f.name: getattr(result, f.name) for f in fields(PlanResult)}
            reference = k in self.references
            before = self.plans.get(k)
            same = reference or self.clocks.get(k) == result.stage_frequencies
            self.plans[k] = PublishedPlan(
                **base,
                version=self.last_version,
                start_iteration=start_iteration,
                models=models,
                deadline_s=deadline,
                reference=reference,
                since_version=before.since if before is not None and before.models == models and same else 0,
            )
            if not reference:
                self.clocks[k] = result.stage_frequencies
        return sorted(changed)

    def retarget(self, wanted: dict[int, PlanKey]) -> list[int]:
        """Give each plan that already runs the clocks solved for its wanted deadline that deadline
        (no new version: see `runs`), so that status and job.json say which deadline it serves and
        a restarted service finds it solved; the pipelines retargeted."""
        retargeted = []
        for k, key in wanted.items():
            plan, result = self.plans.get(k), self.results.get(key)
            if plan is not None and plan.key != key and isinstance(result, PlanResult) and self.runs(k, key, result):
                self.plans[k] = replace(plan, deadline_s=key[1])
                retargeted.append(k)
        return retargeted

    def runs(self, pipeline: int, key: PlanKey, result: PlanResult) -> bool:
        """Whether the pipeline already runs `result`'s clocks on its GPU models (a reference window
        or not, alike): a plan solved for another deadline, or anew, that sets every instruction to
        the clock it runs is no change. A new version would start verification over (a reference
        window) and the planned mean with it, for iterations that run as before."""
        plan = self.plans.get(pipeline)
        return (
            plan is not None
            and plan.models == key[0]
            and plan.reference == (pipeline in self.references)
            and plan.stage_frequencies == result.stage_frequencies
        )

    def restart(self) -> None:
        """The job runs again from iteration 0: every plan applies at once."""
        self.plans = {k: replace(plan, start_iteration=0) for k, plan in self.plans.items()}

    def withdraw(self) -> None:
        """Forget every plan, published or solved (a new run of the job plans on its own
        baseline); versions go on counting, so no rank mistakes a new plan for one it holds."""
        self.plans = {}
        self.results = {}
        self.references = {}
        self.clocks = {}

    def drop_failures(self) -> None:
        """Forget why plans could not be solved: a new run of the job tries again."""
        self.results = {k: r for k, r in self.results.items() if not isinstance(r, str)}

    def forget_models(self, gpu_models: set[str]) -> None:
        """Forget the plans, published or solved, of every pipeline on one of these GPU models."""
        self.plans = {k: p for k, p in self.plans.items() if not gpu_models & set(p.models)}
        self.results = {k: r for k, r in self.results.items() if not gpu_models & set(k[0])}
        self.references = {k: r for k, r in self.references.items() if k in self.plans}
        self.clocks = {k: c for k, c in self.clocks.items() if k in self.plans}

    def record(self, pipeline: int) -> dict[str, Any]:
        """The pipeline's published plan as saved; a reference window's with the plan it checks
        (`checks`: a restart resumes that plan, and a job record tells its figures)."""
        plan = self.plans[pipeline]
        doc = asdict(plan)
        solved = self.results.get(plan.key)
        if plan.reference and isinstance(solved, PlanResult):
            doc["checks"] = asdict(solved)
        return doc

    def restore(self, pipeline: int, plan: PublishedPlan, checks: PlanResult | None = None) -> None:
        """A plan published before a restart of the service (see perseus.service.persistence);
        for a reference window, `checks` is the plan it checked (kept as the solved plan, so the
        next publication runs it again, not maximum clocks)."""
        self.plans[pipeline] = plan
        self.results[plan.key] = checks if plan.reference and checks is not None else plan.result()
        ran = checks if plan.reference else plan
        if ran is not None:
            self.clocks[pipeline] = ran.stage_frequencies

    def checked(self, plan: PublishedPlan) -> PublishedPlan | PlanResult:
        """The plan whose figures a pipeline is predicted by: a reference window's, the plan it
        checks (the window runs maximum clocks for a few iterations, then that plan resumes)."""
        solved = self.results.get(plan.key)
        return solved if plan.reference and isinstance(solved, PlanResult) else plan

    def predicted(self, running: bool = False) -> tuple[float, float, float]:
        """Iteration time (the slowest pipeline's plan), energy and energy at maximum clocks
        (summed over pipelines); a pipeline without a plan is counted at its peers' mean. A
        pipeline in a reference window counts its plan (the one the window checks), not the
        window; with `running`, the window (maximum clocks: what its iterations should measure)."""
        plans = [plan if running else self.checked(plan) for plan in self.plans.values()]
        energy = sum(p.energy_j for p in plans) * self.dp / len(plans)
        baseline = sum(p.baseline_energy_j for p in plans) * self.dp / len(plans)
        return max(p.iteration_time_s for p in plans), energy, baseline

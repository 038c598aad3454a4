"""A job's profiles: the frequencies its ranks sweep, the stage profiles they upload, merged over
tensor parallelism, the whole-pipeline profiles of the signature cache, and the profile each
pipeline is planned with.

Profiles are kept per GPU model and stage (the tensor-parallel ranks' uploads merged: slowest
time, summed energy), so data-parallel replicas on the same model share them.
"""

from __future__ import annotations

import hashlib

from perseus.exceptions import ConfigError
from perseus.profiler.profile import SWITCH_LATENCIES_META, SWITCH_LATENCY_META, Profile, format_switch_latencies
from perseus.schedules import Schedule
from perseus.service.planning import check_stage_profile, merge_profiles, stage_rows
from perseus.service.ranks import Models, bad_field
from perseus.service.sweep import design_steps
from perseus.wire.parallelism import merge_tensor_parallel
from perseus.wire.spec import JobSpec, RankInfo, check_sweep_size


class Profiling:
    """`cached_profile`: the job's whole-pipeline profile from the signature cache (no sweep then)."""

    def __init__(self, spec: JobSpec, cached_profile: Profile | None = None) -> None:
        self.spec = spec
        self.cached: dict[str, Profile] = {} if cached_profile is None else {spec.gpu_model: cached_profile}
        self.uploads: dict[tuple[str, int], dict[int, Profile]] = {}  # (model, stage) -> tp_index -> upload
        self.upload_names: dict[tuple[str, int, int], str] = {}  # (model, stage, tp_index) -> state file name
        self.merged: dict[str, dict[int, Profile]] = {}  # model -> stage -> merged over tensor parallel
        # The frequencies ranks sweep: () when cached, None until the spec or the first rank names them.
        self.sweep: tuple[int, ...] | None = () if cached_profile is not None else spec.sweep_frequencies
        self._steps: tuple[tuple[int, ...], ...] = ()  # design_steps of `sweep`, made once
        # GPU models whose profile this run of the job's ranks did not measure (the signature
        # cache's, or an earlier run's): checked against the run's spans before it is planned on.
        self.inherited: set[str] = set(self.cached)

    def steps(self) -> tuple[tuple[int, ...], ...]:
        """The sweep's steps as `Table.sweep_steps` carries them (perseus.service.sweep); () before the
        sweep's frequencies are known."""
        if not self._steps and self.sweep:
            self._steps = design_steps(self.sweep, self.spec.iterations_per_frequency)
        return self._steps

    def check_sweep(self, info: RankInfo) -> None:
        """ServiceError (bad_field) unless `info`'s GPU supports every sweep frequency (the first
        rank's frequencies are the sweep if the spec names none)."""
        if self.sweep is None:
            try:
                check_sweep_size(len(info.frequencies), self.spec.iterations_per_frequency, "the sweep")
            except ConfigError as e:
                raise bad_field(f"rank {info.rank}'s clocks would be the sweep (the spec names none): {e}") from None
            self.sweep = info.frequencies
        missing = sorted(set(self.sweep) - set(info.frequencies), reverse=True)
        if missing:
            raise bad_field(
                f"rank {info.rank}'s GPU does not support sweep frequencies {missing[:8]} MHz; "
                "set JobSpec.sweep_frequencies to frequencies every rank supports"
            )

    def stages_of(self, model: str) -> tuple[int, ...]:
        """The stages profiled on `model` (every stage when its profile is cached)."""
        if model in self.cached:
            return tuple(range(self.spec.pp))
        return tuple(sorted(self.merged.get(model, {})))

    def add(self, schedule: Schedule, info: RankInfo, stage: int, profile: Profile) -> str | None:
        """Accept `info`'s rank's profile of its stage; the state-file name to save it under, or
        None if that rank's share of (GPU model, stage) is already in (the first one is kept).
        ServiceError (bad_field) if the profile does not fit the stage or the rank's GPU."""
        rank = info.rank
        if stage != info.stage:
            raise bad_field(f"rank {rank} registered stage {info.stage} but uploaded a profile for stage {stage}")
        try:
            check_stage_profile(schedule, stage, profile)
        except ConfigError as e:
            raise bad_field(str(e)) from None
        unsupported = sorted(
            {p.frequency for pts in profile.points.values() for p in pts} - set(info.frequencies), reverse=True
        )
        if unsupported:
            raise bad_field(
                f"profile of stage {stage} has rows at {unsupported[:8]} MHz, which rank {rank}'s GPU does not support "
                f"(it registered {len(info.frequencies)} frequencies); profile only frequencies the rank can run"
            )
        model = info.gpu_model
        if stage in self.stages_of(model) or info.tp_index in self.uploads.get((model, stage), {}):
            return None
        name = f"stage-{stage}" + (f"-tp{info.tp_index}" if info.tp_index else "")
        if model != self.spec.gpu_model:
            name += "-m" + hashlib.sha256(model.encode()).hexdigest()[:8]
        self.take(model, stage, info.tp_index, profile, name)
        return name

    def take(self, model: str, stage: int, tp_index: int, profile: Profile, name: str) -> None:
        """Keep one tensor-parallel share; once every share of the stage is in, merge them."""
        shares = self.uploads.setdefault((model, stage), {})
        shares[tp_index] = profile
        self.upload_names[(model, stage, tp_index)] = name
        if len(shares) == self.spec.tp:
            try:
                merged = merge_tensor_parallel([shares[t] for t in range(self.spec.tp)])
            except ConfigError as e:
                del shares[tp_index]
                raise bad_field(str(e)) from None
            self.merged.setdefault(model, {})[stage] = merged

    def drop(self, info: RankInfo, name: str) -> None:
        """Forget the upload `add` took from `info`'s rank under `name`."""
        model, stage, tp_index = info.gpu_model, info.stage, info.tp_index
        if self.upload_names.get((model, stage, tp_index)) != name:
            return
        del self.upload_names[(model, stage, tp_index)]
        self.uploads.get((model, stage), {}).pop(tp_index, None)
        self.merged.get(model, {}).pop(stage, None)

    def inherit(self) -> None:
        """A new run of the job: every profile so far was measured by an earlier one."""
        self.inherited = set(self.cached) | set(self.merged)

    def forget_models(self, models: set[str], frequencies: tuple[int, ...] | None) -> None:
        """Forget every profile of these GPU models (cached or uploaded): they are profiled again,
        sweeping the spec's frequencies, or `frequencies` (a rank's) if it names none."""
        for model in models:
            self.cached.pop(model, None)
            self.merged.pop(model, None)
            self.inherited.discard(model)
            for key in [k for k in self.uploads if k[0] == model]:
                del self.uploads[key]
            for name in [k for k in self.upload_names if k[0] == model]:
                del self.upload_names[name]
        if not self.sweep:
            self.sweep = self.spec.sweep_frequencies or frequencies
            self._steps = ()

    def model_profile(self, model: str) -> Profile | None:
        """Every stage's profile on `model` merged (what the signature cache keeps), if complete."""
        stages = self.merged.get(model, {})
        if len(stages) < self.spec.pp:
            return None
        merged = merge_profiles(stages, self._blocking_power())
        latency = max(p.switch_latency_s() for p in stages.values())
        if latency:
            merged.meta[SWITCH_LATENCY_META] = f"{latency:.4g}"  # the cached profile keeps it
        targets: dict[int, float] = {}
        for p in stages.values():
            for clock, seconds in p.switch_latencies_s().items():
                targets[clock] = max(seconds, targets.get(clock, 0.0))
        if targets:
            merged.meta[SWITCH_LATENCIES_META] = format_switch_latencies(targets)
        return merged

    def _blocking_power(self) -> float | None:
        power = self.spec.blocking_power_w
        return None if power is None else power * self.spec.tp  # every GPU of a stage blocks

    def pipeline_profile(self, schedule: Schedule, models: Models) -> Profile | None:
        """The profile a pipeline with these stage models is planned with: the stages' measured
        rows, each stage's GPU's clock switch latency in its meta (`Profile.switch_latency_s(stage)`,
        which `plan_pipeline` keeps every planned clock for), plus the spec's host and hop
        overheads. None until complete."""
        stages: dict[int, Profile] = {}
        measured: dict[int, Profile] = {}  # what carries each stage's GPU's switch latencies
        for s, model in enumerate(models):
            if model in self.cached:
                rows = stage_rows(schedule, s, self.cached[model])
                measured[s] = self.cached[model]
            else:
                rows = self.merged.get(model, {}).get(s)
            if rows is None:
                return None
            stages[s] = rows
            measured.setdefault(s, rows)
        merged = merge_profiles(stages, self._blocking_power())
        for s, source in measured.items():
            latency = source.switch_latency_s()
            if latency:
                merged.meta[f"{SWITCH_LATENCY_META}@{s}"] = f"{latency:.4g}"
            targets = source.switch_latencies_s()
            if targets:
                merged.meta[f"{SWITCH_LATENCIES_META}@{s}"] = format_switch_latencies(targets)
        return merged.with_overheads(self.spec.instruction_overhead_s, self.spec.hop_latency_s)

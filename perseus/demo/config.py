"""The demo job's settings, passed from the launcher to every rank as one JSON file (no torch here:
the `perseus` command line imports this)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from perseus.demo.workload import DEFAULT_TIME_SCALE
from perseus.exceptions import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The demo transformer's shape (see perseus.demo.model)."""

    vocab_size: int = 256
    seq_len: int = 16
    d_model: int = 32
    num_heads: int = 2
    layers_per_stage: int = 1


@dataclass(frozen=True)
class DemoConfig:
    out_dir: str
    num_stages: int = 4
    # Data-parallel pipelines (torch mapping: rank = stage + num_stages * pipeline); the last one
    # runs on GPUs throttled `straggler` times slower (set by the launcher) when straggler > 1.
    dp: int = 1
    straggler: float = 1.0
    num_microbatches: int = 8
    microbatch_size: int = 2
    seed: int = 0
    learning_rate: float = 1e-3
    time_scale: float = DEFAULT_TIME_SCALE
    model: ModelConfig = field(default_factory=ModelConfig)
    # Iterations: baseline ones at maximum clocks without Perseus (the first warms up), then
    # under Perseus: warm-up, profiling, the planning ones (the service calibrates its model on
    # them), then `planned_iterations` planned ones (after the switch), or more until the plan
    # is verified; `max_iterations` under Perseus stops the job even if no plan arrives.
    # With a straggler, the planned iterations count from the straggler-aware re-plan, and
    # `replan_wait_iterations` planned iterations without one stop the job.
    baseline_iterations: int = 3
    planned_iterations: int = 4
    max_iterations: int = 200
    replan_wait_iterations: int = 30
    # Perseus: the planner service's address (None: no Perseus, baseline iterations only)
    server: str | None = None
    warmup_iterations: int = 1
    iterations_per_frequency: int = 2
    sweep_frequencies: list[int] | None = None
    tag: str = "perseus-demo"
    # Run the plan until the service's verification has decided on it, as the launcher tells the
    # ranks (perseus.demo.watch); a job started without the launcher leaves it off.
    await_verification: bool = False
    # Iterations at maximum clocks after Perseus closed (phase "after", the first warms up): the
    # baseline again, on the other side of the planned iterations.
    after_iterations: int = 0

    def __post_init__(self) -> None:
        for name in ("num_stages", "dp", "num_microbatches", "microbatch_size", "planned_iterations", "max_iterations"):
            if getattr(self, name) < 1:
                raise ConfigError(f"demo setting {name} must be >= 1, got {getattr(self, name)}")
        if self.baseline_iterations < 2:
            raise ConfigError(
                "demo setting baseline_iterations must be >= 2 (the first one warms up), got "
                f"{self.baseline_iterations}"
            )
        if not self.straggler >= 1.0 or (self.straggler > 1.0 and self.dp < 2):
            raise ConfigError(
                f"demo setting straggler must be >= 1.0, and > 1.0 only with dp >= 2; got {self.straggler} with "
                f"dp={self.dp}"
            )

    @property
    def world_size(self) -> int:
        return self.num_stages * self.dp

    @property
    def straggler_pipeline(self) -> int | None:
        """The throttled pipeline: the last one (the first one uploads the shared profiles)."""
        return self.dp - 1 if self.straggler > 1.0 else None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> DemoConfig:
        doc = dict(doc)
        doc["model"] = ModelConfig(**doc.get("model", {}))
        return cls(**doc)

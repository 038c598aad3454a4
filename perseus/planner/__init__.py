"""The planner core: schedule DAGs, the evaluator, and frequency plans. Pure and deterministic."""

from perseus.planner.dag import DagArrays, build_dag, dag_arrays
from perseus.planner.evaluator import (
    Evaluation,
    Evaluator,
    Options,
    StageStats,
    evaluate,
    max_frequencies,
    shared_frequencies,
    uniform_frequencies,
)

__all__ = [
    "DagArrays",
    "Evaluation",
    "Evaluator",
    "Options",
    "StageStats",
    "build_dag",
    "dag_arrays",
    "evaluate",
    "max_frequencies",
    "shared_frequencies",
    "uniform_frequencies",
]

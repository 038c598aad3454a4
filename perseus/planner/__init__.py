"""The planner core: schedule DAGs, the evaluator, and frequency plans. Pure and deterministic."""

from perseus.planner.dag import DagArrays, build_dag, dag_arrays
from perseus.planner.evaluator import (
    Choices,
    Evaluation,
    Evaluator,
    StageStats,
    evaluate,
    max_frequencies,
    shared_frequencies,
    uniform_frequencies,
)

__all__ = [
    "Choices",
    "DagArrays",
    "Evaluation",
    "Evaluator",
    "StageStats",
    "build_dag",
    "dag_arrays",
    "evaluate",
    "max_frequencies",
    "shared_frequencies",
    "uniform_frequencies",
]

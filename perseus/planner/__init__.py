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
from perseus.planner.plan import Plan
from perseus.planner.solver import FrontierPoint, Planner

__all__ = [
    "Choices",
    "DagArrays",
    "Evaluation",
    "Evaluator",
    "FrontierPoint",
    "Plan",
    "Planner",
    "StageStats",
    "build_dag",
    "dag_arrays",
    "evaluate",
    "max_frequencies",
    "shared_frequencies",
    "uniform_frequencies",
]

"""The planner service (`perseus serve`): jobs, their profiles and plans, and their state on disk."""

from perseus.service.budget import Budget
from perseus.service.service import PlannerService

__all__ = ["Budget", "PlannerService"]

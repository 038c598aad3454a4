"""The rank side of the planner service: the client each rank talks to it through."""

from perseus.client.planner_client import Assignment, PlannerClient

__all__ = ["Assignment", "PlannerClient"]

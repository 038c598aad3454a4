"""The planner service (`perseus serve`): jobs, their profiles and plans, and their state on disk.

service       PlannerService: answers the requests, moves work between the parts below
transport     the ROUTER socket and its loop
admission     the jobs held within the Budget (budget.py): admission and idle eviction
workers       the threads off the loop: schedule builder, planning pool
job           one job's state machine, made of:
  ranks         the registered ranks (coordinates, GPU models, uploader election)
  profiles      the sweep, uploaded and cached profiles, each pipeline's profile
  plans         wanted, solved and published plans
  measurements  reported iterations and stragglers (straggler.py detects, tally.py sums)
  status        what a job tells; persistence: its job.json record
planning      schedule, profile checks and the planner call; state: the state directory
"""

from perseus.service.budget import Budget
from perseus.service.service import PlannerService

__all__ = ["Budget", "PlannerService"]

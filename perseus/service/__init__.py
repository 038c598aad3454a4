"""The planner service (`perseus serve`): jobs, their profiles and plans, and their state on disk.

service       PlannerService: puts the parts below together and runs the loop
transport     the ROUTER socket and its loop
handlers      the answer to each request
admission     the jobs held within the Budget (budget.py): admission and idle eviction
workers       the threads off the loop: schedule builder, calibrator, planning pool
results       the loop's side of them: takes built schedules, calibrations and solved plans, publishes
              plans, acts on verification's verdicts
keeper        the jobs on disk: saved on change, retried, resumed at startup; fault isolation
job           one job's state machine, made of:
  ranks         the registered ranks (coordinates, GPU models, uploader election)
  profiles      the sweep, uploaded and cached profiles, each pipeline's profile
  plans         wanted, solved and published plans
  measurements  reported iterations and stragglers (straggler.py detects, tally.py sums)
  model         what plans are made on and held to: timelines (spans, each model's calibration
                state), calibration (the fit, on a worker), verification (each plan checked)
  status        what a job tells; persistence: its job.json record
planning      schedule, profile checks and the planner call; state: the state directory
"""

from perseus.service.budget import Budget
from perseus.service.service import PlannerService

__all__ = ["Budget", "PlannerService"]

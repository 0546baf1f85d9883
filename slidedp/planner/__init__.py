"""The planner: from a job to the step plan its ranks carry out, and what it charged for it.

`plan_for` (job.py) is the one entry: the job file's [plan] section, the store's facts and the host's
room in, a `JobPlan` out (the `StepPlan` and its report). Under it: `make_plan` (plan.py) searches step
plans, `step_model` predicts a step's time and `costs` its GPU memory, for a `Workload` (workload.py);
`Plan` (plan_record.py) is the planner's report. What the planner charges is measured on the host:
the `Calibration` record (calibration.py), measured by calibrate.py, host_bandwidth.py, links.py and,
per shape of GPU work, measure.py, in a process of its own (inputs.py), and kept in the host's cache
(cache.py) with what runs taught it (learn.py).
"""

from slidedp.planner.cache import load_or_calibrate
from slidedp.planner.calibrate import calibrate
from slidedp.planner.calibration import REFERENCE_CALIBRATION, Calibration, CalibrationError
from slidedp.planner.job import JobPlan, StoreFacts, plan_for
from slidedp.planner.plan import Plan, PlanError, make_plan
from slidedp.planner.step_model import predict_step
from slidedp.planner.workload import HostRoom, Workload

__all__ = [
    "REFERENCE_CALIBRATION",
    "Calibration",
    "CalibrationError",
    "JobPlan",
    "Plan",
    "PlanError",
    "HostRoom",
    "StoreFacts",
    "Workload",
    "calibrate",
    "load_or_calibrate",
    "make_plan",
    "plan_for",
    "predict_step",
]

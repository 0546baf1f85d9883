"""Step-time model and planner: calibrate the host, predict a step, pick the plan that fits."""

from slidedp.planner.cache import load_or_calibrate
from slidedp.planner.calibrate import calibrate
from slidedp.planner.calibration import REFERENCE_CALIBRATION, Calibration, CalibrationError
from slidedp.planner.plan import Plan, PlanError, make_plan
from slidedp.planner.step_model import predict_step
from slidedp.planner.workload import HostRoom, Workload

__all__ = [
    "REFERENCE_CALIBRATION",
    "Calibration",
    "CalibrationError",
    "Plan",
    "PlanError",
    "HostRoom",
    "Workload",
    "calibrate",
    "load_or_calibrate",
    "make_plan",
    "predict_step",
]

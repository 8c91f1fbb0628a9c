"""tierplan's runtime: replay a plan inside an ordinary PyTorch training loop.

    handle = apply_plan(model, "plans/gpt-tiny-cpu-host.json")
    ...train...
    print(handle.report()); handle.remove()

Never imports pulp; reads plans through ``planner.formats``.
"""
from .apply import Handle, InputTooLargeError, PlanMismatchError, UnsupportedModelError, apply_plan
from .checkpoint import meta_parameters
from .recompute import RecomputeMismatch
from .sharded import shard_for_plan
from planner.formats.report import Report, StepRecord

__all__ = ["apply_plan", "meta_parameters", "Handle", "Report", "StepRecord", "PlanMismatchError",
           "InputTooLargeError", "UnsupportedModelError", "RecomputeMismatch",
           "shard_for_plan"]

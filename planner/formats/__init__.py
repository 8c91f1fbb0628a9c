"""The file formats: hardware spec (YAML), profile (JSON), plan (JSON), run report (JSON).

One frozen dataclass per format with ``to_dict``/``from_dict``; JSON is written with sorted
keys, bytes as integers, times in seconds, and a ``schema`` key that is checked on load.
Loaders turn every problem with a user's file into a ``UserError`` (exit code 2) naming the
file and the fix. ``docs/file-formats.md`` documents every field.

Modules, by job:

- ``enums``: schema identifiers and the enumerations (unit kinds, activations, tiers,
  policies, engines);
- ``validate``: the validation engine every loader uses (field kinds and ranges, one-line
  errors);
- ``spec``: ``HardwareSpec``, ``with_nvme_drives`` (the same drives, n of them);
- ``profile``: ``UnitRecord``, ``Profile`` and the checks on units and the model section;
- ``decisions``: ``LayerDecision`` and ``Home``, the choices for one unit;
- ``plan``: ``Plan`` and its sections (``Budgets``, ``SolverRecord``, ``Prediction``), the
  schedule read back from JSON; current schema only;
- ``events``: the schedule's vocabulary (streams, ops, tensor classes, ``Event``);
- ``fileio``: reading and writing files safely (paths, size and depth limits, atomic writes);
- ``report``: the measured run report (``tierplan.report/1``);
- ``executor``: the plan's ``executor`` section (what the runtime needs that the cost model
  computes) and the piece sizes the plan's shares refer to;
- ``identity``: what ties a plan to a model (structure hash, parameter and input tables, the
  identity hash a profile and a plan carry, dtype names);
- ``calls``: the block-call convention the profile's bytes and the runtime's replay share
  (where a block's hidden state is, ``StateSnapshot``); torch imported lazily.

This package is the lowest layer: it imports neither torch (``identity`` and ``calls`` only
inside functions) nor pulp, nor anything of the planner above it, and it is all of the planner
the runtime imports (it reads plans through it; ``UserError`` is re-exported for it). A
``tierplan.plan/1`` plan is upgraded by
``planner.plans.load``, which sits above the cost model that rebuilds its schedule.

This ``__init__`` re-exports the names other packages import.
"""
from __future__ import annotations

from planner.errors import UserError
from planner.formats.decisions import RESIDENT, Home, LayerDecision
from planner.formats.enums import (CLIPS, ENGINES, HARDWARE_SCHEMA, MICRO_BATCH_ORDERS,
                                   OPTIMIZER_OVERLAPS, PLAN_SCHEMA, PLAN_SCHEMA_V1,
                                   PLAN_SCHEMA_V2, PROFILE_SCHEMA, REPORT_SCHEMA, Activation,
                                   Policy, Tier, UnitKind)
from planner.formats.executor import (ACC_CHUNK_BYTES, IO_BLOCK_BYTES, STEP_PIECE_ALIGN,
                                      STEP_PIECE_BYTES, Executor, io_requests)
from planner.formats.fileio import read_json, sha256_file, write_atomic, write_json_atomic
from planner.formats.plan import Budgets, Plan, Prediction, SolverRecord, load_plan
from planner.formats.profile import (Profile, UnitRecord, check_model_section, check_units,
                                     load_profile)
from planner.formats.spec import HardwareSpec, nvme_aggregate, with_nvme_drives

__all__ = [
    "CLIPS", "ENGINES", "HARDWARE_SCHEMA", "MICRO_BATCH_ORDERS", "OPTIMIZER_OVERLAPS",
    "PLAN_SCHEMA", "PLAN_SCHEMA_V1", "PLAN_SCHEMA_V2", "PROFILE_SCHEMA",
    "REPORT_SCHEMA", "Activation", "Policy", "Tier", "UnitKind",
    "HardwareSpec", "nvme_aggregate", "with_nvme_drives", "Profile", "UnitRecord", "check_model_section", "check_units",
    "load_profile", "RESIDENT", "Home", "LayerDecision",
    "Budgets", "Plan", "Prediction", "SolverRecord", "load_plan",
    "read_json", "sha256_file", "write_atomic", "write_json_atomic",
    "ACC_CHUNK_BYTES", "IO_BLOCK_BYTES", "io_requests", "STEP_PIECE_ALIGN", "STEP_PIECE_BYTES", "Executor", "UserError",
]

"""Reading plans of any schema this version knows: ``tierplan.plan/3`` and ``/2`` directly
(``planner.formats``), ``tierplan.plan/1`` upgraded first (``planner.plans.upgrade``, which
rebuilds its schedule with the cost model), and ``load_any`` for a plan or a profile.

Everything in the planner that may be handed an old plan reads it here: the verbs
``simulate``, ``upgrade`` (which writes it as today's, with the ``executor`` section the
runtime reads), ``inspect`` and ``diff``. ``runtime.apply_plan`` reads the current schema only
(``planner.formats``) and refuses an older plan naming ``plan upgrade``. The upgrade lives
above the cost model so that the formats layer imports nothing of the planner above it.
"""
from __future__ import annotations

from planner.errors import UserError
from planner.formats import (PLAN_SCHEMA, PLAN_SCHEMA_V1, PLAN_SCHEMA_V2, PROFILE_SCHEMA, Plan,
                             Profile, read_json)
from planner.plans.upgrade import plan_v1_to_v2


def plan_from_dict(d: dict, source: str = "plan") -> Plan:
    """``Plan.from_dict`` that also reads a ``/1`` plan, upgraded to today's schema."""
    if d.get("schema") == PLAN_SCHEMA_V1:
        d = plan_v1_to_v2(d, source)
    return Plan.from_dict(d, source)


def load_plan(path) -> Plan:
    """The plan at ``path``, of either schema."""
    return plan_from_dict(read_json(path, "plan"), str(path))


def load_any(path) -> Profile | Plan:
    """Load a profile or a plan, whichever the file's schema says."""
    d = read_json(path, "plan")
    if d.get("schema") in (PLAN_SCHEMA, PLAN_SCHEMA_V2, PLAN_SCHEMA_V1):
        return plan_from_dict(d, str(path))
    if d.get("schema") == PROFILE_SCHEMA:
        return Profile.from_dict(d, str(path))
    raise UserError(f"'{path}' has schema {d.get('schema')!r}; give a plan ('plan solve') or a "
                    "profile ('plan profile')")


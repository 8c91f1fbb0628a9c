"""The one cost model: the stages of an optimizer step, what every decision holds on each tier
in each stage, what each stage moves on each link, and what each stage's duration is made of.
``docs/formulation.md`` documents it symbol for symbol; ``model``'s docstring says how the
stages run.

Modules:

- ``layout``: the vocabulary: tiers, resources, activation choices, ``Layout`` (stage
  indices), transfer ``KINDS``, the ``View`` protocol, ``Lin``/``evaluate``, ``Windows``;
- ``model``: ``CostModel``, the frozen model of one profile on one spec under one set of
  budgets, built from its parts below, and ``device_budget`` (the reserve and margin taken off);
- ``options``: what each unit may do: homes, activation choices, transfer windows;
- ``memory``: bytes per home, shared tensors, allocations, frees, transients, staging;
- ``loads``: seconds per resource per stage and in the optimizer phase, the step's floor;
- ``ranks``: FSDP2/DDP: per-rank figures, collectives, the engine's device memory;
- ``objective``: the objective's secondary terms (bytes held longer, bytes moved);
- ``schedule``: a plan's events from its decisions and shares;
- ``baselines``: the baseline policies' decisions.
"""
from planner.costmodel.layout import (CHOICE_DECISION, CHOICES, KINDS, REC, RESOURCES, TIERS,
                                      Kind, Layout, Lin, View, Windows, decision_choice, evaluate)
from planner.costmodel.memory import ACC_CHUNK_BYTES, STEP_PIECE_ALIGN, STEP_PIECE_BYTES
from planner.costmodel.loads import ACCUMULATE_TRAFFIC
from planner.costmodel.model import CostModel, device_budget
from planner.costmodel.objective import EPS_S_PER_BYTE

__all__ = ["ACCUMULATE_TRAFFIC", "ACC_CHUNK_BYTES", "CHOICES", "CHOICE_DECISION", "CostModel",
           "EPS_S_PER_BYTE", "KINDS", "Kind", "Layout", "Lin", "REC", "RESOURCES",
           "STEP_PIECE_ALIGN", "STEP_PIECE_BYTES", "TIERS", "View", "Windows", "decision_choice",
           "device_budget", "evaluate"]

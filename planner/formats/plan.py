"""The plan (``tierplan.plan/3``): the container of decisions, schedule and prediction, its
sections (``Budgets``, ``SolverRecord``, ``Prediction``) and the schedule's events read back
from JSON.

The current schema and ``/2`` load here (a ``/2`` plan is read as the schedule it ran:
``after-backward``, ``global`` clipping, ``batch-major``). A ``tierplan.plan/1`` plan is upgraded
by ``planner.plans.load``, above the cost model that rebuilds its schedule.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.errors import UserError
from planner.formats.decisions import LayerDecision
from planner.formats.enums import (CLIPS, ENGINES, MICRO_BATCH_ORDERS, OPTIMIZER_OVERLAPS,
                                   PLAN_SCHEMA, Activation, PLAN_SCHEMA_V1, PLAN_SCHEMA_V2, Tier,
                                   paced_possible)
from planner.formats.executor import Executor
from planner.formats.events import Event, Op, Passes, Stream, TensorClass
from planner.formats.fileio import read_json
from planner.formats.profile import UnitRecord, check_model_section, check_units
from planner.formats.spec import HardwareSpec
from planner.formats.validate import FIX, check_fields, check_schema, entry_where, from_fields, require


@dataclass(frozen=True)
class Budgets:
    """Memory budgets in bytes; 0 means the tier is not used. ``gpu_bytes`` is per rank,
    ``cpu_bytes`` and ``nvme_bytes`` per node."""

    gpu_bytes: int
    cpu_bytes: int = 0
    nvme_bytes: int = 0

    def of(self, tier: str) -> int:
        return getattr(self, f"{tier}_bytes")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str, fix: str) -> "Budgets":
        require(d, ("gpu_bytes", "cpu_bytes", "nvme_bytes"), f"{where} budgets", fix)
        check_fields(d, _BUDGET_FIELDS, f"{where} budgets", fix)
        return cls(d["gpu_bytes"], d["cpu_bytes"], d["nvme_bytes"])


@dataclass(frozen=True)
class SolverRecord:
    """How the plan was found. ``origin`` names the strategy that won (``milp``,
    ``baseline:sqrt``, ...); ``gap`` is relative to the step time."""

    name: str
    status: str
    origin: str = ""
    objective: float | None = None
    gap: float | None = None
    solve_s: float = 0.0
    variables: int = 0
    constraints: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str, fix: str) -> "SolverRecord":
        require(d, ("name", "status"), f"{where} solver", fix)
        check_fields(d, _SOLVER_FIELDS, f"{where} solver", fix)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class Prediction:
    """What the simulator predicts for one optimizer step (``micro_batches`` passes and the
    optimizer phase)."""

    step_s: float
    compute_s: float                 # fwd + bwd of every pass + the optimizer at device speed
    peak_gpu_bytes: int
    peak_cpu_bytes: int
    peak_nvme_bytes: int
    pass_s: float = 0.0              # one forward/backward pass (the first one)
    optimizer_s: float = 0.0         # the optimizer phase after the last pass
    flops: float = 0.0               # model FLOPs of one optimizer step (no recompute)
    # device bytes held in each stage (0 .. 2U: the passes, the last pass's figure; 2U+1: the
    # optimizer phase), the simulator's figures; empty in plans written before it was kept
    stage_gpu_bytes: tuple = ()

    @property
    def tflops(self) -> float:
        return self.flops / self.step_s / 1e12 if self.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str, fix: str) -> "Prediction":
        require(d, ("step_s", "compute_s", "peak_gpu_bytes", "peak_cpu_bytes",
                     "peak_nvme_bytes"), f"{where} predicted", fix)
        check_fields(d, _PREDICTED_FIELDS, f"{where} predicted", fix)
        d = {**d, "stage_gpu_bytes": tuple(d.get("stage_gpu_bytes", ()))}
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


_BUDGET_FIELDS = {"gpu_bytes": "bytes", "cpu_bytes": "bytes", "nvme_bytes": "bytes"}
_SOLVER_FIELDS = {"name": "text", "status": "text", "origin": "text?", "objective": "number?",
                  "gap": "number?", "solve_s": "number", "variables": "count",
                  "constraints": "count"}
_PREDICTED_FIELDS = {"step_s": "number", "compute_s": "number", "pass_s": "number",
                     "optimizer_s": "number", "flops": "number", "peak_gpu_bytes": "bytes",
                     "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes",
                     "stage_gpu_bytes": "bytes list"}


@dataclass(frozen=True)
class Plan:
    """A plan: the decisions per unit and the schedule of every event, plus what it predicts.

    ``units`` and ``model`` are copied from the profile so that a plan stands alone.
    ``schedule`` maps a stream name to its events in the order the stream runs them.
    """

    profile: dict        # {"path": str, "sha256": str}
    model: dict          # the profile's model section (name, batch, seq, structure_hash, ...)
    hardware: dict       # HardwareSpec.to_dict()
    budgets: Budgets
    policy: str
    solver: SolverRecord
    predicted: Prediction
    units: list          # list[UnitRecord]
    layers: list         # list[LayerDecision], one per unit, same order
    schedule: dict       # stream name -> list[Event]
    nvme_dir: str | None = None
    micro_batches: int = 1       # forward/backward passes per optimizer step
    optimizer_depth: int = 3     # units in flight in the optimizer phase (1 or 3)
    world_size: int = 1
    ranks_per_node: int = 1
    engine: str = "none"
    optimizer_s: float = 0.0
    optimizer_workspace_bytes: int = 0
    # The schedule family (``tierplan.plan/3``; docs/file-formats.md, "Schedule families"):
    # ``overlapped``: a unit's optimizer work may run once its last gradient is complete,
    # beside the backward of the units before it (under ``clip: global`` only its state reads
    # may, up to ``optimizer_prefetch_bytes``, held until the optimizer phase).
    optimizer_overlap: str = "after-backward"
    clip: str = "global"
    micro_batch_order: str = "batch-major"
    optimizer_prefetch_bytes: int = 0
    executor: Executor | None = None    # what the runtime needs from the planner (executor.py)
    schema: str = PLAN_SCHEMA

    @property
    def new_families(self) -> list[str]:
        """The schedule families this plan uses beyond ``/2``'s (after-backward, batch-major)."""
        out = []
        if self.optimizer_overlap != "after-backward":
            out.append(f"optimizer_overlap {self.optimizer_overlap!r}")
        if self.micro_batch_order != "batch-major":
            out.append(f"micro_batch_order {self.micro_batch_order!r}")
        return out

    @property
    def hardware_spec(self) -> HardwareSpec:
        return HardwareSpec.from_dict(self.hardware)

    def decision(self, name: str) -> LayerDecision:
        for d in self.layers:
            if d.name == name:
                return d
        raise KeyError(name)

    def events(self, stream: Stream) -> list[Event]:
        return list(self.schedule.get(stream.value, []))

    def all_events(self) -> list[Event]:
        """Every event, by stage, compute first within a stage."""
        order = {s.value: k for k, s in enumerate(Stream)}
        evs = [e for s in sorted(self.schedule, key=order.get) for e in self.schedule[s]]
        return sorted(evs, key=lambda e: (e.stage, order[e.stream.value]))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("budgets", "solver", "predicted"):
            d[k] = d[k].to_dict()
        if self.executor is None:
            del d["executor"]                # a plan from before the section: written as read
        else:
            d["executor"] = self.executor.to_dict()
        d["units"] = [u.to_dict() for u in self.units]
        d["layers"] = [x.to_dict() for x in self.layers]
        d["schedule"] = {s: [e.to_dict() for e in evs] for s, evs in self.schedule.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        """A plan of the current schema; a ``/1`` plan is refused with the loader that reads
        it (``planner.plans.load``, which upgrades it first)."""
        if d.get("schema") == PLAN_SCHEMA_V1:
            raise UserError(f"plan '{source}' has schema {PLAN_SCHEMA_V1!r}, which must be "
                            "upgraded before it is read: 'plan upgrade PLAN -o NEW' writes it "
                            "as today's (planner.plans.load_plan reads it; plan simulate, "
                            "inspect and diff do)")
        if d.get("schema") == PLAN_SCHEMA_V2:
            d = {**d, "schema": PLAN_SCHEMA}      # /3 only adds fields, each with its /2 meaning
        check_schema(d, PLAN_SCHEMA, "plan", source)
        fix = FIX["plan"]
        where = f"plan '{source}'"
        check_fields(d, _PLAN_FIELDS, where, fix)
        plan = from_fields(cls, d, "plan", source)
        check_model_section(plan.model, where, fix)
        check_fields(plan.profile, {"path": "str?", "sha256": "str?"}, f"{where} profile", fix)
        HardwareSpec.from_dict(plan.hardware, source + " (hardware)")
        units = [UnitRecord.from_dict(u, source, "plan") for u in plan.units]
        check_units(units, where, fix)
        layers = [LayerDecision.from_dict(x, source) for x in plan.layers]
        if [u.name for u in units] != [x.name for x in layers]:
            raise UserError(f"{where}: layers and units disagree on names or order; {fix}")
        if plan.engine not in ENGINES:
            raise UserError(f"{where}: engine {plan.engine!r} is not one of {', '.join(ENGINES)}")
        for k, most in (("micro_batches", 4096), ("world_size", 2**20), ("ranks_per_node", 2**10)):
            if not 1 <= getattr(plan, k) <= most:
                raise UserError(f"{where}: {k} must be 1 to {most}; {fix}")
        if plan.world_size > 1 and plan.engine == "none":
            raise UserError(f"{where}: world_size {plan.world_size} needs engine fsdp2 or ddp; {fix}")
        if plan.ranks_per_node > plan.world_size:
            raise UserError(f"{where}: ranks_per_node {plan.ranks_per_node} exceeds world_size "
                            f"{plan.world_size}; {fix}")
        if plan.optimizer_depth not in (1, 3):
            raise UserError(f"{where}: optimizer_depth must be 1 or 3; {fix}")
        for k, allowed in (("optimizer_overlap", OPTIMIZER_OVERLAPS), ("clip", CLIPS),
                           ("micro_batch_order", MICRO_BATCH_ORDERS)):
            if getattr(plan, k) not in allowed:
                raise UserError(f"{where}: {k} {getattr(plan, k)!r} is not one of "
                                f"{', '.join(allowed)}; {fix}")
        if plan.optimizer_overlap == "paced" and not paced_possible(
                plan.clip, plan.engine, plan.micro_batches, plan.micro_batch_order):
            raise UserError(f"{where}: optimizer_overlap 'paced' steps each unit right after "
                            "its one backward, so it needs clip 'none', engine 'none' and "
                            "micro_batches 1 or micro_batch_order 'layer-major' (this plan: "
                            f"clip {plan.clip!r}, engine {plan.engine!r}, {plan.micro_batches} "
                            f"{plan.micro_batch_order}); {fix}")
        schedule = _schedule_from_dict(plan.schedule, {u.name for u in units}, where, fix)
        predicted = Prediction.from_dict(d["predicted"], where, fix)
        n = len(predicted.stage_gpu_bytes)
        if n and n != 2 * len(units) + 2:
            raise UserError(f"{where} predicted: stage_gpu_bytes has {n} entries, but "
                            f"{len(units)} units make {2 * len(units) + 2} stages; {fix}")
        return dataclasses.replace(
            plan, units=units, layers=layers, schedule=schedule,
            budgets=Budgets.from_dict(d["budgets"], where, fix),
            solver=SolverRecord.from_dict(d["solver"], where, fix),
            predicted=predicted,
            executor=(None if d.get("executor") is None
                      else Executor.from_dict(d["executor"], where, fix)))


_PLAN_FIELDS = {"profile": "dict", "model": "dict", "hardware": "dict", "budgets": "dict",
                "policy": "name", "solver": "dict", "predicted": "dict", "units": "list",
                "layers": "list", "schedule": "dict", "nvme_dir": "path?", "optimizer_s": "seconds",
                "optimizer_workspace_bytes": "bytes", "micro_batches": "count",
                "optimizer_depth": "count", "executor": "dict?", "optimizer_overlap": "str", "clip": "str",
                "micro_batch_order": "str", "optimizer_prefetch_bytes": "bytes",
                "world_size": "count", "ranks_per_node": "count", "engine": "str"}


def _event_from_dict(d, units: set, where: str, fix: str) -> Event:
    w = entry_where(d, where, "schedule event", "id", fix)
    require(d, ("stream", "op", "cls", "units", "stage"), w, fix)
    check_fields(d, _EVENT_FIELDS, w, fix)
    try:
        e = Event(stream=Stream(d["stream"]), op=Op(d["op"]), cls=TensorClass(d["cls"]),
                  units=tuple(d["units"]), stage=d["stage"], bytes=d.get("bytes", 0),
                  seconds=float(d.get("seconds", 0.0)), passes=Passes(d.get("passes", "all")))
    except ValueError as err:
        raise UserError(f"{w}: {err}; {fix}") from None
    if not e.units:
        raise UserError(f"{w}: names no unit; {fix}")
    for u in e.units:
        if u not in units:
            raise UserError(f"{w}: names unit {u!r}, which is not a unit of the plan; {fix}")
    if "id" in d and d["id"] != e.id:
        raise UserError(f"{w}: id {d['id']!r} does not match its fields (expected {e.id!r}); {fix}")
    return e


_EVENT_FIELDS = {"id": "str", "stream": "str", "op": "str", "cls": "str", "units": "names",
                 "stage": "count", "bytes": "bytes", "seconds": "number", "passes": "str"}


def _schedule_from_dict(raw: dict, units: set, where: str, fix: str) -> dict:
    """Stream name -> events, each well formed, under its own stream, naming known units, with
    unique ids. Whether the events match the decisions is the simulator's check."""
    schedule, ids = {}, set()
    for s, evs in raw.items():
        if s not in {x.value for x in Stream}:
            raise UserError(f"{where}: schedule stream {s!r} is not one of "
                            f"{', '.join(x.value for x in Stream)}; {fix}")
        if not isinstance(evs, list):
            raise UserError(f"{where}: schedule stream {s!r} must be a list of events; {fix}")
        schedule[s] = [_event_from_dict(e, units, where, fix) for e in evs]
        for e in schedule[s]:
            if e.stream.value != s:
                raise UserError(f"{where}: event {e.id!r} is listed under stream {s!r} but says "
                                f"stream {e.stream.value!r}; {fix}")
            if e.id in ids:
                raise UserError(f"{where}: event id {e.id!r} appears twice; {fix}")
            ids.add(e.id)
    return schedule


def load_plan(path) -> Plan:
    """The plan at ``path``, of the current schema (``planner.plans.load_plan`` also reads
    ``/1`` plans)."""
    return Plan.from_dict(read_json(path, "plan"), str(path))


_HOME_CLASSES = (("weights", TensorClass.WEIGHT), ("grads", TensorClass.GRAD),
                 ("optimizer", TensorClass.STATE))


def check_homes(plan: Plan, where: str = "the plan") -> None:
    """What the runtime can check of a plan's consistency without the cost model (the
    simulator's ``check_plan`` checks all of it when a plan is written, simulated or upgraded):
    a unit's weights, gradients or optimizer state are moved by the schedule only when they
    live off the device (or, weights and gradients, when its step runs on the host); weights,
    gradients or optimizer state at home on NVMe (weights and gradients on the host) have their
    transfers; a unit whose parameters another unit uses (``tied_to``, or
    ``outside_params``) keeps its weights and gradients on the device. Transfers of a sharded
    engine's collectives (the ``net`` stream) are the engine's and not counted; no unit the
    profile found unreplayable (``model.not_replayable``) is recomputed. One ``UserError``
    line naming the unit, the class and the fix."""
    fix = FIX["plan"]
    unreplayable = set(plan.model.get("not_replayable") or ())
    moved: dict = {}
    for s, evs in plan.schedule.items():
        if s == Stream.NET.value:
            continue
        for e in evs:
            if e.is_transfer:
                for u in e.units:
                    moved.setdefault((u, e.cls), e.id)
    for u, d in zip(plan.units, plan.layers):
        if u.name in unreplayable and d.activation is Activation.RECOMPUTE:
            raise UserError(f"{where}: unit {u.name} is recomputed, but its forward cannot be "
                            "run again as it first ran (a tensor in its cache argument is "
                            f"written in place: model.not_replayable); {fix}")
        if (u.tied_to or u.outside_params) and (d.home.weights is not Tier.GPU
                                                or d.home.grads is not Tier.GPU):
            raise UserError(f"{where}: unit {u.name}: home {d.home.label()!r} is not possible "
                            "here (tied weights, and a block's weights used between blocks, "
                            f"stay on the device); {fix}")
        for attr, cls in _HOME_CLASSES:
            tier = getattr(d.home, attr)
            ev = moved.get((u.name, cls))
            # a step on the host reads the gradients and uploads the weights it updated
            host_step = d.home.step is Tier.CPU and attr != "optimizer"
            if tier is Tier.GPU and ev is not None and not host_step:
                raise UserError(f"{where}: unit {u.name} keeps its {attr} on the device but "
                                f"event {ev!r} moves them: its schedule does not match its "
                                f"layers; {fix}")
            needs = tier is Tier.NVME or (tier is Tier.CPU and attr != "optimizer")
            if needs and ev is None:
                raise UserError(f"{where}: unit {u.name} keeps its {attr} on {tier.value} but no "
                                f"event moves them: its schedule does not match its layers; {fix}")

"""Replaying the plan's stages: at each stage's start, wait for the previous stage's transfers
(the stage barrier of ``planner.formats.events``) and issue this stage's.

The training thread tells the driver when a compute event starts (``enter(stage)``: a block's
forward, a backward reached through a gradient hook, the start of a forward pass); the driver
runs every stage up to that one in order, so a stage whose trigger never fired (a unit without
a gradient) is still run, and ``finish`` runs what is left when the backward ends. Each
transfer event of the plan becomes one action on one unit's bytes; where one movement shows as
two events (device to host, then host to disk, on CUDA), the action is taken once, on the event
next to the device. Shares are kept as fractions of the planned bytes.
"""
from __future__ import annotations

import time

from planner.formats.events import Op, Stream, TensorClass


class Action:
    """One share of one unit's bytes moving in one stage."""

    __slots__ = ("cls", "out", "unit", "fa", "fb")

    def __init__(self, cls: TensorClass, out: bool, unit: str, fa: float, fb: float):
        # out: leaving the device (offload, gradient home); else arriving (prefetch, weights)
        self.cls, self.out, self.unit, self.fa, self.fb = cls, out, unit, fa, fb

    def __repr__(self):
        return (f"Action({self.cls.value} {'out' if self.out else 'in'} {self.unit} "
                f"{self.fa:.3f}..{self.fb:.3f})")


def plan_actions(plan, unified: bool) -> dict[int, list[Action]]:
    """Stage -> the actions of the pass's transfers, from the plan's events."""
    U = len(plan.units)
    fwd = {u.name: 1 + i for i, u in enumerate(plan.units)}
    evs = [e for e in plan.all_events() if e.is_transfer and e.stage <= 2 * U]
    primary = []
    for e in evs:
        if e.stream is Stream.HOST or e.passes.value == "rest":
            continue                          # accumulation: part of the gradient action
        near_device = (e.stream in (Stream.D2H, Stream.H2D)) if not unified else \
            (e.stream is Stream.NVME)
        if not near_device:
            continue
        leaving = e.op in (Op.OFFLOAD, Op.WRITE)
        if e.cls in (TensorClass.ACT, TensorClass.CKPT):
            key = (e.cls, leaving, False, e.unit)
        elif e.cls is TensorClass.WEIGHT:
            # fetched twice a pass: for the forward, and again for the backward
            key = (e.cls, False, e.stage >= fwd[e.unit], e.unit)
        elif e.cls is TensorClass.GRAD:
            key = (e.cls, True, False, e.unit)
        else:
            continue
        primary.append((e, key))
    totals, done = {}, {}
    for e, key in primary:
        totals[key] = totals.get(key, 0) + e.bytes
    out: dict[int, list[Action]] = {}
    for e, key in sorted(primary, key=lambda p: p[0].stage):
        total = totals[key] or 1
        a = done.get(key, 0)
        done[key] = a + e.bytes
        out.setdefault(e.stage, []).append(
            Action(key[0], key[1], e.unit, a / total, (a + e.bytes) / total))
    return out


class StageDriver:
    """Runs stages in order for one pass at a time; ``run_action`` does the moving."""

    def __init__(self, actions: dict[int, list[Action]], last_stage: int, run_action, barrier,
                 on_stage=None):
        self.actions = actions
        self.last = last_stage
        self.run_action = run_action      # (ctx, action) -> None
        self.barrier = barrier            # (ctx) -> None: wait for what was issued
        self.on_stage = on_stage          # (ctx, stage) -> None: compute in that stage begins
        self.stage: int | None = None
        self.ctx = None
        self.wait_s = 0.0

    def begin(self, ctx) -> None:
        """A new pass starts (its prologue runs at the first ``enter``)."""
        self.ctx = ctx
        self.stage = None

    def enter(self, stage: int) -> None:
        """The compute of ``stage`` is about to run: run every stage up to it."""
        if self.ctx is None:
            return
        start = 0 if self.stage is None else self.stage + 1
        for s in range(start, min(stage, self.last) + 1):
            if s > 0:
                t0 = time.perf_counter()
                self.barrier(self.ctx)
                self.wait_s += time.perf_counter() - t0
            self.stage = s
            if self.on_stage is not None:
                self.on_stage(self.ctx, s)
            for a in self.actions.get(s, ()):
                self.run_action(self.ctx, a)

    def finish(self) -> None:
        """The pass's backward is over: run the stages left and wait for all of it."""
        if self.ctx is None:
            return
        self.enter(self.last)
        t0 = time.perf_counter()
        self.barrier(self.ctx)
        self.wait_s += time.perf_counter() - t0
        if self.on_stage is not None:
            self.on_stage(self.ctx, self.last + 1)
        self.ctx = None
        self.stage = None

"""The schedule's vocabulary: streams, ops, tensor classes and the one way to build an event.

A plan's schedule is a list of events, each on one stream, each in one stage (see
``planner.costmodel.Layout`` for the stages). Every field a reader needs is a typed field of
``Event``; the ``id`` is a label for people and error messages, built here from those fields
and never parsed back by anyone (the runtime reads ``op``, ``cls``, ``units`` and ``stage``).

The rule that ties events together is the stage barrier: an event of stage s starts when stage
s starts, and stage s+1 starts when every event of stage s has finished. Nothing else orders
events, so an event needs no list of what it waits for.

This module imports neither torch nor pulp: the runtime reads plans through it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Stream(str, enum.Enum):
    """Who runs an event: the compute device, a link, the NVMe device or the host CPU."""

    COMPUTE = "compute"   # the device that trains (a GPU, or the CPU on a cpu-host)
    D2H = "d2h"           # device -> pinned host memory
    H2D = "h2d"           # pinned host memory -> device
    NVME = "nvme"         # reads and writes share one drive
    HOST = "host"         # host CPU work: gradient accumulation, the CPU optimizer step
    NET = "net"           # the interconnect: a sharded engine's collectives (FSDP2, DDP)


class Op(str, enum.Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"     # a segment's forward again, at the backward of its last unit
    BACKWARD = "backward"
    STEP = "step"               # one unit's optimizer step (compute or host stream)
    OFFLOAD = "offload"         # device -> host copy (d2h)
    PREFETCH = "prefetch"       # host -> device copy that serves a forward or a backward (h2d)
    UPLOAD = "upload"           # host -> device copy of weights a CPU step updated (h2d)
    WRITE = "write"             # to a file on NVMe
    READ = "read"               # from a file on NVMe
    ACCUMULATE = "accumulate"   # add a gradient into its home copy on the host
    # collectives of a sharded engine (net stream): issued by the engine, timed by the plan
    ALL_GATHER = "all-gather"           # FSDP2: a unit's weights gathered from every rank
    REDUCE_SCATTER = "reduce-scatter"   # FSDP2: a unit's gradients summed and re-sharded
    ALL_REDUCE = "all-reduce"           # DDP: a unit's gradients summed on every rank


COMPUTE_OPS = (Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.STEP)
_TAG = {Op.FORWARD: "F", Op.RECOMPUTE: "R", Op.BACKWARD: "B", Op.STEP: "S"}


class TensorClass(str, enum.Enum):
    """What a transfer moves."""

    ACT = "act"          # a unit's saved activations
    CKPT = "ckpt"        # a recompute checkpoint (the unit's input)
    WEIGHT = "weight"    # parameters in the compute dtype
    GRAD = "grad"        # parameter gradients
    STATE = "state"      # optimizer state (fp32 master and moments)
    NONE = "-"           # compute events


class Passes(str, enum.Enum):
    """In which forward/backward passes of an optimizer step an event runs."""

    ALL = "all"
    REST = "rest"        # every pass but the first (reading back a gradient accumulator)


def event_id(op: Op, cls: TensorClass, unit: str, stage: int) -> str:
    """``F:blocks.3`` for compute events (``S:`` for a step), ``offload:act:blocks.3@7`` for
    transfers. Built only here."""
    if op in _TAG:
        return f"{_TAG[op]}:{unit}"
    return f"{op.value}:{cls.value}:{unit}@{stage}"


@dataclass(frozen=True)
class Event:
    """One event of the schedule.

    ``units`` names what it acts on (a recompute acts on its whole segment, its last unit
    first in the id). ``bytes`` is what a transfer moves; ``seconds`` is its nominal duration
    (compute time, or bytes over the link's rate): the simulator re-derives both from the
    profile and the hardware spec and uses those.
    """

    stream: Stream
    op: Op
    cls: TensorClass
    units: tuple
    stage: int
    bytes: int = 0
    seconds: float = 0.0
    passes: Passes = Passes.ALL

    @property
    def unit(self) -> str:
        """The unit the event is named after (a recompute: its segment's last unit)."""
        return self.units[-1] if self.op is Op.RECOMPUTE else self.units[0]

    @property
    def id(self) -> str:
        return event_id(self.op, self.cls, self.unit, self.stage)

    @property
    def is_transfer(self) -> bool:
        return self.op not in COMPUTE_OPS

    def to_dict(self) -> dict:
        return {"id": self.id, "stream": self.stream.value, "op": self.op.value,
                "cls": self.cls.value, "units": list(self.units), "stage": self.stage,
                "bytes": int(self.bytes), "seconds": self.seconds, "passes": self.passes.value}


def compute(op: Op, units, stage: int, seconds: float, stream: Stream = Stream.COMPUTE) -> Event:
    return Event(stream=stream, op=op, cls=TensorClass.NONE, units=tuple(units), stage=stage,
                 seconds=float(seconds))


def transfer(stream: Stream, op: Op, cls: TensorClass, unit: str, stage: int, nbytes: int,
             seconds: float, passes: Passes = Passes.ALL) -> Event:
    return Event(stream=stream, op=op, cls=cls, units=(unit,), stage=stage, bytes=int(nbytes),
                 seconds=float(seconds), passes=passes)

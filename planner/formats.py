"""The three file formats: hardware spec (YAML), profile (JSON), plan (JSON).

One frozen dataclass per format with ``to_dict``/``from_dict``; JSON is written with sorted
keys, bytes as integers, times in seconds, and a ``schema`` key that is checked on load.
Loaders turn every problem with a user's file into a ``UserError`` (exit code 2) naming the
file and the fix. ``docs/file-formats.md`` documents every field.

This module imports neither torch nor pulp: the runtime reads plans through it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UserError

PROFILE_SCHEMA = "tierplan.profile/1"
PLAN_SCHEMA = "tierplan.plan/1"
HARDWARE_SCHEMA = "tierplan.hardware/1"
REPORT_SCHEMA = "tierplan.report/1"


class UnitKind(str, enum.Enum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


class Activation(str, enum.Enum):
    """What happens to a unit's saved activations between its forward and its backward."""

    KEEP = "keep"            # stay on the GPU
    RECOMPUTE = "recompute"  # dropped after forward, recomputed at backward from a checkpoint
    CPU = "cpu"              # offloaded to pinned host memory, prefetched back
    NVME = "nvme"            # offloaded through pinned staging to files on NVMe, read back


class Tier(str, enum.Enum):
    """Where a recomputed unit's input (its checkpoint) is kept."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"
    NONE = "none"  # itself recomputed from the nearest earlier checkpoint (segment recompute)


class Policy(str, enum.Enum):
    OPTIMAL = "optimal"
    KEEP_ALL = "keep-all"
    RECOMPUTE_ALL = "recompute-all"
    SQRT = "sqrt"
    OFFLOAD_ALL = "offload-all"
    REMAT_ONLY = "remat-only"  # the MILP with offloading disabled (a benchmark peer)


class Stream(str, enum.Enum):
    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"
    NVME = "nvme"


# ----------------------------------------------------------------------------- JSON I/O

def write_atomic(path: str | os.PathLike, write, binary: bool = False) -> Path:
    """Call ``write(f)`` on a temporary file in the target's folder, then rename it over the
    target.

    A reader never sees a half-written file, and an existing file is replaced only once the new
    one is complete; on any failure (Ctrl-C included) the temporary file is removed.
    """
    path = Path(path)
    if path.is_dir():
        raise UserError(f"output '{path}' is a directory; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise UserError(f"output '{path}': cannot create it ({e.strerror}); give a path in a "
                        "writable folder") from None
    try:
        # mkstemp creates 0600 files; give the output the permissions a plain open() would.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as sorted JSON atomically (see ``write_atomic``)."""
    def write(f):
        json.dump(obj, f, sort_keys=True, indent=1)
        f.write("\n")
    return write_atomic(path, write)


def read_json(path: str | os.PathLike, what: str) -> dict:
    """Read a JSON object, turning every failure into one UserError line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} '{path}': no such file; check the path")
    if p.is_dir():
        raise UserError(f"{what} '{path}' is a directory; give a JSON file")
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"{what} '{path}': cannot read it ({e.strerror}); check its permissions")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} '{path}' is not valid JSON (line {e.lineno}: {e.msg}); "
                        "regenerate it with the plan tool")
    if not isinstance(obj, dict):
        raise UserError(f"{what} '{path}' is not a JSON object; regenerate it with the plan tool")
    return obj


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_schema(d: dict, expected: str, what: str, source: str) -> None:
    got = d.get("schema")
    if got != expected:
        hint = ""
        if got == PROFILE_SCHEMA:
            hint = " (this is a profile; run 'plan solve' on it to get a plan)"
        elif got == PLAN_SCHEMA:
            hint = " (this is a plan, not a profile)"
        raise UserError(f"{what} '{source}' has schema {got!r}, expected {expected!r}{hint}")


def _from_fields(cls, d: dict, what: str, source: str):
    """Build a dataclass from a dict, rejecting missing required fields with one line."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, f in names.items():
        if name in d:
            kwargs[name] = d[name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{what} '{source}' lacks the field '{name}'; regenerate it")
    return cls(**kwargs)


# ----------------------------------------------------------------------------- field checks
# One table per dataclass maps each field to a kind below; ``_check_fields`` is the only place
# that tests a loaded value, so every bad value gets the same one-line message.

_FIX = {"profile": "regenerate it with 'plan profile'",
        "plan": "regenerate it with 'plan solve'"}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON true is a Python int


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_KINDS = {
    "bytes": (lambda v: _int(v) and v >= 0, "a non-negative integer number of bytes"),
    "bytes?": (lambda v: v is None or (_int(v) and v >= 0),
               "null or a non-negative integer number of bytes"),
    "count": (lambda v: _int(v) and v >= 0, "a non-negative integer"),
    "number": (lambda v: _num(v) and v >= 0, "a non-negative finite number"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str?": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "a list of strings"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON list"),
}


def _entry_where(d, file: str, noun: str, key: str, fix: str) -> str:
    """How errors name one entry of a list in a file (``plan 'p.json': unit 'blocks.3'``);
    refuses an entry that is not a JSON object."""
    if not isinstance(d, dict):
        raise UserError(f"{file}: a {noun} is {type(d).__name__}, not a JSON object; {fix}")
    label = d.get(key)
    return f"{file}: {noun} {label!r}" if isinstance(label, str) else f"{file}: a {noun}"


def _check_fields(d: dict, spec: dict, where: str, fix: str) -> None:
    """Raise one UserError line for the first field of ``d`` that is not of its ``spec`` kind.

    Absent fields are left to ``_from_fields`` (required ones) or to ``_require``.
    """
    for name, kind in spec.items():
        if name in d:
            test, desc = _KINDS[kind]
            if not test(d[name]):
                got = repr(d[name])
                got = got if len(got) <= 40 else got[:37] + "..."
                raise UserError(f"{where}: {name} must be {desc}, got {got}; {fix}")


def _require(d, keys, where: str, fix: str) -> None:
    if not isinstance(d, dict):
        raise UserError(f"{where} must be a JSON object; {fix}")
    for k in keys:
        if k not in d:
            raise UserError(f"{where} lacks '{k}'; {fix}")


# ----------------------------------------------------------------------------- hardware

@dataclass(frozen=True)
class HardwareSpec:
    """One machine: compute rates, memory per tier and the bandwidth of each link.

    Rates are in bytes/s and FLOP/s. ``unified_memory`` means there is no separate host tier
    (a CPU-only host, or unified-memory parts): then H2D/D2H do not exist, ``--cpu-mem`` must be
    0 and NVMe traffic goes straight from device memory to disk.
    """

    name: str
    description: str
    device: str                     # "cuda" or "cpu": what runs the compute
    unified_memory: bool
    memory_bytes: int               # device (GPU) memory
    host_memory_bytes: int          # host DRAM (0 where unified)
    peak_flops: dict                # dtype name ("bf16", "fp16", "fp32") -> FLOP/s
    efficiency: float               # achievable fraction of peak for dense transformer work
    memory_bandwidth: float         # device memory bytes/s (roofline for memory-bound ops)
    h2d_bandwidth: float            # pinned host -> device, bytes/s (0 where unified)
    d2h_bandwidth: float            # pinned device -> host, bytes/s (0 where unified)
    nvme_read_bandwidth: float      # bytes/s
    nvme_write_bandwidth: float     # bytes/s
    nvme_bytes: int = 0             # capacity of the NVMe tier the spec assumes (0: unknown)
    sources: dict = field(default_factory=dict)  # field -> where the number comes from
    schema: str = HARDWARE_SCHEMA

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype``."""
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("fp32")
        return float(peak) * self.efficiency

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "hardware spec") -> "HardwareSpec":
        if d.get("schema", HARDWARE_SCHEMA) != HARDWARE_SCHEMA:
            raise UserError(f"hardware spec '{source}' has schema {d.get('schema')!r}, "
                            f"expected {HARDWARE_SCHEMA!r}")
        spec = _from_fields(cls, d, "hardware spec", source)
        for key in ("memory_bytes", "host_memory_bytes", "nvme_bytes"):
            v = getattr(spec, key)
            if not isinstance(v, int) or v < 0:
                raise UserError(f"hardware spec '{source}': {key} must be a non-negative integer "
                                f"number of bytes, got {v!r}")
        for key in ("efficiency", "memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth",
                    "nvme_read_bandwidth", "nvme_write_bandwidth"):
            v = getattr(spec, key)
            if not isinstance(v, (int, float)) or v < 0:
                raise UserError(f"hardware spec '{source}': {key} must be a non-negative number, "
                                f"got {v!r}")
        if not spec.unified_memory and (spec.h2d_bandwidth <= 0 or spec.d2h_bandwidth <= 0):
            raise UserError(f"hardware spec '{source}': a spec with a separate host tier needs "
                            "positive h2d_bandwidth and d2h_bandwidth")
        if not isinstance(spec.peak_flops, dict) or not spec.peak_flops:
            raise UserError(f"hardware spec '{source}': peak_flops must map dtypes to FLOP/s")
        return spec


# ----------------------------------------------------------------------------- profile

@dataclass(frozen=True)
class UnitRecord:
    """One unit of execution: ``embedding``, a block (by qualified module name), or ``head``.

    Byte fields follow the design brief. ``saved_bytes`` counts every storage autograd keeps for
    this unit's backward once, its input included where an op of the unit saves it, parameters
    and buffers excluded. ``shared_saved_bytes`` is the part of it that belongs to tensors made
    by an earlier unit other than the one just before (for example rotary tables passed to every
    block): those storages are one tensor for all their readers, so the planner counts them once,
    alive until the last reader's backward, and never offloads or recomputes them.
    ``shared_from`` names the unit that produced them.
    """

    name: str
    kind: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    input_bytes: int
    output_bytes: int
    saved_bytes: int
    workspace_bytes: int
    fwd_flops: int
    bwd_flops: int
    fwd_s: float
    bwd_s: float
    shared_saved_bytes: int = 0
    shared_from: str | None = None
    param_count: int = 0
    samples: int = 0                 # timing repeats behind fwd_s/bwd_s (0: estimated)
    measured_peak_bytes: int | None = None  # CUDA only: allocator peak above start during fwd+bwd
    # The fp32 master copy inside optimizer_bytes (0 where the parameters are fp32 already: they
    # are their own master). Streaming needs it apart: a CPU step must hold the master on the host.
    master_bytes: int = 0
    # Other units that use a parameter charged to this unit, or charge one this unit uses (tied
    # embeddings): such weights and gradients cannot leave the GPU between those units' uses.
    tied_to: tuple = ()

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes a plan can act on: saved bytes less the shared storages."""
        return self.saved_bytes - self.shared_saved_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile", what: str = "profile") -> "UnitRecord":
        """``what`` is the file the unit sits in: ``profile`` or ``plan`` (names the fix)."""
        fix = _FIX[what]
        where = _entry_where(d, f"{what} '{source}'", "unit", "name", fix)
        _check_fields(d, _UNIT_FIELDS, where, fix)
        rec = _from_fields(cls, d, "unit record in", source)
        rec = dataclasses.replace(rec, tied_to=tuple(rec.tied_to))
        if rec.kind not in {k.value for k in UnitKind}:
            raise UserError(f"'{source}': unit {rec.name!r} has kind {rec.kind!r}; "
                            "expected embedding, block or head")
        if rec.shared_saved_bytes > rec.saved_bytes:
            raise UserError(f"{where}: shared_saved_bytes {rec.shared_saved_bytes} exceeds "
                            f"saved_bytes {rec.saved_bytes} (it is a part of them); {fix}")
        return rec


_UNIT_FIELDS = {
    "name": "str", "kind": "str", "shared_from": "str?",
    **{k: "bytes" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes",
                            "output_bytes", "saved_bytes", "workspace_bytes",
                            "shared_saved_bytes")},
    "measured_peak_bytes": "bytes?",
    "fwd_flops": "number", "bwd_flops": "number", "fwd_s": "number", "bwd_s": "number",
    "param_count": "count", "samples": "count", "master_bytes": "bytes", "tied_to": "strs",
}


@dataclass(frozen=True)
class Profile:
    """Per-unit memory, FLOPs and times of one model at one shape on one hardware spec."""

    model: dict          # name, config, batch, seq, dtype, param_count, structure_hash, blocks_path,
                         # attention (the kernel assumed), optimizer, bytes_per_param
    device: str          # meta | cpu | cuda: where the profile was taken
    timing: str          # estimated | measured
    hardware: dict       # HardwareSpec.to_dict() of the target
    layers: list         # list[UnitRecord] in execution order
    optimizer_s: float = 0.0          # time of the optimizer step (estimated or measured)
    optimizer_workspace_bytes: int = 0  # transient bytes of the optimizer step
    schema: str = PROFILE_SCHEMA

    @property
    def units(self) -> list[UnitRecord]:
        return self.layers

    @property
    def hardware_spec(self) -> HardwareSpec:
        return HardwareSpec.from_dict(self.hardware)

    @property
    def static_bytes(self) -> int:
        return sum(u.static_bytes for u in self.layers)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layers"] = [u.to_dict() for u in self.layers]
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> "Profile":
        _check_schema(d, PROFILE_SCHEMA, "profile", source)
        fix = _FIX["profile"]
        _check_fields(d, _PROFILE_FIELDS, f"profile '{source}'", fix)
        prof = _from_fields(cls, d, "profile", source)
        if not prof.layers:
            raise UserError(f"profile '{source}' has no layers; {fix}")
        layers = [u if isinstance(u, UnitRecord) else UnitRecord.from_dict(u, source, "profile")
                  for u in prof.layers]
        HardwareSpec.from_dict(prof.hardware, source + " (hardware)")
        return dataclasses.replace(prof, layers=layers)


_PROFILE_FIELDS = {"model": "dict", "device": "str", "timing": "str", "hardware": "dict",
                   "layers": "list", "optimizer_s": "number",
                   "optimizer_workspace_bytes": "bytes"}


def load_profile(path) -> Profile:
    return Profile.from_dict(read_json(path, "profile"), str(path))


# ----------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class LayerDecision:
    """The independent choice for one unit (see ``docs/file-formats.md``)."""

    name: str
    activation: Activation
    checkpoint: Tier | None = None   # only for RECOMPUTE

    def to_dict(self) -> dict:
        d = {"name": self.name, "activation": self.activation.value}
        if self.activation is Activation.RECOMPUTE:
            d["checkpoint"] = (self.checkpoint or Tier.GPU).value
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "LayerDecision":
        try:
            if not isinstance(d["name"], str):
                raise TypeError("name is not a string")
            act = Activation(d["activation"])
            ck = Tier(d["checkpoint"]) if act is Activation.RECOMPUTE else None
            return cls(name=d["name"], activation=act, checkpoint=ck)
        except (KeyError, ValueError, TypeError) as e:
            raise UserError(f"plan '{source}': layer entry {d!r} is malformed ({e}); "
                            "activation is keep|recompute|cpu|nvme and checkpoint gpu|cpu|nvme|none")


@dataclass(frozen=True)
class Event:
    """One event on one stream of the schedule.

    A compute event runs when the one before it on the compute stream has finished and every
    event in ``after`` has finished. A transfer event runs when the one before it on its stream
    has finished, every event in ``after`` has finished, and the compute event named in
    ``issue`` (if any) has started. ``units`` lists the units it acts on (a segment recompute
    acts on several).
    """

    id: str
    stream: Stream
    op: str            # forward|backward|recompute|optimizer|offload|prefetch|write|read
    units: tuple
    bytes: int = 0
    seconds: float = 0.0   # compute events: duration; transfers: derived from bytes and links
    after: tuple = ()
    issue: str | None = None
    stage: int = 0         # index of the stage (0..2U-1) the event belongs to

    def to_dict(self) -> dict:
        return {"id": self.id, "stream": self.stream.value, "op": self.op,
                "units": list(self.units), "bytes": int(self.bytes), "seconds": self.seconds,
                "after": list(self.after), "issue": self.issue, "stage": self.stage}

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan",
                  fix: str = "regenerate it with 'plan solve'") -> "Event":
        where = _entry_where(d, f"plan '{source}'", "schedule event", "id", fix)
        _require(d, ("id", "stream", "op", "units"), where, fix)
        _check_fields(d, _EVENT_FIELDS, where, fix)
        if d["stream"] not in {s.value for s in Stream}:
            raise UserError(f"{where}: stream {d['stream']!r} is not one of "
                            f"{', '.join(s.value for s in Stream)}; {fix}")
        if d["op"] not in EVENT_OPS:
            raise UserError(f"{where}: op {d['op']!r} is not one of {', '.join(EVENT_OPS)}; {fix}")
        return cls(id=d["id"], stream=Stream(d["stream"]), op=d["op"], units=tuple(d["units"]),
                   bytes=d.get("bytes", 0), seconds=float(d.get("seconds", 0.0)),
                   after=tuple(d.get("after", ())), issue=d.get("issue"),
                   stage=d.get("stage", 0))


EVENT_OPS = ("forward", "backward", "recompute", "optimizer", "offload", "prefetch", "write",
             "read")
_EVENT_FIELDS = {"id": "str", "stream": "str", "op": "str", "units": "strs", "bytes": "bytes",
                 "seconds": "number", "after": "strs", "issue": "str?", "stage": "count"}


@dataclass(frozen=True)
class Plan:
    """A plan: the decision per unit and the schedule of every event, plus what it predicts.

    ``units`` and ``model`` are copied from the profile so that a plan stands alone.
    """

    profile: dict        # {"path": str, "sha256": str}
    model: dict          # the profile's model section (name, batch, seq, structure_hash, ...)
    hardware: dict       # HardwareSpec.to_dict()
    budgets: dict        # gpu_bytes, cpu_bytes, nvme_bytes
    policy: str
    solver: dict         # name, status, objective, gap, solve_s, variables, constraints
    predicted: dict      # step_s, compute_s, peak_gpu_bytes, peak_cpu_bytes, peak_nvme_bytes
    units: list          # list[UnitRecord]
    layers: list         # list[LayerDecision], one per unit, same order
    schedule: dict       # stream name -> list[Event]
    nvme_dir: str | None = None
    optimizer_s: float = 0.0
    optimizer_workspace_bytes: int = 0
    schema: str = PLAN_SCHEMA

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

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["units"] = [u.to_dict() for u in self.units]
        d["layers"] = [x.to_dict() for x in self.layers]
        d["schedule"] = {s: [e.to_dict() for e in evs] for s, evs in self.schedule.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        _check_schema(d, PLAN_SCHEMA, "plan", source)
        fix = _FIX["plan"]
        where = f"plan '{source}'"
        _check_fields(d, _PLAN_FIELDS, where, fix)
        plan = _from_fields(cls, d, "plan", source)
        for section, spec in (("budgets", _BUDGET_FIELDS), ("predicted", _PREDICTED_FIELDS)):
            _require(d[section], spec, f"{where} {section}", fix)
            _check_fields(d[section], spec, f"{where} {section}", fix)
        HardwareSpec.from_dict(plan.hardware, source + " (hardware)")
        units = [UnitRecord.from_dict(u, source, "plan") for u in plan.units]
        layers = [LayerDecision.from_dict(x, source) for x in plan.layers]
        if [u.name for u in units] != [x.name for x in layers]:
            raise UserError(f"{where}: layers and units disagree on names or order; {fix}")
        schedule = _schedule_from_dict(plan.schedule, where, source, fix)
        return dataclasses.replace(plan, units=units, layers=layers, schedule=schedule)


_PLAN_FIELDS = {"profile": "dict", "model": "dict", "hardware": "dict", "budgets": "dict",
                "policy": "str", "solver": "dict", "predicted": "dict", "units": "list",
                "layers": "list", "schedule": "dict", "nvme_dir": "str?", "optimizer_s": "number",
                "optimizer_workspace_bytes": "bytes"}
_BUDGET_FIELDS = {"gpu_bytes": "bytes", "cpu_bytes": "bytes", "nvme_bytes": "bytes"}
_PREDICTED_FIELDS = {"step_s": "number", "compute_s": "number", "peak_gpu_bytes": "bytes",
                     "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes"}


def _schedule_from_dict(raw: dict, where: str, source: str, fix: str) -> dict:
    """Stream name -> events, each well formed, listed under its own stream, with unique ids
    and ``after``/``issue`` that name events of this schedule. (Whether ``units`` match the
    plan's units is left to the verbs: ``plan diff`` names a renamed unit itself.)"""
    schedule = {}
    for s, evs in raw.items():
        if s not in {x.value for x in Stream}:
            raise UserError(f"{where}: schedule stream {s!r} is not one of "
                            f"{', '.join(x.value for x in Stream)}; {fix}")
        if not isinstance(evs, list):
            raise UserError(f"{where}: schedule stream {s!r} must be a list of events; {fix}")
        schedule[s] = [Event.from_dict(e, source, fix) for e in evs]
    ids: set = set()
    for s, evs in schedule.items():
        for e in evs:
            if e.stream.value != s:
                raise UserError(f"{where}: event {e.id!r} is listed under stream {s!r} but says "
                                f"stream {e.stream.value!r}; {fix}")
            if e.id in ids:
                raise UserError(f"{where}: event id {e.id!r} appears twice; {fix}")
            ids.add(e.id)
    for evs in schedule.values():
        for e in evs:
            for ref in e.after + ((e.issue,) if e.issue is not None else ()):
                if ref not in ids:
                    raise UserError(f"{where}: event {e.id!r} refers to {ref!r}, which is not "
                                    f"an event of the schedule; {fix}")
    return schedule


def load_plan(path) -> Plan:
    return Plan.from_dict(read_json(path, "plan"), str(path))


def load_any(path) -> Profile | Plan:
    """Load a profile or a plan, whichever the file's schema says."""
    d = read_json(path, "plan")
    if d.get("schema") == PLAN_SCHEMA:
        return Plan.from_dict(d, str(path))
    if d.get("schema") == PROFILE_SCHEMA:
        return Profile.from_dict(d, str(path))
    raise UserError(f"'{path}' has schema {d.get('schema')!r}; give a plan ('plan solve') or a "
                    "profile ('plan profile')")

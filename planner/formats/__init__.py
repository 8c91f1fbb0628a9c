"""The three file formats: hardware spec (YAML), profile (JSON), plan (JSON).

One frozen dataclass per format with ``to_dict``/``from_dict``; JSON is written with sorted
keys, bytes as integers, times in seconds, and a ``schema`` key that is checked on load.
Loaders turn every problem with a user's file into a ``UserError`` (exit code 2) naming the
file and the fix. ``docs/file-formats.md`` documents every field.

This module imports neither torch nor pulp: the runtime reads plans through it.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field

from planner.errors import UserError
from planner.formats.events import Event, Op, Passes, Stream, TensorClass, event_id
from planner.formats.fileio import path_problem
from planner.formats.fileio import read_json, sha256_file, write_atomic, write_json_atomic  # noqa: F401 (re-exported)

PROFILE_SCHEMA = "tierplan.profile/1"
PLAN_SCHEMA = "tierplan.plan/2"
PLAN_SCHEMA_V1 = "tierplan.plan/1"   # still loads: every tensor class at home on the GPU
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
    """A memory tier: where a checkpoint, weights, gradients or optimizer state live, and
    (``gpu``/``cpu`` only) where an optimizer step runs."""

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


def _check_schema(d: dict, expected: str, what: str, source: str) -> None:
    got = d.get("schema")
    if got != expected:
        hint = ""
        if got == PROFILE_SCHEMA:
            hint = " (this is a profile; run 'plan solve' on it to get a plan)"
        elif got in (PLAN_SCHEMA, PLAN_SCHEMA_V1):
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
    # ints are compared exactly (math.isfinite(10**400) raises OverflowError)
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and math.isfinite(v))


# Ranges every loaded number must lie in (docs/reliability.md): wide enough for any real
# machine or model, narrow enough that no sum, product or quotient the planner forms overflows
# a float or loses its meaning (a 400-digit byte count, a 1e308 time and a 1e-300 bandwidth
# each crashed the solver).
MAX_BYTES = 2**60            # 1 EiB
MAX_COUNT = 2**53            # the largest integer a float holds exactly
MAX_SECONDS = 1e6            # 11.6 days for one unit's forward, or one step
MAX_FLOPS = 1e30             # a unit's FLOPs; 1e30 is ~10^6 x GPT-3's training compute
MIN_RATE, MAX_RATE = 1.0, 1e15        # bytes/s of a link or a drive: 1 B/s .. 1 PB/s
MIN_FLOP_RATE, MAX_FLOP_RATE = 1.0, 1e21   # FLOP/s: 1 .. 1 ZFLOP/s
MAX_NAME = 1000              # characters of a name (qualified module names are < 200)


def _name_ok(v) -> bool:
    """A non-empty printable name: control characters would break one-line messages and
    tables."""
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable()


def _rate(v) -> bool:
    return _num(v) and (v == 0 or MIN_RATE <= v <= MAX_RATE)


_KINDS = {
    "bytes": (lambda v: _int(v) and 0 <= v <= MAX_BYTES,
              "a non-negative integer number of bytes, at most 2^60"),
    "bytes?": (lambda v: v is None or (_int(v) and 0 <= v <= MAX_BYTES),
               "null or a non-negative integer number of bytes, at most 2^60"),
    "count": (lambda v: _int(v) and 0 <= v <= MAX_COUNT, "a non-negative integer below 2^53"),
    "count?": (lambda v: v is None or (_int(v) and 0 <= v <= MAX_COUNT),
               "null or a non-negative integer below 2^53"),
    "seconds": (lambda v: _num(v) and 0 <= v <= MAX_SECONDS,
                f"a finite number of seconds from 0 to {MAX_SECONDS:g}"),
    "flops": (lambda v: _num(v) and 0 <= v <= MAX_FLOPS,
              f"a finite number of FLOPs from 0 to {MAX_FLOPS:g}"),
    "number": (lambda v: _num(v) and 0 <= v <= MAX_FLOPS,
               f"a finite number from 0 to {MAX_FLOPS:g}"),
    "number?": (lambda v: v is None or (_num(v) and 0 <= v <= MAX_FLOPS),
                f"null or a finite number from 0 to {MAX_FLOPS:g}"),
    # rates in a spec: 0 (no such link) or a real machine's figure
    "rate": (_rate, f"0 or a finite number of bytes/s from {MIN_RATE:g} to {MAX_RATE:g}"),
    "fraction": (lambda v: _num(v) and 0 < v <= 1, "a number above 0 and at most 1"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "dict?": (lambda v: v is None or isinstance(v, dict), "null or a mapping"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str?": (lambda v: v is None or isinstance(v, str), "null or a string"),
    # free text printed in one-line messages and tables: no control characters
    "text": (lambda v: isinstance(v, str) and v != "" and len(v) <= 10_000 and v.isprintable(),
             "a non-empty printable string (no line breaks or control characters)"),
    "text?": (lambda v: v is None or (isinstance(v, str) and len(v) <= 10_000
                                      and v.isprintable()),
              "null or a printable string (no line breaks or control characters)"),
    "name": (_name_ok, f"a non-empty printable string of at most {MAX_NAME} characters"),
    "name?": (lambda v: v is None or _name_ok(v),
              f"null or a non-empty printable string of at most {MAX_NAME} characters"),
    "names": (lambda v: isinstance(v, list) and all(_name_ok(x) for x in v),
              "a list of non-empty printable strings"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "a list of strings"),
    "strs?": (lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
              "null or a list of strings"),
    # a directory the runtime creates and every verb prints: what the OS takes, one line
    "path?": (lambda v: v is None or (isinstance(v, str) and path_problem(v) is None),
              "null or a path the OS takes (non-empty, no control characters such as a "
              "newline, at most 4095 bytes, each name at most 255 bytes)"),
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
    0 and NVMe traffic goes straight from device memory to disk. Fields after ``nvme_bytes``
    are optional; each says what its default means.
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
    # Both directions at once: the aggregate H2D + D2H rate (0: full duplex, h2d + d2h).
    duplex_bandwidth: float = 0.0
    # Host DRAM bytes/s: gradient accumulation on the host reads and writes it.
    host_memory_bandwidth: float = 0.0
    # Parameters per second of torch's AdamW on the host CPU (0: no CPU optimizer step).
    cpu_adam_params_per_s: float = 0.0
    # Pinned host memory the runtime may hold (0: host_memory_bytes).
    pinned_memory_bytes: int = 0
    # NVMe traffic through pinned staging (CUDA): this many buffers, each at most this size.
    staging_buffers: int = 2
    staging_buffer_bytes: int = 256 * 1024**2
    # Device memory a plan leaves unused for what no profile counts: autograd's bookkeeping,
    # small allocations and the allocator's rounding (on a CPU host, the process heap).
    reserved_bytes: int = 0
    # Bus bandwidth of one rank in a ring collective (bytes/s; nccl-tests' busbw): between the
    # ranks of one node (NVLink), and across nodes (the rank's NIC). 0: not given (one rank).
    intra_node_bandwidth: float = 0.0
    inter_node_bandwidth: float = 0.0
    sources: dict = field(default_factory=dict)  # field -> where the number comes from
    schema: str = HARDWARE_SCHEMA

    def flops_per_s(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype``."""
        peak = self.peak_flops.get(dtype) or self.peak_flops.get("fp32")
        if peak is None:
            raise UserError(f"hardware spec {self.name!r} gives no peak_flops for {dtype} (nor "
                            "fp32, which other dtypes fall back to); add it")
        return float(peak) * self.efficiency

    @property
    def duplex(self) -> float:
        """Aggregate bytes/s when H2D and D2H copy at once."""
        return float(self.duplex_bandwidth) or float(self.h2d_bandwidth + self.d2h_bandwidth)

    @property
    def pinned_limit(self) -> int:
        return int(self.pinned_memory_bytes or self.host_memory_bytes)

    @property
    def staging_bytes(self) -> int:
        """The pinned staging pool the runtime allocates for NVMe traffic: none on a CPU
        device, whose runtime reads and writes each tensor's own memory."""
        return 0 if self.device == "cpu" else self.staging_buffers * self.staging_buffer_bytes

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "hardware spec") -> "HardwareSpec":
        if d.get("schema", HARDWARE_SCHEMA) != HARDWARE_SCHEMA:
            raise UserError(f"hardware spec '{source}' has schema {d.get('schema')!r}, "
                            f"expected {HARDWARE_SCHEMA!r}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserError(f"hardware spec '{source}' has unknown field {unknown[0]!r}; see "
                            "docs/file-formats.md (Hardware spec) for the fields")
        spec = _from_fields(cls, d, "hardware spec", source)
        where, fix = f"hardware spec '{source}'", "fix the file or start from profiles/hardware/*.yaml"
        _check_fields(d, _HARDWARE_FIELDS, where, fix)
        if spec.device not in ("cuda", "cpu"):
            raise UserError(f"{where}: device must be cuda or cpu, got {spec.device!r}; {fix}")
        if not spec.unified_memory and (spec.h2d_bandwidth <= 0 or spec.d2h_bandwidth <= 0):
            raise UserError(f"{where}: a spec with a separate host tier needs positive "
                            "h2d_bandwidth and d2h_bandwidth")
        if not spec.peak_flops or not all(
                isinstance(k, str) and k.isprintable() and 0 < len(k) <= 16 and _num(v)
                and MIN_FLOP_RATE <= v <= MAX_FLOP_RATE for k, v in spec.peak_flops.items()):
            raise UserError(f"{where}: peak_flops must map dtypes (a dtype not listed falls "
                            f"back to fp32) to FLOP/s from {MIN_FLOP_RATE:g} to "
                            f"{MAX_FLOP_RATE:g}; {fix}")
        if not 0 < spec.efficiency <= 1:
            raise UserError(f"{where}: efficiency must be in (0, 1], got {spec.efficiency!r}; {fix}")
        if spec.memory_bandwidth <= 0:
            raise UserError(f"{where}: memory_bandwidth must be positive; {fix}")
        if spec.memory_bytes <= 0:
            raise UserError(f"{where}: memory_bytes must be positive (the device's memory); {fix}")
        if not 1 <= spec.staging_buffers <= 64:
            raise UserError(f"{where}: staging_buffers must be 1 to 64; {fix}")
        if spec.sources and not all(isinstance(k, str) and isinstance(v, str)
                                    for k, v in spec.sources.items()):
            raise UserError(f"{where}: sources must map field names to text; {fix}")
        return dataclasses.replace(spec, peak_flops=dict(spec.peak_flops),
                                   sources=dict(spec.sources or {}))


_HARDWARE_FIELDS = {
    "name": "name", "description": "str?", "device": "str", "unified_memory": "bool",
    **{k: "bytes" for k in ("memory_bytes", "host_memory_bytes", "nvme_bytes",
                            "pinned_memory_bytes", "staging_buffer_bytes", "reserved_bytes")},
    "staging_buffers": "count", "peak_flops": "dict", "sources": "dict?",
    "efficiency": "fraction", "schema": "str",
    **{k: "rate" for k in ("memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth",
                           "nvme_read_bandwidth", "nvme_write_bandwidth", "duplex_bandwidth",
                           "host_memory_bandwidth", "cpu_adam_params_per_s",
                           "intra_node_bandwidth", "inter_node_bandwidth")},
}


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
    # Gradient bytes of the parameters this unit uses but another unit is charged for (a head
    # tied to the embedding): autograd holds this unit's part of their gradient from the later
    # user's backward until the earlier user's, before adding it into ``.grad``.
    tied_grad_bytes: int = 0
    # Parameters charged to this block that are not inside its module: code that runs between
    # two blocks (LLaVA's projector, CLIP's text embeddings before its first text layer) is
    # charged to the next block. They are used before the block's forward starts and their
    # gradients finish after its backward ends, so they cannot leave the GPU between uses.
    outside_params: int = 0

    @property
    def static_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def activation_bytes(self) -> int:
        """Bytes a plan can act on: saved bytes less the shared storages."""
        return self.saved_bytes - self.shared_saved_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tied_to"] = list(self.tied_to)
        return d

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
    "name": "name", "kind": "str", "shared_from": "name?",
    **{k: "bytes" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes",
                            "output_bytes", "saved_bytes", "workspace_bytes",
                            "shared_saved_bytes")},
    "measured_peak_bytes": "bytes?",
    "fwd_flops": "flops", "bwd_flops": "flops", "fwd_s": "seconds", "bwd_s": "seconds",
    "param_count": "count", "samples": "count", "master_bytes": "bytes", "tied_to": "names",
    "tied_grad_bytes": "bytes", "outside_params": "count",
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
        if prof.device not in ("meta", "cpu", "cuda"):
            raise UserError(f"profile '{source}': device must be meta, cpu or cuda, got "
                            f"{_short(prof.device)}; {fix}")
        if prof.timing not in ("estimated", "measured"):
            raise UserError(f"profile '{source}': timing must be estimated or measured, got "
                            f"{_short(prof.timing)}; {fix}")
        check_model_section(prof.model, f"profile '{source}'", fix)
        if not prof.layers:
            raise UserError(f"profile '{source}' has no layers; {fix}")
        layers = [u if isinstance(u, UnitRecord) else UnitRecord.from_dict(u, source, "profile")
                  for u in prof.layers]
        check_units(layers, f"profile '{source}'", fix)
        HardwareSpec.from_dict(prof.hardware, source + " (hardware)")
        return dataclasses.replace(prof, layers=layers)


_PROFILE_FIELDS = {"model": "dict", "device": "str", "timing": "str", "hardware": "dict",
                   "layers": "list", "optimizer_s": "seconds",
                   "optimizer_workspace_bytes": "bytes"}


def load_profile(path) -> Profile:
    return Profile.from_dict(read_json(path, "profile"), str(path))


# ----------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Home:
    """Where one unit's static tensors live between uses, and where its optimizer step runs.

    ``weights`` (compute dtype): gpu, cpu (pinned host) or nvme; ``grads``: gpu, cpu or nvme
    (the accumulated gradient between passes); ``optimizer`` (fp32 master and moments): gpu,
    cpu or nvme; ``step``: gpu (the compute device) or cpu (the host CPU).
    """

    weights: Tier = Tier.GPU
    grads: Tier = Tier.GPU
    optimizer: Tier = Tier.GPU
    step: Tier = Tier.GPU

    @property
    def resident(self) -> bool:
        """Everything on the compute device: the activation-only planner's world."""
        return all(t is Tier.GPU for t in (self.weights, self.grads, self.optimizer, self.step))

    @property
    def streams_weights(self) -> bool:
        return self.weights is not Tier.GPU

    def label(self) -> str:
        """``w:cpu g:cpu o:nvme s:cpu`` (or ``gpu`` when resident), for tables."""
        if self.resident:
            return "gpu"
        return (f"w:{self.weights.value} g:{self.grads.value} o:{self.optimizer.value} "
                f"s:{self.step.value}")


RESIDENT = Home()


@dataclass(frozen=True)
class LayerDecision:
    """The independent choices for one unit (see ``docs/file-formats.md``, Layers)."""

    name: str
    activation: Activation
    checkpoint: Tier | None = None   # only for RECOMPUTE
    home: Home = RESIDENT

    def to_dict(self) -> dict:
        d = {"name": self.name, "activation": self.activation.value,
             "weights": self.home.weights.value, "grads": self.home.grads.value,
             "optimizer": self.home.optimizer.value, "step": self.home.step.value}
        if self.activation is Activation.RECOMPUTE:
            d["checkpoint"] = (self.checkpoint or Tier.GPU).value
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "LayerDecision":
        try:
            if not isinstance(d, dict):
                raise TypeError(f"it is a {type(d).__name__}, not an object")
            if not isinstance(d["name"], str) or not d["name"]:
                raise TypeError("name is not a non-empty string")
            act = Activation(d["activation"])
            ck = Tier(d["checkpoint"]) if act is Activation.RECOMPUTE else None
            home = Home(*(Tier(d.get(k, "gpu")) for k in ("weights", "grads", "optimizer", "step")))
        except (KeyError, ValueError, TypeError) as e:
            shown = repr(d)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UserError(f"plan '{source}': layer entry {shown} is malformed ({e}); activation "
                            "is keep|recompute|cpu|nvme, checkpoint gpu|cpu|nvme|none, weights/"
                            "grads/optimizer gpu|cpu|nvme and step gpu|cpu") from None
        if ck is not None and ck is not Tier.NONE and ck not in (Tier.GPU, Tier.CPU, Tier.NVME):
            raise UserError(f"plan '{source}': layer {d['name']!r} has checkpoint {ck.value!r}")
        if Tier.NONE in (home.weights, home.grads, home.optimizer, home.step) or \
                home.step is Tier.NVME:
            raise UserError(f"plan '{source}': layer {d['name']!r}: weights, grads and optimizer "
                            "live on gpu, cpu or nvme, and a step runs on gpu or cpu; "
                            "regenerate it with 'plan solve'")
        return cls(name=d["name"], activation=act, checkpoint=ck, home=home)


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
        _require(d, ("gpu_bytes", "cpu_bytes", "nvme_bytes"), f"{where} budgets", fix)
        _check_fields(d, _BUDGET_FIELDS, f"{where} budgets", fix)
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
        _require(d, ("name", "status"), f"{where} solver", fix)
        _check_fields(d, _SOLVER_FIELDS, f"{where} solver", fix)
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

    @property
    def tflops(self) -> float:
        return self.flops / self.step_s / 1e12 if self.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str, fix: str) -> "Prediction":
        _require(d, ("step_s", "compute_s", "peak_gpu_bytes", "peak_cpu_bytes",
                     "peak_nvme_bytes"), f"{where} predicted", fix)
        _check_fields(d, _PREDICTED_FIELDS, f"{where} predicted", fix)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


_BUDGET_FIELDS = {"gpu_bytes": "bytes", "cpu_bytes": "bytes", "nvme_bytes": "bytes"}
_SOLVER_FIELDS = {"name": "text", "status": "text", "origin": "text?", "objective": "number?",
                  "gap": "number?", "solve_s": "number", "variables": "count",
                  "constraints": "count"}
_PREDICTED_FIELDS = {"step_s": "number", "compute_s": "number", "pass_s": "number",
                     "optimizer_s": "number", "flops": "number", "peak_gpu_bytes": "bytes",
                     "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes"}
ENGINES = ("none", "fsdp2", "ddp")


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

    def all_events(self) -> list[Event]:
        """Every event, by stage, compute first within a stage."""
        order = {s.value: k for k, s in enumerate(Stream)}
        evs = [e for s in sorted(self.schedule, key=order.get) for e in self.schedule[s]]
        return sorted(evs, key=lambda e: (e.stage, order[e.stream.value]))

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for k in ("budgets", "solver", "predicted"):
            d[k] = d[k].to_dict()
        d["units"] = [u.to_dict() for u in self.units]
        d["layers"] = [x.to_dict() for x in self.layers]
        d["schedule"] = {s: [e.to_dict() for e in evs] for s, evs in self.schedule.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        if d.get("schema") == PLAN_SCHEMA_V1:
            from planner.plans.upgrade import plan_v1_to_v2   # rebuilds the schedule: lazy, rarely needed
            d = plan_v1_to_v2(d, source)
        _check_schema(d, PLAN_SCHEMA, "plan", source)
        fix = _FIX["plan"]
        where = f"plan '{source}'"
        _check_fields(d, _PLAN_FIELDS, where, fix)
        plan = _from_fields(cls, d, "plan", source)
        check_model_section(plan.model, where, fix)
        _check_fields(plan.profile, {"path": "str?", "sha256": "str?"}, f"{where} profile", fix)
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
        schedule = _schedule_from_dict(plan.schedule, {u.name for u in units}, where, fix)
        return dataclasses.replace(
            plan, units=units, layers=layers, schedule=schedule,
            budgets=Budgets.from_dict(d["budgets"], where, fix),
            solver=SolverRecord.from_dict(d["solver"], where, fix),
            predicted=Prediction.from_dict(d["predicted"], where, fix))


_PLAN_FIELDS = {"profile": "dict", "model": "dict", "hardware": "dict", "budgets": "dict",
                "policy": "name", "solver": "dict", "predicted": "dict", "units": "list",
                "layers": "list", "schedule": "dict", "nvme_dir": "path?", "optimizer_s": "seconds",
                "optimizer_workspace_bytes": "bytes", "micro_batches": "count",
                "optimizer_depth": "count",
                "world_size": "count", "ranks_per_node": "count", "engine": "str"}


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


# The model section's fields that the planner reads (the rest is the runtime's, checked by
# runtime/binding.py against the model itself).
_MODEL_FIELDS = {"name": "name", "batch": "count", "seq": "count", "param_count": "count",
                 "dtype": "str?", "structure_hash": "str?", "blocks_path": "str?",
                 "blocks": "strs?", "attention": "str?", "optimizer": "str?",
                 "bytes_per_param": "count", "unique_blocks": "count", "state_bytes": "bytes?",
                 "chain_breaks": "strs?", "inplace_input": "strs?", "identity": "str?",
                 "config": "dict?", "params": "dict?", "timing_quality": "dict?"}


def check_model_section(m: dict, where: str, fix: str) -> None:
    """The profile's (or plan's) ``model`` section: each field the tools read of its kind."""
    _check_fields(m, _MODEL_FIELDS, f"{where} model", fix)


def check_units(units: list, where: str, fix: str) -> None:
    """Units in order (embedding, blocks, head), names unique, ``shared_from`` and
    ``tied_to`` naming other units (a shared tensor's producer runs earlier, or is the unit
    itself)."""
    if len(units) < 2:
        raise UserError(f"{where} has {len(units)} unit(s); a model has at least an embedding "
                        f"and a head; {fix}")
    kinds = [u.kind for u in units]
    if kinds[0] != UnitKind.EMBEDDING.value or kinds[-1] != UnitKind.HEAD.value or any(
            k != UnitKind.BLOCK.value for k in kinds[1:-1]):
        raise UserError(f"{where}: units must be the embedding, then blocks, then the head, in "
                        f"execution order; got {', '.join(kinds[:3])}{'...' if len(kinds) > 3 else ''}"
                        f"; {fix}")
    index = {}
    for i, u in enumerate(units):
        if u.name in index:
            raise UserError(f"{where}: unit name {u.name!r} appears twice; {fix}")
        index[u.name] = i
    for i, u in enumerate(units):
        # the unit itself may be the producer: its prologue (code between the blocks) made
        # the tensors (Jamba's attention layers between its Mamba blocks)
        if u.shared_from is not None and (u.shared_from not in index or index[u.shared_from] > i):
            raise UserError(f"{where}: unit {u.name!r} reads a shared tensor from "
                            f"{u.shared_from!r}, which is neither it nor an earlier unit; {fix}")
        for t in u.tied_to:
            if t not in index or t == u.name:
                raise UserError(f"{where}: unit {u.name!r} is tied to {t!r}, which is not "
                                f"another unit; {fix}")


def _event_from_dict(d, units: set, where: str, fix: str) -> Event:
    w = _entry_where(d, where, "schedule event", "id", fix)
    _require(d, ("stream", "op", "cls", "units", "stage"), w, fix)
    _check_fields(d, _EVENT_FIELDS, w, fix)
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
    return Plan.from_dict(read_json(path, "plan"), str(path))


def load_any(path) -> Profile | Plan:
    """Load a profile or a plan, whichever the file's schema says."""
    d = read_json(path, "plan")
    if d.get("schema") in (PLAN_SCHEMA, PLAN_SCHEMA_V1):
        return Plan.from_dict(d, str(path))
    if d.get("schema") == PROFILE_SCHEMA:
        return Profile.from_dict(d, str(path))
    raise UserError(f"'{path}' has schema {d.get('schema')!r}; give a plan ('plan solve') or a "
                    "profile ('plan profile')")

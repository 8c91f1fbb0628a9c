"""The hardware spec (``tierplan.hardware/1``): one machine's compute rates, memory per tier
and link bandwidths, and its validation on load.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planner.errors import UserError
from planner.formats.enums import HARDWARE_SCHEMA
from planner.formats.validate import (MAX_FLOP_RATE, MIN_FLOP_RATE, check_fields, from_fields,
                                      is_int, is_num)


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
    # The NVMe tier's aggregate bytes/s (the whole array): what the cost model reads. Where the
    # array fields below are given these are derived from them (``nvme_aggregate``).
    nvme_read_bandwidth: float = 0.0
    nvme_write_bandwidth: float = 0.0
    nvme_bytes: int = 0             # capacity of the NVMe tier the spec assumes (0: unknown)
    # The tier as an array of identical drives (0: not given; the tier figures stand alone):
    # per-drive sequential read and *sustained* write bytes/s, and the fraction of the drives'
    # sum a striped array of two or more delivers.
    nvme_drives: int = 0
    nvme_drive_read_bandwidth: float = 0.0
    nvme_drive_write_bandwidth: float = 0.0
    nvme_striping_efficiency: float = 1.0
    # Both directions at once: the aggregate H2D + D2H rate (0: full duplex, h2d + d2h).
    duplex_bandwidth: float = 0.0
    # Host DRAM bytes/s: gradient accumulation on the host reads and writes it.
    host_memory_bandwidth: float = 0.0
    # Parameters per second of torch's AdamW on the host CPU (0: no CPU optimizer step), and
    # the cores it was measured on (0: not given).
    cpu_adam_params_per_s: float = 0.0
    cpu_adam_cores: int = 0
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
        """Every field, except the optional ones added with the NVMe array (2026-12-02) where
        they hold their default: a spec without them writes what it wrote before."""
        d = dataclasses.asdict(self)
        for k, default in _OPTIONAL_SINCE_ARRAY.items():
            if d.get(k) == default:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "hardware spec") -> "HardwareSpec":
        if d.get("schema", HARDWARE_SCHEMA) != HARDWARE_SCHEMA:
            raise UserError(f"hardware spec '{source}' has schema {d.get('schema')!r}, "
                            f"expected {HARDWARE_SCHEMA!r}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise UserError(f"hardware spec '{source}' has unknown field {unknown[0]!r}; see "
                            "docs/file-formats.md (Hardware spec) for the fields")
        where, fix = f"hardware spec '{source}'", "fix the file or start from profiles/hardware/*.yaml"
        check_fields(d, _HARDWARE_FIELDS, where, fix)
        d = _with_nvme_tier(d, where)
        spec = from_fields(cls, d, "hardware spec", source)
        if spec.device not in ("cuda", "cpu"):
            raise UserError(f"{where}: device must be cuda or cpu, got {spec.device!r}; {fix}")
        if not spec.unified_memory and (spec.h2d_bandwidth <= 0 or spec.d2h_bandwidth <= 0):
            raise UserError(f"{where}: a spec with a separate host tier needs positive "
                            "h2d_bandwidth and d2h_bandwidth")
        if not spec.peak_flops or not all(
                isinstance(k, str) and k.isprintable() and 0 < len(k) <= 16 and is_num(v)
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
        if spec.reserved_bytes >= spec.memory_bytes:
            raise UserError(f"{where}: reserved_bytes {spec.reserved_bytes} is not below "
                            f"memory_bytes {spec.memory_bytes} (it is the part of the device's "
                            "memory plans leave unused); lower reserved_bytes; " + fix)
        if not 1 <= spec.staging_buffers <= 64:
            raise UserError(f"{where}: staging_buffers must be 1 to 64; {fix}")
        if spec.sources and not all(isinstance(k, str) and isinstance(v, str)
                                    for k, v in spec.sources.items()):
            raise UserError(f"{where}: sources must map field names to text; {fix}")
        return dataclasses.replace(spec, peak_flops=dict(spec.peak_flops),
                                   sources=dict(spec.sources or {}))


# How far (relative) a spec's tier figure may lie from the one its array fields give.
_AGREE = 1e-3
_OPTIONAL_SINCE_ARRAY = {"nvme_drives": 0, "nvme_drive_read_bandwidth": 0.0,
                         "nvme_drive_write_bandwidth": 0.0, "nvme_striping_efficiency": 1.0,
                         "cpu_adam_cores": 0}
_ARRAY = ("nvme_drives", "nvme_drive_read_bandwidth", "nvme_drive_write_bandwidth")


def nvme_aggregate(drives: int, per_drive: float, efficiency: float) -> float:
    """Bytes/s of ``drives`` identical drives striped: one drive is itself; two or more
    deliver ``efficiency`` of their sum."""
    return float(per_drive) if drives == 1 else float(drives * per_drive * efficiency)


def _with_nvme_tier(d: dict, where: str) -> dict:
    """``d`` with the tier's aggregate NVMe rates filled in from the array fields, where given;
    a spec that gives neither, only part of the array, or both in disagreement is refused."""
    given = [k for k in _ARRAY if d.get(k)]
    if not given:
        if "nvme_striping_efficiency" in d and d["nvme_striping_efficiency"] != 1.0:
            raise UserError(f"{where}: nvme_striping_efficiency without nvme_drives and the "
                            "per-drive bandwidths means nothing; give the array or drop it")
        for k in ("nvme_read_bandwidth", "nvme_write_bandwidth"):
            if k not in d:
                raise UserError(f"{where} lacks the field '{k}'; give it (the whole NVMe "
                                "tier's bytes/s) or nvme_drives with nvme_drive_read_bandwidth "
                                "and nvme_drive_write_bandwidth")
        return d
    if len(given) < len(_ARRAY):
        lack = next(k for k in _ARRAY if not d.get(k))
        raise UserError(f"{where}: the NVMe array gives {', '.join(given)} but not {lack} "
                        "(positive); give all of nvme_drives, nvme_drive_read_bandwidth and "
                        "nvme_drive_write_bandwidth, or none")
    out = dict(d)
    n, eff = d["nvme_drives"], d.get("nvme_striping_efficiency", 1.0)
    for way in ("read", "write"):
        derived = nvme_aggregate(n, d[f"nvme_drive_{way}_bandwidth"], eff)
        tier = d.get(f"nvme_{way}_bandwidth")
        if tier is not None and abs(tier - derived) > _AGREE * derived:
            raise UserError(f"{where}: nvme_{way}_bandwidth {tier:g} disagrees with its array "
                            f"({n} drives x {d[f'nvme_drive_{way}_bandwidth']:g} B/s, striping "
                            f"efficiency {eff:g} = {derived:g}); drop nvme_{way}_bandwidth or "
                            "make them agree")
        out[f"nvme_{way}_bandwidth"] = derived
    return out


def without_nvme_array(d: dict, why: str) -> dict:
    """A spec dict whose tier figures stand alone: its NVMe array fields dropped (they would
    disagree with a tier figure measured in their place), ``why`` noted in its sources."""
    if not d.get("nvme_drives"):
        return d
    out = {k: v for k, v in d.items() if k not in _ARRAY + ("nvme_striping_efficiency",)}
    sources = dict(out.get("sources") or {})
    sources["nvme_drives"] = (f"{why}; the spec gave {d['nvme_drives']} drives of "
                              f"{d.get('nvme_drive_read_bandwidth', 0):g} / "
                              f"{d.get('nvme_drive_write_bandwidth', 0):g} B/s")
    out["sources"] = sources
    return out


def with_nvme_drives(spec: HardwareSpec, n: int) -> HardwareSpec:
    """``spec`` with ``n`` of its drives (same per-drive figures and striping efficiency): the
    tier's rates and, where known, its capacity follow; the NVMe source says so."""
    if not is_int(n) or not 1 <= n <= _MAX_DRIVES:
        raise UserError(f"--nvme-drives {n!r}: give a whole number of drives from 1 to "
                        f"{_MAX_DRIVES}")
    if not spec.nvme_drives:
        raise UserError(f"hardware spec {spec.name!r} gives its NVMe tier as one figure, not "
                        "as drives; add nvme_drives, nvme_drive_read_bandwidth and "
                        "nvme_drive_write_bandwidth to it to use --nvme-drives")
    eff = spec.nvme_striping_efficiency
    sources = dict(spec.sources)
    note = f"{n} drives instead of the spec's {spec.nvme_drives} (--nvme-drives)"
    sources["nvme_drives"] = f"{note}; {sources['nvme_drives']}" if "nvme_drives" in sources \
        else note
    return dataclasses.replace(
        spec, nvme_drives=n,
        nvme_read_bandwidth=nvme_aggregate(n, spec.nvme_drive_read_bandwidth, eff),
        nvme_write_bandwidth=nvme_aggregate(n, spec.nvme_drive_write_bandwidth, eff),
        nvme_bytes=spec.nvme_bytes * n // spec.nvme_drives, sources=sources)


_MAX_DRIVES = 1024

_HARDWARE_FIELDS = {
    "name": "name", "description": "str?", "device": "str", "unified_memory": "bool",
    **{k: "bytes" for k in ("memory_bytes", "host_memory_bytes", "nvme_bytes",
                            "pinned_memory_bytes", "staging_buffer_bytes", "reserved_bytes")},
    "staging_buffers": "count", "peak_flops": "dict", "sources": "dict?",
    "nvme_drives": "drives", "cpu_adam_cores": "cores",
    "nvme_striping_efficiency": "fraction",
    "efficiency": "fraction", "schema": "str",
    **{k: "rate" for k in ("memory_bandwidth", "h2d_bandwidth", "d2h_bandwidth",
                           "nvme_read_bandwidth", "nvme_write_bandwidth", "duplex_bandwidth",
                           "nvme_drive_read_bandwidth", "nvme_drive_write_bandwidth",
                           "host_memory_bandwidth", "cpu_adam_params_per_s",
                           "intra_node_bandwidth", "inter_node_bandwidth")},
}

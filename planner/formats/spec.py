"""The hardware spec (``tierplan.hardware/1``): one machine's compute rates, memory per tier
and link bandwidths, and its validation on load.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from planner.errors import UserError
from planner.formats.enums import HARDWARE_SCHEMA
from planner.formats.validate import (MAX_FLOP_RATE, MIN_FLOP_RATE, check_fields, from_fields,
                                      is_num)


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
        spec = from_fields(cls, d, "hardware spec", source)
        where, fix = f"hardware spec '{source}'", "fix the file or start from profiles/hardware/*.yaml"
        check_fields(d, _HARDWARE_FIELDS, where, fix)
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

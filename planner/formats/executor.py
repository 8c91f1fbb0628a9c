"""What the executor needs from the planner, written into the plan (its ``executor`` section):
the figures the cost model computed that the runtime acts on, and the piece sizes the plan's
shares and transient bytes refer to.

The runtime reads plans and nothing else of the planner (docs/architecture.md, Rules): every
figure here is computed by the planner when it writes a plan (``planner.plans.make_plan``)
and only read by ``runtime.apply_plan``. A plan without the section (written before it
existed) is refused by the runtime in one line naming ``plan upgrade``, which writes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.errors import UserError
from planner.formats.validate import check_fields, require

# A unit whose optimizer state lives on NVMe is stepped piece by piece
# (runtime/streaming.py, ``UnitStatic.step_in_pieces``): a piece is whole tensors whose state
# comes to at most STEP_PIECE_BYTES, or a slice of STEP_PIECE_ALIGN-element multiples of one
# larger tensor (at least one such slice). Only a piece's state is read at a time, so a tied
# embedding whose own moments exceed the budget can still be stepped. Slices start at
# multiples of 2^20 elements so that the elementwise kernels see the same vector/scalar split
# as on the whole tensor (bit-identical steps; tests/test_streaming.py).
STEP_PIECE_BYTES = 16 * 2**20
STEP_PIECE_ALIGN = 2**20
# In the passes after the first, a gradient accumulator on NVMe is read back, added into and
# written again in parts of at most this many bytes, one part at a time (the runtime's single
# I/O thread): the read-back holds one such part, not the unit's whole gradient.
ACC_CHUNK_BYTES = 2**20
# The runtime's file I/O (runtime/disk.py) is what ``plan hardware`` measures: O_DIRECT, cut
# at multiples of a request's bytes of the file, several requests in flight per drive. A
# request that is not block-aligned in the file and in memory (most are: tensors start 64
# bytes into a page) goes through a bounce buffer of the request's size, at most one per
# request in flight. On a CPU host those buffers are device memory, priced as its staging pool
# (docs/formulation.md, "Staging"), so it issues fewer and smaller requests: 256 KiB, 2 in
# flight, moved 2.2-2.6 GB/s written and 1.26-1.31 GB/s read on the development host's disk,
# against 2.3-2.9 and 1.30-1.46 for 1 MiB at 4 (its spec says 1.5 and 1.3).
IO_REQUEST_BYTES = 2**20
IO_IN_FLIGHT_PER_DRIVE = 4
IO_REQUEST_BYTES_UNIFIED = 2**18
IO_IN_FLIGHT_PER_DRIVE_UNIFIED = 2
IO_BLOCK_BYTES = 4096


def io_requests(unified: bool, drives: int) -> tuple[int, int]:
    """(request bytes, requests in flight) of the runtime's disk I/O on such a host."""
    if unified:
        return IO_REQUEST_BYTES_UNIFIED, IO_IN_FLIGHT_PER_DRIVE_UNIFIED * max(1, int(drives))
    return IO_REQUEST_BYTES, IO_IN_FLIGHT_PER_DRIVE * max(1, int(drives))


@dataclass(frozen=True)
class Executor:
    """The plan's ``executor`` section.

    ``grads_from_backward``: the plan counts a gradient on the device from its unit's backward
    to the optimizer step (one pass per step), so gradients alive as a step's forward starts
    are not in it (the runtime warns). ``static_device_bytes``: what the plan holds on the
    device before a step (weights and optimizer state at home there, an engine's own buffers;
    not the gradients), the report's prediction of the static bytes. ``staging_bytes``: the
    pinned staging pool the plan prices (0: none). ``step_piece_bytes``,
    ``step_piece_align``, ``acc_chunk_bytes``: the piece sizes the plan priced (above); the
    runtime refuses a plan priced with other sizes than it executes. ``compute_threads``: the
    intra-op threads the profile's times were measured with on a CPU device, which a CPU
    model under the plan computes with (0: not recorded, torch's left as they are).
    ``io_request_bytes``, ``io_in_flight``: the disk requests the plan priced (``io_requests``;
    0: not recorded, the runtime takes ``io_requests`` of the plan's hardware)."""

    grads_from_backward: bool
    static_device_bytes: int
    staging_bytes: int = 0
    step_piece_bytes: int = STEP_PIECE_BYTES
    step_piece_align: int = STEP_PIECE_ALIGN
    acc_chunk_bytes: int = ACC_CHUNK_BYTES
    compute_threads: int = 0
    io_request_bytes: int = 0
    io_in_flight: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d, where: str, fix: str) -> "Executor":
        require(d, ("grads_from_backward", "static_device_bytes"), f"{where} executor", fix)
        check_fields(d, _FIELDS, f"{where} executor", fix)
        for k in ("step_piece_bytes", "step_piece_align", "acc_chunk_bytes"):
            if k in d and d[k] < 1:
                raise UserError(f"{where} executor: {k} must be at least 1; {fix}")
        n = d.get("io_request_bytes", 0)
        if n and (n % IO_BLOCK_BYTES or n > 2**30):
            raise UserError(f"{where} executor: io_request_bytes must be whole "
                            f"{IO_BLOCK_BYTES}-byte blocks, at most 1 GiB (or 0); {fix}")
        if not 0 <= d.get("io_in_flight", 0) <= 1024:
            raise UserError(f"{where} executor: io_in_flight must be 0 to 1024; {fix}")
        if n * d.get("io_in_flight", 0) > 2**30:
            # each request in flight holds a bounce buffer of its size
            raise UserError(f"{where} executor: io_request_bytes x io_in_flight must be at "
                            f"most 1 GiB of buffers; {fix}")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def check_pieces(self, where: str) -> None:
        """Refuse a plan priced with piece sizes other than those this version executes."""
        for k, mine in (("step_piece_bytes", STEP_PIECE_BYTES),
                        ("step_piece_align", STEP_PIECE_ALIGN),
                        ("acc_chunk_bytes", ACC_CHUNK_BYTES)):
            if getattr(self, k) != mine:
                raise UserError(f"{where}: executor.{k} is {getattr(self, k)}, but this version "
                                f"executes {mine}; re-solve the plan with this version")


_FIELDS = {"grads_from_backward": "bool", "static_device_bytes": "bytes",
           "staging_bytes": "bytes", "step_piece_bytes": "bytes", "step_piece_align": "count",
           "acc_chunk_bytes": "bytes", "compute_threads": "count", "io_request_bytes": "bytes",
           "io_in_flight": "count"}

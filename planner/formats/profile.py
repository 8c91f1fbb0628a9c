"""The profile (``tierplan.profile/1``): per-unit memory, FLOPs and times (``UnitRecord``),
the ``Profile`` that holds them, and the checks on units and the model section that plans
share.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from planner.errors import UserError
from planner.formats.enums import PROFILE_SCHEMA, UnitKind
from planner.formats.fileio import read_json
from planner.formats.spec import HardwareSpec
from planner.formats.validate import (FIX, check_fields, check_schema, entry_where, from_fields,
                                      short_repr)


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
        fix = FIX[what]
        where = entry_where(d, f"{what} '{source}'", "unit", "name", fix)
        check_fields(d, _UNIT_FIELDS, where, fix)
        rec = from_fields(cls, d, "unit record in", source)
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
        check_schema(d, PROFILE_SCHEMA, "profile", source)
        fix = FIX["profile"]
        check_fields(d, _PROFILE_FIELDS, f"profile '{source}'", fix)
        prof = from_fields(cls, d, "profile", source)
        if prof.device not in ("meta", "cpu", "cuda"):
            raise UserError(f"profile '{source}': device must be meta, cpu or cuda, got "
                            f"{short_repr(prof.device)}; {fix}")
        if prof.timing not in ("estimated", "measured"):
            raise UserError(f"profile '{source}': timing must be estimated or measured, got "
                            f"{short_repr(prof.timing)}; {fix}")
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


# The model section's fields that the planner reads (the rest is the runtime's, checked by
# runtime/binding.py against the model itself).
_MODEL_FIELDS = {"name": "name", "batch": "count", "seq": "count", "param_count": "count",
                 "dtype": "str?", "structure_hash": "str?", "blocks_path": "str?",
                 "blocks": "strs?", "attention": "str?", "optimizer": "str?",
                 "bytes_per_param": "count", "unique_blocks": "count", "state_bytes": "bytes?",
                 "chain_breaks": "strs?", "inplace_input": "strs?", "not_replayable": "strs?",
                 "identity": "str?",
                 "config": "dict?", "params": "dict?", "timing_quality": "dict?",
                 "compute_threads": "count?"}


def check_model_section(m: dict, where: str, fix: str) -> None:
    """The profile's (or plan's) ``model`` section: each field the tools read of its kind."""
    check_fields(m, _MODEL_FIELDS, f"{where} model", fix)


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

"""A model too large for host memory: built with its parameters on the meta device, and filled
from a safetensors checkpoint one tensor at a time, each straight into its home.

    from runtime import apply_plan, meta_parameters

    with meta_parameters():                  # parameters on meta, buffers real
        model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters())   # holds the same Parameter objects
    handle = apply_plan(model, plan, optimizer=opt, checkpoint="model.safetensors")

``apply_plan`` then gives every parameter real storage on the plan's device: a parameter whose
weights stay on the device is read from the checkpoint into it; one whose weights live on NVMe
is read into a buffer of its own size, written to its home file and freed before the next is
read, so the process never holds more than the resident weights and one streamed tensor.
Buffers stay as the model built them (rotary tables and masks are computed at construction),
and persistent ones found in the checkpoint are loaded too.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

from planner.errors import UserError

from .files import byte_view


@contextlib.contextmanager
def meta_parameters():
    """Within it, ``nn.Module`` parameters are created on the meta device (no memory); buffers
    are created as usual, so what a model computes at construction (rotary tables, causal
    masks) is real. Outside it nothing changes."""
    real = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            kw = {"requires_grad": param.requires_grad}
            param = type(param)(param.to("meta"), **kw)
        return real(module, name, param)
    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = real


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class Checkpoint:
    """The tensors of a safetensors checkpoint, each read on its own with ``pread`` straight
    into the memory that keeps it: a ``.safetensors`` file, a sharded checkpoint's
    ``*.safetensors.index.json``, or a directory holding either (``model.safetensors`` or
    ``model.safetensors.index.json``). Not through mmap: the pages of a mapped file count in
    the process's resident memory as they are touched (a 586 MiB file added its whole size to
    the peak of a load that holds 16 MiB of it at a time). The format: an 8-byte little-endian
    header length, a JSON header {name: {dtype, shape, data_offsets}}, then the data."""

    def __init__(self, path):
        path = str(path)
        if os.path.isdir(path):
            for name in ("model.safetensors.index.json", "model.safetensors"):
                if os.path.isfile(os.path.join(path, name)):
                    path = os.path.join(path, name)
                    break
            else:
                raise UserError(f"checkpoint '{path}': no model.safetensors or "
                                "model.safetensors.index.json in it; give the file")
        if not os.path.isfile(path):
            raise UserError(f"checkpoint '{path}': no such file; check the path")
        self.path = path
        self.entries: dict[str, tuple] = {}     # name -> (file, dtype, shape, begin, end)
        self._fds: dict[str, int] = {}
        try:
            if path.endswith(".json"):
                with open(path) as fh:
                    index = json.load(fh)
                base = os.path.dirname(path)
                files = sorted({os.path.join(base, f) for f in index["weight_map"].values()})
            else:
                files = [path]
            for f in files:
                self._read_header(f)
        except UserError:
            self.close()
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            self.close()
            raise UserError(f"checkpoint '{path}' cannot be read as safetensors ({e}); give a "
                            ".safetensors file or its index") from None

    def _read_header(self, f: str) -> None:
        fd = self._fds[f] = os.open(f, os.O_RDONLY)
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise UserError(f"checkpoint '{f}' cannot be read as safetensors (its header length "
                            f"{n} does not fit a {size}-byte file); give a .safetensors file")
        header = json.loads(os.pread(fd, n, 8))
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            dt = _DTYPES.get(e["dtype"])
            shape = tuple(int(x) for x in e["shape"])
            lo, hi = (int(x) for x in e["data_offsets"])
            if dt is None:
                raise UserError(f"checkpoint '{f}': tensor {name!r} has dtype {e['dtype']!r}, "
                                "which this reader does not know")
            count = 1
            for x in shape:
                count *= x
            if lo < 0 or hi < lo or base + hi > size or hi - lo != count * dt.itemsize:
                raise UserError(f"checkpoint '{f}': tensor {name!r} lies outside the file or "
                                "has the wrong length (truncated or corrupt)")
            self.entries[name] = (f, dt, shape, base + lo, base + hi)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def read_into(self, name: str, dst: torch.Tensor) -> None:
        """Fill ``dst`` (contiguous, on the CPU, of the tensor's shape) with tensor ``name``,
        cast to ``dst``'s dtype where they differ."""
        f, dt, shape, lo, hi = self.entries[name]
        buf = dst if dst.dtype == dt else torch.empty(shape, dtype=dt)
        mv = byte_view(buf)
        at = lo
        while len(mv):
            got = os.preadv(self._fds[f], [mv], at)
            if got <= 0:
                raise UserError(f"checkpoint '{f}' ended inside tensor {name!r}; it is truncated")
            mv, at = mv[got:], at + got
        if buf is not dst:
            dst.copy_(buf)

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def names_of(model: torch.nn.Module) -> dict:
    """id(parameter) -> every qualified name it has (a tied weight has several)."""
    out: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def fill(ck: Checkpoint, names: list, dst: torch.Tensor) -> None:
    """Fill ``dst`` from the checkpoint's tensor for a parameter known by ``names`` (a tied
    weight has several), checked against its shape; one line naming what is missing or wrong
    otherwise."""
    dst = dst.detach()
    name = next((n for n in names if n in ck), None)
    if name is None:
        raise UserError(f"checkpoint '{ck.path}' has no tensor {names[0]!r}; save it from this "
                        "model's state_dict()")
    if tuple(ck.shape(name)) != tuple(dst.shape):
        raise UserError(f"checkpoint '{ck.path}': {name!r} has shape {tuple(ck.shape(name))}, "
                        f"the model's is {tuple(dst.shape)}; it is from another model")
    if ck.dtype(name).is_floating_point != dst.dtype.is_floating_point:
        raise UserError(f"checkpoint '{ck.path}': {name!r} is {ck.dtype(name)}, the model's is "
                        f"{dst.dtype}; it is from another model")
    if dst.device.type == "cpu" and dst.is_contiguous():
        ck.read_into(name, dst)
    else:
        tmp = torch.empty(dst.shape, dtype=dst.dtype)
        ck.read_into(name, tmp)
        dst.copy_(tmp)


def empty_like_on(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of ``p``'s shape and dtype on ``device`` whose storage holds nothing yet."""
    t = torch.empty(p.shape, dtype=p.dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def _replace(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    """``p`` takes ``t``'s data, device included, and stays the same Python object (the
    optimizer holds it): ``torch.utils.swap_tensors``, since ``p.data = t`` cannot move a
    parameter off the meta device."""
    if p.device == t.device:
        p.data = t
        return
    swap = getattr(torch.utils, "swap_tensors", None)
    if swap is None:
        raise UserError("filling a meta-device model from a checkpoint needs torch >= 2.3 "
                        "(torch.utils.swap_tensors)")
    swap(p, torch.nn.Parameter(t, requires_grad=p.requires_grad))


def load_resident(model: torch.nn.Module, ck: Checkpoint, device: torch.device,
                  streamed: set) -> None:
    """Every parameter not in ``streamed`` (ids) gets real storage on ``device`` holding the
    checkpoint's values; every streamed one a stand-in with no storage (filled at ``setup``);
    persistent buffers found in the checkpoint are loaded."""
    names = names_of(model)
    with torch.no_grad():
        for p in {id(q): q for q in model.parameters()}.values():
            if id(p) in streamed:
                if p.device.type == "meta":
                    _replace(p, empty_like_on(p, device))
                continue
            dst = torch.empty(p.shape, dtype=p.dtype, device=device)
            fill(ck, names[id(p)], dst)
            _replace(p, dst)
        for n, b in model.named_buffers():
            if n in ck and b.device.type == "meta":
                owner, _, leaf = n.rpartition(".")
                real = torch.empty(b.shape, dtype=b.dtype, device=device)
                fill(ck, [n], real)
                model.get_submodule(owner)._buffers[leaf] = real
            elif n in ck:
                fill(ck, [n], b)
            elif b.device.type == "meta":
                raise UserError(f"buffer {n!r} is on the meta device and not in checkpoint "
                                f"'{ck.path}'; build the model under runtime.meta_parameters(), "
                                "which keeps buffers real")

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
import stat
import warnings

import torch

from planner.formats import UserError

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
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in _DTYPES.items()}

# The header's size bound. The safetensors library allows 100 MB; this reader parses the
# header into Python objects (about ten times its size in memory), so it takes less: the
# largest published checkpoints have headers far below it even as one file (about 130 bytes
# a tensor: DeepSeek-V3's ~92,000 tensors would make 12 MB; a 5 GB shard's is under 100 KB),
# and 32 MiB leaves over twice that while refusing a header padded to tens of MiB.
MAX_HEADER_BYTES = 32 * 1024**2
MAX_INDEX_BYTES = 32 * 1024**2
_FIX = "re-save it with safetensors (save_file or save_model)"


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Duplicate(k)
        d[k] = v
    return d


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _json_object(raw: bytes, f: str, what: str) -> dict:
    """``raw`` as the format defines its JSON: UTF-8 (no BOM, not UTF-16, which
    ``json.loads`` of bytes would quietly detect), one object, no key twice (Python's
    ``json`` and serde's maps both keep the last), no NaN/Infinity, nesting that does not
    exhaust the interpreter's stack."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"checkpoint '{f}': its {what} is not UTF-8 ({e.reason} at byte "
                        f"{e.start}); {_FIX}") from None
    if not text.startswith("{"):
        raise UserError(f"checkpoint '{f}': its {what} is not a JSON object (it starts "
                        f"{text[:8]!r}; a byte-order mark or another encoding?); {_FIX}")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise UserError(f"checkpoint '{f}': its {what} names {str(e)[:80]!r} twice, so which "
                        f"entry holds it is ambiguous; {_FIX}") from None
    except RecursionError:
        raise UserError(f"checkpoint '{f}': its {what} is nested too deep to be what the "
                        f"format defines; {_FIX}") from None
    except ValueError as e:
        raise UserError(f"checkpoint '{f}': its {what} is not valid JSON ({str(e)[:80]}); "
                        f"{_FIX}") from None
    if not isinstance(obj, dict):
        raise UserError(f"checkpoint '{f}': its {what} is not a JSON object; {_FIX}")
    return obj


def _open_regular(f: str, what: str) -> tuple[int, int]:
    """(fd, size) of ``f``, a regular file: a FIFO, a device or a directory is refused from
    ``os.stat`` before anything opens it (opening a FIFO to read waits for a writer), and the
    descriptor (opened non-blocking) is checked again, in case the name changed between."""
    try:
        st = os.stat(f)
    except FileNotFoundError:
        raise UserError(f"{what} '{f}': no such file; check the path") from None
    except OSError as e:
        raise UserError(f"{what} '{f}': {e.strerror or e}; check the path") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else \
            "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device or socket"
        raise UserError(f"{what} '{f}' is not a regular file ({kind}); give a .safetensors "
                        "file or its index")
    try:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise UserError(f"{what} '{f}': {e.strerror or e}; check the path and its "
                        "permissions") from None
    st2 = os.fstat(fd)
    if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise UserError(f"{what} '{f}' is not a regular file (it changed while being opened); "
                        "give a .safetensors file or its index")
    return fd, st2.st_size


def _pread_all(fd: int, n: int, at: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = os.pread(fd, n - got, at + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def _count(shape) -> int:
    c = 1
    for x in shape:
        c *= x
    return c


def _is_uint(x) -> bool:
    return type(x) is int and x >= 0          # not bool, not float: the format's usize


def _parse_header(f: str, header: dict, base: int, size: int) -> dict:
    """name -> (dtype, shape, begin, end) (absolute file offsets) of a parsed header, checked
    as the format defines it: each entry exactly {dtype, shape, data_offsets} with a known
    dtype, unsigned integer dims and offsets, a byte count equal to its range, and the ranges,
    ordered by offset, tiling the data area from 0 to the file's end with no gap or overlap;
    ``__metadata__`` a map of strings."""
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            if not (isinstance(e, dict) and all(isinstance(v, str) for v in e.values())):
                raise UserError(f"checkpoint '{f}': its __metadata__ must map strings to "
                                f"strings; {_FIX}")
            continue
        if not isinstance(e, dict):
            raise UserError(f"checkpoint '{f}': the entry of tensor {name[:80]!r} is not an "
                            f"object with dtype, shape and data_offsets; {_FIX}")
        for key in ("dtype", "shape", "data_offsets"):
            if key not in e:
                raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} has no {key}; {_FIX}")
        dt = _DTYPES.get(e["dtype"]) if isinstance(e["dtype"], str) else None
        if dt is None:
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} has dtype "
                            f"{str(e['dtype'])[:20]!r}, which this reader does not know "
                            f"(it reads {', '.join(_DTYPES)}); convert the checkpoint")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(_is_uint(x) for x in shape)):
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} has shape "
                            f"{str(shape)[:40]}, not a list of unsigned integers; {_FIX}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_uint(x) for x in offs)):
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} has data_offsets "
                            f"{str(offs)[:40]}, not two unsigned integers; {_FIX}")
        lo, hi = offs
        if hi < lo or base + hi > size:
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} has data_offsets "
                            f"[{lo}, {hi}], outside the file's {size - base} data bytes "
                            "(truncated or corrupt); " + _FIX)
        if hi - lo != _count(shape) * dt.itemsize:
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r} ({e['dtype']} "
                            f"{shape}) needs {_count(shape) * dt.itemsize} bytes but its range "
                            f"holds {hi - lo}; {_FIX}")
        out[name] = (dt, tuple(shape), base + lo, base + hi)
    cursor = base
    for name, (_, _, lo, hi) in sorted(out.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if lo != cursor:
            how = "overlaps the one before it" if lo < cursor else \
                f"leaves {lo - cursor} bytes unused before it"
            raise UserError(f"checkpoint '{f}': tensor {name[:80]!r}'s data range {how}; the "
                            f"format's ranges are contiguous and disjoint; {_FIX}")
        cursor = hi
    if cursor != size:
        raise UserError(f"checkpoint '{f}': {size - cursor} bytes after the last tensor's "
                        f"range (the format's ranges cover the data exactly); {_FIX}")
    return out


def _library_check(fd: int, f: str, entries: dict) -> None:
    """The safetensors library's own parser over the same file: whatever it refuses is
    refused here too, and it must find the same tensors. It cannot be the only parser: it
    gives no data offsets (this reader needs them to ``pread`` into the tensors' homes
    without mapping the file), it keeps the last of a duplicate key, and it allows a 100 MB
    header. It opens the file through this descriptor (``/proc/self/fd``) where there is one,
    so what it reads is the file checked above."""
    try:
        from safetensors import safe_open
    except ImportError:
        return
    path = f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f
    try:
        with safe_open(path, framework="pt") as g:
            lib = {k: (g.get_slice(k).get_dtype(), tuple(g.get_slice(k).get_shape()))
                   for k in g.keys()}
    except Exception as e:                                   # noqa: BLE001 (its own error type)
        msg = " ".join(str(e).split())[:120]
        raise UserError(f"checkpoint '{f}': safetensors refuses it ({msg}); {_FIX}") from None
    ours = {k: (_NAMES[dt], shape) for k, (dt, shape, _, _) in entries.items()}
    if lib != ours:
        k = next(iter(sorted(set(lib.items()) ^ set(ours.items()))))[0]
        raise UserError(f"checkpoint '{f}': safetensors reads tensor {k[:80]!r} differently "
                        f"from this reader; {_FIX}")


class Checkpoint:
    """The tensors of a safetensors checkpoint, each read on its own with ``pread`` straight
    into the memory that keeps it: a ``.safetensors`` file, a sharded checkpoint's
    ``*.safetensors.index.json``, or a directory holding either (``model.safetensors`` or
    ``model.safetensors.index.json``). Not through mmap: the pages of a mapped file count in
    the process's resident memory as they are touched (a 586 MiB file added its whole size to
    the peak of a load that holds 16 MiB of it at a time).

    The format, as https://github.com/huggingface/safetensors defines it: an 8-byte
    little-endian header length N, N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets},
    "__metadata__": {str: str}} (padded with spaces), then the data, every tensor's range
    relative to the data's start, the ranges contiguous, disjoint and covering it. A sharded
    checkpoint's index maps each tensor to the shard that holds it (``weight_map``); a tensor
    is read from that shard only. Every file must be a regular file. Anything else is one
    ``UserError`` line naming the file and the fix."""

    def __init__(self, path):
        path = str(path)
        if os.path.isdir(path):
            for name in ("model.safetensors.index.json", "model.safetensors"):
                if os.path.lexists(os.path.join(path, name)):
                    path = os.path.join(path, name)
                    break
            else:
                raise UserError(f"checkpoint '{path}': no model.safetensors or "
                                "model.safetensors.index.json in it; give the file")
        self.path = path
        self.entries: dict[str, tuple] = {}     # name -> (file, dtype, shape, begin, end)
        self._fds: dict[str, int] = {}
        try:
            if path.endswith(".json"):
                self._read_index(path)
            else:
                for name, e in self._read_header(path).items():
                    self.entries[name] = (path, *e)
        except BaseException:
            self.close()
            raise

    def _read_index(self, path: str) -> None:
        fd, size = _open_regular(path, "checkpoint index")
        try:
            if size > MAX_INDEX_BYTES:
                raise UserError(f"checkpoint index '{path}' is {size} bytes, more than an "
                                f"index's {MAX_INDEX_BYTES}; give the index of a checkpoint")
            index = _json_object(_pread_all(fd, size, 0), path, "index")
        finally:
            os.close(fd)
        wm = index.get("weight_map")
        if not (isinstance(wm, dict) and all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in wm.items())):
            raise UserError(f"checkpoint index '{path}': its weight_map must map each tensor "
                            "name to its shard's file name; regenerate the index")
        base = os.path.dirname(path)
        for shard in set(wm.values()):
            parts = shard.replace("\\", "/").split("/")
            if not shard or os.path.isabs(shard) or ".." in parts or "\x00" in shard:
                raise UserError(f"checkpoint index '{path}': shard {shard[:80]!r} is not a file "
                                "name inside the index's folder; regenerate the index")
        shards = {s: self._read_header(os.path.join(base, s)) for s in sorted(set(wm.values()))}
        for name, shard in wm.items():
            e = shards[shard].get(name)
            if e is None:
                raise UserError(f"checkpoint index '{path}' maps tensor {name[:80]!r} to "
                                f"{shard!r}, which has no tensor {name[:80]!r}; regenerate the "
                                "index or give the complete set of shards")
            self.entries[name] = (os.path.join(base, shard), *e)
        stray = [(n, s) for s, es in shards.items() for n in es if wm.get(n) != s]
        if stray:
            n, s = stray[0]
            where = f"maps to {wm[n]!r}" if n in wm else "does not list"
            warnings.warn(f"checkpoint index '{path}': {len(stray)} tensor(s) in shards the "
                          f"index does not name for them, not read (e.g. {n[:80]!r} in {s!r}, "
                          f"which the index {where})", stacklevel=3)

    def _read_header(self, f: str) -> dict:
        fd, size = _open_regular(f, "checkpoint")
        self._fds[f] = fd
        head = _pread_all(fd, 8, 0)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n > MAX_HEADER_BYTES and 8 + n <= size:
            raise UserError(f"checkpoint '{f}' declares a header of {n} bytes, more than the "
                            f"{MAX_HEADER_BYTES} this reader allows; {_FIX}")
        if n < 2 or 8 + n > size:
            raise UserError(f"checkpoint '{f}' cannot be read as safetensors (its header length "
                            f"{n} does not fit a {size}-byte file); give a .safetensors file")
        raw = _pread_all(fd, n, 8)
        if len(raw) != n:
            raise UserError(f"checkpoint '{f}' ended inside its header; it is truncated")
        entries = _parse_header(f, _json_object(raw, f, "header"), 8 + n, size)
        _library_check(fd, f, entries)
        return entries

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


def _lookup(ck: Checkpoint, names: list, dst: torch.Tensor) -> str:
    """The checkpoint's name for a tensor known by ``names`` (a tied weight has several),
    checked against ``dst``'s shape and kind; one line naming what is missing or wrong."""
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
    return name


def fill(ck: Checkpoint, names: list, dst: torch.Tensor) -> None:
    """Fill ``dst`` from the checkpoint's tensor for a parameter known by ``names`` (a tied
    weight has several), checked against its shape; one line naming what is missing or wrong
    otherwise."""
    dst = dst.detach()
    name = _lookup(ck, names, dst)
    if dst.device.type == "cpu" and dst.is_contiguous():
        ck.read_into(name, dst)
    else:
        tmp = torch.empty(dst.shape, dtype=dst.dtype)
        ck.read_into(name, tmp)
        dst.copy_(tmp)


def check_against(model: torch.nn.Module, ck: Checkpoint) -> None:
    """Before anything is read: every parameter has its tensor, of its shape (one line naming
    the first that does not); tensors the model has no parameter or buffer of are not loaded
    and are named in one warning, as Hugging Face's loader does for unexpected keys (a
    checkpoint may carry extra tensors, e.g. another head; refusing it would refuse those),
    while a missing one is refused (a parameter left without its values would train
    garbage)."""
    names = names_of(model)
    for p in {id(q): q for q in model.parameters()}.values():
        _lookup(ck, names[id(p)], p)
    known = {n for ns in names.values() for n in ns}
    known.update(n for n, _ in model.named_buffers(remove_duplicate=False))
    extra = sorted(n for n in ck.entries if n not in known)
    if extra:
        warnings.warn(f"checkpoint '{ck.path}': {len(extra)} tensor(s) the model does not have, "
                      f"not loaded: {', '.join(repr(n) for n in extra[:3])}"
                      + (", ..." if len(extra) > 3 else ""), stacklevel=3)


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
    persistent buffers found in the checkpoint are loaded. ``check_against`` runs first."""
    check_against(model, ck)
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

"""runtime/checkpoint.py's safetensors reader, fuzzed: a truncated, cut or scribbled file gives
one UserError line naming it, never a traceback or a tensor read from outside its range."""
from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from planner.errors import UserError
from runtime.checkpoint import Checkpoint, fill

TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
           "c.ids": torch.tensor([7, 8, 9], dtype=torch.int64)}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    from safetensors.torch import save_file
    p = tmp_path_factory.mktemp("ck") / "model.safetensors"
    save_file(TENSORS, str(p))
    return p.read_bytes()


def test_reads_what_safetensors_wrote_by_name_and_casts(good, tmp_path):
    p = tmp_path / "model.safetensors"
    p.write_bytes(good)
    for where in (p, tmp_path):                 # the file, or its directory
        ck = Checkpoint(where)
        for name, t in TENSORS.items():
            dst = torch.empty(t.shape, dtype=t.dtype)
            fill(ck, [name], dst)
            assert torch.equal(dst, t)
        dst = torch.empty(3, 4, dtype=torch.float64)          # cast to the model's dtype
        fill(ck, ["missing.weight", "a.weight"], dst)          # a tied weight's other name
        assert torch.equal(dst, TENSORS["a.weight"].double())
        with pytest.raises(UserError, match="is torch.int64, the model's is torch.float32"):
            fill(ck, ["c.ids"], torch.empty(3))
        ck.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_files_are_one_line(good, tmp_path, data):
    raw = bytearray(good)
    how = data.draw(st.sampled_from(["cut", "scribble", "header"]))
    if how == "cut":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif how == "scribble":
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    else:
        n = struct.unpack("<Q", bytes(raw[:8]))[0]
        head = json.loads(bytes(raw[8:8 + n]))
        name = data.draw(st.sampled_from(sorted(TENSORS)))
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        head[name][field] = data.draw(st.sampled_from(
            [None, "Q9", [], [10**12, 10**12 + 4], [-4, 0], [0, 10**6], [2, 2], "x", 3]))
        body = json.dumps(head).encode()
        raw = struct.pack("<Q", len(body)) + body + raw[8 + n:]
    p = tmp_path / "model.safetensors"
    p.write_bytes(bytes(raw))
    try:
        ck = Checkpoint(p)
    except UserError as e:
        assert "\n" not in str(e) and str(p) in str(e)
        return
    try:
        for name, t in TENSORS.items():
            dst = torch.empty(t.shape, dtype=t.dtype)
            try:
                fill(ck, [name], dst)
            except UserError as e:
                assert "\n" not in str(e)
    finally:
        ck.close()


# ----------------------------------------------------------------------------- the format, exactly

def _file(path, header, data: bytes, raw: bytes | None = None):
    """A safetensors file with ``header`` (or the header bytes ``raw``) and ``data``."""
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _f32(*vals) -> bytes:
    return struct.pack(f"<{len(vals)}f", *vals)


def _two(lo_b=8, hi_b=16):
    return {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [lo_b, hi_b]}}


def _refused(path, match, **kw):
    with pytest.raises(UserError, match=match) as e:
        Checkpoint(path, **kw).close()
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def test_sharded_checkpoint_reads_each_tensor_from_the_shard_its_index_names(tmp_path):
    """Two shards both hold 'w'; the index maps it to the first. It is read from there (with a
    warning about the other copy), not from whichever file sorts last."""
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3), "u": torch.zeros(2)}, str(tmp_path / "s-00001.safetensors"))
    save_file({"w": torch.full((3,), 1001.0), "v": torch.ones(2)},
              str(tmp_path / "s-00002.safetensors"))
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": {
        "w": "s-00001.safetensors", "u": "s-00001.safetensors", "v": "s-00002.safetensors"}}))
    with pytest.warns(UserWarning, match="index maps to"):
        ck = Checkpoint(tmp_path)
    dst = torch.empty(3)
    fill(ck, ["w"], dst)
    ck.close()
    assert torch.equal(dst, torch.ones(3))


def test_an_index_naming_a_shard_without_the_tensor_or_outside_its_folder_is_refused(tmp_path):
    from safetensors.torch import save_file
    save_file({"w": torch.ones(3)}, str(tmp_path / "s1.safetensors"))
    idx = tmp_path / "model.safetensors.index.json"
    for wm, match in (({"w": "s1.safetensors", "x": "s1.safetensors"}, "has no tensor 'x'"),
                      ({"w": "../s1.safetensors"}, "inside the index's folder"),
                      ({"w": str(tmp_path / "s1.safetensors")}, "inside the index's folder"),
                      ({"w": 3}, "weight_map"), ([], "weight_map")):
        idx.write_text(json.dumps({"weight_map": wm}))
        _refused(idx, match)
    idx.write_text('{"weight_map": {"w": "s1.safetensors"}, "weight_map": {}}')
    _refused(idx, "twice")


BAD_HEADERS = [
    # (label, header dict or raw bytes, data, what the message says)
    ("duplicate key", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                      b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', 16, "twice"),
    ("same key, same entry", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                             b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "twice"),
    ("overlapping ranges", _two(0, 8), 8, "overlap|contiguous|invalid offset"),
    ("a gap between ranges", _two(12, 20), 20, "contiguous|not fully covered"),
    ("data after the last range", _two(), 24, "cover"),
    ("float offsets", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0.0,8]},'
                      b'"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', 16, "offset"),
    ("bool offsets", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[false,8]},'
                     b'"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', 16, "offset"),
    ("negative offset", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}', 8, "offset"),
    ("offset past the end", _two(8, 10**12), 16, "offset|outside"),
    ("float shape", b'{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}', 8, "shape"),
    ("string shape", b'{"a":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}}', 8, "shape"),
    ("byte count not the range's", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
     8, "bytes"),
    ("unknown dtype", {"a": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}, 8, "dtype"),
    ("missing field", {"a": {"dtype": "F32", "shape": [2]}}, 8, "data_offsets"),
    ("metadata not strings", b'{"__metadata__":{"x":1},'
                             b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8, "metadata"),
    ("NaN literal", b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,NaN]}}', 8, "JSON|offset"),
    ("not an object", b'[1, 2]', 0, "object"),
    ("UTF-16", json.dumps(_two()).encode("utf-16"), 16, "UTF-8|object"),
    ("UTF-8 BOM", b"\xef\xbb\xbf" + json.dumps(_two()).encode(), 16, "UTF-8|object|BOM"),
    ("deep nesting", b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}", 0,
     "nest|metadata|JSON"),
    ("deep nesting in a name's entry", b'{"a":' + b"{\"x\":" * 50_000 + b"1" + b"}" * 50_001, 0,
     "nest|JSON|entry"),
]


@pytest.mark.parametrize("label,header,data,match", BAD_HEADERS, ids=[b[0] for b in BAD_HEADERS])
def test_a_header_the_format_does_not_allow_is_one_line(tmp_path, label, header, data, match):
    raw = header if isinstance(header, bytes) else None
    p = _file(tmp_path / "model.safetensors", header, bytes(data), raw)
    _refused(p, match)


def test_zero_length_tensors_and_alignment_padding_are_valid(tmp_path):
    """What the format allows and the library writes: empty tensors sharing an offset, the
    header padded with spaces, metadata of strings."""
    head = {"__metadata__": {"format": "pt"},
            "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "BF16", "shape": [1], "data_offsets": [8, 10]}}
    body = json.dumps(head).encode() + b"       "
    p = _file(tmp_path / "m.safetensors", None, _f32(1.0, 2.0) + b"\x80\x3f", body)
    ck = Checkpoint(p)
    dst = torch.empty(2)
    fill(ck, ["a"], dst)
    assert dst.tolist() == [1.0, 2.0]
    assert ck.shape("z") == (0, 3)
    ck.close()


def test_a_header_over_the_bound_is_refused_before_it_is_read(tmp_path):
    from runtime.checkpoint import MAX_HEADER_BYTES
    body = json.dumps(_two()).encode()
    body += b" " * (MAX_HEADER_BYTES + 1 - len(body))
    p = _file(tmp_path / "m.safetensors", None, bytes(16), body)
    _refused(p, "header of .* bytes")


def _refuses_at_once(make, tmp_path, match):
    """Checkpoint(path) refuses a non-regular file within seconds; a FIFO reader blocked in
    open() is released by opening its other end, so a hang fails the test instead of it."""
    import threading
    path, target = make(tmp_path)
    got = {}

    def run():
        try:
            Checkpoint(path).close()
            got["ok"] = True
        except UserError as e:
            got["error"] = str(e)
        except BaseException as e:                              # noqa: BLE001
            got["other"] = repr(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    hung = t.is_alive()
    if hung and target is not None:
        import os
        fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
    assert not hung, "Checkpoint() hung on a FIFO"
    assert "error" in got, got
    assert "\n" not in got["error"] and re.search(match, got["error"]), got["error"]


def _fifo_file(tmp_path):
    import os
    p = tmp_path / "model.safetensors"
    os.mkfifo(p)
    return p, p


def _fifo_shard(tmp_path):
    import os
    os.mkfifo(tmp_path / "s1.safetensors")
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    return idx, tmp_path / "s1.safetensors"


def _fifo_index(tmp_path):
    import os
    idx = tmp_path / "model.safetensors.index.json"
    os.mkfifo(idx)
    return tmp_path, idx


def _device_shard(tmp_path):
    import os
    os.symlink("/dev/zero", tmp_path / "s1.safetensors")
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    return idx, None


def _dir_shard(tmp_path):
    (tmp_path / "s1.safetensors").mkdir()
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"w": "s1.safetensors"}}))
    return idx, None


@pytest.mark.parametrize("make", [_fifo_file, _fifo_shard, _fifo_index, _device_shard,
                                  _dir_shard], ids=lambda f: f.__name__[1:])
def test_a_fifo_or_device_is_refused_at_once(make, tmp_path):
    _refuses_at_once(make, tmp_path, "not a regular file")


def test_missing_tensors_are_refused_naming_one_and_extra_ones_warned(tmp_path):
    """Before anything is read: a parameter the checkpoint lacks is one line naming it; a
    tensor the model does not have is a warning (as Hugging Face's loader does), not loaded."""
    from safetensors.torch import save_file
    from runtime.checkpoint import load_resident, meta_parameters
    with meta_parameters():
        m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    full = {"0.weight": torch.ones(2, 3), "0.bias": torch.ones(2), "1.weight": torch.ones(1, 2),
            "1.bias": torch.ones(1)}
    save_file({k: v for k, v in full.items() if k != "1.bias"}, str(tmp_path / "short.safetensors"))
    ck = Checkpoint(tmp_path / "short.safetensors")
    with pytest.raises(UserError, match="has no tensor '1.bias'"):
        load_resident(m, ck, torch.device("cpu"), set())
    ck.close()
    assert all(p.device.type == "meta" for p in m.parameters())   # nothing read before it
    save_file(dict(full, **{"2.weight": torch.ones(1)}), str(tmp_path / "extra.safetensors"))
    ck = Checkpoint(tmp_path / "extra.safetensors")
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) the model does not have.*'2.weight'"):
        load_resident(m, ck, torch.device("cpu"), set())
    ck.close()
    assert torch.equal(m[1].bias.detach(), torch.ones(1))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_reader_accepts_exactly_what_the_safetensors_library_accepts(good, tmp_path, data,
                                                                         monkeypatch):
    """Random mutations of a valid file (header bytes, the length, offsets, dtype names,
    shapes, truncation), read by this module's own checks with the library's switched off,
    agree with ``safetensors.safe_open``: refused by one iff refused by the other (except
    what this reader refuses on purpose: a duplicate key, which the library's map quietly
    takes the last of, and a header over MAX_HEADER_BYTES)."""
    from safetensors import safe_open
    import runtime.checkpoint as rc
    raw = _mutate(data, bytearray(good))
    p = tmp_path / "model.safetensors"
    p.write_bytes(raw)
    try:
        with safe_open(str(p), framework="pt") as f:
            lib = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                   for k in f.keys()}
    except Exception:                                          # noqa: BLE001
        lib = None
    monkeypatch.setattr(rc, "_library_check", lambda fd, f, entries: None)
    try:
        ck = Checkpoint(p)
        ours = {k: (rc._NAMES[e[1]], e[2]) for k, e in ck.entries.items()}
        ck.close()
    except UserError as e:
        assert "\n" not in str(e) and str(p) in str(e)
        ours = None
    if lib is not None and ours is None:
        dup = b'"a.weight"' in raw and raw.count(b'"a.weight"') > 1
        assert dup, (bytes(raw[:200]), "refused what the library accepts")
    else:
        assert ours == lib, bytes(raw[:300])


def _mutate(data, raw: bytearray) -> bytes:
    how = data.draw(st.sampled_from(["cut", "scribble", "length", "field", "offsets", "dtype",
                                     "header_byte", "as_is"]))
    n = struct.unpack("<Q", bytes(raw[:8]))[0]
    if how == "as_is":
        return bytes(raw)
    if how == "cut":
        return bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    if how == "scribble":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        return bytes(raw)
    if how == "length":
        n2 = data.draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, len(raw), 2**63, 2**64 - 1]))
        return struct.pack("<Q", n2 % 2**64) + bytes(raw[8:])
    if how == "header_byte":
        at = 8 + data.draw(st.integers(0, n - 1))
        raw[at] = data.draw(st.sampled_from(list(b'{}[]",:0123456789 -.eE\\ntfx\x00\xff')))
        return bytes(raw)
    head = json.loads(bytes(raw[8:8 + n]))
    name = data.draw(st.sampled_from(sorted(TENSORS)))
    if how == "offsets":
        lo, hi = head[name]["data_offsets"]
        head[name]["data_offsets"] = [lo + data.draw(st.integers(-3, 3)),
                                      hi + data.draw(st.integers(-3, 3))]
    elif how == "dtype":
        head[name]["dtype"] = data.draw(st.sampled_from(
            ["F32", "F16", "BF16", "I64", "I32", "U8", "BOOL", "f32", "F64", "Q9", "", "U64"]))
    else:
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        head[name][field] = data.draw(st.sampled_from(
            [None, [], [0], [1, 2, 3], [2, 6], [2.0, 6], [True], "x", 3, {}, [-1, 6]]))
    body = json.dumps(head).encode()
    return struct.pack("<Q", len(body)) + body + bytes(raw[8 + n:])

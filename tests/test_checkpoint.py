"""runtime/checkpoint.py's safetensors reader, fuzzed: a truncated, cut or scribbled file gives
one UserError line naming it, never a traceback or a tensor read from outside its range."""
from __future__ import annotations

import json
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

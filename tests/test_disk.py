"""runtime/disk.py: the NVMe tier's reads and writes go to the drive with O_DIRECT, in requests
of the plan's size, several in flight, whatever the alignment of the file range and of the
memory; fuzzed against a plain byte array, and checked against the page cache itself."""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from runtime import files
from runtime.disk import BLOCK, DiskIO, ShortRead
from runtime.files import NvmeStore, OffloadCorrupted, byte_view, pread_all, pwrite_all

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _direct_fd(path) -> int | None:
    try:
        return os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError:
        return None


@pytest.fixture
def dfd(tmp_path):
    fd = _direct_fd(tmp_path / "f.bin")
    if fd is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    yield fd
    os.close(fd)


def _buffer(nbytes: int, misalign: int) -> tuple[torch.Tensor, memoryview]:
    """A tensor of ``nbytes`` whose memory starts ``misalign`` bytes past a block boundary."""
    raw = torch.empty(nbytes + 2 * BLOCK, dtype=torch.uint8)
    start = (-raw.data_ptr()) % BLOCK + misalign
    t = raw[start:start + nbytes]
    return t, byte_view(t)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * 2**16), st.integers(0, 2**16 + 3 * BLOCK),
                          st.sampled_from([0, 1, 64, 512, BLOCK - 1])), min_size=1, max_size=8),
       st.sampled_from([BLOCK, 4 * BLOCK, 2**16]), st.integers(1, 4))
def test_ranges_read_back_as_a_plain_byte_array_holds_them(tmp_path_factory, writes, request,
                                                           in_flight):
    """Any sequence of writes (offsets and sizes in no block's order, memory anywhere in a
    page), each read back whole and the file at the end read back in other pieces, equals the
    same writes into a byte array; no more bounce buffers are made than requests in flight."""
    fd = _direct_fd(tmp_path_factory.mktemp("d") / "f.bin")
    if fd is None:
        pytest.skip("no O_DIRECT on the temp dir")
    io = DiskIO(request, in_flight)
    io.opened(fd)
    model = bytearray()
    try:
        for off, n, mis in writes:
            t, mv = _buffer(n, mis)
            t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            io.write(fd, mv, off)
            if n and len(model) < off + n:        # an empty write writes nothing
                model.extend(bytes(off + n - len(model)))
            model[off:off + n] = bytes(mv)
            back, bmv = _buffer(n, (mis * 7) % BLOCK)
            io.read(fd, bmv, off)
            assert bytes(bmv) == bytes(mv)
        assert os.fstat(fd).st_size % BLOCK == 0         # whole blocks, padded
        total, _ = _buffer(len(model), 3)
        tv = byte_view(total)
        io.read(fd, tv, 0)
        assert bytes(tv) == bytes(model)
        assert io.made <= in_flight
    finally:
        io.close()
        os.close(fd)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * BLOCK), st.integers(0, 3 * BLOCK),
                          st.sampled_from([0, 64, 1000])), min_size=1, max_size=12),
       st.integers(0, 2 * BLOCK), st.sampled_from([BLOCK, 4 * BLOCK]))
def test_many_items_at_once_are_the_same_bytes_as_one_at_a_time(tmp_path_factory, pieces,
                                                                 start, request):
    """Items end to end (a unit's tensors), with gaps here and there, written and read back
    by ``write_many``/``read_many``: each item reads back as written, and the file holds
    what writing them one at a time into a byte array gives."""
    fd = _direct_fd(tmp_path_factory.mktemp("m") / "f.bin")
    if fd is None:
        pytest.skip("no O_DIRECT on the temp dir")
    io = DiskIO(request, 2)
    io.opened(fd)
    try:
        items, keep, at, model = [], [], start, bytearray()
        for gap, n, mis in pieces:
            at += gap if gap % 3 == 0 else 0          # most items follow the one before
            t, mv = _buffer(n, mis)
            t.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            items.append((at, mv))
            keep.append(t)
            if n:
                model.extend(bytes(max(0, at + n - len(model))))
                model[at:at + n] = bytes(mv)
            at += n
        io.write_many(fd, items)
        back = [(off, _buffer(len(mv), 5)) for off, mv in items]
        io.read_many(fd, [(off, bmv) for off, (_, bmv) in back])
        for (off, mv), (_, (_, bmv)) in zip(items, back):
            assert bytes(bmv) == bytes(mv)
        if model:
            whole, wv = _buffer(len(model), 0)
            io.read(fd, wv, 0)
            assert bytes(wv) == bytes(model)
    finally:
        io.close()
        os.close(fd)


def test_a_units_small_tensors_go_in_few_requests(dfd, monkeypatch):
    """Two hundred 3,000-byte tensors end to end (a unit's biases and norms) take a handful
    of direct writes and reads, not two hundred of each plus the reads of their partial
    blocks."""
    from runtime import disk
    calls = {"w": 0, "r": 0}
    pwrite, preadv = os.pwrite, os.preadv

    def counting_pwrite(*a):
        calls["w"] += 1
        return pwrite(*a)

    def counting_preadv(*a):
        calls["r"] += 1
        return preadv(*a)
    io = DiskIO(2**16, 2)
    io.opened(dfd)
    ts = [torch.full((750,), float(k)) for k in range(200)]
    items = [(100 + 3000 * k, byte_view(t)) for k, t in enumerate(ts)]
    monkeypatch.setattr(disk.os, "pwrite", counting_pwrite)
    monkeypatch.setattr(disk.os, "preadv", counting_preadv)
    io.write_many(dfd, items)
    writes, patched = calls["w"], calls["r"]
    back = [torch.empty(750) for _ in ts]
    io.read_many(dfd, [(off, byte_view(t)) for (off, _), t in zip(items, back)])
    monkeypatch.undo()
    io.close()
    requests = -(-(100 + 3000 * 200) // 2**16)        # 10: cut at multiples of 64 KiB
    assert writes == requests, calls
    assert patched <= 2, calls                        # the partial blocks at the two ends
    assert calls["r"] - patched == requests, calls
    assert all(torch.equal(a, b) for a, b in zip(ts, back))


def test_two_threads_writing_ranges_that_share_blocks_keep_each_others_bytes(dfd):
    """Unaligned neighbours written at once from two threads (the I/O worker and a host
    worker can): each one's partial blocks are read, patched and written under the file's
    lock, so neither loses the other's bytes."""
    io = DiskIO(BLOCK, 2)
    io.opened(dfd)
    n, rounds = 1000, 200
    a = bytes(range(256)) * 4
    b = bytes(255 - x for x in range(256)) * 4

    def writer(data, base):
        mv = memoryview(bytearray(data[:n]))
        for r in range(rounds):
            io.write(dfd, mv, base + r * 2 * n)

    ts = [threading.Thread(target=writer, args=(a, 0)), threading.Thread(target=writer, args=(b, n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out = memoryview(bytearray(2 * n * rounds))
    io.read(dfd, out, 0)
    for r in range(rounds):
        assert bytes(out[2 * n * r:2 * n * r + n]) == a[:n]
        assert bytes(out[2 * n * r + n:2 * n * (r + 1)]) == b[:n]
    io.close()


def test_a_file_cut_short_on_disk_is_a_short_read_not_zeros(dfd):
    io = DiskIO(2**16, 4)
    io.opened(dfd)
    data = memoryview(bytearray(os.urandom(3 * 2**16 + 100)))
    io.write(dfd, data, 10)
    os.ftruncate(dfd, 2**16 + 5)                 # mid-block, mid-request
    with pytest.raises(ShortRead):
        io.read(dfd, memoryview(bytearray(len(data))), 10)
    io.close()


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a mapping of it)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f:
        p = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        assert p is not None and p != ctypes.c_void_p(-1).value
        try:
            assert libc.mincore(p, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(p, size)
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_the_stores_files_bypass_the_page_cache_unless_asked(tmp_path, monkeypatch, mode):
    """Through the NVMe store, 8 MiB written and read back leave (almost) nothing of the file
    in the page cache: it went to the drive, as ``plan hardware`` measured it. With
    ``TIERPLAN_NVME_IO=buffered`` the same bytes sit in the cache (the control: the probe
    does see cached pages)."""
    if mode == "buffered":
        monkeypatch.setenv("TIERPLAN_NVME_IO", "buffered")
    store = NvmeStore(tmp_path / "nvme", (2**18, 4))
    try:
        fd, path = store.open("w-blocks.0")
        if mode == "direct" and not store.direct:
            pytest.skip(f"{tmp_path} refuses O_DIRECT ({store.buffered_why})")
        assert store.direct is (mode == "direct") and (fd in files._DIRECT) is store.direct
        t = torch.randn(2**21)                        # 8 MiB, 64 bytes into a page
        sums = files.Sums(path, "w-blocks.0")
        store.submit(pwrite_all, fd, byte_view(t), 100, sums).result()
        back = torch.empty_like(t)
        store.submit(pread_all, fd, byte_view(back), 100, sums).result()
        sums.verify(100, byte_view(back))
        assert torch.equal(back, t)
        cached = _resident_pages(path)
        pages = os.path.getsize(path) // mmap.PAGESIZE
        if mode == "direct":
            assert cached <= 2, (cached, pages)       # at most the partial end blocks' reads
            assert store.disk.made <= 4
        else:
            assert cached > pages // 2, (cached, pages)
    finally:
        store.close()
    assert not files._DIRECT


def test_a_file_system_that_refuses_direct_io_falls_back_to_buffered(tmp_path, monkeypatch):
    """Where O_DIRECT opens but its I/O fails, the store says why and reads and writes the
    page cache, with the same bytes and the same checks."""
    monkeypatch.setattr(files, "accepts_direct", lambda fd: False)
    store = NvmeStore(tmp_path / "nvme")
    try:
        fd, path = store.open("g-x")
        assert store.direct is False and "refuses O_DIRECT" in store.buffered_why
        assert fd not in files._DIRECT
        assert not os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
        data = bytearray(os.urandom(10_000))
        sums = files.Sums(path, "g-x")
        pwrite_all(fd, memoryview(data), 3, sums)
        out = bytearray(len(data))
        pread_all(fd, memoryview(out), 3, sums)
        assert out == data
        os.truncate(path, 5000)
        with pytest.raises(OffloadCorrupted, match="shorter than what was written"):
            pread_all(fd, memoryview(bytearray(len(data))), 3, sums)
    finally:
        store.close()


def test_a_truncated_direct_file_is_one_line_naming_it(tmp_path):
    store = NvmeStore(tmp_path / "nvme")
    try:
        fd, path = store.open("s-blocks.1")
        if not store.direct:
            pytest.skip(store.buffered_why)
        sums = files.Sums(path, "s-blocks.1")
        data = bytearray(os.urandom(300_000))
        pwrite_all(fd, memoryview(data), 77, sums)
        os.truncate(path, 100_001)
        with pytest.raises(OffloadCorrupted) as e:
            pread_all(fd, memoryview(bytearray(len(data))), 77, sums)
        msg = str(e.value)
        assert path in msg and "optimizer state of unit 'blocks.1'" in msg
        assert "truncated" in msg and "\n" not in msg
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_the_report_says_how_the_nvme_files_were_read_and_written(tmp_path, monkeypatch, mode):
    """A streaming run's report names its disk I/O: O_DIRECT with the plan's requests, or the
    page cache and why."""
    from conftest import plan_for
    from planner.formats import Home, Tier as T
    from planner.models import build_model, load_config, make_inputs
    from runtime import apply_plan
    if mode == "buffered":
        monkeypatch.setenv("TIERPLAN_NVME_IO", "buffered")
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=2)
    torch.manual_seed(0)
    model = build_model(cfg)
    plan = plan_for(model, "keep-all", 2, 16, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": Home(T.NVME, T.GPU, T.NVME, T.GPU)})
    opt = torch.optim.AdamW(model.parameters())
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        for _ in range(2):
            model(**make_inputs(cfg, 2, 16)).loss.backward()
            opt.step()
            opt.zero_grad()
        rep = handle.report()
    finally:
        handle.remove()
    if mode == "direct" and "buffered" in rep.nvme_io:
        pytest.skip(rep.nvme_io)
    want = ("O_DIRECT, 256 KiB requests, up to 2 in flight" if mode == "direct"
            else "buffered, through the page cache (TIERPLAN_NVME_IO=buffered)")
    assert rep.nvme_io == want
    assert f"nvme files: {want}" in str(rep)
    assert rep.to_dict()["nvme_io"] == want
    from planner.formats.report import load_report
    assert load_report(rep.save(tmp_path / "r.json")).nvme_io == want

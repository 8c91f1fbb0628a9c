"""``plan hardware``: measure this host and write a hardware spec (``tierplan.hardware/1``).

Disk bandwidth is measured with the page cache out of the way: ``O_DIRECT`` where the file
system takes it (aligned buffers, sizes in whole blocks), otherwise buffered I/O with ``fsync``
after writing and ``posix_fadvise(DONTNEED)`` before reading, so the read comes from the disk and
not from memory. Compute rates are the median of a few timed matmuls after a warm-up. On CUDA,
pinned host<->device copies and device matmuls are timed with the device synchronised.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import socket
import stat
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

from planner.errors import UserError
from planner.formats.fileio import _check_path_text, _shown, check_output, write_atomic
from planner.formats import HARDWARE_SCHEMA, HardwareSpec
from planner.sizes import parse_size

BLOCK = 8 << 20          # 8 MiB per I/O call: large enough for sequential bandwidth


def _median_time(fn, repeats=3):
    fn()                                    # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ----------------------------------------------------------------------------- disk

def _aligned_buffer(nbytes: int) -> mmap.mmap:
    # An anonymous mapping is page aligned, which O_DIRECT needs for its buffer.
    buf = mmap.mmap(-1, nbytes)
    buf.write(os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20)))
    return buf


def disk_bandwidth(directory: Path, size: int) -> dict:
    """Write then read ``size`` bytes in ``directory``; bytes/s each way and the method used."""
    size = max(BLOCK, size - size % BLOCK)
    buf = _aligned_buffer(BLOCK)
    fd, name = tempfile.mkstemp(prefix=".tierplan-probe-", dir=directory)
    os.close(fd)
    path = Path(name)
    try:
        method = "O_DIRECT"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
            os.write(fd, buf)                      # O_DIRECT may be refused on first write
            os.lseek(fd, 0, os.SEEK_SET)
        except (AttributeError, OSError):
            method = "fsync+fadvise"
            fd = os.open(path, os.O_WRONLY)
        t0 = time.perf_counter()
        for _ in range(size // BLOCK):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)

        if method == "O_DIRECT":
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        else:
            fd = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        done = 0
        while done < size:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
            done += n
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        buf.close()
        path.unlink(missing_ok=True)
    return {"write": size / write_s, "read": done / read_s, "method": method, "bytes": size}


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


# ----------------------------------------------------------------------------- compute

def matmul_rates(device: str, n: int, dtypes=("bf16", "fp16", "fp32")) -> dict:
    """FLOP/s of an n x n matmul per dtype (2 n^3 FLOPs each), median of three."""
    import torch
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    rates = {}
    for d in dtypes:
        m = n
        if device == "cpu":
            # Size each dtype to ~0.2 s a matmul: CPU fp16 runs at a few GFLOP/s (no fast path),
            # and a 1024^3 fp16 matmul would take seconds.
            x = torch.randn(256, 256).to(names[d])
            torch.mm(x, x)                        # warm-up: the first call sets up threads
            t0 = time.perf_counter()
            torch.mm(x, x)
            rate = 2.0 * 256 ** 3 / max(time.perf_counter() - t0, 1e-9)
            m = int(max(256, min(n, (rate * 0.2 / 2.0) ** (1 / 3))))
        a = torch.randn(m, m, device=device).to(names[d])
        b = torch.randn(m, m, device=device).to(names[d])

        def run():
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
        rates[d] = 2.0 * m ** 3 / _median_time(run)
    return rates


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device memory bandwidth from a tensor copy (reads and writes ``nbytes`` each)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
    return 2.0 * nbytes / _median_time(run)


def pinned_bandwidth(nbytes: int) -> tuple[float, float]:
    """(H2D, D2H) bytes/s of pinned copies."""
    import torch
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def h2d():
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def d2h():
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
    return nbytes / _median_time(h2d), nbytes / _median_time(d2h)


# ----------------------------------------------------------------------------- the spec

def measure_host(nvme_dir: str | None, size: int, matmul_n: int | None = None) -> HardwareSpec:
    """This host's spec, measured: the disk probe in ``nvme_dir`` (or the temp folder), the
    matmul rate per dtype, copy bandwidths and memory sizes."""
    import torch

    probe_dir, created = _probe_dir(nvme_dir)
    disk, free = _disk_probe(probe_dir, size, created)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    n = matmul_n or (8192 if cuda else 1024)
    rates = matmul_rates(device, n)
    if cuda:
        # NB: CPU fp16 matmuls have no fast path; measured anyway, they are what a CPU run gets.
        mem = int(torch.cuda.get_device_properties(0).total_memory)
        bw = copy_bandwidth("cuda", 1 << 30)
        h2d, d2h = pinned_bandwidth(256 << 20)
        host = host_memory_bytes()
        name_dev = torch.cuda.get_device_name(0)
    else:
        mem = host_memory_bytes()
        bw = copy_bandwidth("cpu", 256 << 20)
        h2d = d2h = 0.0
        host = 0
        name_dev = f"{os.cpu_count()} CPU cores"
    when = time.strftime("%Y-%m-%d")
    how = f"measured by 'plan hardware' on {when}"
    return HardwareSpec(
        name=socket.gethostname() or "this-host",
        description=f"{name_dev}, measured by plan hardware",
        device=device, unified_memory=not cuda, memory_bytes=mem, host_memory_bytes=host,
        peak_flops={k: float(f"{v:.4g}") for k, v in rates.items()},
        efficiency=0.6, memory_bandwidth=float(f"{bw:.4g}"),
        h2d_bandwidth=float(f"{h2d:.4g}"), d2h_bandwidth=float(f"{d2h:.4g}"),
        nvme_read_bandwidth=float(f"{disk['read']:.4g}"),
        nvme_write_bandwidth=float(f"{disk['write']:.4g}"),
        nvme_bytes=int(free),
        sources={
            "peak_flops": f"{how}: median of 3 torch.mm of up to n={n} per dtype on {device}",
            "efficiency": "not measured: 0.6, the shipped cpu-host figure for transformer blocks "
                          "against the matmul rate",
            "memory_bandwidth": f"{how}: tensor copy, read + write bytes over time",
            "h2d_bandwidth": f"{how}: pinned 256 MiB copies" if cuda else "unified memory: none",
            "nvme": f"{how}: {disk['bytes'] >> 20} MiB written then read in {BLOCK >> 20} MiB "
                    f"blocks in {probe_dir} ({disk['method']})",
            "nvme_bytes": f"free space in {probe_dir} when measured",
            "memory_bytes": "torch.cuda device total" if cuda else "physical memory (sysconf)",
        },
        schema=HARDWARE_SCHEMA)


def _probe_dir(nvme_dir: str | None) -> tuple[Path, list[Path]]:
    """Where the disk probe writes, and the folders created for it (to remove afterwards):
    ``nvme_dir``, made where missing, or the temp folder."""
    created: list[Path] = []
    if not nvme_dir:
        return Path(tempfile.gettempdir()), created
    _check_path_text(nvme_dir, "--nvme-dir")
    target = Path(nvme_dir)
    shown = _shown(nvme_dir)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UserError(f"--nvme-dir '{shown}': cannot use it ({e.strerror}); give a "
                        "writable directory") from None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise UserError(f"--nvme-dir '{shown}' is not a directory; give a directory")
    # Create what is missing, remembering each level so that exactly those are removed.
    missing = []
    p = target.absolute()
    while not os.path.lexists(p):
        missing.append(p)
        p = p.parent
    try:
        for m in reversed(missing):
            m.mkdir()
            created.append(m)
    except OSError as e:
        raise UserError(f"--nvme-dir '{nvme_dir}': cannot create it ({e.strerror}); "
                        "give a writable directory") from None
    return target, created


def _disk_probe(probe_dir: Path, size: int, created: list[Path]) -> tuple[dict, int]:
    """The disk's read and write bandwidth in ``probe_dir`` and its free bytes; the folders
    in ``created`` are removed afterwards, whatever happens."""
    try:
        free = _free_bytes(probe_dir)
        if size > free // 2:
            # the probe's file would take most of the disk (and, past its room, fail late)
            raise UserError(f"--size {size} bytes is more than half the {free} bytes free in "
                            f"'{_shown(probe_dir)}'; give a smaller --size, e.g. 1G")
        disk = disk_bandwidth(probe_dir, size)
    except OSError as e:
        raise UserError(f"--nvme-dir '{_shown(probe_dir)}': disk probe failed ({e.strerror}); "
                        "give a writable directory on the disk to measure") from None
    finally:
        for p in reversed(created):
            with contextlib.suppress(OSError):
                p.rmdir()
    return disk, free


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return int(st.f_bavail * st.f_frsize)


def spec_yaml(spec: HardwareSpec) -> str:
    d = spec.to_dict()
    head = {"schema": d.pop("schema")}
    return yaml.safe_dump(head, sort_keys=False) + yaml.safe_dump(d, sort_keys=True)


def cli_hardware(args) -> int:
    size = parse_size(args.size, "--size")
    if size <= 0:
        raise UserError("--size 0: give the number of bytes the disk probe writes, e.g. 1G")
    if args.output:       # refused before the minutes of measuring, not after
        check_output(args.output, what="-o output", make_parents=True)
    spec = measure_host(args.nvme_dir, size)
    text = spec_yaml(spec)
    if args.output:
        # atomically, like every output (a directory or device is refused; Ctrl-C or SIGTERM
        # leaves no temporary file)
        out = write_atomic(args.output, lambda f: f.write(text), what="-o output")
        print(out)
    else:
        sys.stdout.write(text)
    return 0

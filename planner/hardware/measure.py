"""``plan hardware``: measure this host and write a hardware spec (``tierplan.hardware/1``).

Disk bandwidth is measured the way the runtime's transfer engine uses the drive: requests of
``request`` bytes (1 MiB), ``in_flight`` of them at once (one thread each, ``pwrite``/``preadv``
release the GIL), with the page cache out of the way: ``O_DIRECT`` where the file system takes
it (page-aligned buffers, whole requests), otherwise buffered I/O with ``fsync`` after writing
and ``posix_fadvise(DONTNEED)`` before reading, so the read comes from the disk and not from
memory; the spec's source line says which. The CPU AdamW rate is torch's own fused kernel
(``foreach`` where torch has no fused CPU AdamW) over fp32 parameters, on the
``torch.get_num_threads()`` cores the runtime's optimizer step gets. Compute rates are the median
of a few timed matmuls after a warm-up. On CUDA, pinned host<->device copies and device matmuls
are timed with the device synchronised.
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
import threading
import time
from pathlib import Path

import yaml

from planner.errors import UserError
from planner.formats.fileio import _check_path_text, _shown, check_output, write_atomic
from planner.formats import HARDWARE_SCHEMA, HardwareSpec, io_requests
from planner.sizes import fmt_bytes, parse_size

# bytes per I/O request and requests at once (threads) where not given: what the runtime's
# disk I/O issues on a host with a GPU (runtime/disk.py; io_requests gives a CPU host's)
REQUEST, IN_FLIGHT = io_requests(False, 1)
ALIGN = 4096             # O_DIRECT: buffer address, offset and size in whole blocks
ADAM_PARAMS = 1 << 25    # fp32 parameters the AdamW probe steps (~0.5 GiB with its state)


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
    # An anonymous mapping is page aligned, which O_DIRECT needs for its buffer; random bytes,
    # since some drives compress what they store.
    buf = mmap.mmap(-1, nbytes)
    buf.write(os.urandom(nbytes))
    return buf


def _open_direct(path: Path, flags: int, probe: mmap.mmap | None) -> tuple[int, str | None]:
    """``path`` opened with O_DIRECT, and None; or opened buffered, and why O_DIRECT was not
    used (the platform lacks it, or the file system refuses it at open or at the first write)."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return os.open(path, flags), "this platform has no O_DIRECT"
    try:
        fd = os.open(path, flags | direct)
    except OSError as e:
        return os.open(path, flags), f"the file system refuses O_DIRECT ({e.strerror})"
    if probe is not None:                 # some refuse only the first write (EINVAL)
        try:
            os.pwrite(fd, memoryview(probe)[:ALIGN], 0)
        except OSError as e:
            os.close(fd)
            return os.open(path, flags), f"the file system refuses O_DIRECT writes ({e.strerror})"
    return fd, None


def _parallel_io(fd: int, count: int, request: int, in_flight: int, write: bool) -> int:
    """Issue requests 0..count-1 of ``request`` bytes on ``fd``, ``in_flight`` at a time; the
    bytes moved (a short read ends early)."""
    nxt, done, lock, errors = [0], [0], threading.Lock(), []

    def worker():
        buf = _aligned_buffer(request)
        view = memoryview(buf)
        try:
            while not errors:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= count:
                    return
                n = os.pwrite(fd, view, i * request) if write else os.preadv(fd, [view], i * request)
                with lock:
                    done[0] += n
                if n < request:
                    return
        except OSError as e:
            errors.append(e)
        finally:
            view.release()
            buf.close()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(in_flight, count))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return done[0]


def disk_bandwidth(directory: Path, size: int, request: int = REQUEST,
                   in_flight: int = IN_FLIGHT) -> dict:
    """Write then read ``size`` bytes in ``directory`` in ``request``-byte requests,
    ``in_flight`` at once; bytes/s each way, the method and, where O_DIRECT was not used, why."""
    count = max(1, size // request)
    size = count * request
    fd, name = tempfile.mkstemp(prefix=".tierplan-probe-", dir=directory)
    os.close(fd)
    path = Path(name)
    probe = _aligned_buffer(ALIGN)
    try:
        fd, why = _open_direct(path, os.O_WRONLY, probe)
        try:
            t0 = time.perf_counter()
            written = _parallel_io(fd, count, request, in_flight, write=True)
            os.fsync(fd)
            write_s = time.perf_counter() - t0
        finally:
            os.close(fd)
        if why is None:
            fd, why_read = _open_direct(path, os.O_RDONLY, None)
            why = why_read
        else:
            fd = os.open(path, os.O_RDONLY)
        if why is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            t0 = time.perf_counter()
            done = _parallel_io(fd, count, request, in_flight, write=False)
            read_s = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        probe.close()
        path.unlink(missing_ok=True)
    method = "O_DIRECT" if why is None else "buffered, fsync after writing, page cache dropped " \
        f"before reading ({why})"
    return {"write": written / write_s, "read": done / read_s, "method": method, "bytes": size,
            "request": request, "in_flight": in_flight, "direct": why is None}


# ----------------------------------------------------------------------------- CPU AdamW

def adamw_rate(params: int, repeats: int = 3) -> dict:
    """Parameters per second of one torch AdamW step over ``params`` fp32 parameters (four
    tensors, gradients set), fused where torch has a fused CPU AdamW, else foreach; median of
    ``repeats`` steps after a warm-up, on ``torch.get_num_threads()`` threads."""
    import torch
    n = max(4, params)
    sizes = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
    ps = [torch.nn.Parameter(torch.randn(k)) for k in sizes]
    for p in ps:
        p.grad = torch.randn_like(p)
    kernel = "fused"
    try:
        opt = torch.optim.AdamW(ps, lr=1e-4, fused=True)
        opt.step()                        # CPU fused AdamW may exist only on newer torch
    except (RuntimeError, TypeError, ValueError):
        kernel = "foreach"
        opt = torch.optim.AdamW(ps, lr=1e-4, foreach=True)
    t = _median_time(opt.step, repeats)
    return {"params_per_s": n / t, "params": n, "kernel": kernel,
            "threads": torch.get_num_threads(), "torch": torch.__version__}


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

def measure_host(nvme_dir: str | None, size: int, matmul_n: int | None = None,
                 request: int | None = None, in_flight: int | None = None,
                 adam_params: int = ADAM_PARAMS) -> HardwareSpec:
    """This host's spec, measured: the disk probe in ``nvme_dir`` (or the temp folder), in
    requests as the runtime issues them here unless ``request``/``in_flight`` say otherwise;
    the CPU AdamW rate, the matmul rate per dtype, copy bandwidths and memory sizes."""
    import torch

    cuda = torch.cuda.is_available()
    own_request, own_in_flight = io_requests(not cuda, 1)
    probe_dir, created = _probe_dir(nvme_dir)
    disk, free = _disk_probe(probe_dir, size, created, request or own_request,
                             in_flight or own_in_flight)
    adam = adamw_rate(adam_params)
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
        cpu_adam_params_per_s=float(f"{adam['params_per_s']:.4g}"),
        cpu_adam_cores=int(adam["threads"]),
        sources=_sources(device, n, disk, adam, probe_dir),
        schema=HARDWARE_SCHEMA)


def _sources(device: str, n: int, disk: dict, adam: dict, probe_dir: Path) -> dict:
    """How each measured number was measured (the spec's ``sources``)."""
    how = f"measured by 'plan hardware' on {time.strftime('%Y-%m-%d')}"
    cuda = device == "cuda"
    return {
        "peak_flops": f"{how}: median of 3 torch.mm of up to n={n} per dtype on {device}",
        "efficiency": "not measured: 0.6, the shipped cpu-host figure for transformer blocks "
                      "against the matmul rate",
        "memory_bandwidth": f"{how}: tensor copy, read + write bytes over time",
        "h2d_bandwidth": f"{how}: pinned 256 MiB copies" if cuda else "unified memory: none",
        "nvme": f"{how}: {fmt_bytes(disk['bytes'])} written then read in "
                f"{fmt_bytes(disk['request'])} requests, {disk['in_flight']} in flight, in "
                f"{probe_dir} ({disk['method']}); the whole tier as the runtime sees it",
        "nvme_bytes": f"free space in {probe_dir} when measured",
        "memory_bytes": "torch.cuda device total" if cuda else "physical memory (sysconf)",
        "cpu_adam_params_per_s": f"{how}: torch {adam['torch']} AdamW ({adam['kernel']}) over "
                                 f"{adam['params']} fp32 parameters in 4 tensors, median of 3 "
                                 f"steps on {adam['threads']} threads (torch.get_num_threads())",
        "cpu_adam_cores": f"{how}: torch.get_num_threads(), the threads the runtime's optimizer "
                          "step gets",
    }


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


def _disk_probe(probe_dir: Path, size: int, created: list[Path], request: int = REQUEST,
                in_flight: int = IN_FLIGHT) -> tuple[dict, int]:
    """The disk's read and write bandwidth in ``probe_dir`` and its free bytes; the folders
    in ``created`` are removed afterwards, whatever happens."""
    try:
        free = _free_bytes(probe_dir)
        if size > free // 2:
            # the probe's file would take most of the disk (and, past its room, fail late)
            raise UserError(f"--size {size} bytes is more than half the {free} bytes free in "
                            f"'{_shown(probe_dir)}'; give a smaller --size, e.g. 1G")
        disk = disk_bandwidth(probe_dir, size, request, in_flight)
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


MAX_IN_FLIGHT = 64
MAX_REQUEST = 64 << 20
MAX_ADAM_PARAMS = 1 << 31


def _own_requests() -> tuple[int, int]:
    """The disk requests the runtime issues on this host, per drive (``io_requests``)."""
    import torch
    return io_requests(not torch.cuda.is_available(), 1)


def _probe_options(args) -> tuple[int, int, int, int]:
    """``--size``, ``--request``, ``--in-flight`` and ``--adam-params``, each checked (one
    line naming the option and a value that works)."""
    size = parse_size(args.size, "--size")
    if size <= 0:
        raise UserError("--size 0: give the number of bytes the disk probe writes, e.g. 1G")
    own_request, own_in_flight = _own_requests()
    request = own_request if args.request is None else parse_size(args.request, "--request")
    if not ALIGN <= request <= MAX_REQUEST or request % ALIGN:
        raise UserError(f"--request {args.request}: give a whole number of 4 KiB blocks from "
                        "4K to 64M (O_DIRECT needs whole blocks), e.g. 1M")
    if size < request:
        raise UserError(f"--size {args.size} is smaller than one --request "
                        f"({fmt_bytes(request)}); give a larger --size, e.g. 1G")
    text = str(args.in_flight if args.in_flight is not None else own_in_flight).strip()
    if not text.isdigit() or not 1 <= int(text) <= MAX_IN_FLIGHT:
        raise UserError(f"--in-flight {_shown(str(args.in_flight))}: give the number of "
                        f"requests at once, 1 to {MAX_IN_FLIGHT}, e.g. {IN_FLIGHT}")
    return size, request, int(text), _adam_params(args)


def _adam_params(args) -> int:
    adam = parse_size(args.adam_params, "--adam-params")
    if not 4 <= adam <= MAX_ADAM_PARAMS:
        raise UserError(f"--adam-params {args.adam_params}: give the number of fp32 "
                        "parameters the AdamW probe steps, 4 to 2G, e.g. 32M")
    return adam


def cli_hardware(args) -> int:
    size, request, in_flight, adam = _probe_options(args)
    if args.output:       # refused before the minutes of measuring, not after
        check_output(args.output, what="-o output", make_parents=True)
    spec = measure_host(args.nvme_dir, size, request=request, in_flight=in_flight,
                        adam_params=adam)
    if "(O_DIRECT)" not in spec.sources["nvme"]:      # the fallback, said where it happened
        print(f"plan hardware: note: no O_DIRECT; {spec.sources['nvme']}", file=sys.stderr)
    text = spec_yaml(spec)
    if args.output:
        # atomically, like every output (a directory or device is refused; Ctrl-C or SIGTERM
        # leaves no temporary file)
        out = write_atomic(args.output, lambda f: f.write(text), what="-o output")
        print(out)
    else:
        sys.stdout.write(text)
    return 0

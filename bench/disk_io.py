"""The runtime's direct disk I/O (runtime/disk.py) alone and beside one compute thread: 256 MiB
of 3 MiB tensors (page+64 in memory, so every request goes through a bounce buffer) written
and read back in the requests a plan gives (default a CPU host's: 256 KiB, 2 in flight), with
and without a thread doing 512x512 fp32 matmuls at one intra-op thread beside it; bytes/s each
way. On a 2-core host this is what separates the spec's disk rates from what a training step
gets (docs/benchmarks.md, "The disk as a disk").

    python bench/disk_io.py [--dir DIR] [--request 262144] [--in-flight 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])   # the repository, not bench/

from runtime.disk import DiskIO  # noqa: E402
from runtime.files import byte_view  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the test file goes (default: temp)")
    ap.add_argument("--request", type=int, default=1 << 18)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    fd_, path = tempfile.mkstemp(prefix=".tierplan-diskio-", dir=args.dir)
    os.close(fd_)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        ts = [torch.randn((3 << 20) // 4) for _ in range((args.mib << 20) // (3 << 20))]
        items, off = [], 0
        for t in ts:
            items.append((off, byte_view(t)))
            off += t.numel() * 4
        stop = [False]

        def compute():
            a = torch.randn(512, 512)
            while not stop[0]:
                a @ a
        print(f"{off >> 20} MiB in 3 MiB tensors, {args.request >> 10} KiB requests, "
              f"{args.in_flight} in flight")
        for busy in (False, True):
            th = threading.Thread(target=compute) if busy else None
            stop[0] = False
            if th:
                th.start()
            io = DiskIO(args.request, args.in_flight)
            io.opened(fd)
            io.write_many(fd, items)                     # the file exists: rewrites below
            t0 = time.perf_counter()
            io.write_many(fd, items)
            tw = time.perf_counter() - t0
            t0 = time.perf_counter()
            io.read_many(fd, items)
            tr = time.perf_counter() - t0
            stop[0] = True
            if th:
                th.join()
            io.close()
            print(f"  {'one compute thread beside' if busy else 'alone':26} write "
                  f"{off / tw / 1e9:.2f} GB/s  read {off / tr / 1e9:.2f} GB/s")
    finally:
        os.close(fd)
        os.unlink(path)


if __name__ == "__main__":
    main()

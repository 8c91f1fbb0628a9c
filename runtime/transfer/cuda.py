"""The CUDA backend (device-generic where torch is: ``getattr(torch, device.type)``, as torchao's
``optim/cpu_offload.py`` does): copy streams and events of the device's torch module, copies
``non_blocking`` from and to pinned memory, explicit waits (FSDP2's pattern: no
``record_stream``), and the device's memory counters. A buffer a copy stream still reads is held
(``keep``) until its event has happened; ``reap`` lets go of those that have."""
from __future__ import annotations

import threading

import torch

from .backend import Backend


class CudaBackend(Backend):
    unified = False
    name = "cuda"

    def __init__(self, device: torch.device, pinned_bytes: int = 0):
        super().__init__(device, pinned_bytes)
        self.mod = getattr(torch, device.type)
        self.streams: dict = {}
        self.kept: list = []
        self.lock = threading.Lock()

    def _s(self, stream):
        return self.mod.current_stream(self.device) if stream is None else stream

    def stream(self, name: str):
        if name not in self.streams:
            self.streams[name] = self.mod.Stream(self.device)
        return self.streams[name]

    def event(self):
        return self.mod.Event()

    def record(self, event, stream) -> None:
        event.record(self._s(stream))

    def wait(self, stream, event) -> None:
        self._s(stream).wait_event(event)

    def host_wait(self, event) -> None:
        event.synchronize()

    def done(self, event) -> bool:
        return event.query()

    def compute_context(self):
        s = torch.cuda.current_stream(self.device)
        return lambda: torch.cuda.stream(s)        # sets the device too

    def synchronize(self) -> None:
        self.mod.synchronize(self.device)
        with self.lock:
            self.kept = []
        self._reap(block=True)

    def copy(self, dst, src, stream) -> None:
        with self.mod.stream(self._s(stream)):
            dst.copy_(src, non_blocking=True)

    def keep(self, tensor, event) -> None:
        with self.lock:
            self.kept = [(t, e) for t, e in self.kept if not e.query()]
            self.kept.append((tensor, event))

    def _alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def allocated(self):
        return self.mod.memory_allocated(self.device)

    def reset_peak(self) -> None:
        self.mod.reset_peak_memory_stats(self.device)

    def peak(self):
        return self.mod.max_memory_allocated(self.device)

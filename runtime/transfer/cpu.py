"""The CPU backend: device memory is host memory (``unified``). Streams are worker threads
(one each, in order), events are futures: a copy on a stream runs on its thread after what was
queued there before; ``wait(stream, ev)`` queues a wait for ``ev``'s future on that thread
(on the compute stream, ``None``, it blocks the caller). The runtime's activation offload on a
CPU device does not stage (the I/O worker writes the tensors' own memory), so these streams
serve only what stages through them explicitly."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .backend import Backend


def _done() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f


class _Event:
    __slots__ = ("fut",)

    def __init__(self):
        self.fut = _done()


class CpuBackend(Backend):
    unified = True
    name = "cpu"

    def __init__(self, device: torch.device | None = None, pinned_bytes: int = 0):
        super().__init__(device or torch.device("cpu"), pinned_bytes)
        self.streams: dict[str, ThreadPoolExecutor] = {}

    def stream(self, name: str):
        if name not in self.streams:
            self.streams[name] = ThreadPoolExecutor(1, thread_name_prefix=f"tierplan-{name}")
        return self.streams[name]

    def event(self):
        return _Event()

    def record(self, event, stream) -> None:
        event.fut = _done() if stream is None else stream.submit(lambda: None)

    def wait(self, stream, event) -> None:
        if stream is None:
            event.fut.result()
        else:
            stream.submit(event.fut.result)

    def host_wait(self, event) -> None:
        event.fut.result()

    def done(self, event) -> bool:
        return event.fut.done()

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.submit(lambda: None).result()

    def copy(self, dst, src, stream) -> None:
        if stream is None:
            dst.copy_(src)
        else:
            stream.submit(dst.copy_, src)

    def close(self) -> None:
        for s in self.streams.values():
            s.shutdown(wait=True)
        self.streams = {}

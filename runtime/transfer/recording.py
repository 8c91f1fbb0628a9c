"""The recording backend, for tests: a device that is not host memory (``unified = False``, so
the runtime takes its staged path, the one CUDA takes), run on the CPU in an adversarial order.

Every operation is recorded with its stream and the events it waits on (``log``). Nothing a copy
stream is given runs when it is issued: each stream's queue is deferred until something forces
it (the compute stream or the host waiting for one of its events, ``synchronize``), and then
only that stream runs, only as far as that event, and a wait in it forces the stream it waits
for in turn. ``synchronize`` drains the streams newest first. So a stream runs as late as its
waits allow, and two streams no wait orders run in the reverse of the order they were issued.

Buffers are watched by their bytes: a copy marks its destination range as written by it until
it runs, and its source range as read by it until it runs. A read (a copy's source when the
copy runs, the compute stream's ``use``, a file ``write``) of bytes whose writer has not run,
a write over bytes a queued reader has not read yet, and a copy whose buffer was freed
before it ran (not run then) are each a *missing wait*
(``missing``, with what and where in ``problems``): the consumer did not wait for its
producer's event. In this order such a consumer also reads the wrong bytes, so the gradients
differ too."""
from __future__ import annotations

import threading

import torch

from .backend import Backend


class _Event:
    __slots__ = ("stream", "seq", "done", "id")
    count = 0

    def __init__(self):
        _Event.count += 1
        self.id = _Event.count
        self.stream, self.seq, self.done = None, 0, True


class _Stream:
    def __init__(self, name: str, order: int):
        self.name, self.order = name, order
        self.queue: list = []      # [(seq, kind, payload)]
        self.ran = 0               # ops run so far (seq of the last one run)
        self.issued = 0


def _range(t: torch.Tensor) -> tuple[int, int, int]:
    st = t.untyped_storage()
    lo = t.storage_offset() * t.element_size()
    return st.data_ptr(), lo, lo + t.numel() * t.element_size()


class RecordingBackend(Backend):
    unified = False
    name = "recording"

    def __init__(self, pinned_bytes: int = 1 << 34):
        super().__init__(torch.device("cpu"), pinned_bytes)
        self.streams: dict[str, _Stream] = {}
        self.lock = threading.RLock()
        self.log: list = []          # (stream, op, events waited on) in issue order
        self.missing = 0
        self.problems: list = []
        self.writes: dict = {}       # id(op) -> (ptr, lo, hi) written by a copy not yet run
        self.reads: dict = {}        # id(op) -> (ptr, lo, hi) read by a copy not yet run
        self.ran_ops = 0
        self.drop_waits: set = set()   # tests: stream names whose waits are dropped

    # -- streams and events
    def stream(self, name: str):
        with self.lock:
            if name not in self.streams:
                self.streams[name] = _Stream(name, len(self.streams))
            return self.streams[name]

    def event(self):
        return _Event()

    def record(self, event, stream) -> None:
        with self.lock:
            self.log.append((self._name(stream), "record", [event.id]))
            if stream is None:
                event.stream, event.done = None, True
                return
            event.stream, event.done = stream, False
            event.seq = self._push(stream, "record", event)

    def wait(self, stream, event) -> None:
        with self.lock:
            self.log.append((self._name(stream), "wait", [event.id]))
            if self._name(stream) in self.drop_waits:
                return
            if stream is None:
                self._force(event)
            elif event.stream is not stream and not event.done:
                self._push(stream, "wait", event)

    def host_wait(self, event) -> None:
        with self.lock:
            self._force(event)

    def synchronize(self) -> None:
        with self.lock:
            for s in sorted(self.streams.values(), key=lambda s: -s.order):
                self._run(s, s.issued)
            self._reap(block=True)

    # -- copies and buffers
    def copy(self, dst, src, stream) -> None:
        with self.lock:
            self.log.append((self._name(stream), "copy", []))
            if stream is None:
                self._check_read(src, "compute copy")
                self._check_write(dst, None, "compute copy")
                dst.copy_(src)
                return
            op = (dst, src)
            self._check_write(dst, None, f"copy on {stream.name}")
            self.writes[id(op)] = _range(dst)
            self.reads[id(op)] = _range(src)
            self._push(stream, "copy", op)

    def use(self, tensor):
        with self.lock:
            self._check_read(tensor, "compute use")
        return tensor

    def unpin(self, view, event=None) -> None:
        with self.lock:      # given back once its event has run (Backend.unpin), not forced
            super().unpin(view, event)

    def pinned(self, nbytes: int):
        with self.lock:
            return super().pinned(nbytes)

    def done(self, event) -> bool:
        return event.done

    def write_many(self, fd, items, sums=None) -> None:
        # each view: a memoryview of a host tensor, checked by address (``write`` comes here)
        items = list(items)
        with self.lock:
            for _, view in items:
                self._check_overlap(self.writes, (_mv_ptr(view), 0, len(view)), "file write",
                                    absolute=True)
        super().write_many(fd, items, sums)

    # -- internals
    def _name(self, stream) -> str:
        return "compute" if stream is None else stream.name

    def _push(self, s: _Stream, kind: str, payload) -> int:
        s.issued += 1
        s.queue.append((s.issued, kind, payload))
        return s.issued

    def _force(self, event) -> None:
        if event.stream is not None and not event.done:
            self._run(event.stream, event.seq)

    def _run(self, s: _Stream, upto: int) -> None:
        while s.queue and s.queue[0][0] <= upto:
            seq, kind, payload = s.queue.pop(0)
            if kind == "record":
                payload.done = True
            elif kind == "wait":
                self._force(payload)
            else:
                dst, src = payload
                self.writes.pop(id(payload), None)
                self.reads.pop(id(payload), None)
                gone = [t for t in (dst, src) if _freed(t)]
                if gone:
                    # its buffer was freed (a storage resized away) before the copy ran: the
                    # free did not wait for the copy's event; the copy is not run
                    self.missing += 1
                    self.problems.append(f"copy on {s.name}: a buffer was freed before it ran")
                else:
                    self._check_read(src, f"copy on {s.name}")
                    dst.copy_(src)
                self.ran_ops += 1
            s.ran = seq

    def _check_read(self, t, who: str) -> None:
        self._check_overlap(self.writes, _range(t), who)

    def _check_write(self, t, _op, who: str) -> None:
        self._check_overlap(self.reads, _range(t), who + " (overwrites unread bytes)")
        self._check_overlap(self.writes, _range(t), who + " (two writers)")

    def _check_overlap(self, table: dict, rng, who: str, absolute: bool = False) -> None:
        ptr, lo, hi = rng
        for r in table.values():
            a, b = (r[0] + r[1], r[0] + r[2]) if absolute else (r[1], r[2])
            same = True if absolute else r[0] == ptr
            x, y = (ptr + lo, ptr + hi) if absolute else (lo, hi)
            if same and a < y and x < b:
                self.missing += 1
                self.problems.append(f"{who}: bytes [{x}, {y}) not yet produced or consumed")
                return


def _freed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage no longer holds its elements (resized away)."""
    return t.untyped_storage().nbytes() < (t.storage_offset() + t.numel()) * t.element_size()


def _mv_ptr(mv) -> int:
    import ctypes
    if len(mv) == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))

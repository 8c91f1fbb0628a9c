"""Per-unit times of a step and busy times of the disk links: what ``plan calibrate`` reads.

``StageClock`` takes one timestamp where the stage driver starts a stage (after the barrier
that waits for the previous stage's transfers, so a stage's span is its compute and the wait
at its end is the stall; the driver's ``wait_s`` tells them apart), one where the model's
forward returns, and one around each recomputed block. At the end of a step the marks become
per-unit forward, backward and recompute seconds (per pass, averaged over the step's passes).
Unit i computes its forward in stage 1+i and its backward in stage 2U-i; a segment's
recompute runs inside the backward stage of its last unit, so a unit's backward is its stage's
compute less the recomputes timed inside it.

A timestamp is ``time.perf_counter()`` on a CPU device and a ``torch.cuda.Event`` recorded on
the current stream on CUDA (kernels are asynchronous: the host clock would time their launch);
events are resolved at the end of the step, after the step's synchronize. The host-side
waits (``wait_s``) are then zero (CUDA barriers are stream waits) and a stage's span includes
its stall.

``LINKS`` counts bytes and busy seconds per disk link (``nvme_read``, ``nvme_write``) around
``files.pread_all`` and ``files.pwrite_all`` (the write's checksum included), as the union of
the intervals when any transfer of that link is in flight: effective bandwidth is bytes over
busy seconds. It is process-wide; a step reads its change.
"""
from __future__ import annotations

import contextlib
import statistics
import threading
import time


class LinkClock:
    """Bytes and busy seconds (union of in-flight intervals) per link, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes: dict[str, int] = {}
        self.busy: dict[str, float] = {}
        self._open: dict[str, int] = {}
        self._since: dict[str, float] = {}

    @contextlib.contextmanager
    def busy_with(self, link: str, nbytes: int):
        with self.lock:
            n = self._open.get(link, 0)
            if n == 0:
                self._since[link] = time.perf_counter()
            self._open[link] = n + 1
        done = False
        try:
            yield
            done = True
        finally:
            with self.lock:
                self._open[link] -= 1
                if done:                    # a failed transfer moved nothing to count
                    self.bytes[link] = self.bytes.get(link, 0) + int(nbytes)
                if self._open[link] == 0:
                    self.busy[link] = (self.busy.get(link, 0.0)
                                       + time.perf_counter() - self._since[link])

    def snapshot(self) -> dict:
        """``{link: (bytes, busy seconds)}`` so far (intervals still open not counted)."""
        with self.lock:
            return {k: (self.bytes.get(k, 0), self.busy.get(k, 0.0)) for k in self.bytes}

    @staticmethod
    def since(before: dict, after: dict) -> dict:
        """Per link ``{"bytes", "busy_s"}`` between two snapshots (links with bytes only)."""
        out = {}
        for k, (b, s) in after.items():
            b0, s0 = before.get(k, (0, 0.0))
            if b > b0:
                out[k] = {"bytes": int(b - b0), "busy_s": max(0.0, s - s0)}
        return out


LINKS = LinkClock()


class StageClock:
    """Stage marks of the passes of one step; ``end_step`` turns them into unit times."""

    def __init__(self, names: list[str], device):
        self.names = list(names)            # every unit, in execution order
        self.U = len(self.names)
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.passes: list[dict] = []
        self.after_backward_t0 = None
        self.link0: dict = {}
        # the optimizer's updates on the device in this step: (t0, t1, elements), appended by
        # the training thread and the overlapped worker (``OptimizerPhase.timed``)
        self.updates: list = []

    # -- timestamps
    def now(self):
        if self.cuda:
            import torch
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _seconds(self, a, b) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    # -- hooks the runner calls
    def begin_step(self) -> None:
        self.passes = []
        self.updates = []
        self.after_backward_t0 = None
        self.link0 = LINKS.snapshot()

    def begin_pass(self, micro_batches: int = 1) -> None:
        """A stage sequence starts; under a layer-major plan one covers ``micro_batches``
        micro-batches, and its unit times are divided by them (seconds per micro-batch)."""
        self.passes.append({"marks": {}, "fwd_end": None, "recompute": [], "backward": False,
                            "n": max(1, int(micro_batches))})

    def backward_seen(self) -> None:
        """A gradient hook of the current pass fired: its backward ran (a pass dropped without
        one has its backward stages run back to back by the next forward: not timed)."""
        if self.passes:
            self.passes[-1]["backward"] = True

    def mark(self, stage: int, wait_s: float) -> None:
        """The driver starts ``stage`` (its barrier waited; ``wait_s`` the driver's total)."""
        if not self.passes:
            return
        p = self.passes[-1]
        if stage not in p["marks"]:
            t = self.now()
            p["marks"][stage] = (t, wait_s)
            if stage == 2 * self.U + 1:
                self.after_backward_t0 = t

    def optimizer(self, t0, t1, elements: int) -> None:
        """An update of ``elements`` parameter elements ran on the device from ``t0`` to
        ``t1`` (timestamps of ``now``)."""
        self.updates.append((t0, t1, int(elements)))

    def optimizer_compute(self) -> tuple[float | None, int]:
        """``(seconds, elements)`` of the step's timed updates, ``(None, 0)`` where none ran
        (after ``end_step``, whose synchronize completes the CUDA events)."""
        ups = list(self.updates)
        if not ups:
            return None, 0
        return (sum(max(0.0, self._seconds(a, b)) for a, b, _ in ups),
                sum(n for _, _, n in ups))

    def forward_done(self) -> None:
        if self.passes:
            self.passes[-1]["fwd_end"] = self.now()

    def recompute(self, name: str, t0, t1) -> None:
        """A block was re-run from ``t0`` to ``t1`` (timestamps of ``now``)."""
        if self.passes:
            self.passes[-1]["recompute"].append((name, t0, t1))

    # -- the step's figures
    def end_step(self) -> tuple[dict, float | None, dict]:
        """``(units, after_backward_s, links)``: per unit name ``{"fwd_s", "bwd_s",
        "recompute_s", "stall_s"}`` per pass (mean over the step's passes; a figure absent
        when no pass measured it), the seconds from the last backward's end to now (the
        optimizer step and whatever the loop did in between), and the disk links' bytes and
        busy seconds in the step."""
        t_end = self.now()
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        U = self.U
        acc: dict[str, dict[str, list]] = {n: {} for n in self.names}

        def add(name, key, v):
            acc[name].setdefault(key, []).append(max(0.0, v) / per)
        for p in self.passes:
            per = p.get("n", 1)
            m = p["marks"]
            rec_by_stage: dict[int, float] = {}
            rec_unit: dict[str, float] = {}
            for name, t0, t1 in p["recompute"]:
                s = self._seconds(t0, t1)
                rec_unit[name] = rec_unit.get(name, 0.0) + s
                st = self._stage_of(m, t0)
                if st is not None:
                    rec_by_stage[st] = rec_by_stage.get(st, 0.0) + s
            for name, s in rec_unit.items():
                add(name, "recompute_s", s)
            for i, name in enumerate(self.names):
                f = 1 + i
                end = m.get(f + 1) if i < U - 1 else None
                if i == U - 1 and p["fwd_end"] is not None:
                    end = (p["fwd_end"], m[f][1] if f in m else 0.0)
                if f in m and end is not None:
                    add(name, "fwd_s", self._seconds(m[f][0], end[0]) - (end[1] - m[f][1]))
                b = 2 * U - i
                if p["backward"] and b in m and b + 1 in m:
                    stall = m[b + 1][1] - m[b][1]
                    span = self._seconds(m[b][0], m[b + 1][0])
                    add(name, "bwd_s", span - stall - rec_by_stage.get(b, 0.0))
                    add(name, "stall_s", stall)
        units = {n: {k: statistics.fmean(v) for k, v in d.items()} for n, d in acc.items() if d}
        after = (self._seconds(self.after_backward_t0, t_end)
                 if self.after_backward_t0 is not None else None)
        return units, after, LinkClock.since(self.link0, LINKS.snapshot())

    def _stage_of(self, marks: dict, t) -> int | None:
        """The stage whose span holds timestamp ``t``: the last mark at or before it."""
        best, best_dt = None, None
        for s, (ts, _) in marks.items():
            dt = self._seconds(ts, t)
            if dt >= 0 and (best_dt is None or dt < best_dt):
                best, best_dt = s, dt
        return best

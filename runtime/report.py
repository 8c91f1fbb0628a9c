"""The measured report: what a step really took beside what the plan predicted.

A step is the forward pass(es), the backward(s) and the optimizer step; it starts at the first
forward with gradients after the previous optimizer step and ends when an optimizer holding the
model's parameters has stepped. ``docs/runtime.md`` says exactly how each figure is measured.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from planner.formats import REPORT_SCHEMA, write_json_atomic
from planner.sizes import fmt_bytes, fmt_seconds

LINKS = ("d2h", "h2d", "nvme_write", "nvme_read")


# ----------------------------------------------------------------------------- host memory probes

_FDS: dict = {}


def _fd(path: str, flags: int):
    """An fd kept open for the process: opening a /proc file costs more than reading it
    (about 45 us per open-read-close of /proc/self/status against 19 us for a pread here)."""
    key = (os.getpid(), path)
    fd = _FDS.get(key)
    if fd is None:
        fd = _FDS[key] = os.open(path, flags | os.O_CLOEXEC)
    return fd


def read_status() -> dict:
    """VmRSS and VmHWM of this process in bytes (Linux ``/proc/self/status``); {} elsewhere."""
    out = {}
    try:
        text = os.pread(_fd("/proc/self/status", os.O_RDONLY), 1 << 16, 0)
    except OSError:
        return out
    for key in (b"VmRSS:", b"VmHWM:"):
        i = text.find(key)
        if i >= 0:
            # the kernel reports kB
            out[key[:-1].decode()] = int(text[i + len(key):text.index(b"kB", i)]) * 1024
    return out


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS: ``echo 5 > clear_refs``
    (Documentation/admin-guide/mm/soft-dirty.rst, Linux >= 4.0). False where not allowed."""
    try:
        os.write(_fd("/proc/self/clear_refs", os.O_WRONLY), b"5")
        return True
    except OSError:
        return False


_libc = None


def malloc_trim() -> None:
    """Give freed heap pages back to the kernel so the RSS before a step is not inflated by
    memory glibc keeps cached (tensors below glibc's mmap threshold, up to 32 MiB, live on the
    heap)."""
    global _libc
    with contextlib.suppress(OSError, AttributeError):   # not glibc: nothing to trim
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)


# ----------------------------------------------------------------------------- records

@dataclass
class StepRecord:
    """One measured step."""

    step_s: float
    passes: int                       # forward passes in the step (gradient accumulation)
    peak_gpu_bytes: int | None        # CUDA: allocator peak; CPU: peak RSS rise over the step
    peak_cpu_bytes: int               # pinned host bytes holding offloaded tensors, peak
    peak_nvme_bytes: int              # bytes in offload files, peak
    peak_activation_bytes: int        # the runtime's own count of resident activation bytes
    static_bytes: int                 # params + grads + optimizer state resident before the step
    base_bytes: int | None            # CUDA: allocated before; CPU: RSS before the step
    moved: dict = field(default_factory=dict)   # link -> bytes
    stall_s: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Report:
    """Measured steps beside the plan's prediction. ``str()`` prints a table."""

    plan_path: str | None
    policy: str
    device: str                       # cuda | cpu
    hardware: str
    batch: int
    seq: int
    predicted: dict                   # the plan's predicted section
    predicted_moved: dict             # link -> bytes, summed over the plan's schedule
    steps: list = field(default_factory=list)   # list[StepRecord]
    hwm_reset: bool = True            # whether /proc/self/clear_refs could reset VmHWM

    def median(self) -> dict:
        """Median of every measured figure over the steps after the first (the first step also
        allocates the optimizer state and warms caches); of all steps when there is only one."""
        steps = self.steps[1:] if len(self.steps) > 1 else self.steps
        if not steps:
            return {}
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        out = {}
        for k in ("step_s", "peak_gpu_bytes", "peak_cpu_bytes", "peak_nvme_bytes",
                  "peak_activation_bytes", "static_bytes", "stall_s"):
            vals = [getattr(s, k) for s in steps if getattr(s, k) is not None]
            out[k] = med(vals)
        out["moved"] = {link: med([s.moved.get(link, 0) for s in steps]) for link in LINKS}
        out["steps"] = len(steps)
        return out

    def predicted_gpu_rise(self, static_bytes: int) -> int | None:
        """What the measured device-memory figure is compared with: on CUDA the predicted peak
        itself (the allocator peak counts everything), on a CPU host the predicted peak less the
        static state already resident before the step (the RSS rise excludes it)."""
        p = self.predicted.get("peak_gpu_bytes")
        if p is None:
            return None
        return int(p) if self.device == "cuda" else int(p) - int(static_bytes)

    def to_dict(self) -> dict:
        med = self.median()
        return {
            "schema": REPORT_SCHEMA,
            "plan": {"path": self.plan_path, "policy": self.policy, "hardware": self.hardware,
                     "batch": self.batch, "seq": self.seq},
            "device": self.device,
            "predicted": dict(self.predicted, moved=dict(self.predicted_moved)),
            "predicted_gpu_rise_bytes": (self.predicted_gpu_rise(med["static_bytes"])
                                         if med else None),
            "measured": med,
            "steps": [s.to_dict() for s in self.steps],
            "hwm_reset": self.hwm_reset,
            "gpu_measure": ("cuda allocator peak (torch.cuda.max_memory_allocated)"
                            if self.device == "cuda" else
                            "rise of peak RSS (VmHWM after reset via /proc/self/clear_refs) "
                            "over RSS before the step"),
        }

    def save(self, path) -> Path:
        return write_json_atomic(path, self.to_dict())

    def __str__(self) -> str:
        med = self.median()
        head = (f"tierplan report: plan {self.plan_path or '(in memory)'} ({self.policy}, "
                f"{self.hardware}), {len(self.steps)} step(s) measured on {self.device}")
        if not med:
            return head + "\n  no complete step yet (a step ends at the optimizer step)"
        p = self.predicted
        rows = [("figure", "measured", "predicted")]
        rows.append(("step time", fmt_seconds(med["step_s"]), fmt_seconds(p.get("step_s"))))
        gpu_label = "peak device memory" if self.device == "cuda" else \
            "peak RSS rise over step"
        rows.append((gpu_label, fmt_bytes(med["peak_gpu_bytes"]),
                     fmt_bytes(self.predicted_gpu_rise(med["static_bytes"]))))
        rows.append(("  activations (runtime count)", fmt_bytes(med["peak_activation_bytes"]), ""))
        rows.append(("  static state before step", fmt_bytes(med["static_bytes"]), ""))
        rows.append(("peak host (pinned)", fmt_bytes(med["peak_cpu_bytes"]),
                     fmt_bytes(p.get("peak_cpu_bytes"))))
        rows.append(("peak nvme", fmt_bytes(med["peak_nvme_bytes"]),
                     fmt_bytes(p.get("peak_nvme_bytes"))))
        for link in LINKS:
            rows.append((f"moved {link}", fmt_bytes(med["moved"][link]),
                         fmt_bytes(self.predicted_moved.get(link, 0))))
        exposed = None
        if p.get("step_s") is not None and p.get("compute_s") is not None:
            exposed = p["step_s"] - p["compute_s"]
        rows.append(("stalled on prefetch", fmt_seconds(med["stall_s"]),
                     "(step - compute) " + fmt_seconds(exposed) if exposed is not None else ""))
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [head, f"  median of {med['steps']} step(s)" +
                 (" (the first step is left out)" if len(self.steps) > 1 else "")]
        for r in rows:
            lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
        if self.device != "cuda" and not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            lines.append("  note: glibc keeps freed tensors in RSS, so the RSS rise is only "
                         "indicative; run with MALLOC_MMAP_THRESHOLD_=65536 to measure it "
                         "(docs/runtime.md)")
        if not self.hwm_reset and self.device != "cuda":
            lines.append("  note: /proc/self/clear_refs was not writable; the RSS peak is the "
                         "process's lifetime peak")
        return "\n".join(lines)

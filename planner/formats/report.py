"""The measured report (``tierplan.report/1``): what a training run under a plan measured,
beside what the plan predicted. The runtime fills it (``handle.report()``); ``plan inspect
--report`` reads it back. One dataclass per record, validated on load like every file here.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from planner.errors import UserError
from planner.formats.fileio import read_json, write_json_atomic
from planner.formats.enums import REPORT_SCHEMA
from planner.formats.plan import Prediction
from planner.formats.validate import (MAX_BYTES, check_fields, check_schema, is_int, require,
                                      short_repr)
from planner.sizes import fmt_bytes, fmt_seconds

LINKS = ("d2h", "h2d", "nvme_write", "nvme_read")
_FIX = "save it again with handle.report().save(path)"


@dataclass(frozen=True)
class StepRecord:
    """One measured optimizer step."""

    step_s: float
    passes: int                       # forward passes in the step (gradient accumulation)
    peak_gpu_bytes: int | None        # CUDA: allocator peak; CPU: peak RSS rise over the step
    peak_cpu_bytes: int               # pinned host bytes the runtime held, peak
    peak_nvme_bytes: int              # bytes in the runtime's files, peak
    peak_activation_bytes: int        # the runtime's own count of resident activation bytes
    static_bytes: int                 # device bytes of params, grads and optimizer state before
    base_bytes: int | None            # CUDA: allocated before; CPU: RSS before the step
    moved: dict = field(default_factory=dict)   # link -> bytes
    stall_s: float = 0.0              # time the training thread waited for transfers
    # per unit name, seconds per pass (runtime/timing.py): fwd_s, bwd_s (its stage's compute
    # less the recomputes inside it), recompute_s, stall_s (the wait at its backward's end)
    units: dict = field(default_factory=dict)
    after_backward_s: float | None = None   # last backward's end to the optimizer step's end
    links: dict = field(default_factory=dict)   # disk link -> {"bytes", "busy_s"}
    # optimizer_overlap 'overlapped': units whose optimizer work (clip none: the step; clip
    # global: the state read ahead) started before the step's last backward ended
    overlapped_units: int = 0
    # the device figure of each stage (0 .. 2U the passes, the largest over them; 2U+1 from
    # the last backward to the optimizer step's end), measured as peak_gpu_bytes is, the
    # peak reset as each stage begins (apply_plan(..., stage_peaks=True)); None for a stage
    # that did not begin, and the whole list None where it was off or no peak could be read
    stage_peaks: list | None = None
    # the optimizer's updates on the device in the step (streaming plans: the plan's own
    # updates and the user's optimizer over what stays on the device), timed alone: their
    # seconds (None: none timed) and the parameter elements they stepped. Not the time the
    # phase waited for reads and writes, which after_backward_s holds as well
    optimizer_compute_s: float | None = None
    optimizer_elements: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d, where: str) -> "StepRecord":
        # every field without a default is required (peak_gpu_bytes and base_bytes may be null)
        require(d, ("step_s", "passes", "peak_gpu_bytes", "peak_cpu_bytes", "peak_nvme_bytes",
                     "peak_activation_bytes", "static_bytes", "base_bytes"), where, _FIX)
        check_fields(d, _STEP_FIELDS, where, _FIX)
        _check_moved(d.get("moved", {}), f"{where} moved")
        _check_unit_times(d.get("units", {}), f"{where} units")
        _check_links(d.get("links", {}), f"{where} links")
        for k in ("after_backward_s", "optimizer_compute_s"):
            if d.get(k) is not None:
                check_fields(d, {k: "seconds"}, where, _FIX)
        sp = d.get("stage_peaks")
        if sp is not None and not (isinstance(sp, list) and all(
                x is None or (is_int(x) and 0 <= x <= MAX_BYTES) for x in sp)):
            raise UserError(f"{where}: stage_peaks must be null or a list of byte counts (or "
                            f"null), got {short_repr(sp)}; {_FIX}")
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


def _check_moved(moved: dict, where: str) -> None:
    """Bytes per link: the report's links only, each a byte count."""
    for k in moved:
        if k not in LINKS:
            raise UserError(f"{where}: link {str(k)[:40]!r} is not one of {', '.join(LINKS)}; "
                            f"{_FIX}")
    check_fields(moved, {k: "bytes" for k in LINKS}, where, _FIX)


def _check_links(links: dict, where: str) -> None:
    """Per disk link, a record of the bytes it moved and the seconds it was busy, both there."""
    for k, v in links.items():
        if k not in LINKS:
            raise UserError(f"{where}: {str(k)[:40]!r} is not one of {', '.join(LINKS)}; {_FIX}")
        if not isinstance(v, dict):
            raise UserError(f"{where} {k} must be a JSON object with bytes and busy_s, got "
                            f"{short_repr(v)}; {_FIX}")
        require(v, ("bytes", "busy_s"), f"{where} {k}", _FIX)
        check_fields(v, {"bytes": "bytes", "busy_s": "seconds"}, f"{where} {k}", _FIX)


UNIT_TIMES = ("fwd_s", "bwd_s", "recompute_s", "stall_s")


def _check_unit_times(units, where: str) -> None:
    check_fields({"units": units}, {"units": "dict"}, where, _FIX)
    for name, t in units.items():
        check_fields({"t": t}, {"t": "dict"}, f"{where} {str(name)[:60]}", _FIX)
        for k in t:
            if k not in UNIT_TIMES:
                raise UserError(f"{where} {str(name)[:60]}: {str(k)[:40]!r} is not one of "
                                f"{', '.join(UNIT_TIMES)}; {_FIX}")
        check_fields(t, {k: "seconds" for k in UNIT_TIMES}, f"{where} {str(name)[:60]}", _FIX)


_STEP_FIELDS = {"step_s": "seconds", "passes": "count", "peak_gpu_bytes": "bytes?",
                "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes",
                "peak_activation_bytes": "bytes", "static_bytes": "bytes", "base_bytes": "bytes?",
                "moved": "dict", "stall_s": "seconds", "units": "dict", "links": "dict",
                "overlapped_units": "count", "optimizer_elements": "count"}


@dataclass(frozen=True)
class Measured:
    """Medians over the steps after the first (the first allocates the optimizer state and
    warms caches); over all steps when there is only one."""

    step_s: float
    peak_gpu_bytes: float | None
    peak_cpu_bytes: float
    peak_nvme_bytes: float
    peak_activation_bytes: float
    static_bytes: float
    stall_s: float
    moved: dict
    steps: int

    @classmethod
    def of(cls, steps: list[StepRecord]) -> "Measured | None":
        use = steps[1:] if len(steps) > 1 else steps
        if not use:
            return None

        def med(k):
            vals = [getattr(s, k) for s in use if getattr(s, k) is not None]
            return statistics.median(vals) if vals else None
        return cls(step_s=med("step_s"), peak_gpu_bytes=med("peak_gpu_bytes"),
                   peak_cpu_bytes=med("peak_cpu_bytes"), peak_nvme_bytes=med("peak_nvme_bytes"),
                   peak_activation_bytes=med("peak_activation_bytes"),
                   static_bytes=med("static_bytes"), stall_s=med("stall_s"),
                   moved={k: statistics.median([s.moved.get(k, 0) for s in use]) for k in LINKS},
                   steps=len(use))


@dataclass
class Report:
    """Measured steps beside the plan's prediction. ``str()`` prints a table."""

    plan_path: str | None
    policy: str
    device: str                       # cuda | cpu
    hardware: str
    batch: int
    seq: int
    micro_batches: int
    predicted: dict                   # the plan's Prediction as a dict
    predicted_moved: dict             # link -> bytes per optimizer step, from the schedule
    predicted_static_bytes: int = 0   # device-resident static state the plan counts
    steps: list = field(default_factory=list)   # list[StepRecord]
    hwm_reset: bool = True            # whether /proc/self/clear_refs could reset VmHWM
    rank: int = 0                     # this process's rank (a sharded engine's; 0 alone)
    world_size: int = 1               # ranks replaying the same plan
    engine: str = "none"              # none | fsdp2 | ddp
    units: list = field(default_factory=list)   # the plan's unit names, in execution order
    structure_hash: str | None = None           # the plan's (its profile's) structure hash
    compute_threads: int = 0          # CPU: torch's intra-op threads under the plan (0: left)
    nvme_io: str = ""                 # how the NVMe files were read and written ("": none)
    dtype: str = ""                   # the plan's (its profile's) dtype ("": an older report)

    @property
    def measured(self) -> Measured | None:
        return Measured.of(self.steps)

    def _use(self) -> list:
        """The steps medians are taken over: all but the first when there are several."""
        return self.steps[1:] if len(self.steps) > 1 else list(self.steps)

    def unit_times(self) -> dict:
        """Per unit name, the median over the steps (after the first) of each time it has:
        ``{name: {"fwd_s": ..., "bwd_s": ..., "recompute_s": ..., "stall_s": ...,
        "samples": steps}}``."""
        out: dict = {}
        for s in self._use():
            for name, t in s.units.items():
                d = out.setdefault(name, {})
                for k, v in t.items():
                    d.setdefault(k, []).append(v)
        return {n: {**{k: statistics.median(v) for k, v in d.items()},
                    "samples": max(len(v) for v in d.values())} for n, d in out.items()}

    def link_rates(self) -> dict:
        """Per disk link, bytes over busy seconds summed over the steps (after the first):
        ``{link: {"bytes", "busy_s", "bytes_per_s"}}`` (links that moved bytes)."""
        tot: dict = {}
        for s in self._use():
            for k, v in s.links.items():
                b, t = tot.get(k, (0, 0.0))
                tot[k] = (b + int(v["bytes"]), t + float(v["busy_s"]))
        return {k: {"bytes": b, "busy_s": t, "bytes_per_s": b / t if t > 0 else None}
                for k, (b, t) in tot.items()}

    def stage_peaks(self) -> list | None:
        """Per stage, the median over the steps (after the first) of its measured device
        figure (``StepRecord.stage_peaks``); None where no step measured it."""
        rows = [s.stage_peaks for s in self._use() if s.stage_peaks]
        if not rows:
            return None
        out = []
        for k in range(max(len(r) for r in rows)):
            vals = [r[k] for r in rows if k < len(r) and r[k] is not None]
            out.append(statistics.median(vals) if vals else None)
        return out

    def stage_name(self, s: int) -> str:
        """Stage s as the simulator names it: the prologue, a unit's forward or backward, the
        optimizer phase."""
        U = len(self.units)
        if s == 0:
            return "stage 0 (prologue)"
        if s <= U:
            return f"stage {s} (forward {self.units[s - 1]})"
        if s <= 2 * U:
            return f"stage {s} (backward {self.units[2 * U - s]})"
        return f"stage {s} (to the optimizer step's end)"

    def stage_summary(self) -> list:
        """Where the device peak was, measured and predicted, each beside the other's figure
        at that stage (the predicted figure as the measured one counts: ``as_measured``).
        Empty where the steps measured no stage (``apply_plan(..., stage_peaks=False)``)."""
        got, pred = self.stage_peaks(), list(self.predicted.get("stage_gpu_bytes") or [])
        n = 2 * len(self.units) + 2
        if not got or len(got) != n or all(x is None for x in got):
            return []
        pred = [self.as_measured(x) for x in pred] if len(pred) == n else []
        m = max((k for k in range(n) if got[k] is not None), key=lambda k: got[k])
        out = [f"  measured peak in {self.stage_name(m)}: {fmt_bytes(got[m])}"
               + (f" (predicted there {fmt_bytes(pred[m])})" if pred else "")]
        if pred:
            q = max(range(n), key=lambda k: pred[k])
            if q != m:
                there = fmt_bytes(got[q]) if got[q] is not None else "not measured"
                out.append(f"  predicted peak in {self.stage_name(q)}: {fmt_bytes(pred[q])} "
                           f"(measured there {there})")
        return out

    def optimizer_seconds_per_element(self) -> float | None:
        """The device's optimizer update time per parameter element, over the steps (after
        the first) that timed updates (``StepRecord.optimizer_compute_s``); None where none
        did (no streaming phase, or a report written before the field existed)."""
        use = [s for s in self._use() if s.optimizer_compute_s is not None
               and s.optimizer_elements > 0]
        if not use:
            return None
        return sum(s.optimizer_compute_s for s in use) / sum(s.optimizer_elements for s in use)

    def after_backward_s(self) -> float | None:
        vals = [s.after_backward_s for s in self._use() if s.after_backward_s is not None]
        return statistics.median(vals) if vals else None

    @property
    def gpu_measure(self) -> str:
        return ("cuda allocator peak" if self.device == "cuda" else
                "rise of peak RSS over the RSS before the step")

    @property
    def predicted_gpu_rise_bytes(self) -> int | None:
        """What the measured device figure is compared with: on CUDA the predicted peak (the
        allocator counts everything), on a CPU host the predicted peak less the static state
        that is resident before the step (the RSS rise leaves it out)."""
        p = self.predicted.get("peak_gpu_bytes")
        return None if p is None else self.as_measured(p)

    def as_measured(self, predicted_bytes) -> int:
        """A predicted device figure as the measured one counts it: on CUDA whole, on a CPU
        host less the static state resident before the step (not in the RSS rise)."""
        if self.device == "cuda":
            return int(predicted_bytes)
        return max(0, int(predicted_bytes) - int(self.predicted_static_bytes))

    def to_dict(self) -> dict:
        med = self.measured
        return {"schema": REPORT_SCHEMA,
                "plan": {"path": self.plan_path, "policy": self.policy, "hardware": self.hardware,
                         "batch": self.batch, "seq": self.seq, "micro_batches": self.micro_batches},
                "device": self.device, "predicted": dict(self.predicted),
                "predicted_moved": dict(self.predicted_moved),
                "predicted_static_bytes": self.predicted_static_bytes,
                "predicted_gpu_rise_bytes": self.predicted_gpu_rise_bytes,
                "measured": dataclasses.asdict(med) if med else None,
                "steps": [s.to_dict() for s in self.steps], "hwm_reset": self.hwm_reset,
                "gpu_measure": self.gpu_measure, "rank": self.rank,
                "world_size": self.world_size, "engine": self.engine,
                "units": list(self.units), "structure_hash": self.structure_hash,
                "compute_threads": self.compute_threads, "nvme_io": self.nvme_io or None,
                "dtype": self.dtype or None,
                "measured_units": self.unit_times(), "measured_links": self.link_rates()}

    def _time_rows(self) -> tuple[list, list]:
        """Where the step's time went, as table rows: the passes (to the last backward's end)
        and the optimizer phase after it, beside the plan's figures; and each disk link's busy
        seconds per step with its rate (the link busy longest is the one the run waited on,
        where it waited). Empty where the steps have no such timings."""
        after, p = self.after_backward_s(), self.predicted
        passes = [s.step_s - s.after_backward_s for s in self._use()
                  if s.after_backward_s is not None]
        phases = []
        if after is not None and passes and p.get("optimizer_s") is not None:
            phases = [("  passes (to the last backward)",
                       fmt_seconds(statistics.median(passes)),
                       fmt_seconds(p["step_s"] - p["optimizer_s"])),
                      ("  optimizer phase (after it)", fmt_seconds(after),
                       fmt_seconds(p["optimizer_s"]))]
            upd = [s.optimizer_compute_s for s in self._use() if s.optimizer_compute_s is not None]
            if upd:     # the rest of the phase waited for its reads and writes
                phases.append(("    of which the device's updates", fmt_seconds(
                    statistics.median(upd)), ""))
        n = max(1, len(self._use()))
        links = [(f"busy {k} per step ({v['bytes_per_s'] / 1e9:.2f} GB/s)",
                  fmt_seconds(v["busy_s"] / n), "")
                 for k, v in sorted(self.link_rates().items()) if v["bytes_per_s"]]
        return phases, links

    def save(self, path) -> Path:
        return write_json_atomic(path, self.to_dict())

    def __str__(self) -> str:
        med = self.measured
        head = (f"tierplan report: plan {self.plan_path or '(in memory)'} ({self.policy}, "
                f"{self.hardware}), {len(self.steps)} step(s) measured on {self.device}")
        if self.compute_threads:
            head += f", {self.compute_threads} compute thread(s)"
        if self.engine != "none":
            head += f", rank {self.rank} of {self.world_size} ({self.engine}; figures per rank)"
        if med is None:
            return head + "\n  no complete step yet (a step ends at the optimizer step)"
        p = self.predicted
        rows = [("figure", "measured", "predicted")]
        rows.append(("step time", fmt_seconds(med.step_s), fmt_seconds(p.get("step_s"))))
        label = "peak device memory" if self.device == "cuda" else "peak RSS rise over step"
        rows.append((label, fmt_bytes(med.peak_gpu_bytes), fmt_bytes(self.predicted_gpu_rise_bytes)))
        rows.append(("  activations (runtime count)", fmt_bytes(med.peak_activation_bytes), ""))
        rows.append(("  static state before step", fmt_bytes(med.static_bytes),
                     fmt_bytes(self.predicted_static_bytes)))
        rows.append(("peak host (pinned)", fmt_bytes(med.peak_cpu_bytes),
                     fmt_bytes(p.get("peak_cpu_bytes"))))
        rows.append(("peak nvme", fmt_bytes(med.peak_nvme_bytes), fmt_bytes(p.get("peak_nvme_bytes"))))
        for link in LINKS:
            rows.append((f"moved {link}", fmt_bytes(med.moved[link]),
                         fmt_bytes(self.predicted_moved.get(link, 0))))
        rows.append(("waited on transfers", fmt_seconds(med.stall_s), ""))
        phases, links = self._time_rows()
        rows[2:2] = phases
        rows += links
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [head, f"  median of {med.steps} step(s)" +
                 (" (the first step is left out)" if len(self.steps) > 1 else "")]
        for r in rows:
            lines.append(f"  {r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}")
        if self.device != "cuda" and not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            lines.append("  note: glibc keeps freed tensors in RSS, so the RSS rise is only "
                         "indicative; run with MALLOC_MMAP_THRESHOLD_=65536 to measure it "
                         "(docs/runtime.md)")
        lines += self.stage_summary()
        if self.nvme_io:
            lines.append(f"  nvme files: {self.nvme_io}")
        if not self.hwm_reset and self.device != "cuda":
            lines.append("  note: /proc/self/clear_refs was not writable; the RSS peak is the "
                         "process's lifetime peak")
        return "\n".join(lines)


def load_report_dict(d: dict, source: str = "report") -> Report:
    """A Report from its dict, every field checked (exit 2 naming the field otherwise)."""
    where = f"report '{source}'"
    check_schema(d, REPORT_SCHEMA, "report", source)
    require(d, ("plan", "device", "predicted", "steps"), where, _FIX)
    check_fields(d, {"plan": "dict", "device": "str", "predicted": "dict", "steps": "list",
                      "predicted_moved": "dict", "predicted_static_bytes": "bytes",
                      "rank": "count", "world_size": "count", "engine": "str",
                      "units": "list", "structure_hash": "str?",
                      "compute_threads": "count", "nvme_io": "str?", "dtype": "name?"},
                 where, _FIX)
    if not all(isinstance(n, str) for n in d.get("units", [])):
        raise UserError(f"{where}: units must be a list of unit names; {_FIX}")
    p = d["plan"]
    check_fields(p, {"path": "str?", "policy": "str", "hardware": "str", "batch": "count",
                      "seq": "count", "micro_batches": "count"}, f"{where} plan", _FIX)
    if d["device"] not in ("cuda", "cpu"):
        raise UserError(f"{where}: device must be cuda or cpu, got {d['device']!r}; {_FIX}")
    check_fields(d, {"hwm_reset": "bool"}, where, _FIX)
    # the plan's prediction, as the plan's own loader checks it (required fields included)
    Prediction.from_dict(d["predicted"], where, _FIX)
    _check_moved(d.get("predicted_moved", {}), f"{where} predicted_moved")
    steps = [StepRecord.from_dict(s, f"{where} step {n}") for n, s in enumerate(d["steps"])]
    return Report(plan_path=p.get("path"), policy=str(p.get("policy", "")), device=d["device"],
                  hardware=str(p.get("hardware", "")), batch=int(p.get("batch", 0)),
                  seq=int(p.get("seq", 0)), micro_batches=int(p.get("micro_batches", 1)),
                  predicted=dict(d["predicted"]), predicted_moved=dict(d.get("predicted_moved", {})),
                  predicted_static_bytes=int(d.get("predicted_static_bytes", 0)),
                  steps=steps, hwm_reset=bool(d.get("hwm_reset", True)),
                  rank=int(d.get("rank", 0)), world_size=int(d.get("world_size", 1)),
                  engine=str(d.get("engine", "none")), units=list(d.get("units", [])),
                  structure_hash=d.get("structure_hash"),
                  compute_threads=int(d.get("compute_threads", 0)),
                  nvme_io=str(d.get("nvme_io") or ""), dtype=str(d.get("dtype") or ""))


def load_report(path) -> Report:
    return load_report_dict(read_json(path, "report"), str(path))

"""Generated invocations of the ``plan`` CLI, run through its real entry point, and the judge
of what each did. Shared by ``tests/test_fuzz.py`` (a fixed sample) and ``bench/fuzz.py``
(>= 10,000 invocations, tallied in docs/reliability.md).

A case is a command line plus the files it names, each either a seed file (a valid profile,
plan, report, hardware spec or model config) as written, a mutation of one, or something that
is not a file at all (a FIFO, ``/dev/zero`` through a link, a directory, a device node, a
link loop, a 300 MiB sparse file, an over-long name). Every case says whether it is *invalid*
— a mutation or argument the documented contract refuses (a value of the wrong type or out
of range, a missing field, a unit out of order, an event naming no unit, a malformed size,
an output that is a device...) — or only *odd* (any documented outcome will do).

Each run is judged (``judge``): no traceback, no hang, an exit code the verb documents, one
``plan: error:`` line on a refusal, an invalid case never accepted with exit 0, no temporary
file left, no folder created beyond the one level ``-o`` makes, and the files the command
must not touch (its inputs, a device node, a FIFO) still as they were.

Cases run in a forked child that calls ``planner.cli.main(argv)`` — the function the ``plan``
script runs — with stdout and stderr in files, in its own process group, killed at its
deadline (a hang). The parent has imported everything heavy once, so a case costs its own
work and not Python's start-up; ``test_fuzz.py`` also runs a sample through the installed
``plan`` script to show the two agree.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import sys
import time
import traceback
from pathlib import Path

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
VERBS = ("profile", "solve", "simulate", "inspect", "diff", "hardware")
RUNTIME_VERBS = ("checkpoint", "apply")     # apply_plan(checkpoint=...), apply_plan(plan)
# Exit codes each verb documents (DESIGN.md): 0 done, 2 bad input, 3 no plan fits.
CODES = {"solve": (0, 2, 3)}
DEFAULT_CODES = (0, 2)
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    verb: str
    argv: list                       # the command line after 'plan'
    files: dict                      # name -> bytes | ("special", kind)
    invalid: str | None = None       # why the contract refuses it (None: any outcome will do)
    protect: tuple = ()              # names that must be exactly as they were afterwards
    timeout: float = 60.0
    max_new_depth: int = 1           # folders the command may create below the case folder

    @property
    def prefix(self) -> str:
        """How its refusal line starts: ``plan: error:`` for the CLI, ``apply_plan: error:``
        for the runtime targets (their children print the error that way)."""
        return "apply_plan" if self.verb in RUNTIME_VERBS else "plan"

    @property
    def codes(self) -> tuple:
        return CODES.get(self.verb, DEFAULT_CODES)

    def describe(self) -> str:
        files = {k: (v if isinstance(v, tuple) else f"{len(v)} bytes") for k, v in self.files.items()}
        return f"plan {' '.join(map(repr, self.argv))}  files={files}  invalid={self.invalid!r}"


class Seeds:
    """The valid files cases start from, built once (synthetic profiles, plans solved from
    them, a report, the shipped specs and a model config)."""

    def __init__(self, folder: Path):
        from planner.formats import load_plan
        from planner.hardware import load_hardware
        from planner.formats.report import Report, StepRecord
        from planner.solve import solve_profile
        from synthetic import uniform_profile

        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.files: dict[str, bytes] = {}

        def dump(obj) -> bytes:
            return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()

        h100, cpu = load_hardware("h100-80g"), load_hardware("cpu-host")
        profs = {"prof_h100.json": uniform_profile(4, h100, jitter=0.02, seed=1),
                 "prof_cpu.json": uniform_profile(4, cpu, jitter=0.02, seed=2,
                                                  saved_bytes=400_000_000,
                                                  param_bytes=50_000_000)}
        for name, p in profs.items():
            self.files[name] = dump(p.to_dict())
            (folder / name).write_bytes(self.files[name])
        from planner.formats import Budgets
        G = 1024**3
        plans = {
            "plan_keep.json": ("prof_h100.json", Budgets(80 * G, 512 * G, 0), "optimal"),
            "plan_tight.json": ("prof_h100.json", Budgets(14 * G, 512 * G, 0), "optimal"),
            "plan_sqrt.json": ("prof_h100.json", Budgets(80 * G, 512 * G, 0), "sqrt"),
            "plan_cpu.json": ("prof_cpu.json", Budgets(3 * G, 0, 40 * G), "optimal"),
            "plan_offload.json": ("prof_cpu.json", Budgets(20 * G, 0, 40 * G), "offload-all"),
        }
        for name, (pname, budgets, policy) in plans.items():
            prof = profs[pname]
            out = solve_profile(prof, str(folder / pname), prof.hardware_spec, budgets, policy,
                                solver="highs", time_limit=30, nvme_dir="/tmp/tierplan-fuzz-nvme")
            self.files[name] = dump(out.plan.to_dict())
        self.plans = list(plans)
        # a report of a run under plan_cpu, as handle.report().save writes it
        plan = load_plan(folder / "plan_cpu.json") if (folder / "plan_cpu.json").exists() else None
        if plan is None:
            (folder / "plan_cpu.json").write_bytes(self.files["plan_cpu.json"])
            plan = load_plan(folder / "plan_cpu.json")
        steps = [StepRecord(step_s=0.5 + 0.01 * k, passes=1, peak_gpu_bytes=3 * 10**9,
                            peak_cpu_bytes=0, peak_nvme_bytes=2 * 10**9,
                            peak_activation_bytes=10**9, static_bytes=10**9, base_bytes=10**8,
                            moved={"d2h": 0, "h2d": 0, "nvme_write": 10**9, "nvme_read": 10**9},
                            stall_s=0.01) for k in range(3)]
        rep = Report(plan_path="plan_cpu.json", policy=plan.policy, device="cpu",
                     hardware="cpu-host", batch=1, seq=1, micro_batches=1,
                     predicted=plan.predicted.to_dict(),
                     predicted_moved={"d2h": 0, "h2d": 0, "nvme_write": 10**9, "nvme_read": 10**9},
                     predicted_static_bytes=10**9, steps=steps)
        self.files["report.json"] = dump(rep.to_dict())
        for hw in ("cpu-host", "h100-80g", "lohan-4090"):     # lohan-4090: an NVMe array
            self.files[f"{hw}.yaml"] = (ROOT / "profiles" / "hardware" / f"{hw}.yaml").read_bytes()
        self.files["tiny.yaml"] = (ROOT / "profiles" / "models" / "gpt-tiny.yaml").read_bytes()
        self.files["fz_factory.py"] = FACTORY.encode()
        self._stream_seeds(folder)

    def _stream_seeds(self, folder: Path) -> None:
        """A streaming plan with homes (every block's weights, gradients and optimizer state
        on NVMe) for STREAM_CFG's model, and that model's checkpoint as one safetensors file
        and as two shards with an index. Made in a fresh interpreter: this process forks the
        cases, and a torch that has run ops (its thread pools started) is not safe to fork."""
        import subprocess
        out = folder / "stream"
        out.mkdir(exist_ok=True)
        code = f"import fuzzcases; fuzzcases._write_stream_seeds({str(out)!r})"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT,
                       stdin=subprocess.DEVNULL, timeout=600)
        for p in sorted(out.iterdir()):
            self.files[p.name] = p.read_bytes()
        self.plans.append("plan_stream.json")
        self.shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]

    def json(self, name: str):
        return json.loads(self.files[name])


FACTORY = '''
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        x = self.emb(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x).sum()


def good(batch, seq):
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, seq, 8),)


def raises(batch, seq):
    raise RuntimeError("factory failed on purpose")


def not_a_pair(batch, seq):
    return 42


def no_blocks(batch, seq):
    return nn.Linear(8, 8), (torch.randn(batch, 8),)
'''


# ----------------------------------------------------------------------------- mutations of values

NAN, INF, NINF = "__NaN__", "__Infinity__", "__-Infinity__"   # written as JSON's non-numbers


def _to_json(obj) -> bytes:
    text = json.dumps(obj, sort_keys=True, indent=1)
    for mark, lit in ((NAN, "NaN"), (INF, "Infinity"), (NINF, "-Infinity")):
        text = text.replace(json.dumps(mark), lit)
    return (text + "\n").encode()


HUGE_INT = 10**400

# Values that break each kind of field (docs/file-formats.md, docs/reliability.md: ranges).
BAD = {
    "bytes": [-1, -2**40, 1.5, "1G", True, None, [], {}, 2**61, HUGE_INT, NAN, INF],
    "bytes?": [-1, 1.5, "1G", True, 2**61, HUGE_INT, NAN],
    "count": [-1, 1.5, "3", True, None, 2**60, HUGE_INT, NAN],
    "count+": [0, -1, 1.5, "3", True, None, 10**9, HUGE_INT],
    "seconds": [-1.0, -1e-9, 1e308, 2e6, "fast", None, True, [], NAN, INF, NINF, HUGE_INT],
    "flops": [-1, 1e31, 1e308, "x", None, NAN, INF, HUGE_INT],
    "number": [-1, 1e31, "x", None, NAN, INF, HUGE_INT],
    "name": ["", 7, None, "a\nb", "x" * 1001, ["a"], "tab\there", "\u0000"],
    "name?": ["", 7, "a\nb", ["a"], "x" * 1001],
    "names": ["a", 3, [3], [None], ["a\nb"], {}],
    "enum": ["", "bogus", 3, None, ["keep"], "KEEP "],
    "bool": ["yes", 1, 0, None, "true", []],
    "dict": [3, "x", [], None, True],
    "dict?": [3, "x", [], True],               # optional: null is allowed
    "list": [3, "x", {}, None],
    "rate": [-1, -1e-300, 1e-300, 0.5, 1e16, 1e308, "fast", None, NAN, INF, HUGE_INT, True],
    "rate+": [0, -1, 1e-300, 0.5, 1e16, "fast", None, NAN, INF],
    "fraction": [0, -0.5, 1.5, 1e308, "x", None, NAN, INF],
    "flops_map": [{}, {"fp32": 0}, {"fp32": -1}, {"fp32": NAN}, {"fp32": 1e-300}, {"bf16": 1e12},
                  {"fp32": "fast"}, {"fp32": 1e30}, [1e12], 5],
    "schema": ["tierplan.plan/9", "", None, 3, "tierplan.profile/1 "],
    "path?": ["", 5, ["x"], "a\u0000b", "x" * 5000, "/tmp/a\nb", "/tmp/" + "y" * 300],
    "micro": [0, -1, 4097, 1.5, "2", None, True],
    "drives": [-1, 1.5, "12", True, None, 1025, HUGE_INT, NAN],
    "cores": [-1, 2.5, "52", True, None, 2**21, HUGE_INT, NAN],
    "stage": [-1, 1.5, "3", None, HUGE_INT],
}

UNIT_FIELDS = {
    "name": "name", "kind": "enum", "shared_from": "name?", "tied_to": "names",
    **{k: "bytes" for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes",
                            "output_bytes", "saved_bytes", "workspace_bytes",
                            "shared_saved_bytes", "master_bytes")},
    "measured_peak_bytes": "bytes?", "fwd_flops": "flops", "bwd_flops": "flops",
    "fwd_s": "seconds", "bwd_s": "seconds", "param_count": "count", "samples": "count",
}
UNIT_REQUIRED = ("name", "kind", "param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes",
                 "output_bytes", "saved_bytes", "workspace_bytes", "fwd_flops", "bwd_flops",
                 "fwd_s", "bwd_s")
HW_FIELDS = {
    "name": "name", "device": "enum", "unified_memory": "bool", "memory_bytes": "bytes",
    "host_memory_bytes": "bytes", "nvme_bytes": "bytes", "pinned_memory_bytes": "bytes",
    "staging_buffer_bytes": "bytes", "staging_buffers": "count+", "peak_flops": "flops_map",
    "efficiency": "fraction", "memory_bandwidth": "rate+", "h2d_bandwidth": "rate",
    "d2h_bandwidth": "rate", "nvme_read_bandwidth": "rate", "nvme_write_bandwidth": "rate",
    "duplex_bandwidth": "rate", "host_memory_bandwidth": "rate", "cpu_adam_params_per_s": "rate",
    "nvme_drives": "drives", "nvme_drive_read_bandwidth": "rate",
    "nvme_drive_write_bandwidth": "rate", "nvme_striping_efficiency": "fraction",
    "cpu_adam_cores": "cores",
    "sources": "dict?", "schema": "schema",
}
HW_REQUIRED = ("name", "description", "device", "unified_memory", "memory_bytes",
               "host_memory_bytes", "peak_flops", "efficiency", "memory_bandwidth",
               "h2d_bandwidth", "d2h_bandwidth", "nvme_read_bandwidth", "nvme_write_bandwidth")
PROFILE_TOP = {"device": "enum", "timing": "enum", "optimizer_s": "seconds",
               "optimizer_workspace_bytes": "bytes", "model": "dict", "hardware": "dict",
               "layers": "list", "schema": "schema"}
PROFILE_REQUIRED = ("model", "device", "timing", "hardware", "layers", "schema")
MODEL_FIELDS = {"name": "name", "batch": "count", "seq": "count", "param_count": "count"}
PLAN_TOP = {"policy": "name", "optimizer_s": "seconds", "optimizer_workspace_bytes": "bytes",
            "micro_batches": "micro", "world_size": "count+", "engine": "enum",
            "nvme_dir": "path?", "model": "dict", "hardware": "dict", "units": "list",
            "layers": "list", "schedule": "dict", "budgets": "dict", "solver": "dict",
            "predicted": "dict", "profile": "dict", "schema": "schema"}
PLAN_REQUIRED = ("profile", "model", "hardware", "budgets", "policy", "solver", "predicted",
                 "units", "layers", "schedule", "schema")
BUDGET_FIELDS = {"gpu_bytes": "bytes", "cpu_bytes": "bytes", "nvme_bytes": "bytes"}
PREDICTED_FIELDS = {"step_s": "number", "compute_s": "number", "peak_gpu_bytes": "bytes",
                    "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes"}
SOLVER_FIELDS = {"name": "name", "status": "name", "objective": "number", "gap": "number",
                 "solve_s": "number", "variables": "count", "constraints": "count"}
LAYER_FIELDS = {"activation": "enum", "weights": "enum", "grads": "enum", "optimizer": "enum",
                "step": "enum", "name": "name"}
EVENT_FIELDS = {"stream": "enum", "op": "enum", "cls": "enum", "units": "names", "stage": "stage",
                "bytes": "bytes", "seconds": "number", "passes": "enum", "id": "name"}
EVENT_REQUIRED = ("stream", "op", "cls", "units", "stage")
STEP_FIELDS = {"step_s": "seconds", "passes": "count", "peak_gpu_bytes": "bytes?",
               "peak_cpu_bytes": "bytes", "peak_nvme_bytes": "bytes",
               "peak_activation_bytes": "bytes", "static_bytes": "bytes", "stall_s": "seconds",
               "moved": "dict"}
REPORT_TOP = {"device": "enum", "plan": "dict", "predicted": "dict", "steps": "list",
              "schema": "schema"}


def _scale(v, f: float):
    """A number scaled within its kind (ints stay ints)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    return int(v * f) if isinstance(v, int) else v * f


@st.composite
def bad_value(draw, kind: str):
    return draw(st.sampled_from(BAD[kind]))


# ----------------------------------------------------------------------------- mutations of files

def _bytes_mutation(draw, data: bytes) -> tuple[bytes, str | None]:
    """A change to the bytes of a JSON file: (new bytes, why invalid or None)."""
    kind = draw(st.sampled_from(["truncate", "badutf8", "nul", "deep", "empty", "toplevel",
                                 "flip", "bom", "nan_literal", "huge_number", "garbage"]))
    text = data
    if kind == "truncate":
        end = data.rstrip().rfind(b"}")
        cut = draw(st.integers(0, max(0, end - 1)))
        return data[:cut], "truncated JSON"
    if kind == "badutf8":
        at = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80",
                                     b"\x80"]))
        return data[:at] + junk + data[at:], "invalid UTF-8"
    if kind == "nul":
        at = draw(st.integers(1, max(1, len(data) - 2)))
        return data[:at] + b"\x00" + data[at:], "a NUL byte"
    if kind == "deep":
        n = draw(st.sampled_from([65, 100, 1000, 5000, 100_000]))
        inner = b"[" * n + b"]" * n
        return b'{"schema": ' + inner + b"}", f"nested {n} deep"
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n\n"])), "an empty file"
    if kind == "toplevel":
        return draw(st.sampled_from([b"[1, 2]", b"3", b'"plan"', b"null", b"true"])), "not an object"
    if kind == "flip":
        at = draw(st.integers(0, max(0, len(data) - 1)))
        b = draw(st.integers(0, 255))
        return data[:at] + bytes([b]) + data[at + 1:], None
    if kind == "bom":
        return b"\xef\xbb\xbf" + data, None
    if kind == "nan_literal":
        # every number of one field becomes NaN: JSON has no NaN
        key = draw(st.sampled_from([b'"fwd_s": ', b'"step_s": ', b'"gpu_bytes": ', b'"efficiency": ',
                                    b'"saved_bytes": ', b'"memory_bandwidth": ']))
        lit = draw(st.sampled_from([b"NaN", b"Infinity", b"-Infinity"]))
        if key not in data:
            return b"{" + key + lit + b"}", "NaN literal"
        import re
        return re.sub(re.escape(key) + rb"[-0-9.eE+]+", key + lit, data), "NaN literal"
    if kind == "huge_number":
        digits = draw(st.sampled_from([400, 4000, 5000]))
        return b'{"schema": ' + b"9" * digits + b"}", f"a {digits}-digit number"
    return draw(st.binary(min_size=1, max_size=64)) + data[:10], None


def _field_paths(obj: dict, fmt: str) -> list[tuple[tuple, str, bool]]:
    """(path, kind, required) of the fields a mutation may hit in a file of format ``fmt``."""
    out = []

    def add(prefix, fields, required, d):
        for k, kind in fields.items():
            out.append((prefix + (k,), kind, k in required, k in d))

    if fmt == "profile":
        add((), PROFILE_TOP, PROFILE_REQUIRED, obj)
        for i, u in enumerate(obj["layers"]):
            add(("layers", i), UNIT_FIELDS, UNIT_REQUIRED, u)
        add(("hardware",), HW_FIELDS, HW_REQUIRED, obj["hardware"])
        add(("model",), MODEL_FIELDS, (), obj["model"])
    elif fmt == "plan":
        add((), PLAN_TOP, PLAN_REQUIRED, obj)
        for i, u in enumerate(obj["units"]):
            add(("units", i), UNIT_FIELDS, UNIT_REQUIRED, u)
        for i, x in enumerate(obj["layers"]):
            add(("layers", i), LAYER_FIELDS, ("name", "activation"), x)
        add(("hardware",), HW_FIELDS, HW_REQUIRED, obj["hardware"])
        add(("budgets",), BUDGET_FIELDS, tuple(BUDGET_FIELDS), obj["budgets"])
        add(("predicted",), PREDICTED_FIELDS, tuple(PREDICTED_FIELDS), obj["predicted"])
        add(("solver",), SOLVER_FIELDS, ("name", "status"), obj["solver"])
        add(("model",), MODEL_FIELDS, (), obj["model"])
        for s, evs in obj["schedule"].items():
            for j, e in enumerate(evs):
                add(("schedule", s, j), EVENT_FIELDS, EVENT_REQUIRED, e)
    elif fmt == "report":
        add((), REPORT_TOP, ("device", "plan", "predicted", "steps", "schema"), obj)
        for i, s in enumerate(obj["steps"]):
            add(("steps", i), STEP_FIELDS, ("step_s", "passes", "peak_cpu_bytes",
                                              "peak_nvme_bytes", "peak_activation_bytes",
                                              "static_bytes"), s)
        add(("predicted",), PREDICTED_FIELDS, tuple(PREDICTED_FIELDS), obj["predicted"])
    elif fmt == "hardware":
        add((), HW_FIELDS, HW_REQUIRED, obj)
    return [(p, k, req) for p, k, req, present in out if present]


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _set(obj, path, value):
    _get(obj, path[:-1])[path[-1]] = value


def _structural_report(draw, obj: dict) -> tuple[str | None, str]:
    op = draw(st.sampled_from(["no_steps", "steps_dict", "bad_link", "moved_list", "plan_list",
                               "extra_field"]))
    if op == "no_steps":
        obj["steps"] = []
        return None, op                     # a report before its first step: valid
    if op == "steps_dict":
        obj["steps"] = {"0": obj["steps"][0]}
        return "steps is not a list", op
    if op == "bad_link":
        obj["steps"][0]["moved"]["pcie9"] = 5
        return "an unknown link", op
    if op == "moved_list":
        obj["steps"][0]["moved"] = [1, 2]
        return "moved is not a mapping", op
    if op == "plan_list":
        obj["plan"] = ["x"]
        return "plan is not a mapping", op
    obj["zzz"] = 1
    return None, op


ODD_OPS = ["swap_blocks", "rename_all", "drop_optional", "extra_field", "event_stage",
           "drop_transfer_event", "event_bytes", "change_activation"]


def _structural(draw, obj: dict, fmt: str, odd_only: bool = False) -> tuple[str | None, str]:
    """A change to a file's structure; returns (why invalid or None, label) after applying it.
    ``odd_only``: only changes that may leave the file valid."""
    if fmt == "report":
        return _structural_report(draw, obj)
    units_key = "layers" if fmt == "profile" else "units"
    units = obj[units_key]
    n = len(units)
    ops = ["head_first", "swap_ends", "dup_name", "shared_later", "shared_missing",
           "tied_missing", "blocks_only", "one_unit", "no_units", "shared_gt_saved", "kind_swap",
           "swap_blocks", "rename_all", "drop_optional", "extra_field"]
    if fmt == "plan":
        ops += ["drop_compute_event", "dup_event", "event_unit_missing", "layers_reversed",
                "event_stage", "drop_transfer_event", "event_bytes", "event_stream_moved",
                "change_activation", "layers_short", "schedule_stream_bogus"]
    if odd_only:
        ops = [o for o in ops if o in ODD_OPS]
    op = draw(st.sampled_from(ops))
    blocks = [i for i, u in enumerate(units) if u.get("kind") == "block"]

    def both(fn):
        fn(units)
        if fmt == "plan":
            fn(obj["layers"])

    if op == "head_first":
        both(lambda L: L.insert(0, L.pop()))
        return "head before the embedding", op
    if op == "swap_ends":
        def sw(L):
            L[0], L[-1] = L[-1], L[0]
        both(sw)
        return "units out of order", op
    if op == "dup_name":
        a, b = draw(st.sampled_from([(1, 2), (0, 1), (n - 2, n - 1), (1, n - 1)]))
        def dn(L, a=a, b=b):
            L[b]["name"] = L[a]["name"]
        both(dn)
        return "a duplicate unit name", op
    if op == "shared_later":
        i = draw(st.sampled_from(blocks[:-1] or blocks))
        units[i]["shared_from"] = units[-1]["name"]
        return "shared_from naming a later unit", op
    if op == "shared_missing":
        units[draw(st.sampled_from(blocks))]["shared_from"] = "no.such.unit"
        return "shared_from naming no unit", op
    if op == "tied_missing":
        units[draw(st.sampled_from(range(n)))]["tied_to"] = ["no.such.unit"]
        return "tied_to naming no unit", op
    if op == "blocks_only":
        both(lambda L: L.__setitem__(slice(None), L[1:-1]))
        return "blocks only: no embedding or head", op
    if op == "one_unit":
        both(lambda L: L.__setitem__(slice(None), L[:1]))
        return "one unit", op
    if op == "no_units":
        both(lambda L: L.clear())
        return "no units", op
    if op == "shared_gt_saved":
        u = units[draw(st.sampled_from(blocks))]
        u["shared_saved_bytes"] = u["saved_bytes"] + 1
        return "shared_saved_bytes above saved_bytes", op
    if op == "kind_swap":
        units[0]["kind"] = "block"
        return "the first unit is not the embedding", op
    if op == "swap_blocks" and len(blocks) >= 2:
        a, b = blocks[0], blocks[-1]
        def sb(L):
            L[a], L[b] = L[b], L[a]
        both(sb)
        return None, op
    if op == "rename_all":
        # a consistent rename (units, layers, events): valid names, odd characters
        new = draw(st.sampled_from(["bloc\u00e9", "x" * 300, "a b", "blocks.\u4e2d", "-x", "1"]))
        names = {u["name"]: (u["name"] if u["kind"] != "block" else f"{new}.{i}")
                 for i, u in enumerate(units)}
        for u in units:
            u["name"] = names[u["name"]]
            if u.get("shared_from") in names:
                u["shared_from"] = names[u["shared_from"]]
            u["tied_to"] = [names.get(t, t) for t in u.get("tied_to", [])]
        if fmt == "plan":
            for x in obj["layers"]:
                x["name"] = names.get(x["name"], x["name"])
            for evs in obj["schedule"].values():
                for e in evs:
                    e["units"] = [names.get(t, t) for t in e["units"]]
                    e.pop("id", None)
        return None, op
    if op == "drop_optional":
        for u in units:
            for k in ("shared_saved_bytes", "samples", "master_bytes", "tied_to", "param_count"):
                u.pop(k, None)
        return None, op
    if op == "extra_field":
        obj["zzz_extra"] = {"x": [1, 2]}
        return None, op
    if fmt == "plan":
        sched = obj["schedule"]
        if op == "drop_compute_event":
            evs = sched["compute"]
            evs.pop(draw(st.integers(0, len(evs) - 1)))
            return "a compute event missing", op
        if op == "dup_event":
            s = draw(st.sampled_from(sorted(k for k, v in sched.items() if v)))
            e = draw(st.sampled_from(sched[s]))
            sched[s].append(copy.deepcopy(e))
            return "an event listed twice", op
        if op == "event_unit_missing":
            s = draw(st.sampled_from(sorted(k for k, v in sched.items() if v)))
            e = draw(st.sampled_from(sched[s]))
            e["units"] = ["no.such.unit"]
            e.pop("id", None)
            return "an event naming no unit", op
        if op == "layers_reversed":
            obj["layers"].reverse()
            return "layers in another order than units", op
        if op == "layers_short":
            obj["layers"].pop(draw(st.integers(0, len(obj["layers"]) - 1)))
            return "a unit without a layer decision", op
        if op == "schedule_stream_bogus":
            sched["pcie9"] = []
            return "an unknown stream", op
        if op == "event_stage":
            e = draw(st.sampled_from(sched["compute"]))
            e["stage"] = e["stage"] + draw(st.sampled_from([1, 7, 10**6]))
            e.pop("id", None)
            return None, op            # other events may be renumbered consistently by chance
        if op == "drop_transfer_event":
            s = [k for k, v in sched.items() if v and k != "compute"]
            if s:
                evs = sched[draw(st.sampled_from(sorted(s)))]
                evs.pop(draw(st.integers(0, len(evs) - 1)))
            return None, op
        if op == "event_bytes":
            s = [k for k, v in sched.items() if v and k != "compute"]
            if s:
                e = draw(st.sampled_from(sched[draw(st.sampled_from(sorted(s)))]))
                e["bytes"] = _scale(e["bytes"], draw(st.sampled_from([0.0, 0.5, 2.0])))
            return None, op
        if op == "event_stream_moved":
            s = [k for k, v in sched.items() if v and k != "compute"]
            if s:
                src = draw(st.sampled_from(sorted(s)))
                e = sched[src].pop(0)
                sched.setdefault("compute", []).append(e)
                return "an event under another stream than its own", op
            return None, op
        if op == "change_activation":
            i = draw(st.sampled_from(blocks))
            obj["layers"][i]["activation"] = draw(st.sampled_from(["keep", "recompute", "cpu", "nvme"]))
            obj["layers"][i]["checkpoint"] = draw(st.sampled_from(["gpu", "cpu", "nvme", "none"]))
            return None, op
    return None, "noop"


@st.composite
def json_file(draw, seed: bytes, fmt: str, odd_only: bool = False):
    """A mutation of the JSON file ``seed`` (format ``fmt``): (bytes, why invalid or None).
    ``odd_only``: only changes that may leave it valid (scaled numbers, renamed units...)."""
    if odd_only:
        how = draw(st.sampled_from(["scale", "scale", "odd", "odd", "bom"]))
        if how == "bom":
            return b"\xef\xbb\xbf" + seed, None
        if how == "odd":
            obj = json.loads(seed)
            _structural(draw, obj, fmt, odd_only=True)
            return _to_json(obj), None
    else:
        how = draw(st.sampled_from(["as_is", "field", "remove", "structure", "bytes", "scale",
                                    "field", "structure"]))
    if how == "as_is":
        return seed, None
    if how == "bytes":
        return _bytes_mutation(draw, seed)
    obj = json.loads(seed)
    if how == "structure" and fmt == "plan" and obj.get("model", {}).get("params") and any(
            x.get("weights") == "nvme" for x in obj.get("layers", ())) and draw(st.booleans()):
        why, label = _stream_mutation(draw, obj, runtime=False)
        return _to_json(obj), why
    if how == "structure":
        why, label = _structural(draw, obj, fmt)
        return _to_json(obj), why
    paths = _field_paths(obj, fmt)
    if how == "remove":
        req = [p for p, _, r in paths if r]
        path = draw(st.sampled_from(req))
        _get(obj, path[:-1]).pop(path[-1])
        return _to_json(obj), f"required field {'.'.join(map(str, path))} removed"
    if how == "scale":
        nums = [p for p, k, _ in paths if isinstance(_get(obj, p), (int, float))
                and not isinstance(_get(obj, p), bool)]
        for p in draw(st.lists(st.sampled_from(nums), min_size=1, max_size=4)):
            _set(obj, p, _scale(_get(obj, p), draw(st.sampled_from([0.0, 0.5, 0.999, 1.5, 3.0]))))
        return _to_json(obj), None
    path, kind, _ = draw(st.sampled_from(paths))
    value = draw(bad_value(kind))
    _set(obj, path, value)
    if path[-1] == "id":
        return _to_json(obj), None          # the id is a label; a wrong one is refused or not
    if kind == "enum" and value == "KEEP " and path[-1] != "activation":
        return _to_json(obj), None
    return _to_json(obj), f"{'.'.join(map(str, path))} = {str(value)[:30]!r}"


@st.composite
def yaml_file(draw, seed: bytes):
    """A mutation of a hardware spec (YAML)."""
    import yaml
    how = draw(st.sampled_from(["as_is", "field", "remove", "unknown", "alias", "tag", "syntax",
                                "bytes", "field", "toplevel"]))
    if how == "as_is":
        return seed, None
    if how == "bytes":
        kind = draw(st.sampled_from(["badutf8", "truncate_key", "tab", "flip", "deep"]))
        if kind == "badutf8":
            at = draw(st.integers(0, len(seed)))
            return seed[:at] + b"\xff\xfe" + seed[at:], "invalid UTF-8"
        if kind == "truncate_key":
            return seed[:seed.index(b"peak_flops")], "required fields cut off"
        if kind == "tab":
            return seed + b"\n\tbroken: [\n", "a YAML syntax error"
        if kind == "deep":
            n = draw(st.sampled_from([70, 1000, 50_000]))
            return seed + b"\nextra: " + b"[" * n + b"]" * n + b"\n", "nested too deep"
        at = draw(st.integers(0, max(0, len(seed) - 1)))
        return seed[:at] + bytes([draw(st.integers(0, 255))]) + seed[at + 1:], None
    if how == "alias":
        return (seed + b"\nx1: &a [1, 1, 1, 1, 1, 1, 1, 1]\nx2: &b [*a, *a, *a, *a, *a, *a]\n"
                b"x3: [*b, *b, *b, *b, *b, *b]\n"), "YAML aliases"
    if how == "tag":
        return seed + b"\nevil: !!python/object/apply:os.system ['true']\n", "a Python tag"
    if how == "syntax":
        return b"name: [unclosed\n", "a YAML syntax error"
    if how == "toplevel":
        return draw(st.sampled_from([b"- 1\n- 2\n", b"42\n", b"", b"null\n"])), "not a mapping"
    obj = yaml.safe_load(seed)
    if how == "unknown":
        obj["nvme_bandwidth_typo"] = 1e9
        return yaml.safe_dump(obj).encode(), "an unknown field"
    if how == "remove":
        k = draw(st.sampled_from([k for k in HW_REQUIRED if k in obj]))
        obj.pop(k)
        return yaml.safe_dump(obj).encode(), f"required field {k} removed"
    k = draw(st.sampled_from(sorted(k for k in HW_FIELDS if k in obj)))
    v = draw(bad_value(HW_FIELDS[k]))
    if v == HUGE_INT:
        v = 10**400
    text = yaml.safe_dump(dict(obj, **{k: v if v not in (NAN, INF, NINF) else 0})).encode()
    if v in (NAN, INF, NINF):
        lit = {NAN: b".nan", INF: b".inf", NINF: b"-.inf"}[v]
        text = text.replace(f"{k}: 0\n".encode(), f"{k}: ".encode() + lit + b"\n")
    return text, f"{k} = {str(v)[:30]!r}"


# ----------------------------------------------------------------------------- special files

SPECIALS = ("fifo", "devzero", "dir", "missing", "symloop", "sparse_huge", "devnull_link",
            "devnode")


def special_path(draw) -> tuple[tuple, str]:
    """('special', kind) and why naming it as an input file is refused."""
    kind = draw(st.sampled_from(SPECIALS))
    if kind == "devnode" and not IS_ROOT:
        kind = "devnull_link"
    return ("special", kind), f"input is {kind}"


def make_special(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "devzero":
        os.symlink("/dev/zero", path)
    elif kind == "devnull_link":
        os.symlink("/dev/null", path)
    elif kind == "devnode":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))   # a /dev/null of our own
    elif kind == "dir":
        path.mkdir()
        (path / "keep.txt").write_text("x")
    elif kind == "symloop":
        os.symlink(path.name, path)
    elif kind == "sparse_huge":
        with open(path, "wb") as f:
            f.truncate(300 * 1024**2)       # 300 MiB of holes: over the read cap, no disk used
    elif kind == "missing":
        pass
    else:
        raise AssertionError(kind)


# ----------------------------------------------------------------------------- arguments

GOOD_SIZES = ["0", "1G", "12G", "14G", "30G", "80G", "512G", "1.5T", "12GB", "100M", "3G",
              "1073741824", " 40 G ", "2GiB", "40G"]
BAD_SIZES = ["", "abc", "-3G", "1e3", "G", "12 X", "1" + "0" * 400, "nan", "inf", "\u0661\u0662G",
             "1048577T", " ", "3..5G", "0x10", "1,5G", "12G\x00", "--", "1" * 60, "12G\nx"]
TIME_GOOD = ["2", "3", "5", "1.5"]
TIME_BAD = ["0", "-1", "nan", "inf", "abc", "", "1e400", "-inf"]


@st.composite
def size_arg(draw, flag: str):
    if draw(st.integers(0, 9)) < 9:
        return [f"{flag}={draw(st.sampled_from(GOOD_SIZES))}"], None
    v = draw(st.sampled_from(BAD_SIZES))
    return [f"{flag}={v}"], f"{flag} {v[:20]!r}"


OUT_GOOD = ["out.json", "sub/out.json", "old.json", "weird name\n.json", "out.png"]
OUT_BAD = [("dir", "is a directory"), ("a/b/out.json", "two missing folders"),
           ("fifo_out", "a FIFO"), ("devnull_out", "a device (link)"), ("", "empty"),
           ("x" * 300 + ".json", "a name too long"), ("file/out.json", "a folder that is a file"),
           ("devnode_out", "a device node")]


@st.composite
def output_arg(draw, flag: str, inputs: list[str], files: dict, protect: list,
               clean: bool = False):
    """``-o``/``--plot`` and the files it needs; (argv, why invalid or None)."""
    r = draw(st.integers(0, 9))
    if r < 5 or clean:
        name = draw(st.sampled_from(OUT_GOOD))
        if name == "old.json":
            files["old.json"] = b'{"old": true}\n'
        return [flag, name], None
    if r == 5 and inputs:
        name = draw(st.sampled_from(inputs))
        protect.append(name)
        return [flag, name], "the output is the command's input"
    if r == 6 and inputs:
        name = draw(st.sampled_from(inputs))
        files["in_link.json"] = ("link", name)
        protect.append(name)
        return [flag, "in_link.json"], "the output is a link to the command's input"
    name, why = draw(st.sampled_from(OUT_BAD))
    if name == "dir":
        files["dir"] = ("special", "dir")
        protect.append("dir")
    elif name == "fifo_out":
        files["fifo_out"] = ("special", "fifo")
        protect.append("fifo_out")
    elif name == "devnull_out":
        files["devnull_out"] = ("special", "devnull_link")
        protect.append("devnull_out")
    elif name == "devnode_out":
        if not IS_ROOT:
            return [flag, "out.json"], None
        files["devnode_out"] = ("special", "devnode")
        protect.append("devnode_out")
    elif name.startswith("file/"):
        files["file"] = b"a file, not a folder\n"
        protect.append("file")
    return [flag, name], f"{flag} {why}"


@st.composite
def input_file(draw, role: str, seeds: Seeds, choices: list[str], fmt: str, files: dict,
               name: str, clean: bool = False):
    """The file for an input argument: a seed, a mutation of one, or a special path.
    Returns why it must be refused (or None). ``clean``: a seed or an odd (maybe valid)
    change of one."""
    r = draw(st.integers(0, 19))
    if clean:
        seed = draw(st.sampled_from(choices))
        if r < 10 or fmt == "hardware":
            files[name] = seeds.files[seed]
        else:
            files[name], _ = draw(json_file(seeds.files[seed], fmt, odd_only=True))
        return None
    if r == 0:
        files[name], why = special_path(draw)
        return why
    seed = draw(st.sampled_from(choices))
    if r < 8:                                   # two in five: the seed as it is
        files[name] = seeds.files[seed]
        return None
    if fmt == "hardware":
        data, why = draw(yaml_file(seeds.files[seed]))
    else:
        data, why = draw(json_file(seeds.files[seed], fmt))
    files[name] = data
    return why


def _first(*whys):
    return next((w for w in whys if w), None)


def _pick(draw, clean: bool, good: list, bad: list, one_in: int):
    """A value from ``good``, or (unless ``clean``) one time in ``one_in`` from ``bad``;
    (value, is_bad)."""
    if not clean and bad and draw(st.integers(0, one_in - 1)) == 0:
        return draw(st.sampled_from(bad)), True
    return draw(st.sampled_from(good)), False


@st.composite
def case_simulate(draw, seeds: Seeds):
    files: dict = {}
    clean = draw(st.integers(0, 9)) < 4          # four in ten: nothing meant to be refused
    why = draw(input_file("plan", seeds, seeds.plans, "plan", files, "plan.json", clean))
    argv = ["simulate", "plan.json"]
    extra, bad = _pick(draw, clean, [[], ["--json"]], [["--bogus"], ["plan.json"]], 8)
    return Case("simulate", argv + extra, files, _first(why, bad and f"extra {extra}"),
                ("plan.json",), 60)


@st.composite
def case_inspect(draw, seeds: Seeds):
    files: dict = {}
    protect: list = ["plan.json"]
    clean = draw(st.integers(0, 9)) < 4
    profile = draw(st.integers(0, 5)) == 0
    if profile:
        why = draw(input_file("plan", seeds, ["prof_h100.json", "prof_cpu.json"], "profile",
                              files, "plan.json", clean))
    else:
        why = draw(input_file("plan", seeds, seeds.plans, "plan", files, "plan.json", clean))
    argv = ["inspect", "plan.json"]
    if draw(st.booleans()):
        argv.append("--json")
    bad = None
    if draw(st.integers(0, 3)) == 0 and not (clean and profile):
        protect.append("report.json")
        if not clean and draw(st.integers(0, 9)) == 0:
            files["report.json"], w = special_path(draw)
        elif clean:
            files["report.json"], w = draw(json_file(seeds.files["report.json"], "report",
                                                     odd_only=draw(st.booleans())))
        else:
            files["report.json"], w = draw(json_file(seeds.files["report.json"], "report"))
        argv += ["--report", "report.json"]
        bad = w or ("--report on a profile" if profile else None)
    if draw(st.integers(0, 12)) == 0 and not (clean and profile):
        o, w = draw(output_arg("--plot", ["plan.json"], files, protect, clean))
        argv += o
        bad = bad or w or ("--plot on a profile" if profile else None)
    if not clean and draw(st.integers(0, 15)) == 0:
        argv.append("--frobnicate")
        bad = "an unknown flag"
    return Case("inspect", argv, files, _first(why, bad), tuple(protect), 90)


@st.composite
def case_diff(draw, seeds: Seeds):
    files: dict = {}
    clean = draw(st.integers(0, 9)) < 4
    a, b = draw(st.sampled_from([(x, y) for x in seeds.plans for y in seeds.plans]))
    whys = []
    which = draw(st.sampled_from(["a", "b", "both", "none", "profile"]))
    if clean and which == "profile":
        which = "none"
    for role, seed, name in (("a", a, "a.json"), ("b", b, "b.json")):
        if which in (role, "both"):
            whys.append(draw(input_file(role, seeds, [seed], "plan", files, name, clean)))
        elif which == "profile" and role == "b":
            files[name] = seeds.files["prof_h100.json"]
            whys.append("a profile given as a plan")
        else:
            files[name] = seeds.files[seed]
    argv = ["diff", "a.json", "b.json"]
    if draw(st.booleans()):
        argv.append("--json")
    if not clean and draw(st.integers(0, 15)) == 0:
        argv = ["diff", "a.json"]
        whys.append("one plan only")
    return Case("diff", argv, files, _first(*whys), ("a.json", "b.json"), 60)


@st.composite
def case_solve(draw, seeds: Seeds):
    files: dict = {}
    protect: list = ["prof.json"]
    clean = draw(st.integers(0, 9)) < 5        # half: nothing meant to be refused
    seed = draw(st.sampled_from(["prof_h100.json", "prof_cpu.json"]))
    whys = []
    if not clean and draw(st.integers(0, 9)) == 0:
        files["prof.json"] = seeds.files[draw(st.sampled_from(seeds.plans))]
        whys.append("a plan given as the profile")
    else:
        whys.append(draw(input_file("profile", seeds, [seed], "profile", files, "prof.json",
                                    clean)))
    argv = ["solve", "prof.json"]

    def size(flag):
        v, bad = _pick(draw, clean, GOOD_SIZES, BAD_SIZES, 8)
        argv.append(f"{flag}={v}")
        whys.append(bad and f"{flag} {v[:20]!r}")

    if clean or draw(st.integers(0, 25)) != 0:
        size("--gpu-mem")
    else:
        whys.append("no --gpu-mem")
    unified = seed == "prof_cpu.json"
    if draw(st.booleans()):
        if unified and (clean or draw(st.booleans())):
            argv.append("--cpu-mem=0")
        else:
            size("--cpu-mem")
    if draw(st.booleans()):
        size("--nvme-mem")
    if draw(st.integers(0, 3)) == 0:
        argv += ["--nvme-dir", draw(st.sampled_from(["nv", "/tmp/tierplan-fuzz-nvme", "a\nb",
                                                      "x" * 300]))]
    if draw(st.integers(0, 4)) == 0:
        h, bad = _pick(draw, clean, ["h100-80g", "cpu-host", "a100-80g", "hw.yaml"],
                       ["tpu9", "hw.yaml"], 3)
        if h == "hw.yaml":
            whys.append(draw(input_file("hardware", seeds, ["cpu-host.yaml", "h100-80g.yaml",
                                                           "lohan-4090.yaml"],
                                        "hardware", files, "hw.yaml", clean or not bad)))
            protect.append("hw.yaml")
        elif bad:
            whys.append("an unknown hardware spec")
        argv += ["--hardware", h]
    limit = 60.0
    if draw(st.integers(0, 9)) != 0:
        v, bad = _pick(draw, clean, TIME_GOOD, TIME_BAD, 8)
        argv.append(f"--time-limit={v}")
        if bad:
            whys.append(f"--time-limit {v!r}")
        else:
            limit = float(v)
    for one_in, flag, good, bad_vals in (
            (5, "--gap", ["0.005", "0", "0.5"], ["-1", "1", "nan", "x"]),
            (5, "--micro-batches", ["1", "2", "4"], ["0", "-1", "5000", "x", "1.5"]),
            (4, "--policy", ["optimal", "keep-all", "recompute-all", "sqrt", "offload-all",
                             "remat-only"], ["best"]),
            (6, "--solver", ["cbc", "highs"], ["gurobi"]),
            (6, "--stream", ["auto", "on", "off"], ["maybe"])):
        if draw(st.integers(0, one_in - 1)) == 0:
            v, bad = _pick(draw, clean, good, bad_vals, 3)
            argv.append(f"{flag}={v}")
            if bad:
                whys.append(f"{flag} {v}")
    if draw(st.integers(0, 2)) == 0:
        o, w = draw(output_arg("-o", ["prof.json"] + (["hw.yaml"] if "hw.yaml" in files else []),
                               files, protect, clean))
        argv += o
        whys.append(w)
    else:
        argv += ["-o", "out.json"]
    if not clean and draw(st.integers(0, 20)) == 0:
        argv.append("--no-such-flag")
        whys.append("an unknown flag")
    return Case("solve", argv, files, _first(*whys), tuple(protect), limit + 30)


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@st.composite
def case_profile(draw, seeds: Seeds):
    files: dict = {"fz_factory.py": seeds.files["fz_factory.py"]}
    protect: list = []
    whys = []
    clean = draw(st.integers(0, 9)) < 4
    good_models = ["gpt-tiny", "llama-tiny", "tiny.yaml", "fz_factory:good"]
    bad_models = ["gpt-9000", "fz_factory:raises", "fz_factory:not_a_pair", "fz_factory:no_blocks",
                  "fz_factory:missing", "no_such_pkg.mod:fn", "weird.yml", "x" * 300 + ".yaml",
                  "tiny.yaml", "gpt2-small"]
    m, bad = _pick(draw, clean, good_models, bad_models, 2)
    if m == "tiny.yaml":
        if bad:
            data, w = draw(yaml_file_model(seeds.files["tiny.yaml"]))
        else:
            data, w = seeds.files["tiny.yaml"], None
        files["tiny.yaml"] = data
        protect.append("tiny.yaml")
        whys.append(w)
    elif m == "weird.yml":
        files["weird.yml"], w = special_path(draw)
        whys.append(w)
    elif m == "gpt2-small":
        pass                     # valid, larger: the meta device profiles it without memory
    elif bad:
        whys.append(f"model {m[:20]}")
    argv = ["profile", m]
    for flag, good, bad_vals in (("--batch", ["1", "2"], ["0", "-1", "x", "1.5", "",
                                                        "1" + "0" * 30]),
                                 ("--seq", ["8", "16"], ["0", "-3", "x", "100000", "1e3"])):
        if not clean and draw(st.integers(0, 30)) == 0:
            whys.append(f"no {flag}")
            continue
        v, bad = _pick(draw, clean, good, bad_vals, 6)
        if v == "100000" and m.startswith("fz_factory:"):
            bad = False          # longer than a built-in's positions; a factory has no limit
        argv.append(f"{flag}={v}")
        whys.append(bad and f"{flag} {v!r}")
    if draw(st.integers(0, 3)) == 0:
        v, bad = _pick(draw, clean, ["bf16", "fp16", "fp32"], ["fp64"], 3)
        argv += ["--dtype", v]
        whys.append(bad and "--dtype fp64")
    device, bad = _pick(draw, clean, ["meta", "meta", "meta", "cpu"], ["cuda", "tpu"], 6)
    argv += ["--device", device]
    if device == "tpu":
        whys.append("--device tpu")
    elif device == "cuda" and not _has_cuda():
        whys.append("--device cuda without a GPU")
    if device in ("cpu", "cuda"):
        argv += ["--repeats", "1"]
    if draw(st.integers(0, 4)) == 0:
        h, bad = _pick(draw, clean, ["cpu-host", "h100-80g", "hw.yaml"], ["hw.yaml", "nope"], 2)
        if h == "hw.yaml":
            whys.append(draw(input_file("hardware", seeds, ["cpu-host.yaml"], "hardware", files,
                                        "hw.yaml", not bad)))
            protect.append("hw.yaml")
        elif bad:
            whys.append("an unknown hardware spec")
        argv += ["--hardware", h]
    if not clean and draw(st.integers(0, 6)) == 0:
        v = draw(st.sampled_from(["blocks", "blocks.*", "nothing.here", "", "a,,b"]))
        argv.append(f"--blocks={v}")
    if draw(st.integers(0, 6)) == 0:
        v, bad = _pick(draw, clean, ["estimate"] + (["measure"] if device != "meta" else []),
                       ["guess", "measure"], 2)
        argv += ["--timing", v]
        if v == "guess":
            whys.append("--timing guess")
        elif v == "measure" and device == "meta":
            whys.append("--timing measure on meta")
    if draw(st.integers(0, 1)) == 0:
        o, w = draw(output_arg("-o", [x for x in ("tiny.yaml", "hw.yaml") if x in files],
                               files, protect, clean))
        argv += o
        whys.append(w)
    else:
        argv += ["-o", "prof_out.json"]
    return Case("profile", argv, files, _first(*whys), tuple(protect), 180)


@st.composite
def yaml_file_model(draw, seed: bytes):
    """A mutation of a model config (YAML)."""
    import yaml
    how = draw(st.sampled_from(["as_is", "field", "remove", "alias", "bytes", "family"]))
    obj = yaml.safe_load(seed)
    if how == "as_is":
        return seed, None
    if how == "alias":
        return seed + b"\nx: &a [1]\ny: *a\n", "YAML aliases"
    if how == "bytes":
        return seed[:40] + b"\xff" + seed[40:], "invalid UTF-8"
    if how == "remove":
        k = draw(st.sampled_from(["n_layers", "d_model", "n_heads", "vocab_size", "max_seq",
                                  "family"]))
        obj.pop(k)
        return yaml.safe_dump(obj).encode(), f"{k} removed"
    if how == "family":
        obj["family"] = draw(st.sampled_from(["bert", 3, None]))
        return yaml.safe_dump(obj).encode(), "unknown family"
    k = draw(st.sampled_from(["n_layers", "d_model", "n_heads", "vocab_size", "max_seq"]))
    v = draw(st.sampled_from([0, -1, "x", 1.5, None, 3]))
    obj[k] = v
    why = None if (v == 3 and k in ("n_layers",)) else f"{k} = {v!r}"
    if v == 3 and k == "n_heads":
        why = "d_model not divisible by n_heads"
    if v == 3 and k in ("vocab_size", "max_seq"):
        why = None
    if v == 3 and k == "d_model":
        why = "d_model not divisible by n_heads"
    return yaml.safe_dump(obj).encode(), why


@st.composite
def case_hardware(draw, seeds: Seeds):
    files: dict = {}
    protect: list = []
    whys = []
    argv = ["hardware"]
    r = draw(st.integers(0, 5))
    if r == 0:
        argv += ["--nvme-dir", "probe"]
    elif r == 1:
        kind = draw(st.sampled_from(["fifo", "devzero", "file", "devnull_link"]))
        files["probe"] = ("special", kind) if kind != "file" else b"a file\n"
        protect.append("probe")
        argv += ["--nvme-dir", "probe"]
        whys.append(f"--nvme-dir is a {kind}")
    elif r == 2:
        argv += ["--nvme-dir", "x" * 300]
        whys.append("--nvme-dir name too long")
    size_good = draw(st.integers(0, 3)) != 0
    if size_good:
        argv.append(f"--size={draw(st.sampled_from(['8M', '16M', '1M']))}")
    else:
        v = draw(st.sampled_from(["0", "-1G", "abc", "1" + "0" * 400, "1000T", "nan"]))
        argv.append(f"--size={v}")
        whys.append(f"--size {v!r}")
    if draw(st.integers(0, 2)) != 0:
        o, w = draw(output_arg("-o", [], files, protect))
        argv += o
        whys.append(w)
    if draw(st.integers(0, 20)) == 0:
        argv.append("--gpu")
        whys.append("an unknown flag")
    # measuring takes seconds: most cases are refusals, a few run in full
    return Case("hardware", argv, files, _first(*whys), tuple(protect), 180)


# ----------------------------------------------------------------------------- the runtime's inputs
# Streaming plans (homes off the device) and safetensors checkpoints, given to apply_plan in a
# forked child: "apply" mutates the plan, "checkpoint" the checkpoint a meta-device model is
# filled from. An accepted case must also be right: one training step equal to plain PyTorch's
# ("apply"), every weight equal to what the safetensors library reads for it ("checkpoint"),
# and no file left in the NVMe folder after remove().

STREAM_CFG = {"n_layers": 2, "dtype": "fp32"}       # over gpt-tiny's config
STREAM_B, STREAM_S = 2, 16


def _stream_model(meta: bool = False):
    import torch
    from planner.models import build_model, load_config
    cfg = dict(load_config("gpt-tiny"), **STREAM_CFG)
    torch.manual_seed(0)
    if meta:
        from runtime import meta_parameters
        with meta_parameters():
            return cfg, build_model(cfg, dtype="fp32")
    return cfg, build_model(cfg, dtype="fp32")


def _write_stream_seeds(out: str) -> None:
    """Run in a fresh interpreter by ``Seeds``: plan_stream.json, model.safetensors and its two
    shards with their index (the tied embedding stored once, as safetensors' save_model does)."""
    import warnings

    from safetensors.torch import save_file, save_model

    from conftest import plan_for
    from planner.formats import Home, Tier
    out_p = Path(out)
    _, model = _stream_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_for(model, "keep-all", STREAM_B, STREAM_S, nvme_dir="/tmp/tierplan-fuzz-nvme",
                        homes={"blocks": Home(Tier.NVME, Tier.NVME, Tier.NVME, Tier.GPU)})
    (out_p / "plan_stream.json").write_bytes(_to_json(plan.to_dict()))
    save_model(model, str(out_p / "model.safetensors"))
    from safetensors import safe_open
    with safe_open(str(out_p / "model.safetensors"), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(sd)
    half = len(names) // 2
    wm = {}
    for j, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{j + 1}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, str(out_p / shard), metadata={"format": "pt"})
        wm.update({k: shard for k in part})
    (out_p / "model.safetensors.index.json").write_bytes(
        _to_json({"metadata": {"total_size": sum(v.numel() * v.element_size()
                                                 for v in sd.values())}, "weight_map": wm}))


# -- plan mutations with homes

HOME_CLASSES = ("weights", "grads", "optimizer", "step")


def _recompute_identity(obj: dict) -> None:
    from planner.blocks import identity_hash
    obj["model"]["identity"] = identity_hash(obj["model"])


def _regenerate_schedule(obj: dict) -> bool:
    """The schedule the (edited) decisions imply, written into ``obj``; False when the planner
    refuses those decisions (the edit stays invalid)."""
    from planner.errors import UserError
    from planner.formats import Plan
    from planner.costmodel.schedule import build_schedule
    from planner.plans.simulate import cost_model_of
    try:
        plan = Plan.from_dict(copy.deepcopy(obj))
        cm = cost_model_of(plan)
        sched = build_schedule(cm, plan.layers)
        if any(cm.homes[i].count(d.home) == 0 for i, d in enumerate(plan.layers)):
            return False
    except UserError:
        return False
    obj["schedule"] = {s.value if hasattr(s, "value") else s: [e.to_dict() for e in evs]
                       for s, evs in sched.items()}
    return True


def _stream_mutation(draw, obj: dict, runtime: bool = True) -> tuple[str | None, str]:
    """An edit of a streaming plan's homes, micro-batches, parameter table or events:
    (why the contract refuses it or None, label), applied to ``obj``. ``runtime``: judged as
    apply_plan sees it (with the model: its tie, its parameters); else as the verbs do, which
    have no model (a table that no longer matches the model is only odd to them)."""
    op = draw(st.sampled_from(["home", "home", "home_consistent", "micro", "param_dup",
                               "param_two_units", "param_drop", "param_rename", "param_shape",
                               "param_unit", "identity_only", "structural"]))
    layers, units = obj["layers"], obj["units"]
    params = obj["model"]["params"]
    if op in ("home", "home_consistent"):
        i = draw(st.integers(0, len(layers) - 1))
        cls = draw(st.sampled_from(HOME_CLASSES))
        new = draw(st.sampled_from(["gpu", "cpu", "nvme"]))
        old = layers[i].get(cls, "gpu")
        layers[i][cls] = new
        if new == old:
            return None, f"{op} unchanged"
        if op == "home":
            return f"unit {layers[i]['name']} {cls} {old} -> {new}, schedule left", op
        if not runtime:
            return (None if _regenerate_schedule(obj) else f"{cls} -> {new} not possible"), op
        if i == 0 and cls in ("weights", "grads"):
            return f"the tied embedding's {cls} -> {new}", op     # tok_emb is lm_head
        if units[i]["kind"] == "head":
            # the seed charges pos_emb (used before the blocks) to the head: streaming the
            # head's weights would be a plan that profile could not have made
            return (None, "head home") if cls in ("optimizer", "step") and \
                _regenerate_schedule(obj) else (f"head {cls} -> {new}", op)
        if not _regenerate_schedule(obj):
            return f"unit {layers[i]['name']} {cls} -> {new} (not possible here)", op
        return None, op
    if op == "micro":
        k = draw(st.sampled_from([1, 2, 3, 4]))
        obj["micro_batches"] = k
        return None, op                   # these homes imply the same events whatever K is
    blocks = [u["name"] for u in units if u["kind"] == "block"]
    b = draw(st.sampled_from(blocks))
    rows = params[b]
    recompute = draw(st.integers(0, 4)) != 0     # most crafted edits recompute the hash
    why = None
    if op == "param_dup":
        rows.append(copy.deepcopy(draw(st.sampled_from(rows))))
        why = "a parameter listed twice in one unit"
    elif op == "param_two_units":
        other = draw(st.sampled_from([u for u in params if u != b]))
        params[other].append(copy.deepcopy(draw(st.sampled_from(rows))))
        why = "a parameter in two units"
    elif op == "param_drop":
        rows.pop(draw(st.integers(0, len(rows) - 1)))
        why = "a model parameter in no unit"
    elif op == "param_rename":
        r = draw(st.sampled_from(rows))
        r[0] = r[0] + draw(st.sampled_from(["x", ".w", "\n"]))
        why = "a parameter the model lacks"
    elif op == "param_shape":
        r = draw(st.sampled_from(rows))
        r[1] = draw(st.sampled_from([[], [0], [r[1][0] + 1] + r[1][1:], [-1], [1.5], "3"]))
        why = "a parameter of another shape"
        if not runtime and not (isinstance(r[1], list) and
                                all(type(s) is int and s >= 0 for s in r[1])):
            return "a malformed parameter row", op
    elif op == "param_unit":
        params[draw(st.sampled_from(["blocks.9", "", "head "]))] = [rows.pop()]
        why = "a table charging a unit the plan does not have"
    elif op == "identity_only":
        obj["model"]["identity"] = draw(st.sampled_from(["0" * 16, "", None, 7]))
        if runtime:
            return "an identity hash that is not the plan's", op
        return ("identity is not a string" if obj["model"]["identity"] == 7 else None), op
    else:
        why, label = _structural(draw, obj, "plan")
        return why, f"structural {label}"
    if recompute:
        try:
            _recompute_identity(obj)
        except (TypeError, ValueError, AttributeError):
            pass
    else:
        why = why or "an edited table under the old identity hash"
    if not runtime and op not in ("param_dup", "param_two_units", "param_unit"):
        why = None        # without the model a verb cannot tell; the table's own rules it can
    return why, op + (" (hash recomputed)" if recompute else "")


@st.composite
def stream_plan_file(draw, seeds: Seeds):
    """The streaming plan, as is (one in five), edited (``_stream_mutation``) or mutated like
    any plan (``json_file``)."""
    seed = seeds.files["plan_stream.json"]
    r = draw(st.integers(0, 9))
    if r < 2:
        return seed, None
    if r < 8:
        obj = json.loads(seed)
        why, _ = _stream_mutation(draw, obj)
        return _to_json(obj), why
    return draw(json_file(seed, "plan"))


@st.composite
def case_apply(draw, seeds: Seeds):
    """apply_plan(gpt-tiny, PLAN, optimizer=opt, nvme_dir=nv), then one step."""
    files: dict = {}
    if draw(st.integers(0, 30)) == 0:
        files["plan.json"], why = special_path(draw)
    else:
        files["plan.json"], why = draw(stream_plan_file(seeds))
    return Case("apply", ["plan.json"], files, why, ("plan.json",), 120, max_new_depth=3)


# -- checkpoint mutations

def _st_split(raw: bytes):
    n = int.from_bytes(raw[:8], "little")
    return n, raw[8:8 + n], raw[8 + n:]


def _st_join(header: bytes, data: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header + data


def _ck_explicit(draw, seeds: Seeds, files: dict) -> tuple[str, str | None]:
    """One of issue 27's hostile checkpoints (or a valid oddity); (file to give, why invalid)."""
    good = seeds.files["model.safetensors"]
    n, head, data = _st_split(good)
    h = json.loads(head)
    names = sorted(k for k in h if k != "__metadata__")
    a, b = draw(st.sampled_from([(x, y) for x in names[:6] for y in names[-6:] if x != y]))
    kind = draw(st.sampled_from([
        "dup_key", "overlap", "gap", "float_offsets", "negative", "out_of_bounds", "bad_count",
        "big_header", "deep", "utf16", "bom", "fifo", "fifo_shard", "dev_shard", "dir_shard",
        "map_other_copy", "map_missing", "map_escape", "extra_tensor", "missing_tensor",
        "wrong_shape", "int_dtype", "half_dtype", "metadata_int", "padding", "sharded_ok",
        "index_dup_key", "index_not_object"]))
    name = "model.safetensors"

    def with_header(obj, raw=None, dat=data):
        files[name] = _st_join(raw if raw is not None else json.dumps(obj).encode(), dat)

    if kind == "dup_key":
        body = head.rstrip()[:-1] + b"," + json.dumps(a).encode() + b":" + \
            json.dumps(h[b]).encode() + b"}"
        with_header(None, body)
        return name, "a duplicate header key"
    if kind == "overlap":
        lo, hi = h[b]["data_offsets"]
        h[b]["data_offsets"] = [lo - 4, hi - 4] if lo >= 4 else [lo + 4, hi + 4]
        with_header(h)
        return name, "overlapping data ranges"
    if kind == "gap":
        with_header(h, dat=data + b"\0" * draw(st.sampled_from([1, 4, 4096])))
        return name, "bytes past the last range"
    if kind == "float_offsets":
        lo, hi = h[a]["data_offsets"]
        h[a]["data_offsets"] = [float(lo), hi]
        with_header(h)
        return name, "float offsets"
    if kind == "negative":
        h[a]["data_offsets"] = [-8, h[a]["data_offsets"][1]]
        with_header(h)
        return name, "a negative offset"
    if kind == "out_of_bounds":
        h[a]["data_offsets"] = [h[a]["data_offsets"][0], len(data) + 4]
        with_header(h)
        return name, "a range past the end"
    if kind == "bad_count":
        h[a]["shape"] = [x + 1 for x in h[a]["shape"]] or [2]
        with_header(h)
        return name, "a byte count not the range's"
    if kind == "big_header":
        from runtime.checkpoint import MAX_HEADER_BYTES
        with_header(None, head + b" " * (MAX_HEADER_BYTES + 1 - len(head)))
        return name, "a header over the bound"
    if kind == "deep":
        d = draw(st.sampled_from([200, 5000, 100_000]))
        with_header(None, b'{"__metadata__":' + b"[" * d + b"]" * d + b"}")
        return name, "deep nesting"
    if kind == "utf16":
        with_header(None, head.decode().encode("utf-16"))
        return name, "a UTF-16 header"
    if kind == "bom":
        with_header(None, b"\xef\xbb\xbf" + head)
        return name, "a byte-order mark"
    if kind == "metadata_int":
        h["__metadata__"] = {"format": 1}
        with_header(h)
        return name, "metadata not strings"
    if kind == "padding":
        with_header(None, head + b" " * draw(st.sampled_from([1, 7, 1000])))
        return name, None
    if kind == "extra_tensor":
        h2 = dict(h)
        h2["zz.extra"] = {"dtype": "F32", "shape": [1], "data_offsets": [len(data), len(data) + 4]}
        with_header(h2, dat=data + b"\0\0\x80\x3f")
        return name, None                                    # a warning, as HF's loader gives
    if kind in ("missing_tensor", "wrong_shape", "int_dtype", "half_dtype"):
        return _ck_rewrite(files, seeds, kind, a)
    if kind == "fifo":
        files[name] = ("special", "fifo")
        return name, "a FIFO"
    # sharded checkpoints: the index and two shards
    idx = json.loads(seeds.files["model.safetensors.index.json"])
    for s in seeds.shards:
        files[s] = seeds.files[s]
    wm = idx["weight_map"]
    t = draw(st.sampled_from(sorted(wm)))
    index_name = "model.safetensors.index.json"
    why = None
    if kind in ("fifo_shard", "dev_shard", "dir_shard"):
        files[wm[t]] = ("special", {"fifo_shard": "fifo", "dev_shard": "devzero",
                                    "dir_shard": "dir"}[kind])
        why = f"a shard that is {kind}"
    elif kind == "map_other_copy":
        # the tensor also in the other shard, with other values: the index decides
        other = [s for s in seeds.shards if s != wm[t]][0]
        n2, h2raw, d2 = _st_split(files[other])
        h2 = json.loads(h2raw)
        n1, h1raw, d1 = _st_split(files[wm[t]])
        h1 = json.loads(h1raw)
        lo, hi = h1[t]["data_offsets"]
        copy_ = bytes((x + 1) % 256 for x in d1[lo:hi])
        h2[t] = dict(h1[t], data_offsets=[len(d2), len(d2) + len(copy_)])
        files[other] = _st_join(json.dumps(h2).encode(), d2 + copy_)
        why = None                                # valid: read from the shard the map names
    elif kind == "map_missing":
        wm[t] = [s for s in seeds.shards if s != wm[t]][0]
        why = "an index naming a shard without the tensor"
    elif kind == "map_escape":
        wm[t] = draw(st.sampled_from(["../" + wm[t], "/etc/passwd", "", "sub/../../x"]))
        why = "a shard outside the index's folder"
    elif kind == "index_dup_key":
        body = json.dumps(idx)[:-1] + ', "weight_map": {}}'
        files[index_name] = body.encode()
        return index_name, "an index with a duplicate key"
    elif kind == "index_not_object":
        files[index_name] = draw(st.sampled_from([b"[]", b"", b"\xff\xfe{}", b"{" * 5000]))
        return index_name, "an index that is not a JSON object"
    files[index_name] = _to_json(idx)
    return (draw(st.sampled_from([index_name, "."])), why)


def _ck_rewrite(files: dict, seeds: Seeds, kind: str, a: str) -> tuple[str, str | None]:
    """A checkpoint rewritten through the library: one tensor dropped, reshaped or retyped."""
    import numpy as np
    from safetensors.numpy import load, save
    sd = load(seeds.files["model.safetensors"])
    why = None
    if kind == "missing_tensor":
        sd.pop(a)
        why = "a parameter missing"
    elif kind == "wrong_shape":
        sd[a] = np.zeros((3,) + sd[a].shape, dtype=sd[a].dtype)
        why = "a tensor of another shape"
    elif kind == "int_dtype":
        sd[a] = sd[a].astype(np.int32)
        why = "an integer tensor for a float parameter"
    else:
        sd[a] = sd[a].astype(np.float16)           # valid: cast to the model's dtype
    files["model.safetensors"] = save(sd)
    return "model.safetensors", why


def _ck_random(draw, seeds: Seeds, files: dict) -> tuple[str, str | None]:
    """A random mutation of a valid file (header bytes, its length, offsets, dtype names,
    truncation, data bytes) or of one shard; validity is decided in the child by the
    safetensors library (``_ck_oracle``), so the case's own ``invalid`` stays None."""
    sharded = draw(st.integers(0, 3)) == 0
    if sharded:
        for s in seeds.shards:
            files[s] = seeds.files[s]
        files["model.safetensors.index.json"] = seeds.files["model.safetensors.index.json"]
        target = draw(st.sampled_from(seeds.shards))
    else:
        target = "model.safetensors"
    raw = bytearray(seeds.files[target] if sharded else seeds.files["model.safetensors"])
    n, head, data = _st_split(bytes(raw))
    how = draw(st.sampled_from(["cut", "scribble_data", "scribble_header", "length", "offsets",
                                "dtype", "shape", "header_byte"]))
    if how == "cut":
        out = bytes(raw[:draw(st.integers(0, len(raw) - 1))])
    elif how == "scribble_data":
        at = 8 + n + draw(st.integers(0, max(0, len(data) - 1)))
        raw[at] = draw(st.integers(0, 255))
        out = bytes(raw)
    elif how == "scribble_header":
        for _ in range(draw(st.integers(1, 3))):
            raw[8 + draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        out = bytes(raw)
    elif how == "length":
        n2 = draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, len(raw), 2**40, 2**64 - 1]))
        out = (n2 % 2**64).to_bytes(8, "little") + bytes(raw[8:])
    elif how == "header_byte":
        raw[8 + draw(st.integers(0, n - 1))] = draw(st.sampled_from(list(b'{}[]",:019 -.eE\\\x00')))
        out = bytes(raw)
    else:
        h = json.loads(head)
        t = draw(st.sampled_from(sorted(k for k in h if k != "__metadata__")))
        if how == "offsets":
            lo, hi = h[t]["data_offsets"]
            h[t]["data_offsets"] = [lo + draw(st.integers(-4, 4)), hi + draw(st.integers(-4, 4))]
        elif how == "dtype":
            h[t]["dtype"] = draw(st.sampled_from(["F32", "F16", "BF16", "I32", "F64", "U8", "BOOL",
                                                  "f32", "Q9", "", "I64"]))
        else:
            h[t]["shape"] = draw(st.sampled_from([[], [0], [1], h[t]["shape"][::-1],
                                                  h[t]["shape"] + [1], [2.0], [-1]]))
        out = _st_join(json.dumps(h).encode(), data)
    files[target] = out
    return ("model.safetensors.index.json" if sharded else target), None


@st.composite
def case_checkpoint(draw, seeds: Seeds):
    """apply_plan(meta-device gpt-tiny, the streaming plan, checkpoint=FILE)."""
    files: dict = {"plan.json": seeds.files["plan_stream.json"]}
    r = draw(st.integers(0, 9))
    if r == 0:
        files["model.safetensors"] = seeds.files["model.safetensors"]
        given, why = "model.safetensors", None
    elif r < 5:
        given, why = _ck_explicit(draw, seeds, files)
    else:
        given, why = _ck_random(draw, seeds, files)
    protect = tuple(k for k in files if k != "plan.json")
    return Case("checkpoint", [given], files, why, protect, 60, max_new_depth=3)


# -- the children's targets

def _runtime_child(case: Case, run) -> int:
    """Run ``run()`` (which prints its result line) with warnings as ``apply_plan: warning:``
    lines and a UserError or OffloadError as one ``apply_plan: error:`` line (exit 2)."""
    import warnings

    import torch

    from planner.errors import UserError
    from runtime.files import OffloadError
    torch.set_num_threads(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run()
            code = 0
        except (UserError, OffloadError) as e:
            print(f"apply_plan: error: {e}", file=sys.stderr)
            code = 2
    for w in caught:
        print(f"apply_plan: warning: {' '.join(str(w.message).split())}", file=sys.stderr)
    return code


def _nvme_files(folder: str = "nv") -> list:
    return sorted(str(p) for p in Path(folder).rglob("*") if p.is_file()) \
        if os.path.isdir(folder) else []


def _target_apply(case: Case) -> int:
    def run():
        import torch

        from planner.models import make_inputs
        from runtime import apply_plan
        cfg, ref = _stream_model()
        _, m = _stream_model()
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        h = apply_plan(m, case.argv[0], optimizer=opt, nvme_dir="nv")
        batch = make_inputs(cfg, STREAM_B, STREAM_S, seed=1)
        for model, o in ((ref, ropt), (m, opt)):
            torch.manual_seed(123)
            model(**batch).loss.backward()
            o.step()
            o.zero_grad()
        got, want = m.state_dict(), ref.state_dict()
        diff = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
        h.remove()
        print(json.dumps({"max_diff": diff, "keys_match": sorted(got) == sorted(want),
                          "left": _nvme_files()}))
    return _runtime_child(case, run)


def _ck_oracle(given: str) -> tuple[str | None, dict]:
    """What the safetensors library reads from ``given`` for this model: (why the checkpoint
    must be refused or None, {name: tensor}). An index is followed as its weight_map says."""
    import torch
    from safetensors import safe_open
    from runtime.checkpoint import MAX_HEADER_BYTES
    path = given
    if os.path.isdir(path):
        path = os.path.join(path, "model.safetensors.index.json") if os.path.lexists(
            os.path.join(path, "model.safetensors.index.json")) else \
            os.path.join(path, "model.safetensors")
    files = {path: None}
    if path.endswith(".json"):
        try:
            wm = json.loads(Path(path).read_bytes())["weight_map"]
        except Exception:                                         # noqa: BLE001
            return "an unreadable index", {}
        files = {}
        for k, s in wm.items():
            files.setdefault(os.path.join(os.path.dirname(path), s), []).append(k)
    values = {}
    for f, only in files.items():
        if not os.path.isfile(f):
            return f"{f} is not a regular file", {}
        raw = Path(f).read_bytes()
        n = int.from_bytes(raw[:8], "little")
        if n > MAX_HEADER_BYTES:
            return "a header over the bound", {}
        try:
            json.loads(raw[8:8 + n], object_pairs_hook=_no_dup_pairs)
        except _DupKey:
            return "a duplicate header key", {}
        except (ValueError, RecursionError):
            pass                                     # the library's verdict below
        try:
            with safe_open(f, framework="pt") as g:
                keys = list(g.keys())
                for k in keys if only is None else only:
                    if k not in keys:
                        return f"{k} not in the shard its index names", {}
                    values[k] = g.get_tensor(k)
        except Exception as e:                                    # noqa: BLE001
            return f"safetensors refuses it: {str(e)[:80]}", {}
    _, m = _stream_model(meta=True)
    names = {}
    for n_, p in m.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), (p, []))[1].append(n_)
    for p, ns in names.values():
        k = next((x for x in ns if x in values), None)
        if k is None:
            return f"no tensor for {ns[0]}", values
        if tuple(values[k].shape) != tuple(p.shape):
            return f"{k} has another shape", values
        if values[k].dtype.is_floating_point != p.dtype.is_floating_point:
            return f"{k} is not a float tensor", values
    return None, values


class _DupKey(ValueError):
    pass


def _no_dup_pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _DupKey(k)
        d[k] = v
    return d


def _target_checkpoint(case: Case) -> int:
    def run():
        import torch

        from runtime import apply_plan
        why, values = _ck_oracle(case.argv[0])
        print(json.dumps({"oracle": why}), flush=True)
        _, m = _stream_model(meta=True)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        h = apply_plan(m, "plan.json", optimizer=opt, nvme_dir="nv", checkpoint=case.argv[0])
        sd = m.state_dict()
        bad = []
        for n_, p in m.named_parameters(remove_duplicate=False):
            k = n_ if n_ in values else next((x for x, q in m.named_parameters(
                remove_duplicate=False) if q is p and x in values), None)
            if k is None or not torch.equal(sd[n_], values[k].to(sd[n_].dtype)):
                bad.append(n_)
        h.remove()
        print(json.dumps({"wrong": bad[:3], "left": _nvme_files()}))
    return _runtime_child(case, run)


RUNTIME_TARGETS = {"apply": _target_apply, "checkpoint": _target_checkpoint}


def preimport_runtime() -> None:
    """What the runtime targets import, once, before the forks: torch's meta-device
    initialisers import its reference implementations on first use (13 s each child on the
    shared host); a meta op runs no kernel and starts no thread pool, so forking stays safe."""
    import safetensors.numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch

    import planner.models  # noqa: F401
    import planner.costmodel.schedule  # noqa: F401
    import planner.plans.simulate  # noqa: F401
    import runtime  # noqa: F401
    import runtime.checkpoint  # noqa: F401
    torch.empty(1, device="meta").normal_()


def _judge_runtime(case: Case, outcome: Outcome) -> list[str]:
    """The runtime targets' own verdicts from their result lines: a checkpoint the library's
    reading calls invalid accepted, a valid one refused, weights not what the file holds, a
    step not equal to plain PyTorch's, files left in the NVMe folder."""
    out = []
    lines = [json.loads(ln) for ln in outcome.stdout.splitlines() if ln.startswith("{")]
    info = {k: v for d in lines for k, v in d.items()}
    if case.verb == "checkpoint" and "oracle" in info:
        if info["oracle"] and outcome.rc == 0:
            out.append(f"accepted invalid: {info['oracle']}")
        if info["oracle"] is None and case.invalid is None and outcome.rc == 2:
            out.append("refused valid: the safetensors library reads it and it fits the model")
    if outcome.rc == 0:
        if case.verb == "checkpoint" and info.get("wrong"):
            out.append(f"wrong result: weights {info['wrong']} are not the file's")
        if case.verb == "apply" and (not info.get("keys_match", True) or
                                     info.get("max_diff", 0.0) > 1e-6):
            out.append(f"wrong result: a step {info.get('max_diff')} off plain PyTorch")
        if info.get("left"):
            out.append(f"left behind: {info['left'][:2]}")
        if "left" not in info:
            out.append("wrong result: no result line")
    return out


STRATEGIES = {"simulate": case_simulate, "inspect": case_inspect, "diff": case_diff,
              "solve": case_solve, "profile": case_profile, "hardware": case_hardware,
              "apply": case_apply, "checkpoint": case_checkpoint}


# ----------------------------------------------------------------------------- running

@dataclasses.dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    seconds: float
    hung: bool


def _prepare(case: Case, folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, v in case.files.items():
        p = folder / name
        if isinstance(v, tuple) and v[0] == "special":
            make_special(p, v[1])
        elif isinstance(v, tuple) and v[0] == "link":
            os.symlink(v[1], p)
        else:
            p.write_bytes(v)


def _fingerprint(p: Path):
    try:
        st_ = os.lstat(p)
    except FileNotFoundError:
        return None
    if stat.S_ISREG(st_.st_mode):
        return ("file", st_.st_ino, hashlib.sha256(p.read_bytes()).hexdigest())
    if stat.S_ISLNK(st_.st_mode):
        return ("link", os.readlink(p))
    if stat.S_ISDIR(st_.st_mode):
        return ("dir", sorted(os.listdir(p)))
    return ("other", stat.S_IFMT(st_.st_mode), st_.st_rdev)


def run_case(case: Case, folder: Path, before: dict | None = None) -> Outcome:
    """Run ``planner.cli.main(case.argv)`` in a forked child inside ``folder``; ``before``
    receives the fingerprints of the protected names as they were made."""
    from planner.cli import main
    _prepare(case, folder)
    if before is not None:
        for name in case.protect:
            before[name] = _fingerprint(folder / name)
    out, err = folder.parent / (folder.name + ".out"), folder.parent / (folder.name + ".err")
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:                                    # the child: the CLI and nothing else
        code = 99
        try:
            os.setpgid(0, 0)
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                f = os.open(path, flags, 0o644)
                os.dup2(f, fd)
                os.close(f)
            # Python's streams over the new fds (under pytest, sys.stdout is its capture)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                          errors="backslashreplace")
            os.chdir(folder)
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            try:
                code = RUNTIME_TARGETS[case.verb](case) if case.verb in RUNTIME_TARGETS \
                    else main(list(case.argv))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:                                 # noqa: BLE001
                traceback.print_exc()
                code = 99
        finally:
            with_flush = (sys.stdout, sys.stderr)
            for s in with_flush:
                try:
                    s.flush()
                except Exception:                                  # noqa: BLE001
                    pass
            os._exit(code if isinstance(code, int) and 0 <= code < 256 else 98)
    deadline = t0 + case.timeout
    hung = False
    status = None
    delay = 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() > deadline:
            hung = True
            with _suppress():
                os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(delay)
        delay = min(0.05, delay * 1.5)
    # anything the CLI started in its group (a CBC process) must be gone with it
    with _suppress():
        os.killpg(pid, signal.SIGKILL)
    rc = None if hung else os.waitstatus_to_exitcode(status)
    return Outcome(rc=rc, stdout=out.read_text(errors="replace"),
                   stderr=err.read_text(errors="replace"),
                   seconds=time.perf_counter() - t0, hung=hung)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], (OSError, ProcessLookupError))


def _depth(root: Path, p: Path) -> int:
    return len(p.relative_to(root).parts)


def judge(case: Case, folder: Path, outcome: Outcome, before: dict) -> list[str]:
    """What went wrong, as (category: detail) strings; empty when the run behaved."""
    problems = []
    err = outcome.stderr
    if outcome.hung:
        problems.append(f"hang: still running after {case.timeout:.0f} s")
    elif "Traceback" in err or "Traceback" in outcome.stdout or outcome.rc in (98, 99):
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["?"]
        problems.append(f"traceback: {tail[0][:200]}")
    elif outcome.rc < 0:
        problems.append(f"crash: killed by signal {-outcome.rc}")
    elif outcome.rc not in case.codes:
        problems.append(f"exit code: {outcome.rc} (documented: {case.codes})")
    elif outcome.rc != 0:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        who = case.prefix
        errors = [ln for ln in lines if ln.startswith(f"{who}: error:")]
        other = [ln for ln in lines if not ln.startswith((f"{who}: error:", f"{who}: warning:",
                                                          f"{who}: note:"))]
        if len(errors) != 1 or other:
            problems.append(f"not one line: {lines[:3]}")
    if case.invalid and outcome.rc == 0:
        problems.append(f"accepted invalid: {case.invalid}")
    if case.verb in RUNTIME_TARGETS and not outcome.hung:
        problems += _judge_runtime(case, outcome)
    for name, fp in before.items():
        if _fingerprint(folder / name) != fp:
            problems.append(f"clobbered: {name} changed ({fp[0]} -> "
                            f"{(_fingerprint(folder / name) or ('gone',))[0]})")
    if folder.exists():
        for p in folder.rglob("*"):
            if p.name.endswith(".tmp") or p.name.startswith(".tierplan"):
                problems.append(f"left behind: {p.relative_to(folder)}")
            if p.is_dir() and not p.is_symlink() and _depth(folder, p) > case.max_new_depth \
                    and not any(str(p.relative_to(folder)).startswith(n) for n in case.files):
                problems.append(f"folder created too deep: {p.relative_to(folder)}")
    return problems


def run_and_judge(case: Case, folder: Path) -> tuple[Outcome, list[str]]:
    """Run ``case`` in a fresh ``folder`` and judge it."""
    if folder.exists():
        shutil.rmtree(folder)
    before: dict = {}
    outcome = run_case(case, folder, before)
    return outcome, judge(case, folder, outcome, before)



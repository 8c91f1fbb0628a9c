"""The validation engine every loader uses: schema checks, required fields, the kinds of
field value (``KINDS``) with the ranges every loaded number must lie in, and the one-line
``UserError`` each bad value gets.

One table per dataclass maps each field to a kind; ``check_fields`` is the only place that
tests a loaded value, so every bad value gets the same one-line message.
"""
from __future__ import annotations

import dataclasses
import math

from planner.errors import UserError
from planner.formats.enums import PLAN_SCHEMA, PLAN_SCHEMA_V1, PLAN_SCHEMA_V2, PROFILE_SCHEMA
from planner.formats.fileio import path_problem


def check_schema(d: dict, expected: str, what: str, source: str) -> None:
    got = d.get("schema")
    if got != expected:
        hint = ""
        if got == PROFILE_SCHEMA:
            hint = " (this is a profile; run 'plan solve' on it to get a plan)"
        elif got in (PLAN_SCHEMA, PLAN_SCHEMA_V2, PLAN_SCHEMA_V1):
            hint = " (this is a plan, not a profile)"
        raise UserError(f"{what} '{source}' has schema {got!r}, expected {expected!r}{hint}")


def from_fields(cls, d: dict, what: str, source: str):
    """Build a dataclass from a dict, rejecting missing required fields with one line."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, f in names.items():
        if name in d:
            kwargs[name] = d[name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{what} '{source}' lacks the field '{name}'; regenerate it")
    return cls(**kwargs)


# The fix every message about a profile or a plan names.
FIX = {"profile": "regenerate it with 'plan profile'",
       "plan": "regenerate it with 'plan solve'"}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)   # JSON true is a Python int


def is_num(v) -> bool:
    # ints are compared exactly (math.isfinite(10**400) raises OverflowError)
    return (isinstance(v, int) and not isinstance(v, bool)) or (
        isinstance(v, float) and math.isfinite(v))


# Ranges every loaded number must lie in (docs/reliability.md): wide enough for any real
# machine or model, narrow enough that no sum, product or quotient the planner forms overflows
# a float or loses its meaning (a 400-digit byte count, a 1e308 time or a 1e-300 bandwidth
# would).
MAX_BYTES = 2**60            # 1 EiB
MAX_COUNT = 2**53            # the largest integer a float holds exactly
MAX_SECONDS = 1e6            # 11.6 days for one unit's forward, or one step
MAX_FLOPS = 1e30             # a unit's FLOPs; 1e30 is ~10^6 x GPT-3's training compute
MIN_RATE, MAX_RATE = 1.0, 1e15        # bytes/s of a link or a drive: 1 B/s .. 1 PB/s
MIN_FLOP_RATE, MAX_FLOP_RATE = 1.0, 1e21   # FLOP/s: 1 .. 1 ZFLOP/s
MAX_NAME = 1000              # characters of a name (qualified module names are < 200)


def _name_ok(v) -> bool:
    """A non-empty printable name: control characters would break one-line messages and
    tables."""
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME and v.isprintable()


def _rate(v) -> bool:
    return is_num(v) and (v == 0 or MIN_RATE <= v <= MAX_RATE)


_KINDS = {
    "bytes": (lambda v: is_int(v) and 0 <= v <= MAX_BYTES,
              "a non-negative integer number of bytes, at most 2^60"),
    "bytes?": (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_BYTES),
               "null or a non-negative integer number of bytes, at most 2^60"),
    "bytes list": (lambda v: isinstance(v, (list, tuple)) and len(v) <= MAX_COUNT
                   and all(is_int(x) and 0 <= x <= MAX_BYTES for x in v),
                   "a list of non-negative integer numbers of bytes, each at most 2^60"),
    "count": (lambda v: is_int(v) and 0 <= v <= MAX_COUNT, "a non-negative integer below 2^53"),
    "count?": (lambda v: v is None or (is_int(v) and 0 <= v <= MAX_COUNT),
               "null or a non-negative integer below 2^53"),
    "seconds": (lambda v: is_num(v) and 0 <= v <= MAX_SECONDS,
                f"a finite number of seconds from 0 to {MAX_SECONDS:g}"),
    "flops": (lambda v: is_num(v) and 0 <= v <= MAX_FLOPS,
              f"a finite number of FLOPs from 0 to {MAX_FLOPS:g}"),
    "number": (lambda v: is_num(v) and 0 <= v <= MAX_FLOPS,
               f"a finite number from 0 to {MAX_FLOPS:g}"),
    "number?": (lambda v: v is None or (is_num(v) and 0 <= v <= MAX_FLOPS),
                f"null or a finite number from 0 to {MAX_FLOPS:g}"),
    # rates in a spec: 0 (no such link) or a real machine's figure
    "rate": (_rate, f"0 or a finite number of bytes/s from {MIN_RATE:g} to {MAX_RATE:g}"),
    "fraction": (lambda v: is_num(v) and 0 < v <= 1, "a number above 0 and at most 1"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    # a hardware spec's NVMe drives and CPU cores: 0 (not given) or a real machine's count
    "drives": (lambda v: is_int(v) and 0 <= v <= 1024, "0 (not given) or a whole number of "
               "drives up to 1024"),
    "cores": (lambda v: is_int(v) and 0 <= v <= 1 << 20, "0 (not given) or a whole number of "
              "cores up to 2^20"),
    "dict?": (lambda v: v is None or isinstance(v, dict), "null or a mapping"),
    "str": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "str?": (lambda v: v is None or isinstance(v, str), "null or a string"),
    # free text printed in one-line messages and tables: no control characters
    "text": (lambda v: isinstance(v, str) and v != "" and len(v) <= 10_000 and v.isprintable(),
             "a non-empty printable string (no line breaks or control characters)"),
    "text?": (lambda v: v is None or (isinstance(v, str) and len(v) <= 10_000
                                      and v.isprintable()),
              "null or a printable string (no line breaks or control characters)"),
    "name": (_name_ok, f"a non-empty printable string of at most {MAX_NAME} characters"),
    "name?": (lambda v: v is None or _name_ok(v),
              f"null or a non-empty printable string of at most {MAX_NAME} characters"),
    "names": (lambda v: isinstance(v, list) and all(_name_ok(x) for x in v),
              "a list of non-empty printable strings"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
             "a list of strings"),
    "strs?": (lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
              "null or a list of strings"),
    # a directory the runtime creates and every verb prints: what the OS takes, one line
    "path?": (lambda v: v is None or (isinstance(v, str) and path_problem(v) is None),
              "null or a path the OS takes (non-empty, no control characters such as a "
              "newline, at most 4095 bytes, each name at most 255 bytes)"),
    "dict": (lambda v: isinstance(v, dict), "a JSON object"),
    "list": (lambda v: isinstance(v, list), "a JSON list"),
}


def entry_where(d, file: str, noun: str, key: str, fix: str) -> str:
    """How errors name one entry of a list in a file (``plan 'p.json': unit 'blocks.3'``);
    refuses an entry that is not a JSON object."""
    if not isinstance(d, dict):
        raise UserError(f"{file}: a {noun} is {type(d).__name__}, not a JSON object; {fix}")
    label = d.get(key)
    return f"{file}: {noun} {label!r}" if isinstance(label, str) else f"{file}: a {noun}"


def check_fields(d: dict, spec: dict, where: str, fix: str) -> None:
    """Raise one UserError line for the first field of ``d`` that is not of its ``spec`` kind.

    Absent fields are left to ``from_fields`` (required ones) or to ``require``.
    """
    for name, kind in spec.items():
        if name in d:
            test, desc = _KINDS[kind]
            if not test(d[name]):
                got = repr(d[name])
                got = got if len(got) <= 40 else got[:37] + "..."
                raise UserError(f"{where}: {name} must be {desc}, got {got}; {fix}")


def require(d, keys, where: str, fix: str) -> None:
    if not isinstance(d, dict):
        raise UserError(f"{where} must be a JSON object; {fix}")
    for k in keys:
        if k not in d:
            raise UserError(f"{where} lacks '{k}'; {fix}")


def short_repr(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."

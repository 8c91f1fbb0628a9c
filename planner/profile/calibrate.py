"""``plan calibrate``: a profile whose times and bandwidths are those a real run measured.

The runtime's report (``tierplan.report/1``, ``runtime/timing.py``) holds, per step, each
unit's forward, backward and recompute seconds per pass and each disk link's bytes and busy
seconds. The calibrated profile is the input profile with, per unit that the run measured,
``fwd_s``/``bwd_s`` the medians over the steps after the first (``samples`` the number of
steps behind them), ``optimizer_s`` the optimizer's update time on the device (the run's
timed updates, per parameter element, times the model's parameters; a report without them:
the median time from the last backward's end to the optimizer step's end), and
``nvme_read_bandwidth``/``nvme_write_bandwidth`` of its hardware the bytes the run moved over
their busy seconds (links that moved at least ``MIN_LINK_BYTES``).
Everything else (bytes, FLOPs, structure) is unchanged. Provenance goes into the profile:
``model.calibration`` (report path and sha256, when, steps, the load average of this host at
calibration time) and the hardware's ``sources`` for each bandwidth replaced.

The report must be of this profile: the same unit names in the same order and the same
structure hash, run on the profile's device and hardware spec in its dtype; otherwise exit 2
in one line. The input is never overwritten: ``-o`` names
the output (default ``<profile>-calibrated.json`` beside it).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

from planner.errors import UserError
from planner.formats.fileio import check_output, write_json_atomic
from planner.formats import Profile, load_profile, sha256_file
from planner.formats.report import Report, load_report
from planner.formats.spec import without_nvme_array
from planner.sizes import fmt_bytes, fmt_seconds

# A link measured over less than this is left at the spec's figure: a few small transfers
# time the call overhead, not the link.
MIN_LINK_BYTES = 1 << 20
LINK_FIELD = {"nvme_read": "nvme_read_bandwidth", "nvme_write": "nvme_write_bandwidth"}


def check_match(profile: Profile, report: Report, ppath: str, rpath: str) -> None:
    """The report was measured on a plan of this profile: same units, same structure hash."""
    names = [u.name for u in profile.layers]
    if not report.units:
        raise UserError(f"report '{rpath}' has no per-unit times (written by an older runtime); "
                        "train again under the plan and save handle.report()")
    if report.units != names:
        diff = next((i for i, (a, b) in enumerate(zip(report.units, names)) if a != b),
                    min(len(report.units), len(names)))
        got = report.units[diff] if diff < len(report.units) else "(none)"
        want = names[diff] if diff < len(names) else "(none)"
        raise UserError(f"report '{rpath}' is not of profile '{ppath}': its units differ at "
                        f"position {diff} ({got!r} against {want!r}; {len(report.units)} "
                        f"against {len(names)} units); give the profile the run's plan was "
                        "solved from")
    h = profile.model.get("structure_hash")
    if report.structure_hash != h:
        raise UserError(f"report '{rpath}' is not of profile '{ppath}': structure hash "
                        f"{report.structure_hash} against {h}; give the profile the run's plan "
                        "was solved from")
    _check_machine(profile, report, ppath, rpath)
    for k in ("batch", "seq"):
        want = int(profile.model.get(k) or 0)
        got = getattr(report, k)
        if want and got and got != want:
            raise UserError(f"report '{rpath}' ran --{k} {got} but profile '{ppath}' is "
                            f"--{k} {want}; calibrate a profile of the shape that ran")


def _check_machine(profile: Profile, report: Report, ppath: str, rpath: str) -> None:
    """The run computed on the profile's device (cpu, cuda) in its dtype: times measured
    elsewhere would be written into a profile that claims this machine. The dtype is the
    plan's (a run in another precision is warned of by ``apply_plan``, not recorded)."""
    hw = profile.hardware or {}
    fix = ("profile the model on the machine the run used (plan profile ... --hardware SPEC) "
           "and calibrate that profile")
    devices = {hw.get("device"), profile.device} - {None, "", "meta"}
    for dev in sorted(devices):
        if report.device != dev:
            raise UserError(f"report '{rpath}' ran on device {report.device} but profile "
                            f"'{ppath}' is of device {dev} (hardware {hw.get('name')}); {fix}")
    # (the spec's name is not compared: the report's is the plan's, and plan solve --hardware
    # may name another spec of the same machine, a measured one)
    dtype = profile.model.get("dtype")
    if dtype and report.dtype and report.dtype != dtype:
        raise UserError(f"report '{rpath}' ran in {report.dtype} but profile '{ppath}' is "
                        f"{dtype}; calibrate a profile of the dtype that ran (plan profile ... "
                        f"--dtype {report.dtype})")


def calibrate(profile: Profile, report: Report, ppath: str, rpath: str) -> tuple[Profile, dict]:
    """The calibrated profile and a summary of what changed (``--json``)."""
    check_match(profile, report, ppath, rpath)
    times = report.unit_times()
    if not times:
        raise UserError(f"report '{rpath}' has no measured step; train at least one step "
                        "under the plan (two or more: the first is left out)")
    units, changed = [], []
    for u in profile.layers:
        t = times.get(u.name, {})
        new = {}
        if "fwd_s" in t:
            new["fwd_s"] = float(t["fwd_s"])
        if "bwd_s" in t:
            new["bwd_s"] = float(t["bwd_s"])
        if new:
            new["samples"] = int(t["samples"])
            changed.append({"unit": u.name, "fwd_s": [u.fwd_s, new.get("fwd_s", u.fwd_s)],
                            "bwd_s": [u.bwd_s, new.get("bwd_s", u.bwd_s)],
                            "recompute_s": t.get("recompute_s")})
        units.append(dataclasses.replace(u, **new))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    hw = dict(profile.hardware)
    sources = dict(hw.get("sources") or {})
    links = {}
    for link, r in report.link_rates().items():
        f = LINK_FIELD.get(link)
        if f is None or r["bytes"] < MIN_LINK_BYTES or not r["bytes_per_s"]:
            continue
        links[f] = [hw.get(f), r["bytes_per_s"]]
        hw[f] = float(r["bytes_per_s"])
        sources[f] = (f"calibrated {when} from report {rpath}: {fmt_bytes(r['bytes'])} in "
                      f"{fmt_seconds(r['busy_s'])} of busy time")
    hw["sources"] = sources
    if links:      # a measured tier rate replaces what the array of drives gave
        hw = without_nvme_array(hw, f"array fields dropped: the NVMe tier calibrated {when}")
    opt, opt_from = _optimizer_s(profile, report)
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    prov = {"report": str(rpath), "report_sha256": sha256_file(rpath), "at": when,
            "steps": len(report._use()), "device": report.device, "plan": report.plan_path,
            "units": len(changed), "links": sorted(links), "load_average": load,
            "optimizer_s": opt is not None, "optimizer_from": opt_from}
    model = dict(profile.model, calibration=prov)
    out = dataclasses.replace(profile, layers=units, hardware=hw, model=model, timing="measured",
                              optimizer_s=float(opt) if opt is not None else profile.optimizer_s)
    # the result must load as any profile does
    Profile.from_dict(out.to_dict(), "the calibrated profile")
    summary = {"units": changed, "bandwidths": links,
               "optimizer_s": [profile.optimizer_s, out.optimizer_s], "provenance": prov}
    return out, summary


def _optimizer_s(profile: Profile, report: Report) -> tuple[float | None, str | None]:
    """The optimizer step's seconds on the device as the run measured them, and whence.

    The runtime times each update the device ran (``StepRecord.optimizer_compute_s``: a
    streaming plan's per-unit steps, the user's optimizer over what stays on the device):
    seconds per element times the model's parameters is the whole model's step, which is what
    the profile's ``optimizer_s`` is. The time after the last backward is not: under a plan
    whose phase reads and writes the optimizer state, weights or gradients it holds those
    transfers too, which the cost model charges to the links again (a streaming plan on this
    host's disk was re-planned 17% slow with it; docs/benchmarks.md). It is the fallback for a
    report without timed updates (no streaming phase, where it is the step itself; an older
    runtime's report)."""
    per = report.optimizer_seconds_per_element()
    n = int(profile.model.get("param_count") or sum(u.param_count for u in profile.layers))
    if per is not None and n > 0:
        return per * n, "updates"
    opt = report.after_backward_s()
    return opt, ("after_backward" if opt is not None else None)


def cli_calibrate(args) -> int:
    profile = load_profile(args.profile)
    report = load_report(args.report)
    out_path = Path(args.output) if args.output else Path(args.profile).with_name(
        Path(args.profile).stem + "-calibrated.json")
    if args.output is None:            # -o was checked with the other verbs' outputs
        check_output(out_path, inputs=[args.profile, args.report], what="calibrated profile")
    cal, summary = calibrate(profile, report, args.profile, args.report)
    write_json_atomic(out_path, cal.to_dict())
    if args.json:
        print(json.dumps({"output": str(out_path), **summary}, sort_keys=True, indent=1))
        return 0
    print(out_path)
    n = len(summary["units"])
    print(f"calibrated {n} of {len(profile.layers)} unit(s) from {summary['provenance']['steps']} "
          f"step(s) of report {args.report}")
    for c in summary["units"]:
        print(f"  {c['unit']:<24} fwd {fmt_seconds(c['fwd_s'][0])} -> {fmt_seconds(c['fwd_s'][1])}"
              f"  bwd {fmt_seconds(c['bwd_s'][0])} -> {fmt_seconds(c['bwd_s'][1])}")
    o = summary["optimizer_s"]
    print(f"  optimizer step {fmt_seconds(o[0])} -> {fmt_seconds(o[1])}")
    for f, (a, b) in summary["bandwidths"].items():
        print(f"  {f} {a / 1e9 if a else 0:.3f} -> {b / 1e9:.3f} GB/s")
    return 0

"""Loading refuses malformed profiles and plans with one UserError line naming the file, the
unit or field, and the fix; output paths that are folders are refused the same way."""
import copy
import dataclasses
import json

import pytest

from planner import PLANS_DIR
from planner.cli import main
from planner.errors import UserError
from planner.formats import load_plan, load_profile, write_atomic, write_json_atomic
from planner.hardware import load_hardware
from synthetic import uniform_profile

GOLDEN = PLANS_DIR / "golden" / "h200-mixed.json"   # has every stream, issues and afters


def _plan_dict():
    return json.loads(GOLDEN.read_text())


def _profile_dict():
    return uniform_profile(3, load_hardware("a100-80g")).to_dict()


def _set(d, path, value):
    *head, last = path
    for k in head:
        d = d[k]
    d[last] = value


def _one_line(err, *needles):
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


UNIT = ("layers", 1)       # a block of the synthetic profile
PROFILE_BAD = [
    (UNIT + ("fwd_s",), "fast", "fwd_s"),
    (UNIT + ("fwd_s",), float("nan"), "fwd_s"),
    (UNIT + ("bwd_s",), -1.0, "bwd_s"),
    (UNIT + ("saved_bytes",), -5, "saved_bytes"),
    (UNIT + ("saved_bytes",), 1.5, "saved_bytes"),
    (UNIT + ("saved_bytes",), True, "saved_bytes"),        # JSON true is a Python int
    (UNIT + ("input_bytes",), "1G", "input_bytes"),
    (UNIT + ("fwd_flops",), None, "fwd_flops"),
    (UNIT + ("name",), 7, "name"),
    (UNIT + ("shared_from",), 3, "shared_from"),
    (UNIT + ("measured_peak_bytes",), -1, "measured_peak_bytes"),
    (UNIT + ("shared_saved_bytes",), 10**15, "shared_saved_bytes"),   # more than saved_bytes
    (("layers", 1), "blocks.0", "not a JSON object"),
    (("layers",), "x", "layers"),
    (("optimizer_s",), "slow", "optimizer_s"),
    (("optimizer_workspace_bytes",), -3, "optimizer_workspace_bytes"),
]


@pytest.mark.parametrize("path,value,needle", PROFILE_BAD)
def test_bad_profile_fields_are_one_line(path, value, needle, tmp_path):
    d = _profile_dict()
    _set(d, path, value)
    f = tmp_path / "bad-profile.json"
    f.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_profile(f)
    _one_line(e, str(f), needle, "plan profile")
    if len(path) == 3 and path[:2] == UNIT and path[2] != "name":
        assert "unit 'blocks.0'" in str(e.value)


PLAN_BAD = [
    (("budgets", "gpu_bytes"), "80G", "gpu_bytes"),
    (("budgets", "cpu_bytes"), -1, "cpu_bytes"),
    (("budgets", "nvme_bytes"), 1.5, "nvme_bytes"),
    (("budgets",), {"gpu_bytes": 1, "cpu_bytes": 0}, "nvme_bytes"),
    (("predicted", "step_s"), "quick", "step_s"),
    (("predicted", "peak_gpu_bytes"), None, "peak_gpu_bytes"),
    (("units", 2, "saved_bytes"), -5, "saved_bytes"),
    (("units", 2, "fwd_s"), "fast", "fwd_s"),
    (("units",), "x", "units"),
    (("policy",), 3, "policy"),
    (("nvme_dir",), 5, "nvme_dir"),
    (("optimizer_s",), float("inf"), "optimizer_s"),
    (("schedule", "compute", 0, "passes"), "sometimes", "sometimes"),
    (("schedule", "compute", 0, "seconds"), "x", "seconds"),
    (("schedule", "compute", 0, "stage"), -1, "stage"),
    (("schedule", "compute", 0, "units"), "embedding", "units"),
    (("schedule", "compute", 0, "op"), "teleport", "teleport"),
    (("schedule", "compute", 0, "stream"), "d2h", "listed under stream 'compute'"),
    (("schedule", "compute", 1, "id"), "F:embedding", "does not match its fields"),
    (("schedule", "d2h", 0, "units"), ["nowhere"], "nowhere"),
    (("schedule", "d2h", 0, "cls"), "teleport", "teleport"),
    (("schedule", "d2h", 0, "bytes"), -100, "bytes"),
    (("schedule", "pcie"), [], "pcie"),
    (("schedule", "nvme"), {"id": "w"}, "nvme"),
    (("schedule", "nvme", 0), "w:blocks.3", "not a JSON object"),
]


@pytest.mark.parametrize("path,value,needle", PLAN_BAD)
def test_bad_plan_fields_are_one_line(path, value, needle, tmp_path):
    d = _plan_dict()
    _set(d, path, value)
    f = tmp_path / "bad-plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_plan(f)
    _one_line(e, str(f), needle, "plan solve")


def test_missing_event_field_is_one_line(tmp_path):
    d = _plan_dict()
    del d["schedule"]["compute"][0]["op"]
    f = tmp_path / "p.json"
    f.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_plan(f)
    _one_line(e, "event 'F:embedding' lacks 'op'", "plan solve")


def test_valid_files_still_load_unchanged(tmp_path):
    plan = load_plan(GOLDEN)
    assert dataclasses.asdict(plan.budgets) == _plan_dict()["budgets"]
    assert sum(len(v) for v in plan.schedule.values()) == sum(
        len(v) for v in _plan_dict()["schedule"].values())
    prof = uniform_profile(3, load_hardware("a100-80g"))
    assert load_profile(write_json_atomic(tmp_path / "p.json", prof.to_dict())) == prof


@pytest.mark.parametrize("verb", [["simulate"], ["inspect"], ["diff", str(GOLDEN)]])
def test_cli_verbs_refuse_bad_plan_exit_2(verb, tmp_path, capsys):
    d = _plan_dict()
    d["budgets"]["gpu_bytes"] = "80G"
    f = tmp_path / "wrongtype.json"
    f.write_text(json.dumps(d))
    assert main([verb[0], str(f)] + verb[1:]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpu_bytes" in err and "Traceback" not in err


def test_solve_refuses_bad_profile_exit_2(tmp_path, capsys):
    d = _profile_dict()
    d["layers"][1]["fwd_s"] = "fast"
    f = tmp_path / "prof.json"
    f.write_text(json.dumps(d))
    assert main(["solve", str(f), "--gpu-mem", "80G", "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fwd_s" in err and "blocks.0" in err
    assert not (tmp_path / "o.json").exists()


def test_write_atomic_refuses_a_directory(tmp_path):
    with pytest.raises(UserError) as e:
        write_json_atomic(tmp_path, {"a": 1})
    _one_line(e, str(tmp_path), "is a directory; give a file name")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError) as e:     # a parent that is a file: cannot create the output
        write_atomic(tmp_path / "file" / "out.json", lambda f: f.write("{}"))
    _one_line(e, "out.json", "cannot create")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]   # no temporary left behind


def test_solve_output_directory_exit_2(tmp_path, capsys):
    prof = write_json_atomic(tmp_path / "prof.json", _profile_dict())
    (tmp_path / "out").mkdir()
    assert main(["solve", str(prof), "--gpu-mem", "80G", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory; give a file name" in err
    assert list((tmp_path / "out").iterdir()) == []


# ----------------------------------------------------------------------------- reports

def _report_dict():
    """A three-step report of a synthetic run, with per-unit times and disk links."""
    from planner.formats.report import Report, StepRecord
    units = {"embedding": {"fwd_s": 0.001, "bwd_s": 0.002, "stall_s": 0.0},
             "blocks.0": {"fwd_s": 0.01, "bwd_s": 0.02, "recompute_s": 0.0, "stall_s": 0.0}}
    step = StepRecord(step_s=0.1, passes=1, peak_gpu_bytes=1 << 20, peak_cpu_bytes=0,
                      peak_nvme_bytes=4096, peak_activation_bytes=1024, static_bytes=2048,
                      base_bytes=1 << 28, moved={"nvme_read": 4096, "nvme_write": 4096},
                      stall_s=0.01, units=units, after_backward_s=0.003,
                      links={"nvme_read": {"bytes": 4096, "busy_s": 0.001},
                             "nvme_write": {"bytes": 4096, "busy_s": 0.002}})
    rep = Report(plan_path="p.json", policy="offload-all", device="cpu", hardware="cpu-host",
                 batch=4, seq=128, micro_batches=1, predicted=_plan_dict()["predicted"],
                 predicted_moved={"nvme_read": 4096}, steps=[step, step, step],
                 units=list(units), structure_hash="b537f365520957cb")
    return json.loads(json.dumps(rep.to_dict()))


LINK = ("steps", 1, "links", "nvme_read")
REPORT_BAD = [
    (LINK, {"bytes": 4096}, "links nvme_read lacks 'busy_s'"),
    (LINK, {"busy_s": 0.1}, "links nvme_read lacks 'bytes'"),
    (LINK, True, "links nvme_read must be a JSON object"),
    (LINK, None, "links nvme_read must be a JSON object"),
    (LINK, 7, "links nvme_read must be a JSON object"),
    (LINK, 1.5, "links nvme_read must be a JSON object"),
    (LINK, "", "links nvme_read must be a JSON object"),
    (LINK, [1], "links nvme_read must be a JSON object"),
]


@pytest.mark.parametrize("path, value, needle", REPORT_BAD)
def test_bad_report_links_are_one_line(path, value, needle, tmp_path, capsys):
    from planner.formats.report import load_report
    d = _report_dict()
    _set(d, path, value)
    f = tmp_path / "rep.json"
    f.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_report(f)
    _one_line(e, "step 1", needle, "handle.report().save")
    # the verbs that read reports: one line, exit 2, nothing written
    prof = write_json_atomic(tmp_path / "prof.json", _profile_dict())
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(prof), "--report", str(f), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and not out.exists()


@pytest.mark.parametrize("field", ["peak_gpu_bytes", "base_bytes"])
def test_a_step_without_a_required_field_is_one_line(field, tmp_path):
    from planner.formats.report import load_report
    d = _report_dict()
    del d["steps"][2][field]
    f = tmp_path / "rep.json"
    f.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_report(f)
    _one_line(e, "step 2", f"lacks '{field}'")
    d["steps"][2][field] = None             # null is allowed: no figure was measured
    f.write_text(json.dumps(d))
    assert load_report(f).steps[2].to_dict()[field] is None


def _paths(o, pre=()):
    if pre:
        yield pre
    if isinstance(o, dict):
        for k, v in o.items():
            yield from _paths(v, pre + (k,))
    elif isinstance(o, list):
        for i, v in enumerate(o[:2]):
            yield from _paths(v, pre + (i,))


def test_report_mutations_load_or_give_one_line(tmp_path):
    """Every field of a step set to each odd JSON value, or deleted: the report either loads
    and every figure calibrate and inspect read can be computed, or one UserError line."""
    from planner.formats.report import load_report_dict
    base = _report_dict()
    odd = [None, True, -1, 0, 1.5, -0.0, 2**70, "", "x\n", [], [1], {}, {"a": 1}, KeyError]
    for path in _paths(base["steps"][1], ("steps", 1)):
        for v in odd:
            d = copy.deepcopy(base)
            if v is KeyError:
                obj = d
                for k in path[:-1]:
                    obj = obj[k]
                del obj[path[-1]]
            else:
                _set(d, path, v)
            try:
                rep = load_report_dict(d, "r.json")
            except UserError as e:
                assert "\n" not in str(e), (path, v)
                continue
            rep.link_rates(), rep.unit_times(), rep.stage_peaks(), str(rep)
            rep.optimizer_seconds_per_element(), rep.after_backward_s(), rep.to_dict()


# ----------------------------------------------------------------------------- duplicate keys

def _with_duplicate(text: str, key: str, value: str) -> str:
    """``text`` (indented JSON) with ``key`` given a second time in the object it opens."""
    at = text.index(f'"{key}": ')
    return text[:at] + f'"{key}": {value}, ' + text[at:]


@pytest.mark.parametrize("kind", ["plan", "profile", "report"])
def test_a_key_given_twice_in_a_json_file_is_one_line(kind, tmp_path, capsys):
    from planner.formats.report import load_report
    text, key, load = {
        "plan": (GOLDEN.read_text(), "gpu_bytes", load_plan),
        "profile": (json.dumps(_profile_dict(), indent=1), "optimizer_s", load_profile),
        "report": (json.dumps(_report_dict(), indent=1), "device", load_report)}[kind]
    f = tmp_path / f"{kind}.json"
    f.write_text(_with_duplicate(text, key, '"80G"' if kind != "report" else '"cuda"'))
    with pytest.raises(UserError) as e:
        load(f)
    _one_line(e, str(f), f"'{key}' twice")
    if kind == "plan":
        assert main(["inspect", str(f)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"'{key}' twice" in err


def test_a_key_given_twice_in_a_yaml_spec_is_one_line(tmp_path, capsys):
    from planner.hardware import HARDWARE_DIR
    text = (HARDWARE_DIR / "a100-80g.yaml").read_text()
    f = tmp_path / "hw.yaml"
    f.write_text(text + "memory_bytes: 1000\n")
    with pytest.raises(UserError) as e:
        load_hardware(str(f))
    _one_line(e, str(f), "'memory_bytes' given twice")
    prof = write_json_atomic(tmp_path / "prof.json", _profile_dict())
    assert main(["solve", str(prof), "--gpu-mem", "80G", "--hardware", str(f),
                 "-o", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "given twice" in err and not (tmp_path / "o.json").exists()
    # a merge may still be overridden by the mapping's own key: not a duplicate
    f.write_text(text.replace("efficiency: 0.55", "<<: {efficiency: 0.3}\nefficiency: 0.55"))
    assert load_hardware(str(f)).efficiency == 0.55

"""The CLI's manners, end to end through the installed ``plan`` script (a real process):
every bad input exits 2 with one line naming it, a budget too small exits 3 with the
smallest budget that fits, and no traceback ever reaches the user."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.formats import write_json_atomic
from planner.hardware import load_hardware
from planner.sizes import parse_size
from planner.synthetic import uniform_profile

ROOT = Path(__file__).resolve().parents[1]
PLAN = str(Path(sys.executable).parent / "plan")


def run(*argv, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([PLAN, *argv], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    prof = write_json_atomic(d / "prof.json",
                             uniform_profile(6, load_hardware("h100-80g"), jitter=0.02).to_dict())
    (d / "broken.json").write_text('{"schema": "tierplan.plan/1", ')
    (d / "empty.json").write_text("")
    (d / "list.json").write_text("[1, 2]")
    (d / "factory_raises.py").write_text("def make(batch, seq):\n    raise RuntimeError('boom')\n")
    plan = d / "plan.json"
    r = run("solve", str(prof), "--gpu-mem", "80G", "--cpu-mem", "512G", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    return d, prof, plan


def _one_line_no_traceback(r, code):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("case", [
    "malformed-json", "empty-file", "not-an-object", "missing-file", "directory",
    "profile-for-plan", "plan-for-profile", "malformed-size", "negative-size", "dash-value",
    "unknown-model", "unimportable-function", "factory-raises", "non-numeric-batch",
    "zero-batch", "negative-seq", "unknown-hardware", "unknown-verb", "diff-plan-profile",
])
def test_bad_input_exits_2_with_one_line(files, case):
    d, prof, plan = files
    argv, needle = {
        "malformed-json": (["simulate", str(d / "broken.json")], "not valid JSON"),
        "empty-file": (["inspect", str(d / "empty.json")], "empty.json"),
        "not-an-object": (["simulate", str(d / "list.json")], "list.json"),
        "missing-file": (["simulate", str(d / "nope.json")], "nope.json"),
        "directory": (["solve", str(d), "--gpu-mem", "80G"], str(d)),
        "profile-for-plan": (["simulate", str(prof)], "profile"),
        "plan-for-profile": (["solve", str(plan), "--gpu-mem", "80G"], "plan"),
        "malformed-size": (["solve", str(prof), "--gpu-mem", "80X"], "80X"),
        "negative-size": (["solve", str(prof), "--gpu-mem=-3G"], "-3G"),
        "dash-value": (["solve", str(prof), "--gpu-mem", "-3G"], "--flag=VALUE"),
        "unknown-model": (["profile", "gpt-9000", "--batch", "1", "--seq", "8"], "gpt-9000"),
        "unimportable-function": (["profile", "no_such_pkg.mod:make", "--batch", "1", "--seq",
                                   "8"], "no_such_pkg"),
        "factory-raises": (["profile", "factory_raises:make", "--batch", "1", "--seq", "8"],
                           "boom"),
        "non-numeric-batch": (["profile", "gpt-tiny", "--batch", "eight", "--seq", "8"],
                              "--batch"),
        "zero-batch": (["profile", "gpt-tiny", "--batch", "0", "--seq", "8"], "--batch"),
        "negative-seq": (["profile", "gpt-tiny", "--batch", "1", "--seq", "-3"], "--seq"),
        "unknown-hardware": (["solve", str(prof), "--gpu-mem", "80G", "--hardware", "tpu9"],
                             "tpu9"),
        "unknown-verb": (["optimise", str(prof)], "optimise"),
        "diff-plan-profile": (["diff", str(plan), str(prof)], "profile"),
    }[case]
    err = _one_line_no_traceback(run(*argv, cwd=d), 2)
    assert needle in err


def test_too_small_budget_exits_3_with_the_smallest_that_fits(files, tmp_path):
    d, prof, _ = files
    r = run("solve", str(prof), "--gpu-mem", "12G", "--cpu-mem", "0", "-o",
            str(tmp_path / "p.json"))
    err = _one_line_no_traceback(r, 3)
    assert "--gpu-mem" in err
    assert not (tmp_path / "p.json").exists(), "a plan that does not fit was written"
    # The figure it names must itself be enough.
    sizes = re.findall(r"(\d+(?:\.\d+)?\s?(?:[KMGT]i?B|[KMGT]))\b", err)
    assert sizes, err
    need = max(parse_size(s.replace(" ", "")) for s in sizes)
    ok = run("solve", str(prof), "--gpu-mem", str(need), "--cpu-mem", "0", "-o",
             str(tmp_path / "p.json"))
    assert ok.returncode == 0, ok.stderr
    sim = json.loads(run("simulate", str(tmp_path / "p.json"), "--json").stdout)
    assert sim["fits"] is True


def test_output_goes_quietly_to_a_pipe(files):
    """No progress or control characters when stdout/stderr are not terminals."""
    d, prof, plan = files
    for argv in (["inspect", str(plan)], ["simulate", str(plan)], ["diff", str(plan), str(plan)]):
        r = run(*argv)
        assert r.returncode == 0, r.stderr
        assert "\x1b[" not in r.stdout + r.stderr and "\r" not in r.stdout + r.stderr
        assert r.stderr == ""

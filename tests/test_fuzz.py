"""The CLI under generated abuse: a fixed sample of ``tests/fuzzcases.py``'s cases for every
verb (bench/fuzz.py runs >= 10,000 of them), each through ``planner.cli.main`` in a forked
child with a deadline, judged for tracebacks, hangs, invalid inputs accepted, refusals that
are not one line, clobbered files and temporaries left behind.

Hypothesis draws the cases (``derandomize=True``: the same sample every run, so a failure
here is a regression and not a new find; the bench explores new seeds). A failure names the
command line and the files, shrunk by Hypothesis to a small one.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import fuzzcases as fc

ROOT = Path(__file__).resolve().parents[1]
PLAN = str(Path(sys.executable).parent / "plan")
# Examples per verb: together about 90 s on the 2-core host (profile and hardware cost most);
# apply and checkpoint (apply_plan with edited streaming plans and hostile checkpoints) about
# 0.5 s a case more.
N = {"simulate": 70, "inspect": 50, "diff": 50, "solve": 45, "profile": 18, "hardware": 8,
     "apply": 30, "checkpoint": 40}


# The cases run in children forked from the test process. Forked from a process whose earlier
# tests left threads (torch's pools, the autograd engine's), a child can inherit a lock that
# one of them held and wait on it forever (seen: every case hanging to its deadline in the
# full suite, none alone). So this module runs in a fresh interpreter of its own, started by
# the one test that runs where the rest of the suite runs.
INNER = "TIERPLAN_FUZZ_FRESH"
fresh_only = pytest.mark.skipif(os.environ.get(INNER) != "1",
                                reason="run in a fresh interpreter by test_in_a_fresh_interpreter")


@pytest.mark.skipif(os.environ.get(INNER) == "1", reason="already fresh")
def test_in_a_fresh_interpreter(tmp_path):
    """Every test below, in a new interpreter (no thread has run before the first fork). Its
    temporary files go under this test's own (a session of its own in the shared root would
    prune the oldest sessions' folders, this one's among them when others run)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--no-header", "-rf", "--basetemp", str(tmp_path / "inner"), __file__],
                       cwd=ROOT,
                       env=dict(os.environ, **{INNER: "1"}), capture_output=True, text=True,
                       timeout=1800, stdin=subprocess.DEVNULL)
    tail = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    fc.preimport_runtime()
    return fc.Seeds(tmp_path_factory.mktemp("fuzz-seeds"))


def _check(case, work: Path, counter: list):
    counter[0] += 1
    folder = work / f"case-{counter[0]}"
    out, problems = fc.run_and_judge(case, folder)
    assert not problems, (f"{problems}\n{case.describe()}\nexit {out.rc}\nstderr: "
                          f"{out.stderr[-1500:]}")
    shutil.rmtree(folder, ignore_errors=True)


@fresh_only
@pytest.mark.parametrize("verb", list(N))
def test_generated_invocations_behave(verb, seeds, tmp_path):
    counter = [0]

    @settings(max_examples=N[verb], derandomize=True, database=None, deadline=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(case=fc.STRATEGIES[verb](seeds))
    def run(case):
        _check(case, tmp_path, counter)

    run()
    assert counter[0] >= N[verb] // 2       # the strategy really produced cases


# ----------------------------------------------------------------------------- the real script

PARITY = [
    (["simulate", "plan.json", "--json"], {"plan.json": "plan_tight.json"}),
    (["simulate", "plan.json"], {"plan.json": b"\xff\xfe{"}),
    (["simulate", "plan.json"], {"plan.json": ("special", "fifo")}),
    (["inspect", "plan.json"], {"plan.json": ("special", "devzero")}),
    (["inspect", "plan.json"], {"plan.json": b"[" * 100_000 + b"]" * 100_000}),
    (["diff", "a.json", "b.json"], {"a.json": "plan_keep.json", "b.json": "plan_tight.json"}),
    (["solve", "prof.json", "--gpu-mem=1" + "0" * 400], {"prof.json": "prof_h100.json"}),
    (["solve", "prof.json", "--gpu-mem=30G", "--cpu-mem=512G", "--time-limit=5", "-o",
      "prof.json"], {"prof.json": "prof_h100.json"}),
    (["solve", "prof.json", "--gpu-mem=30G", "--cpu-mem=512G", "--time-limit=5", "-o",
      "out.json"], {"prof.json": "prof_h100.json"}),
    (["hardware", "--size=0"], {}),
    (["profile", "gpt-9000", "--batch=1", "--seq=8"], {}),
    (["bogus-verb"], {}),
]


@fresh_only
@pytest.mark.parametrize("argv,files", PARITY, ids=[" ".join(a)[:40] for a, _ in PARITY])
def test_the_installed_script_agrees_with_the_entry_point(argv, files, seeds, tmp_path):
    """The same command through the ``plan`` script (a fresh interpreter) and through
    ``main`` in a fork: the same exit code and the same one-line refusal."""
    made = {k: (seeds.files[v] if isinstance(v, str) else v) for k, v in files.items()}
    case = fc.Case(argv[0], argv, made, timeout=120)
    out, problems = fc.run_and_judge(case, tmp_path / "fork")
    assert not problems, problems
    folder = tmp_path / "script"
    fc._prepare(case, folder)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([PLAN, *argv], cwd=folder, env=env, capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == out.rc, (r.stderr, out.stderr)
    assert "Traceback" not in r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("plan: error:")]
    want = [ln for ln in out.stderr.splitlines() if ln.startswith("plan: error:")]
    assert [e.replace(str(folder), "") for e in err] == \
        [w.replace(str(tmp_path / "fork"), "") for w in want]


@fresh_only
def test_ten_thousand_units_end_within_the_time_limit(tmp_path):
    """A 10,000-unit profile: ``plan solve --time-limit 8`` ends within the limit (the
    backstop gives 3 s more to write), with a plan or one line saying what did not fit."""
    from planner.formats import write_json_atomic
    from planner.hardware import load_hardware
    from synthetic import uniform_profile
    prof = uniform_profile(10_000, load_hardware("h100-80g"), jitter=0.02, fwd_s=1e-3,
                           saved_bytes=20_000_000, input_bytes=1_000_000,
                           param_bytes=1_000_000, workspace_bytes=2_000_000,
                           head_saved_bytes=50_000_000)
    path = write_json_atomic(tmp_path / "p10k.json", prof.to_dict())
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for limit, budgets in ((8, ["--gpu-mem=80G", "--cpu-mem=1T"]),
                           (8, ["--gpu-mem=1G", "--cpu-mem=0"])):
        t0 = time.perf_counter()
        r = subprocess.run([PLAN, "solve", str(path), *budgets, f"--time-limit={limit}",
                            "-o", str(tmp_path / "o.json")], env=env, capture_output=True,
                           text=True, timeout=120)
        took = time.perf_counter() - t0
        # the interpreter's start-up (~1.5 s importing pulp and numpy) is outside the limit
        assert took < limit + 3 + 5, took
        assert r.returncode in (0, 3), r.stderr
        assert "Traceback" not in r.stderr
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("plan: error:")]
        if r.returncode == 3:
            assert len(errors) == 1
            assert "--time-limit" in errors[0] or "no plan fits" in errors[0], errors
        else:
            assert not errors and (tmp_path / "o.json").is_file()

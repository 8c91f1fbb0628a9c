"""The CLI's manners, end to end through the installed ``plan`` script (a real process):
every bad input exits 2 with one line naming it, a budget too small exits 3 with the
smallest budget that fits, and no traceback ever reaches the user."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.formats import write_json_atomic
from planner.hardware import load_hardware
from planner.sizes import parse_size
from synthetic import uniform_profile

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
    "zero-batch", "negative-seq", "huge-batch", "huge-tokens", "unknown-hardware",
    "unknown-verb", "diff-plan-profile",
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
        # found by bench/fuzz.py: torch's int64 sizes ended in a TypeError traceback
        "huge-batch": (["profile", "gpt-tiny", "--batch", "1" + "0" * 30, "--seq", "8",
                        "--device", "meta"], "--batch"),
        "huge-tokens": (["profile", "gpt-tiny", "--batch", "2000000000", "--seq", "2000000000",
                         "--device", "meta"], "tokens a pass"),
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


# ----------------------------------------------------------------------------- issue 11

def _edit(src: Path, dst: Path, fn) -> Path:
    d = json.loads(src.read_text())
    fn(d)
    dst.write_text(json.dumps(d))
    return dst


def _hw_yaml(dst: Path, **fields) -> Path:
    import yaml
    d = yaml.safe_load((ROOT / "profiles" / "hardware" / "h100-80g.yaml").read_text())
    d.update(fields)
    text = yaml.safe_dump(d)
    for k, v in fields.items():                   # YAML's own spellings of non-numbers
        if isinstance(v, float) and v != v:
            text = text.replace(f"{k}: .nan", f"{k}: .nan")
    dst.write_text(text)
    return dst


def _swap_ends(key):
    def fn(d):
        d[key][0], d[key][-1] = d[key][-1], d[key][0]
    return fn


@pytest.mark.parametrize("case", [
    "invalid-utf8", "deep-nesting", "huge-size", "long-path", "long-name", "fifo", "dev-zero",
    "event-unit-missing", "shared-from-later", "head-first-profile",
    "head-first-plan", "duplicate-blocks", "blocks-only", "zero-and-huge-times",
    "hw-nan", "hw-inf", "hw-negative", "hw-wrong-type", "hw-tiny-bandwidth", "hw-alias",
    "diff-inconsistent", "nan-literal", "huge-int-field", "policy-newline",
    "solver-name-newline",
])
def test_issue_11_inputs_exit_2_with_one_line(files, case, tmp_path):
    """Every input the adversarial pass found crashing, hanging or accepted: one line, exit 2,
    naming the file (and the field where there is one)."""
    d, prof, plan = files
    t = tmp_path
    argv, needle = {
        "invalid-utf8": lambda: ((t / "u.json").write_bytes(b'{"schema": "\xff"}') and
                                 (["simulate", str(t / "u.json")], "not UTF-8")),
        "deep-nesting": lambda: ((t / "n.json").write_text("[" * 100_000 + "]" * 100_000) and
                                 (["inspect", str(t / "n.json")], "deep")),
        "huge-size": lambda: (["solve", str(prof), "--gpu-mem=1" + "0" * 400], "--gpu-mem"),
        "long-path": lambda: (["simulate", "x/" * 3000], "more than 4096"),
        "long-name": lambda: (["simulate", "x" * 300 + ".json"], "File name too long"),
        "fifo": lambda: (os.mkfifo(t / "f") or (["simulate", str(t / "f")], "FIFO")),
        "dev-zero": lambda: (["simulate", "/dev/zero"], "character device"),
        "event-unit-missing": lambda: (["simulate", str(_edit(plan, t / "p.json", lambda x: x[
            "schedule"]["compute"][0].update(units=["no.such"], id="F:no.such")))], "no.such"),
        "shared-from-later": lambda: (["solve", str(_edit(prof, t / "p.json", lambda x: x[
            "layers"][1].update(shared_from="head"))), "--gpu-mem=80G"],
            "neither it nor an earlier unit"),
        "head-first-profile": lambda: (["solve", str(_edit(prof, t / "p.json",
                                                           _swap_ends("layers"))),
                                        "--gpu-mem=80G"], "embedding, then blocks"),
        "head-first-plan": lambda: (["simulate", str(_edit(plan, t / "p.json", lambda x: (
            _swap_ends("units")(x), _swap_ends("layers")(x))))], "embedding, then blocks"),
        "duplicate-blocks": lambda: (["solve", str(_edit(prof, t / "p.json", lambda x: x[
            "layers"][2].update(name=x["layers"][1]["name"]))), "--gpu-mem=80G"], "twice"),
        "blocks-only": lambda: (["solve", str(_edit(prof, t / "p.json", lambda x: x.update(
            layers=x["layers"][1:-1]))), "--gpu-mem=80G"], "embedding, then blocks"),
        "zero-and-huge-times": lambda: (["solve", str(_edit(prof, t / "p.json", lambda x: (
            x["layers"][1].update(fwd_s=0.0), x["layers"][2].update(bwd_s=1e308)))),
            "--gpu-mem=80G"], "bwd_s"),
        "hw-nan": lambda: (["solve", str(prof), "--gpu-mem=80G", "--hardware",
                            str(_hw_yaml(t / "h.yaml", nvme_read_bandwidth=float("nan")))],
                           "nvme_read_bandwidth"),
        "hw-inf": lambda: (["solve", str(prof), "--gpu-mem=80G", "--hardware",
                            str(_hw_yaml(t / "h.yaml", h2d_bandwidth=float("inf")))],
                           "h2d_bandwidth"),
        "hw-negative": lambda: (["solve", str(prof), "--gpu-mem=80G", "--hardware",
                                 str(_hw_yaml(t / "h.yaml", memory_bytes=-5))], "memory_bytes"),
        "hw-wrong-type": lambda: (["solve", str(prof), "--gpu-mem=80G", "--hardware",
                                   str(_hw_yaml(t / "h.yaml", efficiency="high"))], "efficiency"),
        "hw-tiny-bandwidth": lambda: (["solve", str(prof), "--gpu-mem=80G", "--hardware",
                                       str(_hw_yaml(t / "h.yaml", d2h_bandwidth=1e-300))],
                                      "d2h_bandwidth"),
        "hw-alias": lambda: ((t / "h.yaml").write_text(
            (ROOT / "profiles" / "hardware" / "h100-80g.yaml").read_text()
            + "\nx: &a [1, 1]\ny: [*a, *a]\n") and (["solve", str(prof), "--gpu-mem=80G",
                                                     "--hardware", str(t / "h.yaml")], "aliases")),
        "diff-inconsistent": lambda: (["diff", str(plan), str(_edit(plan, t / "p.json", lambda x:
            x["schedule"]["compute"].pop()))], "does not match its layers"),
        "nan-literal": lambda: ((t / "p.json").write_text(plan.read_text().replace(
            '"step_s": ', '"step_s": NaN, "x": ', 1)) and
            (["simulate", str(t / "p.json")], "step_s is NaN")),
        "policy-newline": lambda: (["inspect", str(_edit(plan, t / "p.json", lambda x: x.update(
            policy="a\nb")))], "policy must be"),
        "solver-name-newline": lambda: (["simulate", str(_edit(plan, t / "p.json", lambda x: x[
            "solver"].update(name="a\nb")))], "name must be"),
        "huge-int-field": lambda: (["simulate", str(_edit(plan, t / "p.json", lambda x: x[
            "units"][1].update(fwd_flops=10**400)))], "fwd_flops"),
    }[case]()
    err = _one_line_no_traceback(run(*argv, cwd=t), 2)
    assert needle in err, err


def _is_char_device(p) -> bool:
    import stat
    return stat.S_ISCHR(os.stat(p).st_mode)


def test_outputs_never_clobber(files, tmp_path):
    """-o refuses devices, folders, FIFOs and the command's own input for every verb that
    writes, before any work; a missing folder is made one level deep only."""
    _, prof, plan = files
    t = tmp_path
    if os.geteuid() == 0:                       # a /dev/null of our own: replacing it is safe
        os.mknod(t / "null", 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 3))
    else:
        os.symlink("/dev/null", t / "null")
    (t / "dir").mkdir()
    os.mkfifo(t / "fifo")
    own = t / "prof.json"
    own.write_bytes(prof.read_bytes())
    before = own.read_bytes()
    solve = ["solve", str(own), "--gpu-mem=80G", "--cpu-mem=512G", "--time-limit=5"]
    for argv, needle in (
            (solve + ["-o", str(t / "null")], "character device"),
            (solve + ["-o", str(own)], "the command's input"),
            (solve + ["-o", str(t / "dir")], "is a directory"),
            (solve + ["-o", str(t / "fifo")], "FIFO"),
            (solve + ["-o", str(t / "a" / "b" / "p.json")], "does not exist"),
            (["hardware", "--size=8M", "-o", str(t / "dir")], "is a directory"),
            (["hardware", "--size=8M", "-o", str(t / "null")], "character device"),
            (["profile", "gpt-tiny", "--batch=1", "--seq=8", "-o", str(t / "fifo")], "FIFO"),
            (["inspect", str(plan), "--plot", str(plan)], "the command's input"),
    ):
        err = _one_line_no_traceback(run(*argv, cwd=t), 2)
        assert needle in err, (argv, err)
    assert _is_char_device(t / "null") and own.read_bytes() == before
    assert sorted(p.name for p in t.iterdir()) == ["dir", "fifo", "null", "prof.json"]
    assert list((t / "dir").iterdir()) == []
    r = run(*solve, "-o", str(t / "new" / "p.json"), cwd=t)   # one level: made
    assert r.returncode == 0, r.stderr
    assert (t / "new" / "p.json").is_file() and not list(t.glob("**/.*.tmp"))


def _children_named(pid: int, word: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat_ = (d / "stat").read_text()
            ppid = int(stat_.rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and word.encode() in cmd:
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tmp(tmp_path) -> Path:
    """A temp directory of this test's own: any other ``plan solve`` on the host sweeps dead
    processes' solve directories from the shared one (a race with what these tests watch)."""
    d = tmp_path / "tmpdir"
    d.mkdir(exist_ok=True)
    return d


def _solve_dirs(pid: int, tmp_path) -> list[Path]:
    return list(_tmp(tmp_path).glob(f"tierplan-solve-{pid}-*"))


@pytest.fixture(scope="module")
def cbc_profile(tmp_path_factory):
    """A profile whose CBC search runs for seconds (so a signal finds CBC running)."""
    d = tmp_path_factory.mktemp("cbc")
    return write_json_atomic(d / "p120.json", uniform_profile(
        120, load_hardware("h100-80g"), jitter=0.05, param_bytes=20_000_000).to_dict())


def _start_cbc_solve(cbc_profile, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(_tmp(tmp_path)))
    # SIGINT as at a terminal: a suite started in the background by a non-interactive shell
    # passes it on ignored, and `plan` would then rightly ignore Ctrl-C
    proc = subprocess.Popen([PLAN, "solve", str(cbc_profile), "--gpu-mem=40G", "--cpu-mem=512G",
                             "--solver=cbc", "--time-limit=300", "-o", str(tmp_path / "o.json")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240            # a loaded host builds the model slowly
    while time.time() < deadline and proc.poll() is None:
        kids = [k for k in _children_named(proc.pid, "cbc") if _alive(k)]
        if kids:
            return proc, kids
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no CBC process appeared (exit {proc.poll()}): {proc.communicate()[1][-800:]}")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupted_solve_ends_its_solver_and_removes_its_files(cbc_profile, tmp_path, sig,
                                                                 code):
    proc, kids = _start_cbc_solve(cbc_profile, tmp_path)
    assert _solve_dirs(proc.pid, tmp_path), "the solve's temporary directory exists while CBC runs"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    deadline = time.time() + 30
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids), "CBC still running after plan exited"
    assert _solve_dirs(proc.pid, tmp_path) == [] and not (tmp_path / "o.json").exists()


def test_sigkilled_solve_takes_its_solver_along_and_is_swept(cbc_profile, files, tmp_path):
    proc, kids = _start_cbc_solve(cbc_profile, tmp_path)
    stale = _solve_dirs(proc.pid, tmp_path)
    assert stale
    proc.kill()
    proc.communicate(timeout=120)
    deadline = time.time() + 30           # PR_SET_PDEATHSIG: CBC gets SIGKILL with its parent
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids), "CBC outlived a SIGKILLed plan"
    assert all(p.exists() for p in stale), "SIGKILL cannot clean up; the next solve must"
    _, prof, _ = files
    r = subprocess.run([PLAN, "solve", str(prof), "--gpu-mem=30G", "--cpu-mem=512G",
                        "--solver=cbc", "-o", str(tmp_path / "next.json")], capture_output=True,
                       text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(_tmp(tmp_path))))
    assert r.returncode == 0, r.stderr
    assert not any(p.exists() for p in stale)


@pytest.mark.parametrize("sig,code,says", [(signal.SIGINT, 130, "plan: interrupted"),
                                           (signal.SIGTERM, 143, "plan: terminated by SIGTERM")])
def test_a_signal_whose_exception_an_extension_swallows_is_still_reported_as_the_signal(
        monkeypatch, capsys, sig, code, says):
    """A C extension can turn the exception a signal handler raises into one of its own
    (Ctrl-C during highspy's argument conversion came out as a TypeError and a traceback):
    ``main`` reports what follows a signal as the signal, with its exit code. An error with
    no signal before it is not hidden."""
    from planner import cli
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")

    def swallowed(args):
        import contextlib
        with contextlib.suppress(KeyboardInterrupt):     # as pybind11's argument casting does
            os.kill(os.getpid(), sig)
            time.sleep(5)                  # the handler raises here
        raise TypeError("addRow(): incompatible function arguments")
    monkeypatch.setattr(cli, "_dispatch", swallowed)
    assert cli.main(["inspect", "nothing.json"]) == code
    err = capsys.readouterr().err
    assert err.strip() == says, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def broken(args):
        raise TypeError("a real bug")
    monkeypatch.setattr(cli, "_dispatch", broken)
    with pytest.raises(TypeError, match="a real bug"):
        cli.main(["inspect", "nothing.json"])


@pytest.mark.parametrize("sig,code,says", [(signal.SIGINT, 130, "plan: interrupted"),
                                           (signal.SIGTERM, 143, "plan: terminated by SIGTERM")])
def test_a_signal_swallowed_before_a_verb_succeeds_still_ends_it_and_writes_nothing(
        monkeypatch, capsys, tmp_path, sig, code, says):
    """Ctrl-C during ``import torch``: torch's C code can discard the KeyboardInterrupt and
    the verb goes on to its end. It wrote its output and exited 0; now the writer refuses to
    publish once a signal was caught, and ``main`` ends with the signal's line and code."""
    from planner import cli
    from planner.errors import CAUGHT_SIGNALS
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    prof = write_json_atomic(tmp_path / "prof.json",
                             uniform_profile(3, load_hardware("h100-80g")).to_dict())
    real = cli._dispatch

    def swallowing(args):
        import contextlib
        with contextlib.suppress(KeyboardInterrupt):     # as torch's import can
            os.kill(os.getpid(), sig)
            time.sleep(5)                  # the handler raises here
        return real(args)
    monkeypatch.setattr(cli, "_dispatch", swallowing)
    out = tmp_path / "plan.json"
    assert cli.main(["solve", str(prof), "--gpu-mem", "80G", "-o", str(out)]) == code
    assert capsys.readouterr().err.strip() == says
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prof.json"]   # no output, no temp
    assert CAUGHT_SIGNALS == []            # cleared: a later command in this process writes
    monkeypatch.setattr(cli, "_dispatch", real)
    assert cli.main(["solve", str(prof), "--gpu-mem", "80G", "-o", str(out)]) == 0


def test_ctrl_c_in_the_training_example_is_one_line_and_leaves_no_file(tmp_path):
    """examples/train.py under an offload plan, interrupted in its third step: one line
    ('train: interrupted'), exit 130, no traceback, no offload file left (it printed a
    KeyboardInterrupt traceback from inside autograd's unpack before)."""
    nvme, plan = _train_plan(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), "--model",
                             "gpt-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32",
                             "--steps", "100000", "--plan", str(plan)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-800:]
    assert err.strip().splitlines()[-1] == "train: interrupted" and "Traceback" not in err
    assert not any(p.is_file() for p in nvme.rglob("*"))


CTRL_C_IN_IMPORT = """
import os, runpy, signal, sys, time
MODE = sys.argv[1]   # (sys.argv is the example's by the time the hook runs)
class Hook:          # Ctrl-C as torch's import reaches torch.nn: seconds in, deep inside it
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn":
            sys.meta_path.remove(self)
            if MODE in ("swallowed", "replaced"):   # as torch's C code can discard it
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(5)
                except KeyboardInterrupt:
                    if MODE == "replaced":          # ... or raise its own in its place
                        raise TypeError("incompatible function arguments")
            else:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)
        return None
sys.meta_path.insert(0, Hook())
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("how", ["raised", "swallowed", "replaced"])
def test_ctrl_c_while_the_training_example_imports_torch_is_one_line(tmp_path, how):
    """Ctrl-C in the training example's first seconds (its ``import torch``) printed a
    KeyboardInterrupt traceback; one that torch swallowed let it train on; one replaced by
    another error gave chained tracebacks (the error's handling imported torch again). All are
    now 'train: interrupted', exit 130."""
    wrap = tmp_path / "wrap.py"
    wrap.write_text(CTRL_C_IN_IMPORT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(wrap), how, str(ROOT / "examples" / "train.py"),
                        "--model", "gpt-tiny", "--batch", "2", "--seq", "16", "--steps", "1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 130, (r.returncode, r.stderr[-800:])
    assert r.stderr.strip() == "train: interrupted" and "step 1" not in r.stdout


def _train_plan(tmp_path):
    nvme = tmp_path / "nvme"
    plan = tmp_path / "p.json"
    from planner.cli import main
    assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32",
                 "--device", "cpu", "--timing", "estimate", "-o", str(tmp_path / "prof.json")]) == 0
    assert main(["solve", str(tmp_path / "prof.json"), "--policy", "offload-all",
                 "--gpu-mem", "1G", "--nvme-mem", "1G", "--nvme-dir", str(nvme),
                 "-o", str(plan)]) == 0
    return nvme, plan


def test_sigterm_in_the_training_example_exits_143_with_one_line(tmp_path):
    """SIGTERM mid-training: 'train: terminated by SIGTERM', exit 143 (it was 130, as for
    Ctrl-C), no traceback, no offload file left."""
    nvme, plan = _train_plan(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train.py"), "--model",
                             "gpt-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32",
                             "--steps", "100000", "--plan", str(plan)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-800:]
    assert err.strip().splitlines()[-1] == "train: terminated by SIGTERM" and "Traceback" not in err
    assert not any(p.is_file() for p in nvme.rglob("*"))


FULL_DISK = """
import errno, os, runpy, sys
real, n = os.pwrite, [0]
def pwrite(fd, data, off):
    n[0] += 1
    if n[0] > 40:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real(fd, data, off)
os.pwrite = pwrite
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_full_disk_in_the_training_example_is_one_line_exit_4(tmp_path):
    """The disk fills during training (the runtime's OffloadError): 'error: tierplan: cannot
    write offload file ... the disk is full', exit 4, no traceback (it was a traceback, exit
    1), no offload file left."""
    nvme, plan = _train_plan(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(ROOT / "examples" / "train.py"),
                        "--model", "gpt-tiny", "--batch", "2", "--seq", "32", "--dtype", "fp32",
                        "--steps", "100", "--plan", str(plan)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 4, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: tierplan: cannot write offload file") and "disk is full" in last
    assert "Traceback" not in r.stderr
    assert not any(p.is_file() for p in nvme.rglob("*"))


@pytest.mark.parametrize("case", ["nvme-dir-empty", "nvme-dir-newline", "nvme-dir-5000",
                                  "nvme-dir-long-name", "plan-nvme-dir-newline",
                                  "plan-nvme-dir-5000", "profile-3000-char-model",
                                  "profile-long-yaml-name"])
def test_issue_27_paths_exit_2_with_one_line(files, case, tmp_path):
    """Paths the OS cannot take (or that would split a line): refused in one line, exit 2,
    at solve time and by the plan loader, never a traceback or a plan every other verb
    refuses."""
    d, prof, plan = files
    t = tmp_path
    out = str(t / "out.json")
    argv, needle = {
        "nvme-dir-empty": lambda: (["solve", str(prof), "--gpu-mem=80G", "--nvme-dir=", "-o",
                                    out], "empty"),
        "nvme-dir-newline": lambda: (["solve", str(prof), "--gpu-mem=80G", "--nvme-dir", "a\nb",
                                      "-o", out], "control character"),
        "nvme-dir-5000": lambda: (["solve", str(prof), "--gpu-mem=80G", "--nvme-dir",
                                   "/tmp/" + "d/" * 2500, "-o", out], "PATH_MAX"),
        "nvme-dir-long-name": lambda: (["solve", str(prof), "--gpu-mem=80G", "--nvme-dir",
                                        "/tmp/" + "n" * 300, "-o", out], "NAME_MAX"),
        "plan-nvme-dir-newline": lambda: (["inspect", str(_edit(plan, t / "p.json", lambda x:
                                           x.update(nvme_dir="/tmp/a\nb")))], "nvme_dir"),
        "plan-nvme-dir-5000": lambda: (["simulate", str(_edit(plan, t / "p.json", lambda x:
                                        x.update(nvme_dir="/tmp/" + "d/" * 2500)))], "nvme_dir"),
        "profile-3000-char-model": lambda: (["profile", "m" * 3000, "--batch", "1", "--seq",
                                             "8"], "unknown"),
        "profile-long-yaml-name": lambda: (["profile", "m" * 300 + ".yaml", "--batch", "1",
                                            "--seq", "8"], "File name too long"),
    }[case]()
    err = _one_line_no_traceback(run(*argv, cwd=t), 2)
    assert needle in err, err
    assert not os.path.exists(out)


@pytest.mark.parametrize("verb, folder, work", [
    ("solve", "plans", "planner.solve.command.solve"),
    ("search", "plans", "planner.cli.search._profiler"),
    ("profile", "profiles", "planner.profile.cli.profile_model"),
])
def test_a_default_output_that_cannot_be_written_is_refused_before_the_work(
        verb, folder, work, tmp_path, monkeypatch, capsys):
    """Without -o, ``plans/...`` or ``profiles/...`` under the working directory: a regular
    file named ``plans`` made ``plan solve`` solve for seconds and then fail. Default outputs
    are now checked up front, as -o is (docs/reliability.md, "Outputs")."""
    from planner.cli import main
    import importlib
    mod, name = work.rsplit(".", 1)

    def worked(*a, **k):
        raise AssertionError("the work ran before the output was checked")
    monkeypatch.setattr(importlib.import_module(mod), name, worked)
    prof = write_json_atomic(tmp_path / "prof.json",
                             uniform_profile(3, load_hardware("h100-80g")).to_dict())
    monkeypatch.chdir(tmp_path)
    (tmp_path / folder).write_text("not a folder")
    argv = {"solve": ["solve", str(prof), "--gpu-mem", "80G"],
            "search": ["search", "gpt-tiny", "--seq", "32", "--tokens-per-step", "64",
                       "--gpu-mem", "80G", "--hardware", "h100-80g"],
            "profile": ["profile", "gpt-tiny", "--batch", "2", "--seq", "16", "--device",
                        "cpu", "--timing", "estimate"]}[verb]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"default output (-o gives another) '{folder}/" in err
    assert "a folder on its path is a file" in err


@pytest.mark.parametrize("verb", ["inspect", "sweep"])
def test_a_plot_name_not_ending_in_png_is_refused_before_any_output(verb, files, tmp_path,
                                                                     capsys, monkeypatch):
    """``plan inspect PLAN --plot x.yaml`` printed the whole report, then exit 2: the
    extension is now checked with the other outputs, before anything is printed or run."""
    from planner.cli import main
    import planner.plans.simulate

    def worked(*a, **k):
        raise AssertionError("the work ran before the --plot name was checked")
    monkeypatch.setattr(planner.plans.simulate, "simulate", worked)
    _, prof, plan = files
    argv = {"inspect": ["inspect", str(plan)],
            "sweep": ["sweep", str(prof), "--gpu-mem", "30G:80G:10G"]}[verb]
    assert main(argv + ["--plot", str(tmp_path / "x.yaml")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "give a file name ending in .png" in err
    assert list(tmp_path.iterdir()) == []

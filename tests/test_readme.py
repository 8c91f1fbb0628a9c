"""Every command in the README runs, in order, in a scratch directory.

The first two commands are the set-up (whose work after installing is examples/demo.sh, run
here) and the test command (this suite; CI runs exactly it — checked against .ci/run).
"""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent


def _blocks(text: str) -> list[list[str]]:
    """Command lines of each ```bash block (comments and blank lines dropped)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines = [ln.split("  #")[0].strip() for ln in block.splitlines()]
        out.append([ln for ln in lines if ln and not ln.startswith("#")])
    return out


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def test_readme_starts_with_setup_and_test_commands():
    first = _blocks(README)[0]
    assert first[0] == "bash setup.sh"
    assert first[1] == ".venv/bin/python -m pytest -q"
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert ci[-1].strip() == first[1], "CI must run exactly the README's test command"
    setup = (ROOT / "setup.sh").read_text()
    assert "examples/demo.sh" in setup


def test_demo_main_job(tmp_path):
    """What `bash setup.sh` runs once installed: profile, solve, inspect, train under the plan."""
    env = _env()
    env.update(OUT_DIR=str(tmp_path), PY=sys.executable, PLAN_CMD=str(BIN / "plan"))
    r = subprocess.run(["bash", str(ROOT / "examples" / "demo.sh")], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for marker in ("== plan profile", "== plan solve", "== plan inspect", "step 3/3",
                   "tierplan report"):
        assert marker in r.stdout
    _demo_figures_agree(r.stdout)
    assert not (tmp_path / "tierplan-nvme").exists(), "offload directory left behind"


def _demo_figures_agree(out: str) -> None:
    """What a new user reads in the demo says one thing once: the training loop's step time is
    the report's (same figure, same definition, same name; it printed "median step 2.34 s"
    beside the report's 1.967 s), the parameter count has its unit (it printed "0 M params"
    for 199,232), and a plan that recomputes blocks to fit is bound by GPU memory (inspect
    said "does not bind: peak 75%")."""
    import re
    loop = re.findall(r"^step time (\S+ \S+): median of steps 2\.\.3 \(the first step is "
                      r"left out\)$", out, re.M)
    report = re.findall(r"^  step time\s+(\S+ \S+)\s+\S+ \S+$", out, re.M)
    assert len(loop) == 1 and report == loop, (loop, report)
    assert re.search(r"^  model .*  199K params  ", out, re.M), out[:600]
    if "recompute" in out.split("== plan inspect")[1].split("binding constraints")[0]:
        assert "  - GPU memory binds: " in out


def test_usage_commands_run_in_order(tmp_path):
    """The '## Use' and later blocks, each command in a scratch directory."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = _env()
    for block in _blocks(README)[1:]:
        for line in block:
            if line.startswith("from ") or "=" in line.split()[0]:
                continue  # a Python snippet, not a shell command
            argv = shlex.split(line)
            if argv[0] == "python":
                argv[0] = sys.executable
            r = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=600)
            # a rank's own error line can sit far above the launcher's traceback: keep it
            cause = "\n".join(x for x in r.stderr.splitlines()
                              if re.search(r"terminate|what\(\)|Error|error|Abort", x))[-1500:]
            assert r.returncode == 0, (f"{line}\n{r.stdout[-1500:]}\n{cause}\n"
                                       f"{r.stderr[-1500:]}")
    assert (tmp_path / "plans" / "gpt2-xl-36G.png").stat().st_size > 10_000


def test_runtime_snippet_runs(tmp_path, monkeypatch):
    """The README's Python snippet, with a model, loader and optimizer made for it."""
    import torch

    from planner.models import build_model, load_config, make_inputs
    snippet = re.findall(r"```python\n(.*?)```", README, flags=re.S)[0]
    plan_path = re.search(r'apply_plan\(model, "([^"]+)"', snippet).group(1)
    monkeypatch.chdir(tmp_path)
    env = _env()
    for argv in (["plan", "profile", "gpt-tiny", "--batch", "4", "--seq", "128", "--dtype",
                  "fp32", "-o", "p.json"],
                 ["plan", "solve", "p.json", "--gpu-mem", "12M", "--nvme-mem", "1G",
                  "-o", plan_path]):
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg)
    ns = {"model": model, "loader": [make_inputs(cfg, 4, 128)] * 2,
          "optimizer": torch.optim.AdamW(model.parameters())}
    exec(compile(snippet, "README.md", "exec"), ns)
    assert (tmp_path / "report.json").is_file()

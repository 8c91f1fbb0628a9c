"""``pip install .`` alone gives a working tierplan: the wheel carries the built-in hardware
specs and model configs (a wheel without them answered every verb with "--hardware
'cpu-host': no such spec"), and HiGHS, the default solver, is a dependency, not an extra."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_specs_and_requires_the_default_solver(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "-w", str(tmp_path), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = tmp_path.glob("tierplan-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    for kind in ("hardware", "models"):
        for f in (ROOT / "profiles" / kind).glob("*.yaml"):
            assert f"planner/specs/{kind}/{f.name}" in names, f
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert any(ln.split()[1].startswith("highspy") and "extra ==" not in ln for ln in requires)

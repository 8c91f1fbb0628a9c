"""tierplan planner: profile -> cost model -> MILP -> simulate -> plan file.

This package never imports ``runtime``. Modules that need torch (the profiler and
the model zoo) or pulp (the formulation and solvers) import them themselves, so that
``planner.formats``, ``planner.sizes`` and ``planner.blocks`` stay light enough for the
runtime to use.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "profiles"
if not (PROFILES_DIR / "hardware").is_dir():
    # installed from a wheel (``pip install .``): the shipped specs are inside the package
    PROFILES_DIR = Path(__file__).resolve().parent / "specs"
PLANS_DIR = ROOT / "plans"

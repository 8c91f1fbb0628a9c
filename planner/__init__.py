"""tierplan planner: profile -> cost model -> MILP -> simulate -> plan file.

This package never imports ``runtime``. Modules that need torch (the profiler and
the model zoo) or pulp (the formulation and solvers) import them themselves, so that
``planner.formats``, ``planner.sizes`` and ``planner.blocks`` stay light enough for the
runtime to use.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "profiles"
PLANS_DIR = ROOT / "plans"

"""Old plans are upgraded above the cost model: ``planner.formats`` reads only the current
schema and imports nothing of the planner above it; ``planner.plans.load`` reads both."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
V1 = ROOT / "tests" / "data" / "plan-v1-h200-mixed.json"
ABOVE = ("planner.plans", "planner.costmodel", "planner.solve", "planner.profile",
         "planner.cli", "planner.blocks", "runtime")


def _imports(path: Path):
    """Every module a file imports, at the top or inside a function."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_formats_imports_nothing_above_it_not_even_lazily():
    for path in sorted((ROOT / "planner" / "formats").glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(ABOVE)]
        assert not bad, f"{path.name} imports {bad}"


def test_importing_formats_loads_no_planner_layer_above_it():
    code = ("import sys, planner.formats, planner.formats.report; "
            f"print([m for m in sys.modules if m.startswith({ABOVE!r})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout.strip()
    assert out == "[]"


def test_formats_refuses_a_v1_plan_naming_the_loader_that_reads_it():
    from planner.formats import load_plan
    with pytest.raises(UserError, match=r"tierplan\.plan/1.*planner\.plans\.load_plan"):
        load_plan(V1)


def test_plans_load_reads_both_schemas(tmp_path):
    from planner.plans import save_plan
    from planner.plans.load import load_any, load_plan, plan_from_dict
    old = load_plan(V1)
    assert old.schema == "tierplan.plan/3" and old.solver.origin == "plan/1"
    assert plan_from_dict(json.loads(V1.read_text()), str(V1)) == old
    save_plan(old, tmp_path / "v2.json")
    assert load_any(tmp_path / "v2.json") == old == load_any(V1)


def test_apply_plan_reads_a_v1_plan_by_path():
    """The runtime loads a ``/1`` file through the upgrading loader: it gets as far as
    binding (this toy model is not the plan's), not a refusal of the schema."""
    torch = pytest.importorskip("torch")
    from runtime import apply_plan
    from runtime.binding import PlanMismatchError
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, str(V1))
    assert "schema" not in str(e.value)

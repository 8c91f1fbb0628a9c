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


def test_apply_plan_refuses_a_v1_plan_naming_plan_upgrade_which_makes_it_bindable(tmp_path):
    """The runtime reads the current schema only (it imports nothing of the planner but the
    formats): a ``/1`` file is refused in one line naming ``plan upgrade``; the upgraded file
    carries the executor section and gets as far as binding (this toy model is not the
    plan's)."""
    torch = pytest.importorskip("torch")
    from planner.cli import main
    from planner.formats import PLAN_SCHEMA, load_plan
    from runtime import apply_plan
    from runtime.binding import PlanMismatchError
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(UserError) as e:
        apply_plan(model, str(V1))
    assert "tierplan.plan/1" in str(e.value) and "'plan upgrade PLAN -o NEW'" in str(e.value)
    assert "\n" not in str(e.value)
    out = tmp_path / "v1-upgraded.json"
    assert main(["upgrade", str(V1), "-o", str(out)]) == 0
    new = load_plan(out)
    assert new.schema == PLAN_SCHEMA and new.executor is not None
    assert new.executor.grads_from_backward is True          # /1 plans are one pass per step
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, str(out))
    assert "schema" not in str(e.value) and "executor" not in str(e.value)


def test_a_plan_without_the_executor_section_is_refused_and_upgrade_writes_what_solve_does(
        tmp_path, make_plan_for):
    """The executor section is what apply_plan reads instead of a cost model: a plan written
    before it is refused in one line; ``plan upgrade`` recomputes it from the plan's own cost
    model, equal to what the planner wrote when it made the plan."""
    torch = pytest.importorskip("torch")
    import dataclasses
    from planner.cli import main
    from planner.formats import load_plan
    from planner.plans import save_plan
    from runtime import apply_plan
    from runtime.binding import PlanMismatchError
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                torch.nn.Linear(8, 8))
    plan = make_plan_for(model, "recompute-all", 2, 4)
    ex = plan.executor
    assert ex is not None and ex.grads_from_backward is True
    # fp32 8x8 weights + bias, and AdamW-sized optimizer state (2x) in conftest's units: 3x
    per = sum(p.numel() * p.element_size() for p in model.parameters())
    assert ex.static_device_bytes == 3 * per
    old = tmp_path / "old.json"
    save_plan(dataclasses.replace(plan, executor=None), old)
    assert "executor" not in json.loads(old.read_text())
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, str(old))
    assert str(e.value) == (f"{old} has no executor section (written before this version); "
                            "write it with 'plan upgrade PLAN -o NEW', or solve again")
    new = tmp_path / "new.json"
    assert main(["upgrade", str(old), "-o", str(new)]) == 0
    assert load_plan(new).executor == ex
    apply_plan(model, str(new)).remove()

"""The planner's structure as docs/architecture.md draws it, checked against the code.

- **Units.** The planner is made of units: its sub-packages (``planner.formats``,
  ``planner.costmodel``, ...) and its few top-level modules (``planner.errors``, ...). Every unit
  has a row in the document's unit table, and the row lists what the unit imports: other units,
  ``runtime`` never, third-party packages by name. Imports inside functions ("lazy") are listed
  after a ``;``. The table and the code must agree both ways.
- **Modules.** Every module of the planner is named in the document (the per-unit module lists).
- **Layers.** Units sit on numbered layers; a unit imports only units on lower layers, so the
  unit graph has no cycle, and neither has the module graph (lazy imports included: a lazy
  import that dodges a cycle is still a cycle).
- **Sizes.** No planner module over 600 lines, no function over 80 (nested functions count
  inside the function that holds them); the exceptions are named below with their reasons.
- **The runtime** imports from the planner only ``planner.formats`` (its package or modules):
  the plan is the runtime's only input from the planner (DESIGN.md), and never pulp or highspy.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

# (module, function) -> why it stays longer than MAX_FUNCTION_LINES
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}
# module -> why it stays longer than MAX_MODULE_LINES
LONG_MODULES: dict[str, str] = {}

# The layers: a unit may import units of lower layers only (docs/architecture.md, "Layers").
LAYERS = {
    "planner": 0, "planner.errors": 0, "planner.sizes": 1,
    "planner.formats": 2,
    "planner.hardware": 3,
    "planner.blocks": 4, "planner.models": 4, "planner.costmodel": 4,
    "planner.profile": 5, "planner.plans": 5,
    "planner.solve": 6,
    "planner.cli": 7,
}


def _modules(pkg: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``pkg``."""
    out = {}
    for p in sorted((ROOT / pkg).rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


PLANNER = _modules("planner")
RUNTIME = _modules("runtime")
ALL = {**PLANNER, **RUNTIME}


def unit_of(mod: str) -> str:
    """The unit a planner module belongs to: ``planner.costmodel.layout`` -> ``planner.costmodel``."""
    parts = mod.split(".")
    if parts[0] == "runtime":
        return "runtime"
    if len(parts) == 1:
        return "planner"
    return ".".join(parts[:2])


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """What an import statement loads, as dotted names: project modules (the most specific one
    that exists) and third-party top-level packages; the standard library left out."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        pairs = [(n, None) for n in names]
    else:
        base = node.module or ""
        if node.level:
            pkg = importer.split(".")
            if not ALL[importer].name == "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        pairs = [(base, a.name) for a in node.names]
    out = []
    for base, name in pairs:
        head = base.split(".")[0]
        if head in STDLIB:
            continue
        if head not in ("planner", "runtime"):
            out.append(head)
            continue
        full = f"{base}.{name}" if name else base
        mod = full if full in ALL else base
        while mod not in ALL:
            mod = mod.rsplit(".", 1)[0]
        out.append(mod)
    return out


def _imports(mod: str) -> tuple[set[str], set[str]]:
    """(at the top level, inside functions) of module ``mod``; TYPE_CHECKING blocks left out."""
    top, lazy = set(), set()

    def visit(node, depth):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (lazy if depth else top).update(_resolve(mod, child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, depth + 1)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, depth)
    visit(ast.parse(ALL[mod].read_text()), 0)
    return top, lazy - top


IMPORTS = {m: _imports(m) for m in ALL}


def _doc_units() -> dict[str, tuple[set[str], set[str]]]:
    """The unit table (layer | unit | owns | imports): unit -> (listed top-level imports, listed
    lazy imports)."""
    out = {}
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not re.fullmatch(r"`[\w.]+`", cells[1]):
            continue
        unit = cells[1].strip("`")
        col = cells[3].replace("—", "")
        eager, _, lazy = col.partition(";")
        names = lambda s: {w.strip().strip("`") for w in s.split(",") if w.strip()}  # noqa: E731
        out[unit] = (names(eager), names(lazy))
    return out


DOC_UNITS = _doc_units()


def _unit_imports(unit: str) -> tuple[set[str], set[str]]:
    """What a unit's modules import from other units and third-party packages."""
    top, lazy = set(), set()
    for m in ALL:
        if unit_of(m) != unit:
            continue
        t, z = IMPORTS[m]
        top |= {unit_of(x) if x.split(".")[0] in ("planner", "runtime") else x for x in t}
        lazy |= {unit_of(x) if x.split(".")[0] in ("planner", "runtime") else x for x in z}
    top.discard(unit)
    lazy.discard(unit)
    return top, lazy - top


UNITS = sorted({unit_of(m) for m in ALL})


def test_every_unit_has_a_row_and_every_row_a_unit():
    assert set(DOC_UNITS) == set(UNITS), (
        f"units without a row in docs/architecture.md: {sorted(set(UNITS) - set(DOC_UNITS))}; "
        f"rows naming no unit: {sorted(set(DOC_UNITS) - set(UNITS))}")


@pytest.mark.parametrize("unit", UNITS)
def test_each_units_row_lists_its_real_imports(unit):
    top, lazy = _unit_imports(unit)
    eager_doc, lazy_doc = DOC_UNITS.get(unit, (set(), set()))
    assert top == eager_doc, (f"{unit} imports {sorted(top)} at the top; docs/architecture.md "
                              f"lists {sorted(eager_doc)}")
    assert lazy == lazy_doc, (f"{unit} imports {sorted(lazy)} lazily; docs/architecture.md "
                              f"lists {sorted(lazy_doc)}")


def test_every_module_is_named_in_the_document():
    named = set(re.findall(r"`((?:planner|runtime)/[\w/]+\.py)`", DOC))
    real = {str(p.relative_to(ROOT)) for p in ALL.values()}
    assert real - named == set(), f"modules docs/architecture.md does not name: {sorted(real - named)}"
    assert named - real == set(), f"docs/architecture.md names missing modules: {sorted(named - real)}"


def _layer_violations(layers: dict[str, int]) -> list[str]:
    out = []
    for unit in layers:
        top, lazy = _unit_imports(unit)
        out += [f"{unit} (layer {layers[unit]}) imports {dep} (layer {layers[dep]})"
                for dep in sorted(top | lazy) if dep.startswith("planner") and
                layers[dep] >= layers[unit]]
    return out


def test_units_import_only_lower_layers():
    assert set(LAYERS) == {u for u in UNITS if u != "runtime"}, "a unit without a layer"
    assert not _layer_violations(LAYERS)


def _cycles(extra_edges=()) -> list[list[str]]:
    g = nx.DiGraph(list(extra_edges))
    for m, (top, lazy) in IMPORTS.items():
        for dep in top | lazy:
            if dep in ALL and dep != m:
                g.add_edge(m, dep)
                # importing a.b.c runs a.b's __init__ first, unless a.b holds the importer
                pkg = dep.rsplit(".", 1)[0]
                if pkg in ALL and pkg != dep and not m.startswith(pkg + ".") and pkg != m:
                    g.add_edge(m, pkg)
    return list(nx.simple_cycles(g))


def test_no_import_cycle_between_modules():
    cycles = _cycles()
    assert not cycles, f"import cycles: {cycles[:5]}"


def _runtime_violations(imports=IMPORTS) -> list[str]:
    """Runtime modules importing a planner module outside ``planner.formats`` (at the top or
    lazily), or a solver."""
    out = []
    for m in RUNTIME:
        top, lazy = imports[m]
        out += [f"{m} imports {x}" for x in sorted(top | lazy)
                if (x.startswith("planner") and unit_of(x) != "planner.formats")
                or x in ("pulp", "highspy")]
    return out


def test_the_planner_never_imports_the_runtime_and_the_runtime_only_the_formats():
    for m in PLANNER:
        top, lazy = IMPORTS[m]
        assert not {x for x in top | lazy if x.startswith("runtime")}, f"{m} imports runtime"
    assert not _runtime_violations()


def _function_lengths(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_planner_module_is_too_long():
    long = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PLANNER.values()}
    over = {m: n for m, n in long.items() if n > MAX_MODULE_LINES and m not in LONG_MODULES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"
    stale = {m for m in LONG_MODULES if long.get(m, 0) <= MAX_MODULE_LINES}
    assert not stale, f"LONG_MODULES names modules that are no longer long: {stale}"


def test_no_planner_function_is_too_long():
    over, seen = {}, set()
    for p in PLANNER.values():
        rel = str(p.relative_to(ROOT))
        for name, n in _function_lengths(p):
            if n > MAX_FUNCTION_LINES:
                seen.add((rel, name))
                if (rel, name) not in LONG_FUNCTIONS:
                    over[f"{rel}:{name}"] = n
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"
    stale = set(LONG_FUNCTIONS) - seen
    assert not stale, f"LONG_FUNCTIONS names functions that are no longer long: {stale}"


def test_the_checks_can_fail():
    """Each check sees what it claims to: a real lazy and a real eager import, a layer broken on
    purpose, a cycle added on purpose, a long function measured."""
    top, lazy = _unit_imports("planner.cli")
    assert "planner.solve" in top and "planner.profile" in lazy
    assert _layer_violations({**LAYERS, "planner.formats": LAYERS["planner.cli"]})
    assert _cycles([("planner.formats.plan", "planner.plans.upgrade")])
    # the runtime rule sees a real formats import, and fails on a lazy import of the cost
    # model or the error module added on purpose
    assert "planner.formats.events" in IMPORTS["runtime.stages"][0]
    for extra in ("planner.costmodel", "planner.errors", "planner.plans.simulate"):
        broken = {**IMPORTS, "runtime.apply": (IMPORTS["runtime.apply"][0],
                                               IMPORTS["runtime.apply"][1] | {extra})}
        assert _runtime_violations(broken) == [f"runtime.apply imports {extra}"]
    lengths = dict(_function_lengths(ROOT / "tests" / "test_architecture.py"))
    assert lengths["test_the_checks_can_fail"] > 5

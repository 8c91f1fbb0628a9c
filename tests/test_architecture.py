"""docs/architecture.md's module table against the real imports, and the layering rules.

For every row that names one module, what the module imports at its top level (project modules
and third-party packages; the standard library left out) must be listed before the ``;`` of the
imports column, and what it imports inside functions must be listed somewhere in that column.
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _rows() -> list[tuple[str, set[str], set[str]]]:
    """(module path, names listed as top-level imports, every name listed) per one-module row."""
    out = []
    for line in DOC.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        mods = re.findall(r"`([\w/]+\.py)`", cells[0])
        if len(mods) != 1 or "modules" in cells[2]:
            continue                      # several modules in a row: described together
        col = re.sub(r"\([^)]*\)", "", cells[2].replace("—", ""))
        eager, _, lazy = col.partition(";")
        names = lambda s: {w.strip() for w in s.split(",") if w.strip()}   # noqa: E731
        out.append((mods[0], names(eager), names(eager) | names(lazy)))
    return out


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(top-level, inside functions) imports of ``path``, named as the table names them
    (``costmodel`` in planner's rows, ``runtime.files`` and ``planner.errors`` in runtime's)."""
    pkg = path.parent.name                       # planner or runtime
    tree = ast.parse(path.read_text())
    top, inner = set(), set()

    def name(node) -> list[str]:
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif node.level:                                        # from .x import y
            if node.module:
                mods = [f"{pkg}.{node.module.split('.')[0]}"]
            else:                                               # from . import a, b
                mods = [f"{pkg}.{a.name}" for a in node.names]
        else:
            mods = [node.module]
        out = []
        for m in mods:
            head = m.split(".")[0]
            if head in STDLIB:
                continue
            if head in ("planner", "runtime"):
                parts = m.split(".")
                sub = parts[1] if len(parts) > 1 else None
                if sub is not None and not (ROOT / head / f"{sub}.py").exists():
                    sub = None                                  # from planner import NAME
                if head == pkg == "planner":
                    out.append(sub or head)       # planner's rows name planner modules short
                else:
                    out.append(f"{head}.{sub}" if sub else head)
            else:
                out.append(head)
        return out

    def visit(node, depth):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (inner if depth else top).update(name(child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, depth + 1)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            else:
                visit(child, depth)
    visit(tree, 0)
    me = {path.stem, f"{pkg}.{path.stem}"} if path.stem != "__init__" else {pkg}
    return top - me, inner - top - me


ROWS = _rows()


def test_the_table_covers_every_module():
    listed = set(re.findall(r"`((?:planner|runtime)/\w+\.py)`", DOC))
    real = {f"{p.parent.name}/{p.name}" for d in ("planner", "runtime")
            for p in (ROOT / d).glob("*.py")}
    assert real - listed == set(), f"modules missing from docs/architecture.md: {real - listed}"
    assert listed - real == set(), f"docs/architecture.md names modules that do not exist: {listed - real}"
    assert len(ROWS) > 20


@pytest.mark.parametrize("mod,eager,every", ROWS, ids=[r[0] for r in ROWS])
def test_each_rows_imports_are_the_real_ones(mod, eager, every):
    top, inner = _imports(ROOT / mod)
    assert top <= eager, f"{mod} imports {sorted(top - eager)} at the top; the table does not say so"
    assert inner <= every, f"{mod} imports {sorted(inner - every)} lazily; the table does not say so"
    stale = every - top - inner
    assert not stale, f"the table lists {sorted(stale)} for {mod}, which does not import them"


def test_planner_never_imports_runtime_and_runtime_never_imports_pulp():
    for pkg, banned in (("planner", "runtime"), ("runtime", "pulp")):
        for p in (ROOT / pkg).glob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Import):
                    heads = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    heads = [node.module.split(".")[0]]
                else:
                    continue
                assert banned not in heads, f"{p.relative_to(ROOT)} imports {banned}"

"""``python bench/plans_compare.py A B``: the plan files of two snapshots (bench/plans_snapshot.sh),
byte for byte, then as JSON without what differs between any two runs (the solve's wall time,
the temporary NVMe folder and profile path). A plan that still differs is printed with its step
and how its solve ended, so a time-limited solve (status ``feasible``) can be told from a change.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _normal(d: dict) -> dict:
    d = dict(d)
    d.pop("nvme_dir", None)
    if isinstance(d.get("solver"), dict):
        d["solver"] = {k: v for k, v in d["solver"].items() if k != "solve_s"}
    if isinstance(d.get("profile"), dict):
        d["profile"] = {k: v for k, v in d["profile"].items() if k != "path"}
    return d


def _ended(d: dict) -> str:
    s = d.get("solver") or {}
    gap = s.get("gap")
    return f"{s.get('origin')}/{s.get('status')}" + ("" if gap is None else f" gap {gap:.2%}")


def main(argv: list[str]) -> int:
    a_dir, b_dir = map(Path, argv)
    same = differ = 0
    for a in sorted(a_dir.rglob("*.json")):
        rel = a.relative_to(a_dir)
        b = b_dir / rel
        if not b.exists():
            print(f"only in {a_dir}: {rel}")
            differ += 1
            continue
        da, db = json.loads(a.read_text()), json.loads(b.read_text())
        if a.read_bytes() == b.read_bytes() or _normal(da) == _normal(db):
            same += 1
            continue
        differ += 1
        sa, sb = da["predicted"]["step_s"], db["predicted"]["step_s"]
        print(f"differs: {rel}: step {sa:.9g} s -> {sb:.9g} s ({sb / sa - 1:+.3%}); "
              f"{_ended(da)} -> {_ended(db)}")
    for b in sorted(b_dir.rglob("*.json")):
        if not (a_dir / b.relative_to(b_dir)).exists():
            print(f"only in {b_dir}: {b.relative_to(b_dir)}")
            differ += 1
    print(f"{same} the same, {differ} different")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

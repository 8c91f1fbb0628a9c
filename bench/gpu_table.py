"""The one table of a ``bench/gpu.sh`` run, from what it wrote under its work directory.

    python bench/gpu_table.py WORK_DIR

Rows: the tests (passed/failed/skipped as pytest summed them), each layer-streaming row of
``streaming.json`` (bench/streaming.py --json: model, family, the schedule the plan has,
largest weight difference against plain PyTorch, device peak measured/predicted, step time
measured/predicted, files left) and each activation plan's report (``TAG-report.json``: step
and peak measured/predicted, beside the plain run's step from ``TAG-plain.log``); then every
stage whose exit status was not 0. A missing file is a row that says so, not an error: the
table is written whatever stage failed.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

MiB = 2 ** 20


def _tests(w: Path) -> list[str]:
    out = []
    for name in ("tests-cuda.log", "tests-transfer.log"):
        p = w / name
        if not p.is_file():
            out.append(f"| tests | {name} | not run | | | |")
            continue
        tail = [ln for ln in p.read_text().splitlines() if re.search(r"passed|failed|skipped|error|deselected|no tests ran", ln)]
        out.append(f"| tests | {name} | {tail[-1].strip('= ') if tail else 'no summary'} | | | |")
    return out


def _streaming(w: Path) -> list[str]:
    p = w / "streaming.json"
    if not p.is_file():
        return ["| streaming | - | streaming.json missing (the stage failed or timed out) | | | |"]
    out = []
    for r in json.loads(p.read_text()):
        what = f"{r['name']} {r['family']}"
        if "no_fit" in r:
            out.append(f"| streaming | {what} | no plan: {r['no_fit'].splitlines()[-1]} | | | |")
            continue
        resident = r["predicted_peak"] - r["predicted_rise"]
        peak = resident + r["peak_rise"]
        out.append(
            f"| streaming | {what} ({r['sched']}, {r['units_off']}/{r['units']} units off) | "
            f"diff {r['max_diff']:.1e} | {peak / MiB:.1f} / {r['predicted_peak'] / MiB:.1f} MiB "
            f"({peak / r['predicted_peak'] - 1:+.1%}) | {r['step_s'] * 1e3:.1f} / "
            f"{r['predicted_step_s'] * 1e3:.1f} ms ({r['step_s'] / r['predicted_step_s'] - 1:+.1%}) "
            f"| files left {len(r['files_left'])} |")
    return out


def _activation_plans(w: Path) -> list[str]:
    out = []
    for rep in sorted(w.glob("*-report.json")):
        tag = rep.name[:-len("-report.json")]
        r = json.loads(rep.read_text())
        steps = r["steps"][1:] or r["steps"]
        step = statistics.median(s["step_s"] for s in steps)
        peak = statistics.median(s["peak_gpu_bytes"] for s in steps)
        pred = r["predicted"]
        plain = "?"
        log = w / f"{tag}-plain.log"
        if log.is_file():
            m = re.search(r"step time ([\d.]+ \w+)", log.read_text())
            plain = m.group(1) if m else "?"
        out.append(f"| activations | {tag} (plain step {plain}) | | "
                   f"rise {peak / MiB:.1f} / {r['predicted_gpu_rise_bytes'] / MiB:.1f} MiB | "
                   f"{step * 1e3:.1f} / {pred['step_s'] * 1e3:.1f} ms "
                   f"({step / pred['step_s'] - 1:+.1%}) | |")
    return out or ["| activations | - | no report written | | | |"]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python bench/gpu_table.py WORK_DIR (the directory bench/gpu.sh wrote)",
              file=sys.stderr)
        return 2
    w = Path(argv[0])
    head = (w / "gpu.txt").read_text().strip().replace("\n", "; ") if (w / "gpu.txt").is_file() \
        else "device unknown"
    print(f"bench/gpu.sh on {head}\n")
    print("| part | case | result | memory measured / predicted | step measured / predicted | files |")
    print("|---|---|---|---|---|---|")
    for row in _tests(w) + _streaming(w) + _activation_plans(w):
        print(row)
    failed = []
    if (w / "stages.tsv").is_file():
        for ln in (w / "stages.tsv").read_text().splitlines():
            name, _, rc = ln.rpartition("\t")
            if rc not in ("0", ""):
                failed.append(f"{name} (rc {rc})")
    print("\nstages not at rc 0: " + ("; ".join(failed) if failed else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The adversarial pass: thousands of generated ``plan`` invocations, tallied.

Every verb gets its share of cases from ``tests/fuzzcases.py`` (Hypothesis strategies over
mutated arguments and mutated profile, plan, report, hardware and model files, plus FIFOs,
devices, directories, link loops, huge and over-long names), each run through the CLI's real
entry point in a forked child with a deadline, and judged: tracebacks, hangs, invalid inputs
accepted with exit 0, refusals that are not one line, clobbered files, temporaries left. Two
more targets call ``apply_plan`` itself in the child: ``apply`` (edited streaming plans with
homes) and ``checkpoint`` (hostile safetensors checkpoints for a meta-device model); an
accepted case there must also be right (a step equal to plain PyTorch's, every weight the
file's, no file left behind).

    .venv/bin/python bench/fuzz.py                    # 13,800 cases (docs/reliability.md)
    .venv/bin/python bench/fuzz.py --scale 0.05       # a quick look
    .venv/bin/python bench/fuzz.py --verb solve --n 500 --seed 7
    .venv/bin/python bench/fuzz.py --counts checkpoint=2000,apply=2000

It prints one row per verb and writes the tally and every problem (with its command line) as
JSON (``--out``). Exit code 1 when anything went wrong.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not bench/ itself: bench/profile.py would shadow the standard library's profile module
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# Invocations per verb at --scale 1: 10,800 in all. profile and hardware cost seconds each
# when they run in full (torch, disk probes), so they get fewer; every verb's refusals are
# cheap.
# apply and checkpoint are apply_plan itself, with mutated streaming plans and mutated
# safetensors checkpoints (tests/fuzzcases.py, "the runtime's inputs").
PLAN_N = {"simulate": 2400, "inspect": 2400, "diff": 2000, "solve": 2400, "profile": 1000,
          "hardware": 600, "apply": 1500, "checkpoint": 1500}
CATEGORIES = ("traceback", "hang", "accepted invalid", "not one line", "exit code", "crash",
              "clobbered", "left behind", "folder created too deep", "wrong result",
              "refused valid")


def run_verb(verb: str, n: int, seed: int, work: Path, seeds) -> dict:
    """``n`` Hypothesis examples of ``verb``; the tally and the problems."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    import fuzzcases as fc

    tally = collections.Counter()
    problems = []
    counter = [0]

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=fc.STRATEGIES[verb](seeds))
    def one(case):
        counter[0] += 1
        folder = work / f"{verb}-{counter[0]}"
        out, probs = fc.run_and_judge(case, folder)
        tally["invocations"] += 1
        tally["invalid cases"] += bool(case.invalid)
        tally[f"exit {out.rc}" if not out.hung else "hung"] += 1
        tally["seconds"] += out.seconds
        seen = set()
        for p in probs:
            cat = p.split(":")[0]
            if cat not in seen:
                tally[cat] += 1
                seen.add(cat)
            problems.append({"verb": verb, "problem": p, "case": case.describe(),
                             "stderr": out.stderr[-800:]})
        shutil.rmtree(folder, ignore_errors=True)
        for ext in (".out", ".err"):
            (work / f"{folder.name}{ext}").unlink(missing_ok=True)

    one()
    return {"tally": dict(tally), "problems": problems}


def _preimport() -> None:
    """Everything a verb imports, once, before the forks (so that a case costs its work)."""
    import highspy  # noqa: F401
    import pulp  # noqa: F401
    import torch  # noqa: F401
    import yaml  # noqa: F401

    import planner.cli.diff  # noqa: F401
    import planner.cli.inspect  # noqa: F401
    import planner.hardware.measure  # noqa: F401
    import planner.profile  # noqa: F401
    import planner.formats.report  # noqa: F401
    import planner.plans.simulate  # noqa: F401
    import planner.solve  # noqa: F401
    import fuzzcases
    fuzzcases.preimport_runtime()
    try:
        import matplotlib  # noqa: F401
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def worker(args) -> None:
    """One process: the verbs and counts it was given, results as JSON on stdout."""
    import fuzzcases as fc
    _preimport()
    work = Path(tempfile.mkdtemp(prefix="tierplan-fuzz-"))
    try:
        seeds = fc.Seeds(work / "seeds")
        out = {}
        for item in args.jobs_spec.split(","):
            verb, n, seed = item.split(":")
            out[verb] = run_verb(verb, int(n), int(seed), work, seeds)
        print(json.dumps(out))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the default counts")
    ap.add_argument("--verb", choices=list(PLAN_N), default=None, help="one verb only")
    ap.add_argument("--n", type=int, default=None, help="invocations (with --verb)")
    ap.add_argument("--counts", default=None,
                    help="invocations per verb, e.g. simulate=3000,apply=1000 (others 0)")
    ap.add_argument("--seed", type=int, default=20251130, help="Hypothesis seed (per verb: +k)")
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                    help="worker processes (default: the cores, at most 4)")
    ap.add_argument("--out", default=None, help="write the tally and problems here (JSON)")
    ap.add_argument("--jobs-spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.jobs_spec:
        worker(args)
        return 0

    counts = {v: max(1, round(n * args.scale)) for v, n in PLAN_N.items()}
    if args.verb:
        counts = {args.verb: args.n or counts[args.verb]}
    if args.counts:
        counts = {v: int(n) for v, n in (kv.split("=") for kv in args.counts.split(","))}
        unknown = set(counts) - set(PLAN_N)
        if unknown:
            ap.error(f"--counts: no verb {sorted(unknown)[0]!r}; the verbs: {', '.join(PLAN_N)}")
    # split each verb's count into chunks, dealt to the workers round robin
    chunks = []
    for k, (verb, n) in enumerate(counts.items()):
        parts = max(1, min(args.jobs, n // 50 or 1))
        for j in range(parts):
            share = n // parts + (1 if j < n % parts else 0)
            chunks.append((verb, share, args.seed + 1000 * k + j))
    specs = [[] for _ in range(args.jobs)]
    for i, c in enumerate(sorted(chunks, key=lambda c: -c[1])):
        specs[i % args.jobs].append(c)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, __file__, "--jobs-spec",
                               ",".join(f"{v}:{n}:{s}" for v, n, s in spec)],
                              stdout=subprocess.PIPE, env=env, text=True)
             for spec in specs if spec]
    results = collections.defaultdict(lambda: {"tally": collections.Counter(), "problems": []})
    failed = False
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            print(f"fuzz: a worker failed with exit {p.returncode}", file=sys.stderr)
            failed = True
            continue
        for verb, r in json.loads(out).items():
            results[verb]["tally"].update(r["tally"])
            results[verb]["problems"] += r["problems"]
    wall = time.perf_counter() - t0

    cols = ("invocations", "invalid cases", "exit 0", "exit 2", "exit 3") + CATEGORIES
    print(f"{'verb':<9}" + "".join(f"{c:>10}" if len(c) < 10 else f" {c}" for c in cols))
    total = collections.Counter()
    for verb in counts:
        t = results[verb]["tally"]
        total.update(t)
        print(f"{verb:<9}" + "".join(f"{int(t.get(c, 0)):>10}" if len(c) < 10 else
                                     f" {int(t.get(c, 0)):>{len(c)}}" for c in cols))
    print(f"{'total':<9}" + "".join(f"{int(total.get(c, 0)):>10}" if len(c) < 10 else
                                   f" {int(total.get(c, 0)):>{len(c)}}" for c in cols))
    print(f"wall {wall:.0f} s with {len(procs)} worker(s); seed {args.seed}")
    bad = sum(total.get(c, 0) for c in CATEGORIES)
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"seed": args.seed, "wall_s": wall, "jobs": len(procs),
             "tally": {v: dict(results[v]["tally"]) for v in counts},
             "problems": [p for v in counts for p in results[v]["problems"]]},
            indent=1, sort_keys=True))
    for v in counts:
        for p in results[v]["problems"][:5]:
            print(f"  {v}: {p['problem']}\n      {p['case'][:300]}\n      "
                  f"{p['stderr'].strip().splitlines()[-1:] if p['stderr'].strip() else ''}")
    return 1 if (bad or failed) else 0


if __name__ == "__main__":
    sys.exit(main())

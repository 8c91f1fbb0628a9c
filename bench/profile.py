"""Wall time and peak RSS of `plan profile` on meta for large built-in models.

Each model is profiled in its own subprocess (`python -m planner.cli profile ...`), so the
peak resident set of one does not hide another's; RSS is the child's ru_maxrss.

    python bench/profile.py [--hardware a100-80g]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

CASES = [("gpt2-small", 8, 1024), ("gpt2-xl", 8, 1024), ("llama3-70b", 1, 8192),
         ("gpt3-175b", 1, 2048)]


def run(model, batch, seq, hardware, out_dir):
    out = os.path.join(out_dir, f"{model}.json")
    argv = [sys.executable, "-c",
            "import resource, sys; from planner.cli import main; rc = main(sys.argv[1:]); "
            "print('RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
            "sys.exit(rc)",
            "profile", model, "--batch", str(batch), "--seq", str(seq), "--dtype", "bf16",
            "--device", "meta", "--hardware", hardware, "-o", out]
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return wall, None, r.stderr.strip().splitlines()[-1]
    rss = int(next(line.split()[1] for line in r.stderr.splitlines() if line.startswith("RSS_KIB")))
    blocks = next(line for line in r.stdout.splitlines() if line.startswith("blocks:"))
    return wall, rss * 1024, blocks.split(" at ")[0].replace("blocks: ", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="a100-80g")
    args = ap.parse_args()
    print(f"{'model':<12} {'batch':>5} {'seq':>5} {'blocks':>6} {'wall s':>7} {'peak RSS':>10}")
    with tempfile.TemporaryDirectory() as d:
        for model, batch, seq in CASES:
            wall, rss, blocks = run(model, batch, seq, args.hardware, d)
            rss_s = f"{rss / 2**20:.0f} MiB" if rss else "failed"
            print(f"{model:<12} {batch:>5} {seq:>5} {blocks:>6} {wall:>7.2f} {rss_s:>10}")


if __name__ == "__main__":
    main()

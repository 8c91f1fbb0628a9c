"""``python -m planner.solve.budget PROFILE --fraction F``: a GPU budget for experiments.

Prints, in bytes, the static state + the embedding's and head's saved bytes + the largest
workspace + the shared tensors + the fraction F of the blocks' saved bytes + the reserve of the
profile's hardware spec (``reserved_bytes``, which every budget keeps free): the budget the
benchmarks and the demo use to ask "what if only F of the blocks' activations fit?".
"""
from __future__ import annotations

import argparse
import sys

from planner.errors import UserError
from planner.formats import Profile, load_profile


def fraction_budget(profile: Profile, fraction: float) -> int:
    blocks = [u for u in profile.layers if u.kind == "block"]
    others = [u for u in profile.layers if u.kind != "block"]
    shared = max((u.shared_saved_bytes for u in profile.layers), default=0)
    return int(profile.static_bytes
               + sum(u.saved_bytes for u in others)
               + max(u.workspace_bytes for u in profile.layers)
               + shared
               + fraction * sum(u.activation_bytes for u in blocks)
               + int((profile.hardware or {}).get("reserved_bytes") or 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m planner.solve.budget", description=__doc__)
    ap.add_argument("profile")
    ap.add_argument("--fraction", type=float, default=0.5)
    args = ap.parse_args(argv)
    try:
        if not 0 <= args.fraction <= 1:
            raise UserError(f"--fraction {args.fraction}: give a number between 0 and 1")
        print(fraction_budget(load_profile(args.profile), args.fraction))
    except UserError as e:
        print(f"planner.solve.budget: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``plan profile``: the verb's face: checks its arguments, profiles, prints the summary and
warnings, and writes the profile (``cli_profile``; ``default_output``).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

from planner.errors import UserError
from planner.formats import Profile, write_json_atomic
from planner.hardware import load_hardware
from planner.profile.load import MAX_TOKENS, _positive_int
from planner.profile.run import WARNING_PREFIX, profile_model
from planner.sizes import fmt_bytes


def default_output(profile: Profile) -> Path:
    """``profiles/<name>-b<B>-s<S>.json`` under the current directory, like any CLI output."""
    m = profile.model
    name = str(m["name"]).replace("/", "_").replace(":", "_")
    return Path("profiles") / f"{name}-b{m['batch']}-s{m['seq']}.json"


def cli_profile(args) -> int:
    """``plan profile``: profile MODEL at one shape, print the summary and warnings, write the
    profile (exit 0; a bad input raises ``UserError``)."""
    batch = _positive_int(args.batch, "batch")
    seq = _positive_int(args.seq, "seq")
    if batch * seq > MAX_TOKENS:
        raise UserError(f"--batch {batch} x --seq {seq} = {batch * seq:,} tokens a pass: at most "
                        f"{MAX_TOKENS:,}")
    if args.output and Path(args.output).is_dir():   # say so before a long profile, not after
        raise UserError(f"output '{args.output}' is a directory; give a file name")
    hardware = load_hardware(args.hardware)
    progress = None
    if sys.stderr.isatty():
        def progress(i, n, what):
            print(f"\rprofiling {i + 1}/{n}: {what:<40}", end="", file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=WARNING_PREFIX)
        prof = profile_model(args.model, batch, seq, dtype=args.dtype, device=args.device,
                             hardware=hardware, optimizer=args.optimizer,
                             blocks_path=args.blocks, repeats=getattr(args, "repeats", 5),
                             progress=progress, timing=getattr(args, "timing", None) or "auto",
                             compute_threads=getattr(args, "compute_threads", None))
    if progress:
        print(file=sys.stderr)
    m = prof.model
    blocks = [u for u in prof.layers if u.kind == "block"]
    where = m["blocks_path"] or "the top level"
    print(f"blocks: {len(blocks)} in '{where}' ({blocks[0].name} .. {blocks[-1].name}), "
          f"{m['unique_blocks']} profiled, the rest reused")
    print(f"attention kernel assumed: {m['attention']} (target {prof.hardware['name']})")
    print(f"parameters: {m['param_count']:,}; static state {fmt_bytes(prof.static_bytes)} "
          f"({m['bytes_per_param']} B/param, {m['optimizer']}); saved activations "
          f"{fmt_bytes(sum(u.saved_bytes for u in prof.layers))}")
    if m.get("state_bytes"):
        print(f"note: the blocks fill a key/value cache of {fmt_bytes(m['state_bytes'])} "
              "(use_cache is on), held until the model's output is dropped; plans count it "
              "for the whole step. Set model.config.use_cache = False to train without it",
              file=sys.stderr)
    for w in m.get("warnings") or ():
        print(f"plan: warning: {w}", file=sys.stderr)
    quality = m.get("timing_quality")
    if quality:
        load = quality["other_load_cpus"]
        print(f"timing: median of {min(quality['samples'].values())}-"
              f"{max(quality['samples'].values())} repeats per unit, widest spread "
              f"{max(max(v) for v in quality['spread'].values()):.0%}"
              + ("" if load is None else f", other processes {load:.2f} CPUs")
              + (f", {m['compute_threads']} compute thread(s)" if m.get("compute_threads")
                 else ""))
        for w in quality["warnings"]:
            print(f"plan: warning: timings unreliable: {w}", file=sys.stderr)
    out = Path(args.output) if args.output else default_output(prof)
    write_json_atomic(out, prof.to_dict())
    print(out)
    return 0

"""The ``plan`` command: profile, solve, sweep, search, calibrate, simulate, upgrade, inspect,
diff, hardware.

Each verb's work lives in its own module (imported only when that verb runs, so ``plan
inspect`` never pays for importing torch). This file only parses arguments and turns a
``UserError`` into one line on stderr and the documented exit code:
0 done, 2 bad input, 3 no plan fits the budgets (or none was found within --time-limit),
130 interrupted (SIGINT), 143 terminated (SIGTERM; 129 for SIGHUP): both unwind the same way,
so temporary files are removed and solver processes ended.

Modules here: ``inspect`` (``plan inspect``), ``diff`` (``plan diff``), ``plot`` (``--plot``),
``table`` (the per-unit table they share), ``sweep`` (``plan sweep``: solves along one
budget axis), ``search`` (``plan search``: micro-batch size and K at fixed tokens per step), ``__main__`` (``python -m planner.cli``). The other
verbs run in their stage's package: ``planner.profile`` (profile), ``planner.profile.calibrate``
(calibrate), ``planner.solve`` (solve),
``planner.plans.simulate`` (simulate, upgrade) and ``planner.hardware.measure`` (hardware).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import signal
import sys
import threading
from pathlib import Path

from planner.errors import CAUGHT_SIGNALS, UserError

EPILOG = {
    "profile": "example: plan profile gpt2-small --batch 8 --seq 1024 --device meta --hardware a100-80g",
    "solve": "example: plan solve profiles/gpt2-xl-b8-s1024.json --gpu-mem 36G --cpu-mem 512G --hardware a100-80g",
    "simulate": "example: plan simulate plans/gpt2-xl-b8-s1024-36G.json --json",
    "upgrade": "example: plan upgrade plans/old.json -o plans/old-upgraded.json\n(a "
               "tierplan.plan/1 plan, or one without the executor section apply_plan needs, "
               "written as today's; simulator-checked first)",
    "inspect": "example: plan inspect plans/gpt2-xl-b8-s1024-36G.json --plot plan.png",
    "diff": "example: plan diff plans/a-80G.json plans/a-36G.json",
    "sweep": "example: plan sweep profiles/gpt2-xl-b8-s1024.json --gpu-mem 30G:80G:5G --plot "
             "sweep.png\n(one budget is A:B:STEP; the other options are plan solve's, "
             "--time-limit per point)",
    "search": "example: plan search gpt2-small --seq 1024 --tokens-per-step 16384 --hardware "
              "a100-80g --gpu-mem 24G --cpu-mem 256G\n(candidates: the powers of two dividing "
              "N / --seq; --time-limit for the whole search; the other options are plan solve's)",
    "calibrate": "example: plan calibrate profiles/m.json --report report.json -o "
                 "profiles/m-calibrated.json",
    "hardware": "example: plan hardware --nvme-dir /tmp/tierplan-probe -o profiles/hardware/this-host.yaml",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line with exit code 2 (no usage dump)."""

    def error(self, message):
        if message.endswith("expected one argument"):
            message += " (a value that starts with '-' is written --flag=VALUE)"
        raise UserError(f"{self.prog}: {message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="plan", description="Plan activation checkpointing, offloading and "
                "transfer timing for a training step that must fit in memory.")
    sub = p.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    _profile_options(_verb(sub, "profile", "Record per-unit memory, FLOPs and times of a model "
                           "at one shape."))
    solve_q = _verb(sub, "solve", "Choose per-unit activation placement and transfer timing "
                    "under budgets.")
    _solve_options(solve_q)
    _sweep_options(_verb(sub, "sweep", "Solve along one budget axis: the memory-time table, its "
                         "knee, a plot."), solve_q)
    _search_options(_verb(sub, "search", "Choose the micro-batch size (and K) of the fastest "
                         "step at a fixed number of tokens per step."), solve_q)
    _calibrate_options(_verb(sub, "calibrate", "Write a profile with the unit times and "
                             "bandwidths a run measured."))
    _simulate_options(_verb(sub, "simulate", "Replay a plan event by event: step time, peaks, "
                            "stream busy time."))
    _upgrade_options(_verb(sub, "upgrade", "Write an older plan as today's schema, with the "
                           "figures the runtime reads."))
    _inspect_options(_verb(sub, "inspect", "Explain a plan (or a profile): per-unit table, "
                           "totals, binding constraints."))
    _diff_options(_verb(sub, "diff", "Compare two plans: changed decisions, predicted time and "
                        "peaks."))
    _hardware_options(_verb(sub, "hardware", "Measure this host and write a hardware spec."))
    return p


def _verb(sub, name: str, help_: str) -> argparse.ArgumentParser:
    """A verb's subparser: its one-line help is also its description, its epilog ``EPILOG``'s."""
    return sub.add_parser(name, help=help_, description=help_, epilog=EPILOG[name],
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _profile_options(q) -> None:
    """``plan profile``'s arguments, in the order --help lists them."""
    q.add_argument("model", help="built-in name (gpt2-small, llama3-8b, ...), a model YAML, "
                   "or package.module:function returning (module, inputs)")
    q.add_argument("--batch", required=True, help="batch size (positive integer)")
    q.add_argument("--seq", required=True, help="sequence length (positive integer)")
    q.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="compute dtype (default: the model's own; bf16 for built-ins)")
    q.add_argument("--device", choices=["meta", "cpu", "cuda"], default="meta",
                   help="meta: shapes/bytes/FLOPs without allocating, times estimated; "
                   "cpu/cuda: also measure times (default: meta)")
    q.add_argument("--hardware", default="cpu-host", help="spec name or YAML (default: cpu-host)")
    q.add_argument("--optimizer", choices=["adamw", "adamw-pure", "sgd"], default="adamw",
                   help="adamw: mixed precision (fp32 master and moments, 16 B/param for 16-bit "
                   "weights); adamw-pure: torch's AdamW on the parameters as they are (8 B/param "
                   "for 16-bit weights); sgd: no momentum")
    q.add_argument("--blocks", default=None, help="the blocks, by qualified name or glob "
                   "pattern, comma or space separated: 'encoder.block.*,decoder.block.*'; one "
                   "ModuleList/Sequential means the blocks inside it, e.g. transformer.h "
                   "(default: found from the forward)")
    q.add_argument("--repeats", type=int, default=5, help="least timed repeats per unit; more "
                   "run until the spread is small (cpu/cuda)")
    q.add_argument("--timing", choices=["measure", "estimate"], default=None,
                   help="measure times (default on cpu/cuda) or estimate them from FLOPs and "
                   "bytes on the hardware spec (the only choice on meta)")
    q.add_argument("--compute-threads", default=None, help="--device cpu: torch's intra-op "
                   "threads while timing, which a plan's runtime computes with: a count or "
                   "'all' (default: every core but one, left to the runtime's transfers)")
    q.add_argument("-o", "--output", default=None, help="output file (default: profiles/<name>.json)")


def _solve_options(q) -> None:
    """``plan solve``'s arguments, in the order --help lists them."""
    q.add_argument("profile", help="profile JSON written by 'plan profile'")
    q.add_argument("--gpu-mem", required=True, help="GPU memory budget, e.g. 80G")
    q.add_argument("--cpu-mem", default=None, help="host memory budget (0 or omitted on "
                   "unified-memory specs such as cpu-host)")
    q.add_argument("--nvme-mem", default="0", help="NVMe budget (default 0: no NVMe tier)")
    q.add_argument("--nvme-dir", default=None, help="directory for NVMe offload files "
                   "(created if missing, left as found)")
    q.add_argument("--hardware", default=None, help="spec name or YAML (default: the profile's)")
    q.add_argument("--solver", choices=["cbc", "highs"], default=None,
                   help="MILP solver (default: highs where highspy is installed, else cbc)")
    q.add_argument("--time-limit", type=float, default=60.0,
                   help="seconds for everything plan solve does (default 60)")
    q.add_argument("--gap", type=float, default=0.005,
                   help="relative optimality gap at which a solve stops (default 0.005)")
    q.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="forward/backward passes per optimizer step (default 1)")
    q.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="ranks training together (torchrun's world size); the profile and the "
                   "plan are one rank's, --gpu-mem is per rank (default 1)")
    q.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="ranks on each node, sharing its --cpu-mem and --nvme-mem "
                   "(default: min(N, 8))")
    q.add_argument("--engine", choices=["fsdp2", "ddp", "none"], default=None,
                   help="how the ranks share the model: fsdp2 (fully_shard on each block, then "
                   "the root) or ddp (default: fsdp2 for N > 1, none for one rank)")
    q.add_argument("--shard-homes", choices=["runnable", "all"], default="runnable",
                   help="with --engine fsdp2: runnable (homes the runtime executes: a block's "
                   "whole shard on the host, stepped on the CPU) or all (also NVMe and split "
                   "homes: priced, not executed yet)")
    q.add_argument("--stream", choices=["auto", "on", "off"], default="auto",
                   help="homes off the device for weights, gradients and optimizer state: "
                   "auto (when they can pay), on (always search them), off (activations only)")
    q.add_argument("--clip", choices=["global", "none"], default="global",
                   help="global: the loop clips gradients by their global norm (the Hugging "
                   "Face Trainer's default), so no update starts before the whole backward; "
                   "none: it does not, and updates may run beside it (default global)")
    q.add_argument("--optimizer-overlap", choices=["auto", "on", "off", "paced"],
                   default="auto",
                   help="auto: units' optimizer work (state reads; with --clip none also the "
                   "update and writes) may run beside the backward where it pays (with --clip "
                   "none and one pass per step, paced searched too: its gradients are freed "
                   "by their update, so the loop cannot read them after the backward); on: the "
                   "fastest plan's decisions run that schedule even where it does not pay; "
                   "off: after the whole backward; paced (with --clip none, one pass per "
                   "step): each unit's step in the backward stages after its own, which wait for "
                   "it, so no gradient waits for the optimizer (--micro-batches 1, or "
                   "layer-major) (default auto)")
    q.add_argument("--nvme-drives", type=int, default=None, metavar="N",
                   help="N of the spec's NVMe drives in its array (same per-drive rates and "
                   "striping efficiency; the spec must give its NVMe tier as drives)")
    q.add_argument("--micro-batch-order", choices=["batch-major", "layer-major", "auto"],
                   default="batch-major",
                   help="with K > 1: batch-major (K whole passes, the runtime's today), "
                   "layer-major (every micro-batch through a unit while its weights are on the "
                   "device: streamed weights move once per step, the K micro-batches' "
                   "activations are held), auto (both solved, the faster kept)")
    q.add_argument("--policy", choices=["optimal", "keep-all", "recompute-all", "sqrt",
                                        "offload-all", "remat-only"], default="optimal")
    q.add_argument("-o", "--output", default=None, help="output file (default: plans/<profile>-<gpu>.json)")


def _sweep_options(q, solve_q) -> None:
    """``plan sweep``'s arguments: ``plan solve``'s (the same action objects, so the same
    defaults) but -o, then its own."""
    for a in solve_q._actions:      # plan solve's options, the same objects (same defaults)
        if a.dest not in ("help", "output"):
            q._add_action(a)
    q.add_argument("--plot", default=None, metavar="FILE.png", help="draw step time and "
                   "tokens/s against the budget")
    q.add_argument("--json", action="store_true", help="print the rows as one JSON object")


# plan solve's options that plan search sets itself (or leaves at one rank)
SEARCH_OWN = ("help", "profile", "output", "micro_batches", "time_limit", "hardware",
              "world_size", "ranks_per_node", "engine")


def _search_options(q, solve_q) -> None:
    """``plan search``'s arguments: its own, then ``plan solve``'s (the same action objects,
    so the same defaults and checks) but those it sets itself (``SEARCH_OWN``)."""
    q.add_argument("model", help="built-in name, model YAML or package.module:function "
                   "(as plan profile)")
    q.add_argument("--seq", required=True, help="sequence length (positive integer)")
    q.add_argument("--tokens-per-step", required=True, metavar="N",
                   help="tokens per optimizer step: micro-batch x --seq x K, a multiple of --seq")
    q.add_argument("--hardware", required=True, help="spec name or YAML the profiles and plans "
                   "are for")
    q.add_argument("--micro-batch-sizes", default=None, metavar="B1,B2,...",
                   help="candidate micro-batch sizes, each dividing N / --seq (default: the "
                   "powers of two that do)")
    q.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="compute dtype (as plan profile)")
    q.add_argument("--optimizer", choices=["adamw", "adamw-pure", "sgd"], default="adamw",
                   help="as plan profile")
    q.add_argument("--blocks", default=None, help="the blocks (as plan profile)")
    q.add_argument("--time-limit", type=float, default=None, help="seconds for the whole search, "
                   "profiles included (default 60 per candidate micro-batch size), shared "
                   "evenly among the cells still to solve")
    for a in solve_q._actions:
        if a.dest not in SEARCH_OWN:
            q._add_action(a)
    q.add_argument("-o", "--output", default=None, help="the fastest plan (default: "
                   "plans/<model>-s<S>-n<N>-<gpu>.json)")
    q.add_argument("--json", action="store_true", help="print the rows as one JSON object")


def _calibrate_options(q) -> None:
    """``plan calibrate``'s arguments."""
    q.add_argument("profile", help="the profile the run's plan was solved from")
    q.add_argument("--report", required=True, metavar="REPORT.json",
                   help="the run's report (handle.report().save(path), or examples/train.py "
                   "--report-out)")
    q.add_argument("-o", "--output", default=None, help="output profile (default: "
                   "<profile>-calibrated.json beside it; never the input itself)")
    q.add_argument("--json", action="store_true", help="print what changed as one JSON object")


def _simulate_options(q) -> None:
    """``plan simulate``'s arguments."""
    q.add_argument("plan")
    q.add_argument("--json", action="store_true", help="print one JSON object")


def _upgrade_options(q) -> None:
    """``plan upgrade``'s arguments."""
    q.add_argument("plan", help="plan JSON of any schema this version reads")
    q.add_argument("-o", "--output", required=True, help="the upgraded plan (never the input)")


def _inspect_options(q) -> None:
    """``plan inspect``'s arguments."""
    q.add_argument("plan", help="plan or profile JSON")
    q.add_argument("--plot", default=None, metavar="FILE.png", help="draw memory per tier and the streams")
    q.add_argument("--report", default=None, metavar="REPORT.json",
                   help="a runtime report to show measured beside predicted")
    q.add_argument("--json", action="store_true")


def _diff_options(q) -> None:
    """``plan diff``'s arguments."""
    q.add_argument("a")
    q.add_argument("b")
    q.add_argument("--json", action="store_true")


def _hardware_options(q) -> None:
    """``plan hardware``'s arguments."""
    q.add_argument("--nvme-dir", default=None, help="where to probe disk bandwidth (default: a temp dir)")
    q.add_argument("--size", default="1G", help="bytes written and read by the disk probe")
    q.add_argument("--request", default=None, help="bytes per disk request, whole 4 KiB "
                   "blocks (default: what the runtime issues on this host: 1M with a GPU, "
                   "256K on a CPU-only host)")
    q.add_argument("--in-flight", default=None, help="disk requests at once, one thread each "
                   "(default: what the runtime issues per drive: 4 with a GPU, 2 on a "
                   "CPU-only host)")
    q.add_argument("--adam-params", default="32M", help="fp32 parameters the CPU AdamW probe "
                   "steps (default: 32M, about 0.5 GiB with its state)")
    q.add_argument("-o", "--output", default=None, help="output YAML (default: print it)")


def _dispatch(args) -> int:
    if args.verb == "profile":
        from planner.profile import cli_profile as run
    elif args.verb == "solve":
        from planner.solve import cli_solve as run
    elif args.verb == "simulate":
        from planner.plans.simulate import cli_simulate as run
    elif args.verb == "upgrade":
        from planner.plans.simulate import cli_upgrade as run
    elif args.verb == "inspect":
        from planner.cli.inspect import cli_inspect as run
    elif args.verb == "diff":
        from planner.cli.diff import cli_diff as run
    elif args.verb == "hardware":
        from planner.hardware.measure import cli_hardware as run
    elif args.verb == "sweep":
        from planner.cli.sweep import cli_sweep as run
    elif args.verb == "search":
        from planner.cli.search import cli_search as run
    elif args.verb == "calibrate":
        from planner.profile.calibrate import cli_calibrate as run
    else:
        raise AssertionError(args.verb)
    return run(args) or 0


# ----------------------------------------------------------------------------- outputs

def _inputs(args) -> list[str]:
    """The files the command reads: no output may overwrite one of them."""
    out = []
    for k in ("profile", "plan", "a", "b", "report", "hardware", "model"):
        v = getattr(args, k, None)
        if isinstance(v, str) and v:
            out.append(v)
    return out


def check_outputs(args) -> None:
    """Refuse, before any work, an output the verb must not write (``fileio.check_output``):
    a directory, a device, a FIFO, a socket, one of the command's own inputs, or a path whose
    folders are missing beyond the one level ``-o`` creates."""
    from planner.formats.fileio import check_output
    inputs = _inputs(args)
    for flag, attr in (("-o", "output"), ("--plot", "plot")):
        v = getattr(args, attr, None)
        if v is not None:
            check_output(v, inputs=inputs, what=f"{flag} output", make_parents=True)
    plot = getattr(args, "plot", None)
    if plot is not None and Path(plot).suffix.lower() != ".png":   # before the report prints
        from planner.formats.fileio import _shown
        raise UserError(f"--plot '{_shown(plot)}': give a file name ending in .png")
    if getattr(args, "output", "") is None:      # the verb's default output, as -o would be
        for path in _default_outputs(args):
            check_output(path, inputs=inputs, make_parents=True,
                         what="default output (-o gives another)")


def _default_outputs(args) -> list:
    """What a verb writes without ``-o``: ``plan solve``'s exact path; ``plan profile`` and
    ``plan search`` name theirs after the model, known only once it is built, so a name in
    their folder stands for it (the folder is what can be wrong: a file named ``plans``)."""
    if args.verb == "solve" and isinstance(getattr(args, "profile", None), str):
        from planner.solve.command import default_plan_path
        return [default_plan_path(args)]
    if args.verb == "profile":
        return [Path("profiles") / "MODEL.json"]
    if args.verb == "search":
        return [Path("plans") / "MODEL.json"]
    return []


# ----------------------------------------------------------------------------- signals

class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) arrived: unwound like Ctrl-C, so that every ``finally`` and
    ``except KeyboardInterrupt`` cleans up (temporary outputs, solver processes and files)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class OutOfTime(KeyboardInterrupt):
    """``plan solve`` ran past its --time-limit (the backstop below): unwound like Ctrl-C,
    never caught as bad input on the way."""


# Signals that arrived during this command. A C extension can swallow the exception a
# handler raises and raise its own instead (highspy's pybind11 layer, interrupted while it
# converts an argument, raises "TypeError: ... incompatible function arguments"), so ``main``
# reports an error that follows a signal as the signal.
_caught: list = CAUGHT_SIGNALS      # one list: write_atomic refuses to publish after one


def _raise_interrupted(signum, frame):
    _caught.append(KeyboardInterrupt())
    raise _caught[-1]


def _raise_terminated(signum, frame):
    _caught.append(Terminated(signum))
    raise _caught[-1]


def _raise_out_of_time(signum, frame):
    _caught.append(OutOfTime())
    raise _caught[-1]


# The backstop's slack over --time-limit: what writing the plan and exiting may take after
# the last phase the solve's own clock governs (a 10,000-unit plan is written in ~1 s).
BACKSTOP_GRACE_S = 3.0


@contextlib.contextmanager
def _signals(args):
    """SIGTERM and SIGHUP unwind like SIGINT; ``plan solve`` gets a timer that interrupts it
    ``BACKSTOP_GRACE_S`` after its --time-limit, whatever phase it is in."""
    main_thread = threading.current_thread() is threading.main_thread()
    saved = {}
    if main_thread:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            saved[sig] = signal.signal(sig, _raise_terminated)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            saved[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupted)
    limit = getattr(args, "time_limit", None) if getattr(args, "verb", None) == "solve" else None
    timer = main_thread and isinstance(limit, (int, float)) and math.isfinite(limit) and 0 < limit <= 1e7
    if timer:
        saved[signal.SIGALRM] = signal.signal(signal.SIGALRM, _raise_out_of_time)
        signal.setitimer(signal.ITIMER_REAL, float(limit) + BACKSTOP_GRACE_S)
    try:
        yield
    finally:
        if timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, h in saved.items():
            signal.signal(sig, h)


def _one_line(msg: str) -> str:
    """A message as one printable line: a newline or control character that came in with a
    user's path or field is shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)


def _quiet_encoding_errors() -> None:
    """Paths given as bytes that are not UTF-8 reach Python as surrogates; printing them must
    not fail (stdout is strict by default)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
            stream.reconfigure(errors="backslashreplace")


def _stopped(e: KeyboardInterrupt, args) -> int:
    """Report a signal (or the --time-limit backstop) that ended the command; its exit code."""
    if isinstance(e, OutOfTime):
        print(f"plan: error: plan solve ran past its --time-limit of {args.time_limit:g} s "
              f"(+{BACKSTOP_GRACE_S:g} s to write the plan) and was stopped, nothing written; "
              "raise --time-limit", file=sys.stderr)
        return 3
    if isinstance(e, Terminated):
        print(f"plan: terminated by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    print("plan: interrupted", file=sys.stderr)
    return 130


def main(argv=None) -> int:
    _quiet_encoding_errors()
    parser = build_parser()
    args = None
    _caught.clear()
    try:
        args = parser.parse_args(argv)
        if not args.verb:
            parser.print_help()
            return 2
        with _signals(args):
            check_outputs(args)
            rc = _dispatch(args)
        if _caught:        # swallowed on its way up (a C extension): still the signal's end
            return _stopped(_caught[0], args)
        return rc
    except UserError as e:
        if _caught:
            return _stopped(_caught[0], args)
        print(f"plan: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        return _stopped(_caught[0] if _caught else e, args)
    except BrokenPipeError:
        # stdout closed early (plan inspect | head): not an error; keep Python from
        # complaining again when it flushes stdout at exit.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        if _caught:             # the signal's own exception was swallowed on its way up
            return _stopped(_caught[0], args)
        raise
    finally:
        _caught.clear()


if __name__ == "__main__":
    sys.exit(main())

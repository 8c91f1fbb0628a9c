"""Determinism of replay: the zoo trained under its keep-all plan, over and over, beside busy
processes, against plain PyTorch in the same process.

    python bench/determinism.py                      # the whole zoo, 20 rounds, 1 busy loop
    python bench/determinism.py --rounds 5 --models bert gpt2 --seq 128 --control

Each zoo model (``tests/zoo_models.py`` and the Hugging Face factories of
``examples/hf_models.py``, the same list ``tests/test_zoo.py`` checks) is given its keep-all
plan. Plain PyTorch trains it once for the
reference (two AdamW steps, dropout on, an evaluation forward between them: ``test_zoo.train``).
Then, round after round, every model trains again under its plan and the largest difference
from the reference over both steps' gradients, the final weights and the buffers is recorded.
Replay promises bit-identical results, so every entry must be 0.0. ``--control`` also retrains
plain PyTorch each round (plain against plain: what the host alone does).

``--busy N`` starts N ``while True: pass`` processes before the first round and kills them
after the last, so the runs share the CPUs with other work as they do on a loaded host.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)                 # bench/runtime.py would shadow the runtime package
sys.path.insert(1, str(REPO / "tests"))

import torch  # noqa: E402

import test_zoo as tz  # noqa: E402


def keep_all_plan(name: str):
    """The keep-all plan of zoo model ``name``: its blocks found from a traced forward, as the
    profiler finds them (``tests/conftest.py``'s ``plan_for``; no timing, which keep-all's
    replay does not use)."""
    from conftest import plan_for
    model, inputs = tz.factory(name)(tz.B, tz.S)
    return plan_for(model, "keep-all", tz.B, tz.S, inputs=inputs)


def diff(got, ref) -> float:
    (g, w), (g0, w0) = got, ref
    return max(tz.max_diff(g[0], g0[0]), tz.max_diff(g[1], g0[1]), tz.max_diff(w, w0))


def usable(name: str) -> bool:
    try:
        tz.factory(name)
    except BaseException as e:       # pytest.skip raises an OutcomeException (a BaseException)
        if type(e).__name__ == "Skipped":
            print(f"  {name}: skipped ({e})", file=sys.stderr)
            return False
        raise
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the runs")
    ap.add_argument("--models", nargs="*", default=None, help="default: the whole zoo")
    ap.add_argument("--batch", type=int, default=tz.B)
    ap.add_argument("--seq", type=int, default=tz.S)
    ap.add_argument("--control", action="store_true", help="retrain plain PyTorch each round")
    a = ap.parse_args(argv)
    tz.B, tz.S = a.batch, a.seq
    warnings.simplefilter("ignore")       # transformers' config chatter
    names = [n for n in (a.models or tz.MODELS) if usable(n)]

    def stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)   # a timeout's TERM: the busy loops go, the table prints
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    t0 = time.time()
    runs = {n: [] for n in names}
    ctrl = {n: [] for n in names}
    done = 0
    try:
        plans, refs = {}, {}
        for n in names:
            plans[n] = keep_all_plan(n)
            refs[n] = tz.train(n)
        for r in range(a.rounds):
            for n in names:
                runs[n].append(diff(tz.train(n, plans[n]), refs[n]))
                if a.control:
                    ctrl[n].append(diff(tz.train(n), refs[n]))
            done += 1
            bad = {n: runs[n][-1] for n in names if runs[n][-1] != 0.0}
            print(f"round {r + 1:2d}/{a.rounds}: {len(names) - len(bad)} of {len(names)} models "
                  f"0.0 {bad or ''} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"stopped after {done} complete round(s)", file=sys.stderr)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    for n in names:                       # complete rounds only
        runs[n], ctrl[n] = runs[n][:done], ctrl[n][:done]
    if not done:
        return 1

    print(f"\nkeep-all replay against plain PyTorch, b{a.batch} s{a.seq}, {done} rounds, "
          f"{a.busy} busy process(es), torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)\n")
    head = f"{'model':<18} {'runs':>4} {'not 0.0':>7} {'largest diff':>12}"
    if a.control:
        head += f" {'plain not 0.0':>13} {'plain largest':>13}"
    print(head)
    print("-" * len(head))
    total = nonzero = 0
    for n in names:
        line = (f"{n:<18} {len(runs[n]):>4} {sum(d != 0.0 for d in runs[n]):>7} "
                f"{max(runs[n]):>12.3g}")
        if a.control:
            line += f" {sum(d != 0.0 for d in ctrl[n]):>13} {max(ctrl[n]):>13.3g}"
        print(line)
        total += len(runs[n])
        nonzero += sum(d != 0.0 for d in runs[n])
    print(f"\n{total - nonzero} of {total} replays bit-identical to plain PyTorch "
          f"({time.time() - t0:.0f} s)")
    return 0 if nonzero == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

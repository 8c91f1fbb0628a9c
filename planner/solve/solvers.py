"""Running the MILP: the solver is chosen here and only here, and every solve cleans up after
itself on every path (done, infeasible, failed, interrupted): its temporary directory (PuLP's
MPS/solution files, CBC's log) is removed and a CBC child process still running is killed.

The reported gap is relative to the step time: the model's objective has no constant term
(every stage's duration is a variable), so the solver's own relative gap already is that.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import pulp

from planner.errors import UserError
from planner.formats.fileio import lock_dir
from planner.solve.highs import available as highs_available, quiet as _quiet_highs
from planner.solve.milp import GB, Model, Solution, lin

SOLVERS = ("cbc", "highs")
# rows handed to a solver per second, beyond its own time limit (a first guess of a run's
# overrun before one has been measured; gpt3-175b's joint MILP: ~8,600 rows, ~2 s)
PASS_ROWS_PER_S = 4000


class Infeasible(Exception):
    """The model has no solution under its budgets (``plan solve`` turns it into exit 3)."""


class SolverFailed(UserError):
    """The solver program itself failed (crashed, or wrote no readable solution): one strategy
    of ``plan solve`` is lost, not the solve; alone it is exit 2."""


class NoIncumbent(Exception):
    """The solver stopped (time limit) before it found any solution."""


class NothingBetter(Exception):
    """The model's LP relaxation proves that no plan of it beats the given incumbent (a plan
    from another strategy) by more than the gap: searching it would not change the answer."""


@dataclass(frozen=True)
class Outcome:
    """One solve: the solution read back and the solver's account of it."""

    solution: Solution
    solver: str
    status: str          # optimal | feasible (stopped at the time limit with a solution)
    gap: float | None    # (incumbent - bound) / incumbent
    solve_s: float
    variables: int
    constraints: int


# ----------------------------------------------------------------------------- the solvers

class _QuietHiGHS(pulp.HiGHS):
    """PuLP's HiGHS without the banner ``highspy.Highs()`` prints on stdout before any option
    can silence it (``plan solve`` prints the plan's path as its first stdout line), with an
    optional callback on HiGHS's MIP interrupt event (progress, and stopping on Ctrl-C)."""

    def __init__(self, *a, callback=None, start=None, **k):
        super().__init__(*a, **k)
        self.callback = callback
        self.start = start          # {variable name: value}: a MIP start (HiGHS checks it)
        self.neighbourhoods = True  # HiGHS's own RINS and RENS (off where ours races it)

    def createAndConfigureSolver(self, lp):
        h = _quiet_highs()
        h.setOptionValue("output_flag", bool(self.msg))
        for key, val in (("mip_rel_gap", self.gapRel), ("threads", self.threads),
                         ("time_limit", None if self.timeLimit is None else float(self.timeLimit))):
            if val is not None:
                h.setOptionValue(key, val)
        if self.callback is not None:
            h.cbMipInterrupt.subscribe(self.callback)
        if not self.neighbourhoods:
            h.setOptionValue("mip_heuristic_run_rins", False)
            h.setOptionValue("mip_heuristic_run_rens", False)
        lp.solverModel = h

    def buildSolverModel(self, lp):
        super().buildSolverModel(lp)
        if self.start:
            import highspy
            sol = highspy.HighsSolution()
            sol.col_value = [float(self.start.get(v.name, 0.0)) for v in lp.variables()]
            sol.value_valid = True
            lp.solverModel.setSolution(sol)


def make_solver(name: str, time_limit: float | None, gap: float, warm: bool, tmp_dir: str,
                log_path: str | None, callback=None, start: dict | None = None):
    """``cbc`` (PuLP's bundled CBC) or ``highs`` (highspy); the one place a solver is made."""
    if name == "cbc":
        # NB: PuLP 3.x warns that its bundled CBC goes away in PuLP 4; we pin pulp<4 for it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            s = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, gapRel=gap, warmStart=warm,
                                  logPath=log_path, threads=1)
        s.tmpDir = tmp_dir           # its MPS, solution and start files go where we clean up
        return s
    if name == "highs":
        if not highs_available():
            raise UserError("--solver highs: highspy is not installed; pip install highspy "
                            "(bash setup.sh installs it) or use --solver cbc")
        return _QuietHiGHS(msg=False, timeLimit=time_limit, gapRel=gap, threads=1,
                           callback=callback, start=start)
    raise UserError(f"--solver '{name}': unknown solver; use {' or '.join(SOLVERS)}")


def _die_with_parent() -> None:
    """In the solver's child, before exec: SIGKILL it when this process dies, however it dies
    (SIGKILL included), so that no CBC runs on to its time limit after its parent is gone
    (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)      # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Children:
    """Records the processes PuLP starts during one solve (it keeps no handle we could reach
    when the solve is interrupted), so that ``kill`` can end one left running; each is also
    made to die with this process (``_die_with_parent``)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def Popen(self, *a, **k):          # noqa: N802 -- stands in for subprocess.Popen
        if sys.platform.startswith("linux") and "preexec_fn" not in k:
            k["preexec_fn"] = _die_with_parent
        p = subprocess.Popen(*a, **k)
        self.procs.append(p)
        return p

    def __getattr__(self, name):       # everything else PuLP uses from subprocess
        return getattr(subprocess, name)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=5)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _tracked_children():
    """Route PuLP's ``subprocess.Popen`` (in its CBC module) through ``_Children`` for the
    duration of one solve."""
    from pulp.apis import coin_api
    children = _Children()
    with _PATCH_LOCK:
        saved = coin_api.subprocess
        coin_api.subprocess = children
        try:
            yield children
        finally:
            coin_api.subprocess = saved
            children.kill()


# ----------------------------------------------------------------------------- progress and gap

_CBC_PROGRESS = re.compile(r"Cbc0010I After (\d+) nodes.*?([-\d.e+]+) best solution, best possible "
                           r"([-\d.e+]+) \(([\d.]+) seconds\)")
_CBC_BOUND = re.compile(r"best possible ([-\d.e+]+)")


def rel_gap(incumbent: float, bound: float) -> float:
    return max(0.0, incumbent - bound) / max(abs(incumbent), 1e-12)


def _progress_line(elapsed: float, incumbent: float, gap: float) -> None:
    print(f"  solve: {elapsed:6.1f} s  incumbent {incumbent:.5f}  gap {gap:.2%}", file=sys.stderr)


def _tail_progress(log_path: str, stop: threading.Event, scale: float = 1.0) -> None:
    """Print elapsed time, incumbent and gap from CBC's log on stderr (TTY only)."""
    pos = 0
    while not stop.wait(1.0):
        try:
            with open(log_path) as fh:
                fh.seek(pos)
                text = fh.read()
                pos = fh.tell()
        except OSError:
            continue
        for m in _CBC_PROGRESS.finditer(text):
            inc, bound = float(m.group(2)), float(m.group(3))
            _progress_line(float(m.group(4)), inc * scale, rel_gap(inc, bound))


class _HighsCallback:
    """HiGHS's MIP interrupt callback: progress once a second (when asked) and a stop when
    the process was interrupted (HiGHS runs in this process: Ctrl-C waits for it otherwise)."""

    def __init__(self, progress: bool, scale: float = 1.0):
        self.progress = progress
        self.scale = scale              # the objective's unit in seconds (Model.ts)
        self.last = -1.0
        self.stop = False

    def __call__(self, event) -> None:
        if self.stop:
            event.interrupt()
            return
        if not self.progress:
            return
        d = event.data_out
        t = float(d.running_time)
        inc, bound = float(d.mip_primal_bound), float(d.mip_dual_bound)
        if t - self.last < 1.0 or not (math.isfinite(inc) and math.isfinite(bound)):
            return
        self.last = t
        _progress_line(t, inc * self.scale, rel_gap(inc, bound))


def _cbc_gap(log_path: str, objective: float, allowed: float) -> float | None:
    """CBC's gap from its log: the last ``best possible`` bound (its final ``Lower bound`` line
    keeps 3 decimals, too coarse); a completed search proved the allowed gap at least."""
    try:
        text = open(log_path).read()
    except OSError:
        return None
    bounds = _CBC_BOUND.findall(text)
    g = rel_gap(objective, float(bounds[-1])) if bounds else None
    if "Search completed" in text or "Result - Optimal solution found" in text:
        if "tolerance" not in text:
            return 0.0
        return min(g, allowed) if g is not None else allowed
    return g


# ----------------------------------------------------------------------------- solving

_SOLVE_DIR = re.compile(r"^tierplan-solve-(\d+)-")


def _solve_dir() -> tuple[str, int]:
    """A temporary directory for one solve, locked (flock) while this process lives, and the
    lock's fd. Made under another name and renamed once locked, so that ``_sweep_solve_dirs``
    never sees it unlocked."""
    staging = tempfile.mkdtemp(prefix=".tierplan-solve-new-")
    fd = lock_dir(staging)
    final = os.path.join(os.path.dirname(staging),
                         f"tierplan-solve-{os.getpid()}-{os.path.basename(staging)[-8:]}")
    try:
        os.rename(staging, final)
    except OSError:
        final = staging
    return final, fd


def _sweep_solve_dirs() -> None:
    """Remove the solve directories of processes that died without cleaning up (SIGKILL):
    those whose lock is free."""
    base = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for ent in os.scandir(base):
            if not _SOLVE_DIR.match(ent.name) or not ent.is_dir(follow_symlinks=False):
                continue
            fd = lock_dir(ent.path)
            if fd is None:
                continue                      # its solve is running
            try:
                shutil.rmtree(ent.path, ignore_errors=True)
            finally:
                os.close(fd)


@contextlib.contextmanager
def _solver_run(solver, time_limit, gap, warm, start, progress, scale: float = 1.0):
    """A solver and the run around it: its own temp directory, its children killed and the
    directory removed on every path (also SIGTERM, which ``plan`` unwinds like Ctrl-C; after
    a SIGKILL the next solve sweeps it); yields (pulp solver, CBC log path, HiGHS callback)."""
    _sweep_solve_dirs()
    tmp, lock_fd = _solve_dir()
    log_path = os.path.join(tmp, "cbc.log") if solver == "cbc" else None
    stop = threading.Event()
    th = None
    callback = _HighsCallback(progress, scale) if solver == "highs" else None
    try:
        if progress and solver == "cbc":
            open(log_path, "w").close()
            th = threading.Thread(target=_tail_progress, args=(log_path, stop, scale),
                                  daemon=True)
            th.start()
        s = make_solver(solver, time_limit, gap, warm, tmp, log_path, callback, start)
        with _tracked_children():
            yield s, log_path, callback
    finally:
        stop.set()
        if th:
            th.join(timeout=2)
        shutil.rmtree(tmp, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)


def hard_deadline(time_limit: float, overrun_s: float) -> float:
    """How long a HiGHS MIP run in its child may take before it is killed: its own limit,
    what handing it the model costs (``overrun_s``, of which ``solve`` keeps 1.5x back from
    the run's limit), and a twentieth more (at least 0.5 s) for the node that is running
    when the limit strikes: the whole solve then ends within about that much of
    ``--time-limit``."""
    return time_limit + max(0.5, 0.05 * time_limit) + 1.5 * overrun_s


def _fork_available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _child(fn, fd: int) -> None:
    """In the forked child: run ``fn``, write back ("ok", its result) or ("failed", why),
    pickled, and leave without running any of the parent's exit handlers."""
    import pickle
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides; it kills us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        try:
            msg = ("ok", fn())
        except pulp.PulpSolverError as e:
            msg = ("failed", str(e))
        except BaseException as e:                       # noqa: BLE001 -- reported, not lost
            msg = ("failed", f"{type(e).__name__}: {e}")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(msg, fh)
    finally:
        os._exit(0)


def _spawn(fn, nice: int = 0) -> tuple[int, int]:
    """``fn()`` in a forked child (``_child``) at ``nice`` more niceness: (its pid, the pipe
    it answers on)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                    # the child
        os.close(r)
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        _child(fn, w)
    os.close(w)
    return pid, r


def _reap(pid: int, fd: int) -> None:
    """Close the pipe of child ``pid`` and kill it (it may have finished: then only reaped)."""
    os.close(fd)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)


def _answer(data: bytes | None):
    """What a child wrote (``_child``): its result; ``pulp.PulpSolverError`` if it failed."""
    import pickle
    try:
        msg = pickle.loads(data)
    except Exception:                               # noqa: BLE001 -- died mid-write
        msg = ("failed", "the HiGHS process ended without an answer")
    if msg[0] == "failed":
        raise pulp.PulpSolverError(msg[1])
    return msg[1]


def _in_child(fn, hard_s: float | None):
    """``fn()`` run in a forked child that is killed after ``hard_s`` seconds: its (pickled)
    result, or ``None`` when the deadline killed it; ``pulp.PulpSolverError`` when it failed.

    Why: HiGHS checks its time limit and its interrupt callback only at points of its own;
    its MIP presolve of one 834-binary model (promises seed 1299) ran for minutes past a 7 s
    limit reaching neither, and in-process nothing can stop it, Ctrl-C included. A child can
    be killed: the caller then keeps the plan it already has. ``os.fork``, not
    ``multiprocessing``: this may run inside a pool's daemonic worker, which may not have
    multiprocessing children."""
    return _race(fn, None, hard_s, lambda _: False, nice=0)[0]


# niceness added to the whole search in a ``_race``
RACE_NICE = 10


def _race(fn, rival, hard_s: float | None, wins, meanwhile=None, nice: int = RACE_NICE):
    """``fn()`` and ``rival()`` side by side, each in a forked child (``_in_child``'s rules;
    ``fn``'s niceness raised by ``nice``): (``fn``'s result or None, ``rival``'s or None). It
    ends when ``fn`` answers, at ``hard_s``, or when ``rival`` answers with a result that
    ``wins(result)`` accepts (``fn`` is then killed). A rival that fails or answers nothing
    counts as None; ``rival`` may be None (``fn`` alone, against ``meanwhile``).
    ``meanwhile(poll)``, if given, runs in this process once both have started, calling
    ``poll()`` between its steps (it reads what the children wrote; True: the race is
    decided, stop); a result it returns that ``wins`` accepts is the rival's answer."""
    import select
    deadline = None if hard_s is None else time.monotonic() + hard_s
    kids = {}
    try:
        # ``fn`` (the whole search, the slowest to decide in the cases that made the race)
        # yields the CPU to the other two where cores are short: on two cores, with all
        # three alike, gpt2-xl at 35G took 10.4 s, where the neighbourhood search alone
        # decides in 4.8 s
        for name, f, up in (("fn", fn, nice), ("rival", rival, 0)):
            if f is not None:
                pid, r = _spawn(f, up)
                kids[r] = (name, pid, [])
        got = {}

        def decided() -> bool:
            return "fn" in got or (got.get("rival") is not None and wins(got["rival"]))

        def drain(wait) -> bool:
            """Read what the children wrote within ``wait`` seconds, and all they write on
            meanwhile (an answer is bigger than the pipe's buffer: one read per poll left
            the count bound running 0.7 s past the polish's answer); whether it is decided."""
            while True:
                open_fds = [r for r, (name, _, _) in kids.items() if name not in got]
                ready, _, _ = select.select(open_fds, [], [], wait)
                if not ready:
                    return decided()
                wait = 0.0
                for r in ready:
                    name, _, chunks = kids[r]
                    chunk = os.read(r, 1 << 20)
                    if chunk:
                        chunks.append(chunk)
                        continue
                    if name == "fn":
                        got["fn"] = _answer(b"".join(chunks))
                    else:
                        try:
                            got["rival"] = _answer(b"".join(chunks))
                        except pulp.PulpSolverError:
                            got["rival"] = None
        if meanwhile is not None:
            early = meanwhile(lambda: drain(0.0))
            if not decided() and early is not None and wins(early):
                return got.get("fn"), early
        while not decided():
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait == 0.0:
                break                               # the deadline
            drain(wait)
    finally:
        for r, (_, pid, _) in kids.items():
            _reap(pid, r)
    return got.get("fn"), got.get("rival")


def _highs_in_child(model: Model, s, time_limit: float | None):
    """Run HiGHS on the MIP in a forked child (``_in_child``) with a hard deadline
    (``hard_deadline``); its dual bound, or ``None`` with the status 'no solution' when the
    deadline killed it. With a ``model.rival`` (``_Rival``, left by the dive) the rival's
    search runs beside it (``_race``) and its plan is taken where it wins or is better."""
    def run():
        model.prob.solve(s)
        bound = float(model.prob.solverModel.getInfo().mip_dual_bound)
        return (model.prob.status, model.prob.sol_status,
                {v.name: v.varValue for v in model.prob.variables()}, bound)
    hard = None if time_limit is None else hard_deadline(time_limit, model.overrun_s)
    rival, model.rival = model.rival, None          # a rival runs beside one search only
    if rival is None:
        got = _in_child(run, hard)
    else:
        # HiGHS's own RINS and RENS off: they search what the rival searches, and took 3.8
        # of gpt2-xl's 11.6 s at 38.45G (the root's sub-MIPs) before its tree began; without
        # them that search proved the gap in 10.8 s of plan solve's 15.5
        s.neighbourhoods = False
        got, other = _race(run, lambda: rival.search(time_limit), hard, rival.wins,
                           meanwhile=lambda poll: rival.prove(time_limit, poll))
        got = rival.merge(model, got, other)
    if got is None:
        model.prob.status = pulp.LpStatusNotSolved
        model.prob.sol_status = pulp.LpSolutionNoSolutionFound
        return None
    model.prob.status, model.prob.sol_status, values, bound = got
    for v in model.prob.variables():
        v.varValue = values.get(v.name)
    return bound


# a MIP with at least this many binaries runs in a child (``_highs_in_child``): forking
# costs ~20 ms with torch loaded, nothing beside a search of that size, but 3x the whole
# solve of the few-binary MIPs that exhaustive checks and small models make by the hundred
CHILD_MIN_BINARIES = 64


def _big_mip(model: Model) -> bool:
    return sum(v.cat == pulp.LpInteger for v in model.prob.variables()) >= CHILD_MIN_BINARIES


def _run(model: Model, solver, time_limit, gap, warm=False, start=None, progress=False):
    """One solve of ``model.prob`` as it stands; (status, objective, gap or None). A HiGHS
    MIP of ``CHILD_MIN_BINARIES`` or more runs in a child process with a hard deadline
    (``_highs_in_child``); LPs, small MIPs and CBC (itself a child process) run as PuLP runs
    them."""
    with _solver_run(solver, time_limit, gap, warm, start, progress,
                     model.objective_value(1.0)) as (s, log_path, cb):
        t0 = time.perf_counter()
        bound = None
        try:
            if solver == "highs" and _fork_available() and _big_mip(model):
                bound = _highs_in_child(model, s, time_limit)
            else:
                model.prob.solve(s)
                if solver == "highs":
                    bound = float(model.prob.solverModel.getInfo().mip_dual_bound)
            if time_limit is not None:      # what passing the model cost beyond the limit
                past = time.perf_counter() - t0 - time_limit
                model.overrun_s = max(model.overrun_s, min(past, 60.0))
        except KeyboardInterrupt:
            if cb is not None:
                cb.stop = True
            raise
        except pulp.PulpSolverError as e:
            raise SolverFailed(f"the {solver} solver failed ({str(e).splitlines()[0][:120]}); "
                               "try --solver highs or a larger --time-limit") from None
        status = model.prob.sol_status
        if status == pulp.LpSolutionNoSolutionFound:
            return status, None, None
        if status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise Infeasible(pulp.LpStatus[model.prob.status])
        raw = float(pulp.value(model.prob.objective))      # in the model's units, as the
        if solver == "cbc":                                  # solvers' bounds are
            g = _cbc_gap(log_path, raw, gap)
        else:
            g = rel_gap(raw, bound) if bound is not None and math.isfinite(bound) else None
        return status, model.objective_value(raw), g


def _binaries(model: Model):
    """The model's binaries (PuLP stores a binary as an integer in [0, 1])."""
    return [v for v in model.prob.variables() if v.cat == pulp.LpInteger]


def _groups(model: Model) -> list[tuple[list, list]]:
    """Per unit, its groups of one-of binaries: (keys, variables) for the activation choice
    and for the home, each only where there is a choice."""
    out = []
    for i in range(model.cm.U):
        g = []
        xs = [(c, v) for c, v in model.xv[i].items() if not isinstance(v, int)]
        if xs:
            g.append(("x", xs))
        hs = [(k, v) for k, v in enumerate(model.hv[i]) if not isinstance(v, int)]
        if hs:
            g.append(("h", hs))
        out.append(g)
    return out


class _Rounder:
    """Whole choices that follow the LP relaxation's fractional ones along the chain.

    The relaxation typically spreads a choice thinly (offload 30% of each of 40 blocks); any
    whole plan must instead take it for some units. Going along the units, each takes the
    choice whose running LP total most exceeds how often it was taken so far (the
    'chairman assignment'), so that at every prefix the count of each choice stays within one
    of the LP's: the chosen units end up evenly spaced, as links and memory want them.
    ``offset`` starts the running totals at different fractions, giving other evenly spaced
    picks. The state carries over from one batch of units to the next."""

    def __init__(self, model: Model, offset: float):
        self.model = model
        self.offset = offset
        self.deficit: dict = {}
        self.prev = None
        self.run = 0
        self.groups = _groups(model)

    def save(self):
        return dict(self.deficit), self.prev, self.run

    def restore(self, state) -> None:
        deficit, self.prev, self.run = state
        self.deficit = dict(deficit)

    def took(self, i: int, keys: dict) -> None:
        """Unit i was fixed to ``keys`` ({'x': choice, 'h': home index}) by someone else:
        keep the chain's state (the running segment) as if the rounder had chosen them."""
        x = keys.get("x", next(iter(self.model.xv[i])))
        self.run = self.run + 1 if x == "rz" else 0
        self.prev = x
        for kind, key in keys.items():
            self.deficit[(kind, key)] = self.deficit.get((kind, key), 0.0) - 1.0

    def round(self, units, lp: dict) -> dict:
        from planner.costmodel import REC
        m = self.model
        wseg = m.cm.windows.seg
        fixed = {}
        for i in units:
            home = None
            groups = self.groups[i]
            for kind, items in groups:
                # only what the relaxation gives this unit is a candidate, and what it gives
                # whole is taken: the running totals only space out what it spreads (a total
                # carried from other units turned an LP's whole rc into rg and put rc where
                # the LP had none, on 48 synthetic blocks). Measured one unit per re-solve:
                # 0.6-1.2% above the bound on 48-96 blocks and gpt2-xl against 0.4-1.5%
                # before, one case worse (2.1% against 0.7%); ``_polish`` follows either way
                # where the plan is not within the gap
                vals = [lp.get(var.name, 0.0) for _, var in items]
                whole = max(vals) > 1 - 1e-6
                allowed, given = [], []
                for n, (key, var) in enumerate(items):
                    d = self.deficit.get((kind, key), (self.offset * (n + 1)) % 1.0) + vals[n]
                    self.deficit[(kind, key)] = d
                    if kind == "x" and key == "rz" and (self.prev not in REC or self.run >= wseg - 1):
                        continue        # none follows a recompute unit; segments <= w_seg
                    allowed.append((d, n, key, var))
                    if vals[n] > (1 - 1e-6 if whole else 1e-6):
                        given.append((d, n, key, var))
                # what the relaxation gives may not follow the units fixed before: then any
                # allowed choice, by its running total (first on ties)
                _, _, key, var = max(given or allowed, key=lambda t: (t[0], -t[1]))
                self.deficit[(kind, key)] -= 1.0
                for _, v2 in items:
                    fixed[v2.name] = 1 if v2 is var else 0
                if kind == "h":
                    home = key
                else:
                    self.run = self.run + 1 if key == "rz" else 0
                    self.prev = key
            if not any(k == "x" for k, _ in groups):
                self.prev, self.run = next(iter(m.xv[i])), 0
            # a unit whose weights stream is recomputed only alone (c_streamed_segments)
            if home is not None and m.cm.homes[i][home].streams_weights and self.prev == "rz":
                fixed[m.xv[i]["rz"].name] = 0
                fixed[m.xv[i]["rg"].name] = 1
                self.prev, self.run = "rg", 0
        return fixed


def _unit_by_unit(r: "_Rounder", units, fixed: dict, cur: dict, relax, over):
    """Fix ``units`` one at a time: each as the rounder rounds it, or, where that does not
    fit, the first of its other choice combinations (by the LP's values) that does. Returns
    (fixed, objective, values), objective None when some unit has no choice that fits."""
    obj = values = None
    for i in units:
        if over():
            return fixed, None, None
        state = r.save()
        trial = dict(fixed, **r.round([i], cur))
        obj, values = relax(trial)
        if obj is None:
            r.restore(state)
            groups = r.groups[i]
            combos = sorted(itertools.product(*[items for _, items in groups]),
                            key=lambda c: -sum(cur.get(v.name, 0.0) for _, v in c))
            for combo in combos:
                if over():
                    return fixed, None, None
                pick = {}
                for (kind, items), (key, var) in zip(groups, combo):
                    pick.update({v.name: int(v is var) for _, v in items})
                trial = dict(fixed, **pick)
                obj, values = relax(trial)
                if obj is not None:
                    r.took(i, dict(zip((k for k, _ in groups), (key for key, _ in combo))))
                    break
            if obj is None:
                return fixed, None, None
        fixed, cur = trial, values
    return fixed, obj, values


def _fixed_lp(model: Model, solver: str, time_limit, fixed: dict):
    """Objective and all values of ``model`` with the binaries in ``fixed`` pinned: an LP.
    ``model.lp_optimal`` says whether it was solved to optimality: an LP the time limit
    stopped has a feasible point, not a bound."""
    saved = []
    by_name = {v.name: v for v in model.prob.variables()}
    for name, val in fixed.items():
        v = by_name[name]
        saved.append((v, v.lowBound, v.upBound, v.cat))
        v.lowBound = v.upBound = val
        v.cat = pulp.LpContinuous
    try:
        model.lp_optimal = False
        try:
            status, obj, _ = _run(model, solver, time_limit, 0.0)
        except Infeasible:
            return None, None
        model.lp_optimal = status == pulp.LpSolutionOptimal
        return obj, {v.name: v.value() for v in model.prob.variables()}
    finally:
        for v, lo, up, cat in saved:
            v.lowBound, v.upBound, v.cat = lo, up, cat


def _relaxation(model: Model, solver: str, time_limit, fixed: dict):
    """The LP relaxation with the binaries in ``fixed`` pinned: (objective, values) or
    (None, None) when infeasible."""
    bins = _binaries(model)
    for v in bins:
        v.cat = pulp.LpContinuous
    try:
        obj, values = _fixed_lp(model, solver, time_limit, fixed)
    finally:
        for v in bins:
            v.cat = pulp.LpInteger
    return obj, values


# a relaxation with at least this many columns is solved first by HiGHS's interior point
# method (then crossover to a vertex), and re-solved by dual simplex from that basis: the
# gpt3-175b joint model's first LP (13,242 columns) took 118 s by simplex and 15 s this way
IPM_MIN_COLUMNS = 8000


class _HeldLP:
    """The model's LP relaxation held in one HiGHS instance for a whole dive: binaries
    relaxed, fixings applied as bound changes, each re-solve warm-started from the last basis
    (through PuLP every LP was built and solved from scratch: 76 ms each at 48 blocks, where a
    re-solve takes 5-15 ms; 7.9 s and then ~1 s on gpt3-175b against minutes). HiGHS only;
    answers what ``_relaxation`` answers."""

    def __init__(self, model: Model):
        import highspy
        import numpy as np
        self.np, self.hs = np, highspy
        self.model = model
        prob = model.prob
        self.vars = prob.variables()
        self.names = [v.name for v in self.vars]
        self.col = {n: j for j, n in enumerate(self.names)}
        inf = highspy.kHighsInf
        self.lo = np.array([-inf if v.lowBound is None else v.lowBound for v in self.vars], float)
        self.up = np.array([inf if v.upBound is None else v.upBound for v in self.vars], float)
        cost = np.zeros(len(self.vars))
        for v, c in prob.objective.items():
            cost[self.col[v.name]] += c
        self.constant = float(prob.objective.constant or 0.0)
        h = _quiet_highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", 1)
        n = len(self.vars)
        h.addVars(n, self.lo, self.up)
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
        senses = {pulp.LpConstraintLE: (-inf, 0), pulp.LpConstraintGE: (0, inf),
                  pulp.LpConstraintEQ: (0, 0)}
        cons = prob.constraints            # a list from a call in later PuLP 3.x, a dict before
        for con in (cons() if callable(cons) else cons.values()):
            idx = np.fromiter((self.col[v.name] for v in con.keys()), np.int32)
            val = np.fromiter(con.values(), float)
            rhs = -float(con.constant or 0.0)
            lo, up = senses[con.sense]
            h.addRow(rhs if lo == 0 else lo, rhs if up == 0 else up, len(idx), idx, val)
        self.rows = h.getNumRow()
        self.h = h
        self.fixed: dict = {}
        self.first = True
        self.root_basis = None      # the basis of the relaxation with nothing fixed

    def solve(self, time_limit, fixed: dict):
        """(objective, {variable name: value}) with the binaries in ``fixed`` pinned, or
        (None, None) when that is infeasible or the time limit left no point; sets
        ``model.lp_optimal``."""
        np, h = self.np, self.h
        self._release([k for k in self.fixed if k not in fixed])
        new = {k: v for k, v in fixed.items() if self.fixed.get(k) != v}
        if new:
            ids = np.fromiter((self.col[k] for k in new), np.int32)
            vals = np.fromiter((float(v) for v in new.values()), float)
            h.changeColsBounds(len(ids), ids, vals, vals)
        self.fixed = dict(fixed)
        # HiGHS's time limit counts the instance's whole run time, every earlier solve's too
        h.setOptionValue("time_limit", float("inf") if time_limit is None
                         else h.getRunTime() + max(0.05, float(time_limit)))
        big = self.first and len(self.vars) >= IPM_MIN_COLUMNS
        h.setOptionValue("solver", "ipm" if big else "simplex")
        self.first = False
        h.run()
        status = h.getModelStatus()
        ok = status == self.hs.HighsModelStatus.kOptimal
        self.model.lp_optimal = ok
        info = h.getInfo()
        if not ok and info.primal_solution_status != 2:       # 2: a feasible point
            return None, None
        values = dict(zip(self.names, h.getSolution().col_value))
        obj = float(info.objective_function_value) + self.constant
        if ok and not fixed and self.root_basis is None and h.getNumRow() == self.rows:
            self.root_basis = h.getBasis()
        return self.model.objective_value(obj), values

    def _release(self, names) -> None:
        """Give the binaries ``names`` their own bounds again (no longer fixed)."""
        if names:
            ids = self.np.fromiter((self.col[k] for k in names), self.np.int32)
            self.h.changeColsBounds(len(ids), ids, self.lo[ids], self.up[ids])

    def infeasible(self) -> bool:
        """Whether the last ``solve`` proved its LP infeasible (not merely stopped)."""
        return self.h.getModelStatus() == self.hs.HighsModelStatus.kInfeasible

    def solve_with_rows(self, rows, time_limit, basis=None):
        """``solve`` with nothing fixed and more rows, each (names, lo, up): lo <= Σ names <=
        up, taken out again afterwards; started from ``basis`` (one this returned for the
        rows but the last, the last row then basic), else from the relaxation's. Returns
        (objective, values, basis)."""
        np, h = self.np, self.h
        if self.fixed:
            self._release(list(self.fixed))
            self.fixed = {}
        start = basis if basis is not None else self.root_basis
        try:
            for names, lo, up in rows:
                ids = np.fromiter((self.col[n] for n in names), np.int32)
                h.addRow(lo, up, len(ids), ids, np.ones(len(ids)))
            if start is not None:
                # from the parent region's basis, not from whichever region was solved last
                # (the rows it was solved with taken out again, its basis is no longer one)
                b = self.hs.HighsBasis()
                b.col_status = list(start.col_status)
                b.row_status = list(start.row_status) + [self.hs.HighsBasisStatus.kBasic] * (
                    h.getNumRow() - len(start.row_status))
                b.valid = True
                h.setBasis(b)
            obj, values = self.solve(time_limit, {})
            return obj, values, (h.getBasis() if obj is not None else None)
        finally:
            n = h.getNumRow()            # every row past the model's, however this ended
            if n > self.rows:
                h.deleteRows(n - self.rows, np.arange(self.rows, n, dtype=np.int32))


# LP re-solves the count bound may take: before the polish (one split), and beside HiGHS's
# search (``_Rival.prove``) and beside the polish, where gpt2-xl at 38.45G proves its plan
# within 0.5% in 0.5 s
COUNT_LPS_FIRST = 4
COUNT_LPS = 96
# counts tried per split (strong branching), most fractional first
STRONG = 2


def _count_bound(model: Model, held: "_HeldLP", lp: dict, bound: float, target: float,
                 time_limit, max_lps: int = COUNT_LPS, stop=None, counts=None) -> float:
    """A bound above the relaxation's, by branch and bound on counts: every sum of binaries
    (``Model.counts``: the units at a home in a group of alike units, the units taking an
    activation choice, the recompute segments) is a whole number in any plan, so a region
    whose relaxed count n is fractional splits into n <= floor(n) and n >= ceil(n), each
    bounded by its own relaxation (rows added to the held instance). The region with the
    lowest bound is split first (strong branching over its ``STRONG`` most fractional
    counts); the least bound over the open regions bounds every plan (``counts``: lists of
    variables, by default ``Model.counts``). Stops when that reaches ``target``, after
    ``max_lps`` LPs, at the time limit, when ``stop()`` says so, or at a region whose counts
    are all whole. A side proven infeasible holds no plan; a side the time limit stopped ends
    the search (a point is not a bound).

    Why: on gpt2-xl's joint model the relaxation is ~0.6% below the best plans because it
    spreads whole decisions (3.74 blocks' optimizer state on the host, 3.86 blocks
    recomputed where plans recompute 5); HiGHS's cuts did not raise it at all, and its tree
    took 200 nodes (7-12 s). At 38.45G this proves the plan within 0.5% in 0.5 s (1.3 s with
    each LP started from the last region's basis, not its parent's)."""
    import heapq
    t0 = time.perf_counter()
    counts = [[v.name for v in vs] for vs in (model.counts() if counts is None else counts)]
    heap = [(bound, 0, (), lp, None)]
    lps, tick = 0, 1
    best = bound
    while heap:
        b, _, rows, values, basis = heap[0]
        best = max(bound, b)
        left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
        if (b >= target or lps + 2 * STRONG > max_lps or (left is not None and left <= 0.05)
                or (stop is not None and stop())):
            return best
        fractional = []
        for names in counts:
            n = sum(values.get(x, 0.0) for x in names)
            f = n - math.floor(n)
            if 1e-6 < f < 1 - 1e-6:
                fractional.append((abs(f - 0.5), n, names))
        if not fractional:
            return best              # whole in every count: this region's bound is the bound
        heapq.heappop(heap)
        # strong branching: of the STRONG most fractional counts, split on the one whose
        # weaker side bounds highest (the relaxation's vertex, and so which count looks most
        # fractional, changes with the basis it starts from)
        pick = None
        for _, n, names in sorted(fractional)[:STRONG]:
            sides = []
            for lo, up in ((0.0, float(math.floor(n))),
                           (float(math.ceil(n)), float(len(names)))):
                left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
                if stop is not None and stop():
                    return best          # asked between LPs too: a split takes four (0.4 s)
                side = rows + ((names, lo, up),)
                obj, got, got_basis = held.solve_with_rows(side, left, basis)
                lps += 1
                if obj is None and held.infeasible():
                    continue                    # no plan on this side
                if obj is None or not model.lp_optimal:
                    return best      # stopped early: the region split still bounds at b
                sides.append((obj, side, got, got_basis))
            weaker = min((o for o, _, _, _ in sides), default=math.inf)
            if pick is None or weaker > pick[0]:
                pick = (weaker, sides)
        for obj, side, got, got_basis in pick[1]:
            heapq.heappush(heap, (obj, tick, side, got, got_basis))
            tick += 1
    return best


def _windows(model: Model, lp: dict, cur: dict, width: int) -> list:
    """Windows of ``width`` consecutive units to re-optimise, worst first: each pass stage
    that the plan ``cur`` makes longer than the relaxation ``lp`` does names the units whose
    decisions load it (its own unit, the two after it and the ``width`` − 3 before it, whose
    offloads, prefetches and segments reach it), scored by how much longer; then every window
    of a stride of half the width along the chain, so that a search that finds nothing
    guided still covers it all."""
    U = model.cm.U
    score: dict = {}
    for T in (model.T, model.T2):
        for s, var in T.items():
            d = cur.get(var.name, 0.0) - lp.get(var.name, 0.0)
            if d <= 1e-9 or s == 0:
                continue
            u = s - 1 if s <= U else 2 * U - s
            lo = max(0, min(u - width + 3, U - width))
            score[lo] = score.get(lo, 0.0) + d
    guided = sorted(score, key=lambda lo: -score[lo])
    step = max(1, width // 2)
    rest = [lo for lo in range(0, max(1, U - width + step), step) if lo not in score]
    return [range(lo, min(U, lo + width)) for lo in guided + rest]


# binaries set free in one window of ``_polish`` (its width in units follows from it): at
# 48-96 blocks a window of ~40 solves in 0.05-0.3 s, and one or two windows placed where the
# dive's plan is slow take it from 1-9% to within 0.5% of the bound
POLISH_BINARIES = 40
# the most one window's search may take: the search finds a window's better plan early and
# spends the rest proving it (gpt2-xl's windows: 0.8-1.8 s to optimality)
POLISH_WINDOW_S = 0.3
# a window's plan counts as better (and makes every other window worth another try) only
# when it gains this much: gains of 1e-6 sent gpt2-xl's search round the chain again for
# nothing
POLISH_MIN_GAIN = 1e-4
# windows in a row that gain nothing end the polish, and the time left goes to the MIP
# search: on 48-96 synthetic blocks every gain came within 4 windows of the last one (1.4-2.2
# s in all), while on gpt2-xl's joint model (windows of 5 units) whole passes of 24 windows
# found nothing in 3.8-5.3 s, time that HiGHS's search then lacked
POLISH_BARREN_RUN = 6


class _SubMIP:
    """The held instance as a MIP over the model's binaries, for searches in a neighbourhood
    of a plan: ``run`` holds every binary outside ``free`` at the plan's value and solves
    the rest, the plan as its start. A context: on leaving, the instance is the dive's LP
    again."""

    def __init__(self, model: Model, held: "_HeldLP", gap: float):
        np, hs = held.np, held.hs
        self.model, self.held = model, held
        groups = _groups(model)
        self.cols = [[held.col[v.name] for _, items in groups[i] for _, v in items]
                     for i in range(model.cm.U)]
        self.ints = np.array(sorted(c for cs in self.cols for c in cs), np.int32)
        self.every = np.arange(len(held.names), dtype=np.int32)
        self.gap = gap
        # seconds: a plan this fast ends a run (``_rins``); after ``patience_s`` seconds of
        # the run, one as fast as ``later`` does
        self.target = None
        self.later = None
        self.patience_s = math.inf
        self.started = 0.0

    def __enter__(self):
        np, hs, h = self.held.np, self.held.hs, self.held.h
        h.changeColsIntegrality(len(self.ints), self.ints,
                                np.full(len(self.ints), hs.HighsVarType.kInteger))
        h.setOptionValue("solver", "choose")
        # a neighbourhood's search stops well inside the gap asked of the whole plan; without
        # HiGHS's own neighbourhood searches (RINS, RENS), which in a window of ~40 binaries
        # took 0.56 of its 0.86 s and ran it past its time limit
        h.setOptionValue("mip_rel_gap", max(1e-4, self.gap / 4))
        h.setOptionValue("mip_heuristic_run_rins", False)
        h.setOptionValue("mip_heuristic_run_rens", False)
        h.cbMipInterrupt.subscribe(self._reached)
        return self

    def __exit__(self, *exc):
        np, hs, h, held = self.held.np, self.held.hs, self.held.h, self.held
        h.cbMipInterrupt.unsubscribe(self._reached)
        h.changeColsIntegrality(len(self.ints), self.ints,
                                np.full(len(self.ints), hs.HighsVarType.kContinuous))
        h.changeColsBounds(len(self.every), self.every, held.lo, held.up)
        h.setOptionValue("mip_heuristic_run_rins", True)
        h.setOptionValue("mip_heuristic_run_rens", True)
        held.fixed = {}

    def _reached(self, event) -> None:
        if self.target is None:
            return
        target = self.target
        if self.later is not None and time.perf_counter() - self.started >= self.patience_s:
            target = self.later
        inc = float(event.data_out.mip_primal_bound)
        if math.isfinite(inc) and self.model.objective_value(inc + self.held.constant) \
                <= target:
            event.interrupt()

    def run(self, values: dict, free, time_limit: float):
        """(objective, values) of the best plan found with the binaries in ``free`` (column
        indices) open, or None when the search found none."""
        held, hs, h = self.held, self.held.hs, self.held.h
        lo, up = held.lo.copy(), held.up.copy()
        free = set(free)
        for c in self.ints:
            if c not in free:
                lo[c] = up[c] = round(values[held.names[c]])
        h.changeColsBounds(len(self.every), self.every, lo, up)
        sol = hs.HighsSolution()
        sol.col_value = [float(values[n]) for n in held.names]
        sol.value_valid = True
        h.setSolution(sol)
        h.setOptionValue("time_limit", h.getRunTime() + time_limit)
        self.started = time.perf_counter()
        h.run()
        info = h.getInfo()
        if info.primal_solution_status != 2:
            return None
        got = self.model.objective_value(float(info.objective_function_value) + held.constant)
        return got, dict(zip(held.names, h.getSolution().col_value))


def _polish(model: Model, held: "_HeldLP", lp: dict, values: dict, obj: float,
            bound: float | None, gap: float, time_limit):
    """Large-neighbourhood search from the dive's plan: all but a window of units held at the
    plan's choices, the MIP over the window solved (``_SubMIP``), windows taken worst first
    (``_windows``) until the plan is within ``gap`` of ``bound``, ``POLISH_BARREN_RUN``
    windows in a row (or a pass over the chain) improve nothing, or the time is up. Returns
    (values, objective) of the best plan. Why: the dive rounds where the relaxation spreads a
    choice over many units, and a rounding that overloads one stage's link costs a percent or
    more; re-deciding a few units around that stage together recovers it, in a fraction of
    what the whole MIP's search takes to find the same plan."""
    t0 = time.perf_counter()
    U = model.cm.U
    with _SubMIP(model, held, gap) as sub:
        if not len(sub.ints):
            return values, obj
        per_unit = max(1.0, len(sub.ints) / max(1, U))
        width = max(3, min(U, int(POLISH_BINARIES / per_unit)))
        tried: set = set()
        dry = 0                     # windows tried since the last gain
        # windows that gained nothing go after the others when the plan changes: they may
        # pay again, but seldom do (gpt-like chains: the last units' windows ran to their
        # limit after each gain elsewhere, 0.3-0.45 s each, for gains under POLISH_MIN_GAIN)
        barren: set = set()
        order = _windows(model, lp, values, width)      # again only when the plan changes
        while True:
            w = next((w for w in order if w.start not in tried), None)
            left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
            if ((bound is not None and rel_gap(obj, bound) <= gap) or w is None
                    or (left is not None and left < 0.05) or dry >= POLISH_BARREN_RUN):
                break
            tried.add(w.start)
            dry += 1
            per = POLISH_WINDOW_S if left is None else max(0.05, min(POLISH_WINDOW_S, left / 2))
            got = sub.run(values, (c for i in w for c in sub.cols[i]), per)
            if got is not None and got[0] < obj * (1 - POLISH_MIN_GAIN):
                obj, values = got
                tried = {w.start}     # the plan changed: every other window may pay again
                dry = 0
                barren.discard(w.start)
                order = sorted(_windows(model, lp, values, width),
                               key=lambda x: x.start in barren)
                continue
            barren.add(w.start)
    return values, obj


# a binary whose relaxed value is this far from the plan's counts as a disagreement (``_rins``)
RINS_TOL = 0.01
# ``_rins`` stops at the first plan within half the gap of the bound, after this many seconds
# at the first within the gap
RINS_PATIENCE_S = 1.0


def _rins(model: Model, held: "_HeldLP", lp: dict, values: dict, obj: float, bound: float,
          gap: float, time_limit):
    """One search over the binaries where the plan and the relaxation ``lp`` disagree, all
    the others held (relaxation-induced neighbourhood search, Danna, Rothberg & Le Pape 2005),
    stopped as soon as a plan is within half the ``gap`` of ``bound``, or after
    ``RINS_PATIENCE_S`` seconds within the gap. Returns (values, objective).
    Why: the plans the windows miss differ from the dive's all along the chain (gpt2-xl at
    33.75G: 27 of 50 units, weights streamed for four blocks instead of one), and where the
    relaxation is whole the two agree: the open part was 122-145 of 483 binaries, searched
    in 0.9-4.8 s, where HiGHS's whole search took 8-20 s to find the same plans. Half the
    gap first: stopped at the first plan within the gap, llama3-8b at a quarter of its
    activations got a plan 0.37% above its bound in 0.2 s where one 0.3% faster came as
    soon; patience: stopped only at half the gap, gpt2-xl at 33.75G took 3 s longer."""
    with _SubMIP(model, held, gap) as sub:
        free = [c for c in sub.ints
                if abs(lp.get(held.names[c], 0.0) - round(values[held.names[c]])) > RINS_TOL]
        if not free:
            return values, obj
        sub.target = bound / (1 - gap / 2)
        sub.later, sub.patience_s = bound / (1 - gap), RINS_PATIENCE_S
        got = sub.run(values, free, math.inf if time_limit is None else time_limit)
    if got is not None and got[0] < obj:
        obj, values = got
    return values, obj


@dataclass
class _Rival:
    """What runs beside HiGHS's search (``_race``): ``_rins`` from the dive's plan in a child,
    and ``_count_bound`` in this process meanwhile. Why beside and not before: where the
    dive's plan is 0.5% off the best (gpt2-xl at 33.75G, 35G) the neighbourhood search finds
    a plan within the gap in 0.9-4.8 s, and no bound can prove the dive's; where the plan is
    already within a hair of the best (36.25G, 38.45G) the neighbourhood search spends 5-7 s
    finding nothing, and the count bound proves the plan (0.5 s at 38.45G). Either one
    deciding ends HiGHS's search. The dive uses one without a ``search`` beside its polish:
    ``prove`` only."""

    search: object                  # time_limit -> (values, objective in seconds)
    bound: float                    # seconds: the best bound known
    gap: float
    ts: float                       # the model's time unit
    raise_bound: object = None      # time_limit -> a bound (seconds) at least ``bound``
    plan: tuple = None              # (values, objective in seconds): the dive's plan

    def wins(self, got) -> bool:
        return rel_gap(got[1], self.bound) <= self.gap

    def prove(self, time_limit, stop=None):
        """Raise the bound (``raise_bound``, until ``stop()``); the dive's plan when that
        proves it within the gap, else None."""
        if self.raise_bound is None or self.plan is None:
            return None
        self.bound = max(self.bound, self.raise_bound(time_limit, stop))
        return self.plan if self.wins(self.plan) else None

    def merge(self, model: Model, got, other):
        """HiGHS's answer (status, solution status, values, dual bound), with the rival's
        plan in it where that is better (or HiGHS has none); None when neither has a plan."""
        if other is None:
            return got
        values, obj = other
        if got is not None and got[1] in (pulp.LpSolutionOptimal,
                                          pulp.LpSolutionIntegerFeasible):
            mine = _objective_of(model, got[2])
            if mine is not None and mine * self.ts <= obj:
                return got
            status, _, _, bound = got
        else:
            status, bound = pulp.LpStatusOptimal, -math.inf
        bound = max(bound, self.bound / self.ts)        # both bound every plan
        sol = pulp.LpSolutionOptimal if rel_gap(obj, bound * self.ts) <= self.gap \
            else pulp.LpSolutionIntegerFeasible
        return status, sol, values, bound


def _objective_of(model: Model, values: dict) -> float | None:
    """The objective, in the model's units, of the plan ``values`` holds."""
    if any(values.get(v.name) is None for v in model.prob.objective):
        return None
    return float(sum(c * values[v.name] for v, c in model.prob.objective.items())
                 + (model.prob.objective.constant or 0.0))


def _guarded(search, model: Model, held: "_HeldLP", lp: dict, values: dict, obj: float,
             bound, gap: float, time_limit, prove=None):
    """``search`` (``_polish``) in a forked child with a hard deadline
    (``_in_child``) where the model is big enough to run HiGHS MIPs there
    (``CHILD_MIN_BINARIES``): a search that runs on past its limit is killed, and the plan it
    started from stands. ``prove(time_limit, poll)`` (``_Rival.prove``: the count bound), if
    given, runs in this process meanwhile (``_race``); when it proves the plan within the gap
    first, the search is killed. Returns (values, objective)."""
    def run():
        return search(model, held, lp, values, obj, bound, gap, time_limit)
    if not (_fork_available() and _big_mip(model)):
        return run()
    hard = None if time_limit is None else time_limit + max(2.0, 0.1 * time_limit)
    meanwhile = None if prove is None else (lambda poll: prove(time_limit, poll))
    try:
        got, proven = _race(run, None, hard, lambda plan: plan is not None, meanwhile, nice=0)
        got = proven if got is None else got
    except pulp.PulpSolverError:
        got = None
    return (values, obj) if got is None else got


def _settle(model: Model, solver: str, time_limit) -> None:
    """Phase two of a time-minimising solve: with the chosen decisions and every stage's
    duration held, the LP that places the transfer shares so that the least device memory is
    held longest (``CostModel.held_longer``: sends as early, fetches as late as the stages'
    durations allow). The objective's own tie-break on it is too small to survive the
    solvers' tolerances and gaps (1e-8 s against a 0.5% gap), so it is settled here on its
    own scale. The step cannot rise (each stage keeps its duration); if the LP fails, the
    solution stands as it was."""
    if model.opt.minimise != "time":
        return
    held = model.cm.held_longer(model.v)
    if not held or (time_limit is not None and time_limit < 1.0):
        return
    values = {v.name: v.varValue for v in model.prob.variables()}
    fixed = {v.name: round(v.varValue or 0.0) for v in _binaries(model)}
    durations = [*model.T.values(), *model.T2.values(), model.To]
    bounds = [(v, v.upBound) for v in durations]
    objective = model.prob.objective
    try:
        for v in durations:
            v.upBound = (v.varValue or 0.0) * (1 + 1e-9) + 1e-12
        model.prob.setObjective(lin(held, 1 / GB))
        try:
            obj, got = _fixed_lp(model, solver, time_limit, fixed)
        except SolverFailed:
            obj = got = None
        if obj is None:             # infeasible, or stopped with no point: values unusable
            got = None
    finally:
        for v, up in bounds:
            v.upBound = up
        model.prob.setObjective(objective)
    for v in model.prob.variables():
        v.varValue = (got or values).get(v.name, values.get(v.name))


# re-solves a dive aims at: at 48 blocks one per unit gave plans 0.2-1.2% above the bound,
# batches of 8 gave 2.1-4.9% (batches of 16: 11.5% on gpt2-xl at a quarter of its activations)
DIVE_SOLVES = 64


def _dive(model: Model, solver: str, time_limit, gap: float, incumbent: float | None = None,
          polish_limit=None):
    """A global bound and a first plan. The LP relaxation's value bounds every plan; then,
    batch by batch along the chain, its choices are rounded (``_Rounder``) and fixed, and the
    relaxation re-solved with them fixed, so the units still open adapt to what the fixed ones
    use; the last LP, with everything fixed, times the plan. A batch that makes the relaxation
    infeasible is retried with the next offset. Why: on this project's instances the
    relaxation is within a fraction of a percent of the optimum, and what the MILP solvers
    lack is a good first plan (gpt2-xl at 30G: HiGHS's root bound is 0.2% below the optimum,
    but it finds that plan after 28 s). With HiGHS, a plan not within ``gap`` of the bound
    has the bound raised (``_count_bound``), then is polished (``_polish``), both within
    ``polish_limit`` seconds; one still not within the gap leaves ``model.rival`` (``_rins``
    from it, the count bound on every count) to race HiGHS's search. Returns (bound, values
    of the plan, its objective)."""
    t0 = time.perf_counter()

    def over():
        return time_limit is not None and time.perf_counter() - t0 > time_limit

    held = _HeldLP(model) if solver == "highs" and highs_available() else None

    def relaxation(limit, fixed):
        if held is None:
            return _relaxation(model, solver, limit, fixed)
        if limit is not None:
            limit = max(0.05, limit - (time.perf_counter() - t0))
        return held.solve(limit, fixed)
    first, lp = relaxation(time_limit, {})
    first_s = time.perf_counter() - t0
    if first is None:
        return None, None, None
    # only an LP solved to optimality bounds every plan (one the time limit stopped gave
    # gpt3-175b a 'bound' of 1,862 s where a 1,768 s plan exists); a stopped one still
    # guides the rounding: without the complete start that gives, HiGHS was handed a partial
    # one and ran 40 s past a 1.5 s limit (promises seed 1299)
    bound = first if model.lp_optimal else None
    if incumbent is not None and bound is not None and rel_gap(incumbent, bound) <= gap:
        raise NothingBetter(f"bound {bound:.6g} s, incumbent {incumbent:.6g} s")
    U = model.cm.U
    # units rounded per re-solve: one at a time where DIVE_SOLVES re-solves fit in half the
    # time left (a re-solve warm-started from the last basis taking about a quarter of the
    # first), more where they do not; never more than a sixth of the chain
    affordable = DIVE_SOLVES
    if time_limit is not None:
        affordable = min(affordable, 0.5 * (time_limit - first_s) / max(first_s / 4, 1e-3))
    batch = max(1, min(max(4, U // 6), math.ceil(U / max(1.0, affordable))))
    for offset in (0.5, 0.0, 0.25, 0.75):
        r = _Rounder(model, offset)
        fixed, cur = {}, lp
        ok = True
        for start in range(0, U, batch):
            if over():
                return bound, None, None
            units = range(start, min(U, start + batch))
            state = r.save()
            trial = dict(fixed, **r.round(units, cur))
            obj, values = relaxation(time_limit, trial)
            if obj is None and held is not None:
                # the batch as rounded does not fit: unit by unit, a unit that does not fit
                # as rounded taking the first of its other choices that does (cheap with the
                # held LP's warm re-solves; gpt3-175b's joint model failed every offset here)
                r.restore(state)
                trial, obj, values = _unit_by_unit(r, units, fixed, cur,
                                                   lambda f: relaxation(time_limit, f), over)
            if obj is None:
                ok = False
                break
            fixed, cur = trial, values
        if ok:
            # every binary is fixed now: the last relaxation is the plan's LP (held), or is
            # timed as one
            if held is None:
                obj, cur = _fixed_lp(model, solver, time_limit, fixed)
            elif obj is not None and (bound is None or rel_gap(obj, bound) > gap):
                t_pol = time.perf_counter()

                def left():              # of the polish's share
                    return None if polish_limit is None else \
                        polish_limit - (time.perf_counter() - t_pol)

                def count_bound(b, o):   # on every count, from bound b, to prove plan o
                    return lambda limit, stop: _count_bound(model, held, lp, b, o * (1 - gap),
                                                            limit, stop=stop)
                # the count bound first, on the home counts, a few LPs (0.1-0.4 s on
                # gpt2-xl), after which the polish has less to find (gpt2-xl at a quarter of
                # its activations: polish 0.58 s -> 0.16 s, plan solve 3.2 s -> 2.8 s)
                if bound is not None:
                    bound = _count_bound(model, held, lp, bound, obj * (1 - gap), left(),
                                         COUNT_LPS_FIRST, counts=model.home_counts())
                if bound is None or rel_gap(obj, bound) > gap:
                    # the count bound on every count beside the polish: where the dive's plan
                    # is already within a hair of the best, it proves it while the polish
                    # finds nothing (gpt2-xl at 38.45G: 0.5 s, where the polish took 1.8 s
                    # and the count bound after it 0.5 s more)
                    proof = None if bound is None else _Rival(
                        None, bound, gap, model.ts, count_bound(bound, obj), (cur, obj))
                    cur, obj = _guarded(_polish, model, held, lp, cur, obj, bound, gap, left(),
                                        prove=None if proof is None else proof.prove)
                    if proof is not None:
                        bound = proof.bound
                if (bound is not None and rel_gap(obj, bound) > gap and _fork_available()
                        and _big_mip(model)):
                    plan, plan_obj, b = cur, obj, bound
                    model.rival = _Rival(lambda limit: _rins(model, held, lp, plan, plan_obj,
                                                             b, gap, limit),
                                         bound, gap, model.ts, count_bound(b, plan_obj),
                                         (plan, plan_obj))
            if obj is not None:
                return bound, cur, obj
    return bound, None, None


def solve(model: Model, solver: str = "highs", time_limit: float | None = 60.0,
          gap: float = 0.005, warm=None, progress: bool = False,
          incumbent: float | None = None) -> Outcome:
    """Solve ``model``; raise ``Infeasible`` when nothing fits, ``NoIncumbent`` when the time
    limit ends the search before a solution.

    First ``_dive`` (a few LPs): when its plan is within ``gap`` of the LP's bound
    it is the answer, proven; otherwise it starts the full search (with ``warm``,
    a list of decisions such as the best baseline's, as the start where it has none).
    With ``incumbent`` (the step of the best plan another strategy has), raise
    ``NothingBetter`` as soon as the LP relaxation's bound shows that no plan of this model
    beats it by more than ``gap``."""
    if model.violated:
        raise Infeasible(f"constant rows violated: {', '.join(model.violated[:3])}")
    t0 = time.perf_counter()
    # A solver's own time limit does not count handing it the model (PuLP passes or writes
    # every row first): gpt3-175b's 8,600 rows ran each run ~2 s past its limit, and four runs
    # past the command's --time-limit. That much is kept back from each run's limit; the
    # first guess is by size, later ones what the runs took beyond their limits.
    model.overrun_s = max(model.overrun_s, model.prob.numConstraints() / PASS_ROWS_PER_S)

    def left(share=1.0):
        if time_limit is None:
            return None
        # 1.5x: a run with a start to pass overran by up to 1.8x the dive's first LP
        return max(0.5, (time_limit - (time.perf_counter() - t0) - 1.5 * model.overrun_s) * share)

    # the dive's share of the time: at IPM_MIN_COLUMNS and more, HiGHS's own search finds
    # nothing in the time plan solve has (its root LP by simplex alone took 118 s on gpt3-175b's
    # joint model), so the dive, which gives the plan there, gets most of it
    big = len(model.prob.variables()) >= IPM_MIN_COLUMNS
    bound, start, obj = _dive(model, solver, left(0.8 if big else 0.3), gap, incumbent,
                              polish_limit=left(0.5))
    if start is not None and bound is not None and rel_gap(obj, bound) <= gap:
        for v in model.prob.variables():
            v.varValue = start.get(v.name, v.varValue)
        status, g = "optimal", rel_gap(obj, bound)
    else:
        dived = start is not None           # the dive's rounded plan: complete, shares and all
        if start is None and warm:
            use = model.warm_start(warm)
            start = {v.name: v.varValue for v in model.prob.variables()} if use else None
        elif start is not None:
            for v in model.prob.variables():
                x = start.get(v.name, 0.0) or 0.0
                lo = -math.inf if v.lowBound is None else v.lowBound
                up = math.inf if v.upBound is None else v.upBound
                v.setInitialValue(min(max(x, lo), up))
        # HiGHS gets only a complete start (the dive's): handed a partial one (a baseline's
        # choices without its shares) it completes it in a sub-search that ran 40 s past a
        # 1.5 s limit (promises seed 1299)
        st, obj2, g = _run(model, solver, left(), gap, warm=start is not None,
                           start=start if (solver == "highs" and dived) else None,
                           progress=progress)
        if (st == pulp.LpSolutionOptimal and start is not None and g is not None and g > gap
                and bound is not None and obj2 is not None and rel_gap(obj2, bound) > gap):
            # HiGHS returned the start as "optimal" though the relaxation bounds the objective
            # more than the gap below it (seen minimising --gpu-mem on a 4-unit Bloom profile:
            # 0.450 GB "optimal", 0.385 GB without the start): search again without it
            st, obj2, g = _run(model, solver, left(), gap, progress=progress)
        if obj2 is None:
            if not dived:
                # nothing but the warm start (a baseline's decisions, whose transfer shares the
                # model does not set): that baseline is already a candidate of plan solve
                raise NoIncumbent(f"{solver} found no solution within {time_limit} s")
            for v in model.prob.variables():
                v.varValue = start.get(v.name, v.varValue)
            status = "feasible"
            g = rel_gap(obj, bound) if bound is not None else None
        else:
            status = "optimal" if st == pulp.LpSolutionOptimal else "feasible"
            if bound is not None and g is not None:
                g = min(g, rel_gap(obj2, bound))
    model.rival = None              # not run (no search followed the dive): let it go
    _settle(model, solver, left())
    sol = model.solution()
    return Outcome(solution=sol, solver=solver, status=status, gap=g,
                   solve_s=time.perf_counter() - t0, variables=len(model.prob.variables()),
                   constraints=model.prob.numConstraints())

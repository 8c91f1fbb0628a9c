"""The optimizer overlapped with the backward (``OverlapRules``, a part of ``CostModel``).

Under ``optimizer_overlap: overlapped`` a unit's optimizer work may start once its gradient of
the last micro-batch is complete (the end of its backward stage ``bwd(j)``, or later where the
gradient still has to leave the device: ``release_stage``) and runs in the
time the later backward stages of the last pass leave idle on each resource; what does not fit
there runs in the optimizer phase. With ``clip: none`` all of a unit's work may move (its state
reads, its step on the host or the device, its writes and its weights' way home); with ``clip:
global`` no update may start before the whole backward (the norm needs every gradient), so only
the state reads of units stepped on the host (on a unified-memory device: of any unit) move, up
to ``prefetch_bytes`` held in host memory (the device's, on unified memory) until the optimizer
phase. A stage is never lengthened by optimizer work: it fills idle
time only.

Per resource r this is a fluid schedule with release times and one deadline, whose exact
feasibility condition (Hall's) is one row per release point c: the work of the units released
at or after c fits in the idle time after c plus what the optimizer phase takes,

    R_r >= Σ_{j : rel(j) >= c} w_r(j) - Σ_{s = c+1}^{2U} (T_s - load_r(s)),    R_r >= 0,

and the optimizer phase lasts at least R_r + F_r on each resource (F_r: work that may not move).
The resources are taken one at a time (a unit's read, step and write are one fluid stream on
each), as the pipelined optimizer phase already takes them, and each unit's own read, step and
write back to back must fit between its release and the phase's end (its chain); the next
step's forward waits for every unit's writes, as it does after the optimizer phase.

Under ``optimizer_overlap: paced`` (clip none, one pass per step) nothing floats: each unit's
read, update and write are in the three stages after its release (``paced_part_stage``), whose
loads carry them (``TimeRules.loads``), and what the step holds is allocated and freed with
them (``MemoryRules.alloc``/``free``); the phase has what is left of the first units.
"""
from __future__ import annotations

from functools import cached_property

from planner.costmodel.layout import View
from planner.formats import Tier

OVERLAP_RESOURCES = ("compute", "d2h", "h2d", "duplex", "nvme", "host")
# the parts of one unit's step, in order: its reads, its update, its writes
PACED_PARTS = ("read", "step", "write")


class OverlapRules:
    """What may move into the backward, of a ``CostModel`` (which holds the data it reads)."""

    @property
    def overlapped(self) -> bool:
        """Whether this model prices the overlapped family (either optimizer depth)."""
        return self.optimizer_overlap == "overlapped"

    @property
    def paced(self) -> bool:
        """Whether this model prices the paced family: each unit's step pipelined through the
        backward stages after its own, each stage lasting until its parts are done
        (``paced_part_stage``)."""
        return self.optimizer_overlap == "paced"

    def paced_part_stage(self, j: int, h, part: str) -> int:
        """Paced: the stage that carries ``part`` (read, step, write: ``PACED_PARTS``) of unit
        j's step under home h. The read is in the stage after its release (``release_stage``:
        its backward, or the last stage for a resident home, the user's optimizer, and a tied
        unit), the update in the next, the write in the one after: the pipeline of the
        optimizer phase at depth 3, its units fed by the backward. Above 2U: the optimizer
        phase (the last units' parts)."""
        return self.release_stage(j, h) + 1 + PACED_PARTS.index(part)

    def in_phase(self, j: int, h, part: str = "step") -> bool:
        """Whether ``part`` of unit j's step under home h runs in the optimizer phase (every
        part of every step but the paced ones)."""
        return (not self.paced or h.resident or not self.G[j]
                or self.paced_part_stage(j, h, part) > 2 * self.U)

    @cached_property
    def paced_at(self) -> dict:
        """Paced: pass stage -> the (unit, home index, part) it carries."""
        out = {}
        if self.paced:
            for j in range(self.U):
                for k, h in enumerate(self.homes[j]):
                    if h.resident or not self.G[j]:
                        continue     # the user's optimizer steps it at opt.step(); or no step
                    for part in PACED_PARTS:
                        s = self.paced_part_stage(j, h, part)
                        if s <= 2 * self.U:
                            out.setdefault(s, []).append((j, k, part))
        return out

    def overlap_resources(self) -> tuple:
        """The resources of the Hall rows: the physical ones, and at depth 1 the one worker
        that runs each unit's read, step and write back to back (``worker``: no backward
        stage loads it, so all of a stage is its idle time)."""
        return OVERLAP_RESOURCES + (("worker",) if self.opt_depth == 1 else ())

    def serial_resources(self) -> tuple:
        """At depth 1, the resources the worker's parts run on, one per part of a step
        (duplex repeats the links' seconds): the worker's idle time in a stage is at most
        theirs summed (``worker_idle``)."""
        return ("compute", "host", "nvme", "d2h", "h2d")

    @staticmethod
    def worker_idle(stage_s: float, idle: list) -> float:
        """The worker's usable seconds in a backward stage: the stage, but no more than the
        idle time of the resources its parts run on (``idle``), summed: each part needs its
        own resource free, and the worker runs one part at a time."""
        return min(stage_s, sum(idle))

    def reads_state_ahead(self, h) -> bool:
        """Whether under ``clip: global`` home h's state read may move into the backward: a
        step on the host, or any step on a unified device (the read-ahead is held in the
        memory the step runs in either way)."""
        return h.step is Tier.CPU or self.unified

    def prefetch_tier(self) -> str:
        """Where state read ahead under ``clip: global`` is held: host memory (the device's on
        a unified-memory spec, whose host is the device)."""
        return "gpu" if self.unified else "cpu"

    def opt_work(self, v: View, by_release: bool = False) -> tuple[list, dict]:
        """``(movable, fixed)``: per unit j a dict resource -> Lin (seconds) of its optimizer
        work that may run after ``release_stage(j)``, and per resource the Lin of the work that
        stays in the optimizer phase. With ``by_release`` movable is a list of ``(stage,
        dict)``, one per unit and release stage of its homes (``release_stage(j, h)``: a home
        whose gradient stays on the device is released at its backward, unless resident or
        tied)."""
        res = self.overlap_resources()
        movable, fixed = [], {r: [] for r in res}
        for j in range(self.U):
            mine = {}                          # release stage -> resource -> Lin
            for k, h in enumerate(self.homes[j]):
                rel = self.release_stage(j, h) if by_release else self.release_stage(j)
                dest_m = mine.setdefault(rel, {r: [] for r in res})
                hv = v.h(j, k)
                r, w = self.step_reads(j, h), self.step_writes(j, h)
                dev, cpu = self.step_seconds(j, h)
                grad_rd = self.G[j] if h.grads is Tier.NVME else 0
                # the optimizer state itself (master, moments), and the rest of the step's
                # reads: the weights a step without a master updates (from NVMe, or the
                # host's own copy ``opt_copy`` counts with the state)
                state_rd = self.O[j] if h.optimizer is Tier.NVME else 0
                parts = {"rd": state_rd, "rd_w": r["nvme"] - grad_rd - state_rd,
                         "rd_grad": grad_rd,
                         "d2h": r["d2h"] + w["d2h"], "wr": w["nvme"], "h2d": w["h2d"] + r["h2d"],
                         "comp": dev, "host": cpu}
                # clip global: only the optimizer state may be read ahead, what the runtime
                # reads ahead (the state file's regions); the weights a step without a master
                # reads, and a gradient read, wait for the phase like the update. Units
                # stepped on the host, or anywhere on a unified device (its step reads its
                # state into the same memory the read ahead holds it in)
                move = set(parts) if self.clip == "none" else \
                    ({"rd"} if self.reads_state_ahead(h) else set())
                for name, n in parts.items():
                    if n:
                        dest = dest_m if name in move else fixed
                        for r_, c in self._work_terms(name, float(n)):
                            dest[r_].append((hv, c))
            if by_release:
                movable += sorted(mine.items())
            else:
                movable.append(next(iter(mine.values()), {r: [] for r in res}))
        return movable, fixed

    def chain_classes(self, v: View, j: int) -> list:
        """``(release stage, Lin)`` per release stage of unit j's homes: its read, step and
        write back to back (``opt_chains``) under the homes released there."""
        by = {}
        for k, h in enumerate(self.homes[j]):
            by.setdefault(self.release_stage(j, h), set()).add(k)
        out = []
        for rel, ks in sorted(by.items()):
            only = _OnlyHomes(v, j, ks)
            out += [(rel, t) for t in self.opt_chains(only, [j])]
        return out

    def _work_terms(self, part: str, n: float) -> list:
        """(resource, seconds) of one part of a step: bytes over its link, or seconds. At
        depth 1 every part is also the worker's time (its chain, as ``opt_chains``)."""
        out = self._physical_terms(part, n)
        if self.opt_depth == 1:
            hw = self.hw
            if part in ("comp", "host"):
                t = n
            elif part in ("rd", "rd_w", "rd_grad"):
                t = n / hw.nvme_read_bandwidth
            elif part == "wr":
                t = n / hw.nvme_write_bandwidth
            else:
                link = hw.d2h_bandwidth if part == "d2h" else hw.h2d_bandwidth
                t = n / link if link else 0.0
            if t:
                out.append(("worker", t))
        return out

    def _physical_terms(self, part: str, n: float) -> list:
        hw = self.hw
        if part == "comp":
            return [("compute", n)]
        if part == "host":
            return [("host", n)]
        if part in ("rd", "rd_w", "rd_grad"):
            return [("nvme", n / hw.nvme_read_bandwidth)]
        if part == "wr":
            return [("nvme", n / hw.nvme_write_bandwidth)]
        if self.unified:
            return []
        link = hw.d2h_bandwidth if part == "d2h" else hw.h2d_bandwidth
        return [(part, n / link), ("duplex", n / hw.duplex)]

    def last_pass_rest(self) -> bool:
        """Whether the last pass is one of the 'later' passes (they differ from the first)."""
        return self.passes > 1 and self.needs_rest_pass()

    def release_cuts(self) -> range:
        """The release points c of the Hall rows: every backward stage."""
        return range(self.U + 1, 2 * self.U + 1)

    def release_stage(self, j: int, home=None) -> int:
        """The stage after whose end unit j's optimizer work may start: its backward, or later
        where its gradient is not complete there: a gradient that leaves the device (the end
        of its gd window, under any of its homes), one tied to a later-backward unit (that
        unit's backward), a unit whose weights are used between blocks (the last stage).
        Given its ``home``, only that home's gradient counts. The runtime starts a unit's
        early work when its gradient is home off the device, or, kept on the device, at the
        end of its backward stage (``runtime/overlap.py``); it steps the resident home (the
        user's optimizer) and a tied unit whose gradient stays on the device at
        ``opt.step()``: those are released at the last stage."""
        L, top = self.L, 2 * self.U
        u = self.units[j]
        if u.outside_params > 0 or (home is not None and (home.resident or (
                home.grads is Tier.GPU and u.tied_to))):
            return top
        rel = L.bwd(j)
        idx = self._unit_index
        for t in u.tied_to or ():
            if t in idx:
                rel = max(rel, L.bwd(idx[t]))
        # only the ways a gradient of this unit may leave (a spec without a host tier has no
        # gdc: its empty window must not hold the unit back to the last stage)
        for kind, tier in (("gdc", Tier.CPU), ("gdn", Tier.NVME)):
            if any(h.grads is tier for h in ([home] if home is not None else self.homes[j])):
                w = self.window(kind, j)
                rel = max(rel, w[-1] if len(w) else top)
        return min(rel, top)

    @property
    def _unit_index(self) -> dict:
        return {x.name: i for i, x in enumerate(self.units)}

    def prefetch_s_per_byte(self) -> float:
        """NVMe seconds of one byte read ahead (``clip: global`` moves reads only)."""
        return 1.0 / self.hw.nvme_read_bandwidth if self.hw.nvme_read_bandwidth else 0.0

    def overlap_remainder(self, movable: list, last_loads: dict, last_dur: dict,
                          rel: list | None = None, busy: list | None = None) -> dict:
        """Per resource, the movable seconds left for the optimizer phase (numbers): the Hall
        maximum over release points, given the last pass's stage durations and loads and the
        movable work (dicts resource -> seconds) per unit, or per entry released at ``rel``.
        ``busy``: the resources the worker's parts may run on (default: those with work here;
        the MILP's rows take every resource some home of some unit has work on)."""
        U = self.U
        rel = [self.release_stage(j) for j in range(U)] if rel is None else rel
        out = {}
        for r in self.overlap_resources():
            w = [m.get(r, 0.0) for m in movable]
            if not any(w):
                out[r] = 0.0
                continue
            if busy is None:
                busy = [q for q in self.serial_resources()
                        if any(m.get(q, 0.0) for m in movable)]
            need, idle, worst = 0.0, 0.0, 0.0
            for c in range(2 * U, U, -1):          # from the last release point backwards
                need += sum(x for x, rj in zip(w, rel) if rj == c)
                worst = max(worst, need - idle)
                if r == "worker":
                    idle += self.worker_idle(last_dur[c], [
                        max(0.0, last_dur[c] - last_loads[c].get(q, 0.0)) for q in busy])
                else:
                    idle += max(0.0, last_dur[c] - last_loads[c].get(r, 0.0))
            out[r] = max(0.0, worst)
        if self.clip == "global":
            # only what the host can hold until the optimizer phase is read ahead
            # (at depth 1 the worker's movable time is those same reads)
            ahead = self.prefetch_bytes * self.prefetch_s_per_byte()
            for r in ("nvme", "worker") if "worker" in out else ("nvme",):
                total = sum(m.get(r, 0.0) for m in movable)
                out[r] = max(out[r], total - ahead)
        return out


class _OnlyHomes:
    """A view of unit j's homes ``ks`` only (every other home of j reads 0)."""

    def __init__(self, v, j, ks):
        self.v, self.j, self.ks = v, j, ks

    def h(self, i, k):
        return self.v.h(i, k) if i != self.j or k in self.ks else 0

"""Time: what each pass stage and the optimizer phase load on each resource (compute, the
links, the NVMe drive, the host), the optimizer step's seconds per home, and the step's floor
(``TimeRules``, a part of ``CostModel``)."""
from __future__ import annotations

import math

from planner.costmodel.layout import KINDS, REC, View
from planner.costmodel.overlap import PACED_PARTS
from planner.formats import Home, Tier

# Host-side gradient accumulation reads the accumulator and the arriving bytes and writes the
# sum: three bytes of memory traffic per gradient byte.
ACCUMULATE_TRAFFIC = 3.0


class TimeRules:
    """Seconds per resource of a ``CostModel`` (which holds the data they read)."""

    def step_seconds(self, i: int, h: Home) -> tuple[float, float]:
        """(device seconds, host seconds) of unit i's optimizer step under home h."""
        if h.step is Tier.CPU:
            return 0.0, self.N[i] / self.hw.cpu_adam_params_per_s
        return self.t_dev_opt[i], 0.0

    def accumulate_s_per_byte(self) -> float:
        """Host seconds to add one gradient byte into its accumulator."""
        bw = self.hw.host_memory_bandwidth or (self.hw.memory_bandwidth if self.unified else 0)
        return ACCUMULATE_TRAFFIC / bw if bw else 0.0

    def needs_rest_pass(self) -> bool:
        """Passes after the first read back an NVMe gradient accumulator: they differ (a
        layer-major step is one pass: each unit's gradient is complete within its stage)."""
        return self.passes > 1 and any(h.grads is Tier.NVME for hs in self.homes for h in hs)

    # -- time ------------------------------------------------------------------------------

    def loads(self, s: int, v: View, rest: bool) -> dict:
        """Lin per resource of pass stage s, each in seconds: the stage lasts the longest.

        compute: f_i at F:i; b_i + f_i e_i + Σ_k f_k q_{k,i} at B:i (its segment's recompute)
        d2h, h2d: bytes over the link's rate; duplex: both over the aggregate rate
        nvme: reads over the read rate plus writes over the write rate (one drive)
        host: gradient accumulation on the host
        """
        U, hw, L = self.U, self.hw, self.L
        comp, d2h, h2d, rd, wr, host = [], [], [], [], [], []
        if 1 <= s <= U:
            comp.append((1, self.f[s - 1]))
        elif s > U:
            i = 2 * U - s
            comp.append((1, self.b[i]))
            if any(ch in self.choices[i] for ch in REC):
                comp.append((v.e(i), self.f[i]))
            for k in v.recomputed_at(i):
                comp.append((v.q(k, i), self.f[k]))
        acc = self.accumulate_s_per_byte()
        for kind, i in v.at(s):
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            if K.src == "gpu" and not self.unified:
                d2h.append((sh, nb))
            if K.dst == "gpu" and not self.unified:
                h2d.append((sh, nb))
            if K.dst == "nvme":
                wr.append((sh, nb))
                if kind == "gdn" and rest:
                    rd.append((sh, nb))
                    host.append((sh, nb * acc))
            if K.src == "nvme":
                rd.append((sh, nb))
            if kind == "gdc":
                host.append((sh, nb * acc))
        if 2 <= s <= U + 1:                  # an offloaded checkpoint leaves
            i = s - 2
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    if not self.unified:
                        d2h.append((v.x(i, ch), float(self.X[i])))
                    if ch == "rn":
                        wr.append((v.x(i, ch), float(self.X[i])))
        for k, e, ch in v.ck_returns(s):
            yv, nb = v.y(ch, k, e), float(self.X[k])
            if not self.unified:
                h2d.append((yv, nb))
            if ch == "rn":
                rd.append((yv, nb))
        for j, k, part in self.paced_at.get(s, ()):
            # paced: a part of unit j's step beside this stage's backward
            self._step_terms(j, k, self.homes[j][k], v, (part,), comp, d2h, h2d, rd, wr, host)
        out = self._resource_terms(comp, d2h, h2d, rd, wr, host)
        if self.distributed:
            # net: the engine's collectives (``collectives``), beside compute on their own stream
            out["net"] = [(1, self.net_s[s])] if self.net_s[s] else []
        return out

    def _resource_terms(self, comp, d2h, h2d, rd, wr, host) -> dict:
        hw = self.hw
        out = {"compute": comp, "host": host}
        if not self.unified:
            out["d2h"] = [(v, c / hw.d2h_bandwidth) for v, c in d2h]
            out["h2d"] = [(v, c / hw.h2d_bandwidth) for v, c in h2d]
            out["duplex"] = [(v, c / hw.duplex) for v, c in d2h + h2d]
        else:
            out["d2h"] = out["h2d"] = out["duplex"] = []
        rb = hw.nvme_read_bandwidth or math.inf
        wb = hw.nvme_write_bandwidth or math.inf
        out["nvme"] = [(v, c / rb) for v, c in rd] + [(v, c / wb) for v, c in wr]
        return out

    def opt_loads(self, v: View) -> dict:
        """Lin per resource of the optimizer phase, each the total over units in seconds. With
        depth 3 the phase is a pipeline (read unit j+1, step unit j, write unit j-1 at once),
        so it lasts as long as its busiest resource, or as one unit's own read-step-write chain
        if that is longer (``opt_chains``); with depth 1 it is the sum of the chains."""
        comp, d2h, h2d, rd, wr, host = [], [], [], [], [], []
        for j in range(self.U):
            for k, h in enumerate(self.homes[j]):
                self._step_terms(j, k, h, v, self._phase_parts(j, h),
                                 comp, d2h, h2d, rd, wr, host)
        return self._resource_terms(comp, d2h, h2d, rd, wr, host)

    def paced_compute(self, s: int, v: View) -> list:
        """Paced: Lin of the device seconds of the updates stage s carries (in its compute)."""
        out = []
        for j, k, part in self.paced_at.get(s, ()):
            dev = self.step_seconds(j, self.homes[j][k])[0] if part == "step" else 0.0
            if dev:
                out.append((v.h(j, k), dev))
        return out

    def _phase_parts(self, j: int, h) -> tuple:
        """The parts of unit j's step under home h that run in the optimizer phase (all of
        them unless paced: ``in_phase``)."""
        return tuple(p for p in PACED_PARTS if self.in_phase(j, h, p))

    def _step_parts(self, j: int, h) -> dict:
        """Unit j's step under home h by part (``PACED_PARTS``): per part, the (list name,
        bytes or seconds) it adds; the lists are ``_step_terms``'."""
        r, w = self.step_reads(j, h), self.step_writes(j, h)
        dev, cpu = self.step_seconds(j, h)
        return {"read": (("rd", r["nvme"]), ("d2h", r["d2h"]), ("h2d", r["h2d"])),
                "step": (("comp", dev), ("host", cpu)),
                "write": (("wr", w["nvme"]), ("d2h", w["d2h"]), ("h2d", w["h2d"]))}

    def _step_terms(self, j, k, h, v, parts, comp, d2h, h2d, rd, wr, host) -> None:
        """``parts`` of unit j's step under its home k (``h``), appended to the lists of bytes
        per link and seconds per processor (``_resource_terms`` makes them seconds)."""
        hv = v.h(j, k)
        lists = {"rd": rd, "d2h": d2h, "wr": wr, "h2d": h2d, "comp": comp, "host": host}
        got = self._step_parts(j, h)
        for part in parts:
            for name, n in got[part]:
                if n:
                    lists[name].append((hv, float(n)))

    def opt_chains(self, v: View, units=None) -> list:
        """One Lin per unit (of ``units``, default all) with optimizer work in the optimizer
        phase: its read, step and write back to back (seconds; paced, the parts left for the
        phase)."""
        hw = self.hw
        rate = {"rd": hw.nvme_read_bandwidth, "wr": hw.nvme_write_bandwidth,
                "d2h": hw.d2h_bandwidth, "h2d": hw.h2d_bandwidth}
        out = []
        for j in (range(self.U) if units is None else units):
            terms = []
            for k, h in enumerate(self.homes[j]):
                got = self._step_parts(j, h)
                t = sum(n / rate[name] if name in rate else n
                        for part in self._phase_parts(j, h) for name, n in got[part] if n)
                if t:
                    terms.append((v.h(j, k), t))
            if terms:
                out.append(terms)
        return out

    # -- totals ----------------------------------------------------------------------------

    def compute_only(self) -> float:
        """Every plan's floor: K passes of forward and backward, and the optimizer phase at its
        shortest, which is the device's own step unless the host's CPU can take a share of it
        in parallel (the split that balances the two, fractional). When the update itself may
        run beside the backward (overlapped, clip none) only the passes are a floor."""
        passes = self.passes * (sum(self.f) + sum(self.b))
        if self.optimizer_overlap in ("overlapped", "paced") and self.clip == "none":
            return passes
        return passes + self.optimizer_floor()

    def optimizer_floor(self) -> float:
        """min over fractional splits x of max(Σ dev_j (1 - x_j), Σ cpu_j x_j), over the units
        whose step may run on the host: move the units that free the most device time per host
        second first, until the host's share would exceed the device's."""
        dev = sum(self.t_dev_opt)
        movable = []
        for j in range(self.U):
            cpu = min((self.step_seconds(j, h)[1] for h in self.homes[j] if h.step is Tier.CPU),
                      default=None)
            if cpu and self.t_dev_opt[j] > 0:
                movable.append((self.t_dev_opt[j] / cpu, self.t_dev_opt[j], cpu))
        host = 0.0
        for _, d, c in sorted(movable, reverse=True):
            # moving a fraction x of this unit: dev - d x = host + c x
            x = min(1.0, max(0.0, (dev - host) / (d + c)))
            dev -= d * x
            host += c * x
            if x < 1.0:
                break
        return max(dev, host)


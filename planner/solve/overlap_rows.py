"""The MILP's rows for the optimizer overlapped with the backward (``planner.costmodel.overlap``;
docs/formulation.md, "The optimizer beside the backward"), added to a ``planner.solve.milp.Model``.
"""
from __future__ import annotations

from planner.solve.lin import GB, lin


def overlap_rows(self) -> None:
    """The optimizer phase when units' optimizer work may run beside the backward
    (``planner.costmodel.overlap``), per resource r with movable work w_r(j):

    idle_r_c:  I_{r,c} = I_{r,c+1} + T'_{c+1} - load_r(c+1),  I_{r,2U} = 0  (idle after c)
    need_r_c:  N_{r,c} = N_{r,c+1} + Σ_{j: rel(j)=c} w_r(j)   (released at or after c)
    hall_r_c:  R_r >= N_{r,c} - I_{r,c}        for every backward stage c
    prefetch:  R_nvme >= N_{nvme,U+1} - Vpre / read rate    (clip global: reads held; at
               depth 1 the same row for the worker, whose movable time is those reads)
    timeo_r:   To >= R_r + F_r                 (F_r: work that may not move)
    worker (depth 1): its idle after c sums Z_s <= T'_s and Z_s <= Σ_q (T'_s - load_q(s)) over
               the resources q its movable parts run on (``worker_idle``)
    prefetch_most: Vpre / read rate <= N_{nvme,U+1}
    after_c:   A_c = A_{c+1} + T'_{c+1},  A_{2U} = 0             (time after c)
    timeo_chain_j: To + A_{rel(j)} >= read_j + step_j + write_j   (clip none; global: A = 0)
    (T' is the last pass's stage: the later passes' where they differ. At depth 1 one more
    resource, the worker, whose work per unit is its whole chain and whose idle time is the
    whole stage: ``OverlapRules.overlap_resources``.)"""
    cm, v = self.cm, self.v
    entries, fixed = cm.opt_work(v, by_release=True)
    mov = [m for _, m in entries]
    last = self.T2 if (self.T2 and cm.last_pass_rest()) else self.T
    top = 2 * cm.U
    released: dict = {}                # stage -> the entries released there (unit, homes)
    for e, (c, _) in enumerate(entries):
        released.setdefault(c, []).append(e)
    busy = [q for q in cm.serial_resources() if any(m[q] for m in mov)]
    for r, fixed_terms in fixed.items():
        if not any(m[r] for m in mov):
            if fixed_terms:
                self._c(self.To - lin(fixed_terms, 1 / self.ts) >= 0, f"timeo_{r}")
            continue
        R = self._var(f"Rov_{r}")
        idle, need = 0, 0
        for c in range(top, cm.U, -1):
            n_c = self._var(f"Nov_{r}_{c}")
            work = [t for j in released.get(c, ()) for t in mov[j][r]]
            self._c(n_c - need - lin(work, 1 / self.ts) == 0, f"need_{r}_{c}")
            if c < top:
                i_c = self._var(f"Iov_{r}_{c}")
                ld = cm.loads(c + 1, v, cm.last_pass_rest())
                if r == "worker":
                    # worker_idle: at most the stage, at most its parts' resources' idle
                    z = self._var(f"Zov_{c}")
                    self._c(z - last[c + 1] <= 0, f"worker_stage_{c}")
                    self._c(z - len(busy) * last[c + 1] + lin(
                        [t for q in busy for t in ld.get(q, [])], 1 / self.ts) <= 0,
                        f"worker_parts_{c}")
                    self._c(i_c - idle - z == 0, f"idle_{r}_{c}")
                else:
                    self._c(i_c - idle - last[c + 1] + lin(ld.get(r, []), 1 / self.ts) == 0,
                            f"idle_{r}_{c}")
                idle = i_c
            self._c(R - n_c + idle >= 0, f"hall_{r}_{c}")
            need = n_c
        if r in ("nvme", "worker") and self.Vpre is not None:
            rate = GB * cm.prefetch_s_per_byte() / self.ts
            self._c(R - need + self.Vpre * rate >= 0, "prefetch" if r == "nvme" else
                    f"prefetch_{r}")
            if r == "nvme":
                # no more read ahead than there is to read
                self._c(self.Vpre * rate - need <= 0, "prefetch_most")
        self._c(self.To - R - lin(fixed_terms, 1 / self.ts) >= 0, f"timeo_{r}")
    # each unit's own chain fits between its release and the phase's end (clip global: in the
    # phase, where its step and write are)
    after, later = {c: 0 for c in range(cm.U + 1, top + 1)}, 0
    for c in range(top - 1, cm.U, -1) if cm.clip == "none" else ():
        a_c = self._var(f"Aov_{c}")
        self._c(a_c - later - last[c + 1] == 0, f"after_{c}")
        after[c] = later = a_c
    for j in range(cm.U):
        # one row per release stage of j's homes: the chosen home's row is its chain, the
        # others' read 0 (a unit's homes are one choice)
        for n, (rel, terms) in enumerate(cm.chain_classes(v, j)):
            slack = after[rel]
            self._c(self.To + slack - lin(terms, 1 / self.ts) >= 0, f"timeo_chain_{j}_{n}")

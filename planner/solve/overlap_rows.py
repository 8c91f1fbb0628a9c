"""The MILP's rows for the optimizer overlapped with the backward (``planner.costmodel.overlap``;
docs/formulation.md, "The optimizer beside the backward"), added to a ``planner.solve.milp.Model``.
"""
from __future__ import annotations

from planner.solve.lin import GB, lin


def overlap_rows(self) -> None:
    """The optimizer phase when units' optimizer work may run beside the backward
    (``planner.costmodel.overlap``), per resource r with movable work w_r(j):

    idle_r_c:  I_{r,c} = I_{r,c+1} + T'_{c+1} - load_r(c+1),  I_{r,2U} = 0  (idle after c)
    need_r_c:  N_{r,c} = N_{r,c+1} + w_r(2U-c),   N_{r,2U+1} = 0  (released at or after c)
    hall_r_c:  R_r >= N_{r,c} - I_{r,c}        for every backward stage c
    prefetch:  R_nvme >= N_{nvme,U+1} - Vpre / read rate    (clip global: reads held)
    timeo_r:   To >= R_r + F_r                 (F_r: work that may not move)
    timeo_chain_j: To >= read_j + step_j + write_j   (unit 0 with clip none; all with global)
    (T' is the last pass's stage: the later passes' where they differ.)"""
    cm, v = self.cm, self.v
    mov, fixed = cm.opt_work(v)
    last = self.T2 if (self.T2 and cm.last_pass_rest()) else self.T
    top = 2 * cm.U
    for r, fixed_terms in fixed.items():
        if not any(m[r] for m in mov):
            if fixed_terms:
                self._c(self.To - lin(fixed_terms, 1 / self.ts) >= 0, f"timeo_{r}")
            continue
        R = self._var(f"Rov_{r}")
        idle, need = 0, 0
        for c in range(top, cm.U, -1):
            n_c = self._var(f"Nov_{r}_{c}")
            self._c(n_c - need - lin(mov[top - c][r], 1 / self.ts) == 0, f"need_{r}_{c}")
            if c < top:
                i_c = self._var(f"Iov_{r}_{c}")
                load = cm.loads(c + 1, v, cm.last_pass_rest())[r]
                self._c(i_c - idle - last[c + 1] + lin(load, 1 / self.ts) == 0,
                        f"idle_{r}_{c}")
                idle = i_c
            self._c(R - n_c + idle >= 0, f"hall_{r}_{c}")
            need = n_c
        if r == "nvme" and self.Vpre is not None:
            self._c(R - need + self.Vpre * (GB * cm.prefetch_s_per_byte() / self.ts) >= 0,
                    "prefetch")
        self._c(self.To - R - lin(fixed_terms, 1 / self.ts) >= 0, f"timeo_{r}")
    for n, terms in enumerate(cm.opt_chains(v, [0] if cm.clip == "none" else None)):
        self._c(self.To - lin(terms, 1 / self.ts) >= 0, f"timeo_chain_{n}")

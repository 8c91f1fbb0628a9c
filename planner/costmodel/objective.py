"""The objective's secondary terms: bytes held longer than their window requires (what a
solve's second phase minimises) and bytes moved (the tie-break, ``EPS_S_PER_BYTE`` a byte)
(``ObjectiveTerms``, a part of ``CostModel``)."""
from __future__ import annotations

from planner.costmodel.layout import KINDS, Lin, View

# A tie-break on the objective: 10 us per GB moved, so that moving bytes that hide fully
# behind compute loses to not moving them (it gains nothing and costs link time).
EPS_S_PER_BYTE = 1e-5 / 1e9


class ObjectiveTerms:
    """Secondary objective terms of a ``CostModel``."""

    def held_longer(self, v: View) -> Lin:
        """Device bytes held for longer than their transfer window requires, times the stages
        (as a fraction of the pass): a send that leaves after its window's first stage, or a
        fetch that arrives before its window's last. What the second phase of a solve minimises
        (``solvers._settle``): among schedules of equal step, the least device memory held, which
        is also how a runtime behaves (it frees a tensor as soon as its bytes have left, and
        has no reason to fetch early what is hidden anyway)."""
        out = []
        n = float(len(self.L.pass_stages))
        for s in self.L.pass_stages:
            for kind, i in v.at(s):
                K, w = KINDS[kind], self.window(kind, i)
                late = s - w.start if K.src == "gpu" else (w.stop - 1 - s if K.dst == "gpu" else 0)
                if late > 0:
                    out.append((v.share(kind, i, s), float(self.size(kind, i)) * late / n))
        return out

    def moved_bytes(self, v: View) -> Lin:
        """Bytes moved per pass (the tie-break's measure)."""
        out = []
        for s in self.L.pass_stages:
            for kind, i in v.at(s):
                if KINDS[kind].src == "gpu" or KINDS[kind].cls == "weight":
                    out.append((v.share(kind, i, s), float(self.size(kind, i))))
        for i in range(self.U):
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    out.append((v.x(i, ch), float(self.X[i])))
        return out

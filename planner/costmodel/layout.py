"""The cost model's vocabulary: tiers and resources, the activation choices and the decisions
they stand for, the stages of one optimizer step (``Layout``), the kinds of spread transfer
(``KINDS``), the ``View`` through which the MILP (variables) and the simulator (numbers) answer
for the decisions, ``Lin`` and ``evaluate``, and the transfer windows (``Windows``)."""
from __future__ import annotations

from dataclasses import dataclass

from planner.formats import Activation, LayerDecision, Tier

TIERS = ("gpu", "cpu", "nvme")
RESOURCES = ("compute", "d2h", "h2d", "duplex", "nvme", "host")
# Activation choices: keep, offload to cpu / nvme, recompute with the input checkpoint on
# gpu / cpu / nvme (rg, rc, rn), recompute from the previous checkpoint (rz, checkpoint none).
CHOICES = ("keep", "cpu", "nvme", "rg", "rc", "rn", "rz")
CHOICE_DECISION = {
    "keep": (Activation.KEEP, None), "cpu": (Activation.CPU, None),
    "nvme": (Activation.NVME, None), "rg": (Activation.RECOMPUTE, Tier.GPU),
    "rc": (Activation.RECOMPUTE, Tier.CPU), "rn": (Activation.RECOMPUTE, Tier.NVME),
    "rz": (Activation.RECOMPUTE, Tier.NONE),
}
REC = ("rg", "rc", "rn", "rz")


def decision_choice(d: LayerDecision) -> str:
    for c, (act, ck) in CHOICE_DECISION.items():
        if d.activation is act and (act is not Activation.RECOMPUTE or
                                    (d.checkpoint or Tier.GPU) is ck):
            return c
    raise AssertionError(d)


Lin = list   # [(value, coefficient)]


def evaluate(terms: Lin) -> float:
    return float(sum(v * c for v, c in terms))


# ----------------------------------------------------------------------------- stages

@dataclass(frozen=True)
class Layout:
    """Stage indices of one optimizer step with U units."""

    U: int

    @property
    def pass_stages(self) -> range:
        return range(0, 2 * self.U + 1)

    @property
    def opt_stage(self) -> int:
        """The optimizer phase: one stage after the last pass."""
        return 2 * self.U + 1

    @property
    def n_stages(self) -> int:
        return 2 * self.U + 2

    def fwd(self, i: int) -> int:
        return 1 + i

    def bwd(self, i: int) -> int:
        return 2 * self.U - i

    def unit_of(self, s: int) -> int | None:
        """The unit whose compute opens pass stage s (None for the prologue and the optimizer
        phase)."""
        U = self.U
        if s == 0 or s > 2 * U:
            return None
        return s - 1 if s <= U else 2 * U - s

    def phase(self, s: int) -> str:
        U = self.U
        if s == 0:
            return "prologue"
        if s <= U:
            return "forward"
        if s <= 2 * U:
            return "backward"
        return "optimizer"


# ----------------------------------------------------------------------------- transfers

@dataclass(frozen=True)
class Kind:
    """One kind of spread transfer: a class of bytes of a unit moved over a window of stages
    as continuous shares (Σ shares = the decision that asks for it)."""

    name: str            # also the MILP's variable prefix
    cls: str             # act | weight | grad
    src: str             # tier the bytes come from
    dst: str             # tier they go to


KINDS = {k.name: k for k in (
    Kind("oc", "act", "gpu", "cpu"), Kind("on", "act", "gpu", "nvme"),
    Kind("pc", "act", "cpu", "gpu"), Kind("pn", "act", "nvme", "gpu"),
    Kind("wfc", "weight", "cpu", "gpu"), Kind("wfn", "weight", "nvme", "gpu"),
    Kind("wbc", "weight", "cpu", "gpu"), Kind("wbn", "weight", "nvme", "gpu"),
    Kind("gdc", "grad", "gpu", "cpu"), Kind("gdn", "grad", "gpu", "nvme"),
)}


class View:
    """What the cost model asks about the decisions. The MILP answers with variables, the
    simulator with numbers; a decision that cannot be taken answers 0."""

    def x(self, i: int, c: str):                  # activation choice c of unit i
        raise NotImplementedError

    def h(self, i: int, k: int):                  # home k (index into CostModel.homes[i])
        raise NotImplementedError

    def share(self, kind: str, i: int, s: int):   # share of unit i's bytes moved in stage s
        raise NotImplementedError

    def e(self, i: int):                          # i ends a recompute segment
        raise NotImplementedError

    def q(self, k: int, i: int):                  # k is recomputed at the backward of i (k < i)
        raise NotImplementedError

    def y(self, c: str, k: int, e: int):          # k's offloaded checkpoint returns for segment end e
        raise NotImplementedError

    def at(self, s: int) -> list:                 # (kind, i) that may move a share in stage s
        raise NotImplementedError

    def recomputed_at(self, i: int) -> list:      # k < i that the recompute at bwd(i) may rebuild
        raise NotImplementedError

    def ck_returns(self, s: int) -> list:         # (k, e, choice) whose checkpoint may return in s
        raise NotImplementedError


# ----------------------------------------------------------------------------- the model

@dataclass
class Windows:
    act: int        # w_a: stages an activation transfer may spread over
    weight: int     # w_w: stages a weight fetch may spread over
    grad: int       # w_g: stages a gradient offload may spread over
    seg: int = 8    # w_seg: longest recompute segment


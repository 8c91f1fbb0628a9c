"""The decisions a plan makes for one unit: where its activations go (``LayerDecision``) and
where its weights, gradients and optimizer state live and its step runs (``Home``).
"""
from __future__ import annotations

from dataclasses import dataclass

from planner.errors import UserError
from planner.formats.enums import Activation, Tier


@dataclass(frozen=True)
class Home:
    """Where one unit's static tensors live between uses, and where its optimizer step runs.

    ``weights`` (compute dtype): gpu, cpu (pinned host) or nvme; ``grads``: gpu, cpu or nvme
    (the accumulated gradient between passes); ``optimizer`` (fp32 master and moments): gpu,
    cpu or nvme; ``step``: gpu (the compute device) or cpu (the host CPU).
    """

    weights: Tier = Tier.GPU
    grads: Tier = Tier.GPU
    optimizer: Tier = Tier.GPU
    step: Tier = Tier.GPU

    @property
    def resident(self) -> bool:
        """Everything on the compute device: the activation-only planner's world."""
        return all(t is Tier.GPU for t in (self.weights, self.grads, self.optimizer, self.step))

    @property
    def state_up(self) -> bool:
        """``w:gpu g:gpu o:cpu s:gpu``: the state in host memory, stepped on the device."""
        return (self.weights, self.grads, self.optimizer, self.step) == \
            (Tier.GPU, Tier.GPU, Tier.CPU, Tier.GPU)

    @property
    def streams_weights(self) -> bool:
        return self.weights is not Tier.GPU

    def label(self) -> str:
        """``w:cpu g:cpu o:nvme s:cpu`` (or ``gpu`` when resident), for tables."""
        if self.resident:
            return "gpu"
        return (f"w:{self.weights.value} g:{self.grads.value} o:{self.optimizer.value} "
                f"s:{self.step.value}")


RESIDENT = Home()


@dataclass(frozen=True)
class LayerDecision:
    """The independent choices for one unit (see ``docs/file-formats.md``, Layers)."""

    name: str
    activation: Activation
    checkpoint: Tier | None = None   # only for RECOMPUTE
    home: Home = RESIDENT

    def to_dict(self) -> dict:
        d = {"name": self.name, "activation": self.activation.value,
             "weights": self.home.weights.value, "grads": self.home.grads.value,
             "optimizer": self.home.optimizer.value, "step": self.home.step.value}
        if self.activation is Activation.RECOMPUTE:
            d["checkpoint"] = (self.checkpoint or Tier.GPU).value
        return d

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "LayerDecision":
        try:
            if not isinstance(d, dict):
                raise TypeError(f"it is a {type(d).__name__}, not an object")
            if not isinstance(d["name"], str) or not d["name"]:
                raise TypeError("name is not a non-empty string")
            act = Activation(d["activation"])
            ck = Tier(d["checkpoint"]) if act is Activation.RECOMPUTE else None
            home = Home(*(Tier(d.get(k, "gpu")) for k in ("weights", "grads", "optimizer", "step")))
        except (KeyError, ValueError, TypeError) as e:
            shown = repr(d)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise UserError(f"plan '{source}': layer entry {shown} is malformed ({e}); activation "
                            "is keep|recompute|cpu|nvme, checkpoint gpu|cpu|nvme|none, weights/"
                            "grads/optimizer gpu|cpu|nvme and step gpu|cpu") from None
        if ck is not None and ck is not Tier.NONE and ck not in (Tier.GPU, Tier.CPU, Tier.NVME):
            raise UserError(f"plan '{source}': layer {d['name']!r} has checkpoint {ck.value!r}")
        if Tier.NONE in (home.weights, home.grads, home.optimizer, home.step) or \
                home.step is Tier.NVME:
            raise UserError(f"plan '{source}': layer {d['name']!r}: weights, grads and optimizer "
                            "live on gpu, cpu or nvme, and a step runs on gpu or cpu; "
                            "regenerate it with 'plan solve'")
        return cls(name=d["name"], activation=act, checkpoint=ck, home=home)

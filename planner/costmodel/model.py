"""The one cost model: the stages of an optimizer step, what every decision holds on each tier
in each stage, what each stage moves on each link, and what each stage's duration is made of.

Nothing else in tierplan knows these rules. The MILP (``planner.solve.milp``) builds its rows from
them with PuLP variables; the simulator (``planner.plans.simulate``) evaluates the very same
functions with a plan's numbers; the schedule builder and ``inspect`` ask them too. So the
MILP's objective and a plan's simulated step are the same function of the decisions, and
``docs/formulation.md`` documents this package symbol for symbol.

``CostModel`` holds the data; its rules come from the parts it is made of: ``OptionRules``
(homes, choices, windows), ``MemoryRules`` (bytes per tier and stage), ``TimeRules`` (seconds
per resource), ``OverlapRules`` (the optimizer beside the backward), ``RankRules`` (FSDP2/DDP),
``ObjectiveTerms`` (secondary terms).

How the functions speak: every quantity is a ``Lin``, a list of ``(value, coefficient)``
pairs, where ``value`` is whatever the caller's ``View`` returns for a decision: a PuLP
variable in the MILP, a number in the simulator. ``evaluate`` sums a Lin of numbers.

Stages (``Layout``). One optimizer step is ``K`` forward/backward passes, then the optimizer
phase: 2U+2 stages in all. A pass has 2U+1 stages: the prologue (stage 0, no compute: weights
the first forward needs come in), the forward of unit i (stage 1+i) and its backward (stage
2U-i; a segment's recompute runs at the start of its last unit's backward stage). The
optimizer phase is one more stage (2U+1). With ``optimizer_depth`` 3 it is a pipeline: unit
j+1's state is read while unit j steps and unit j-1 is written back, so it lasts as long as its
busiest resource, or as one unit's own read-step-write chain if that is longer; with depth 1
the units go one after the other and it lasts the sum of their chains. Every pass stage ends at
a barrier: it lasts as long as its longest resource (compute, each link, the NVMe drive, the
host CPU), a transfer assigned to it starts with it, and bytes it moves out are freed at its
end while bytes it brings in are held from its start.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from functools import partial

from planner.costmodel.layout import Layout, Windows
from planner.costmodel.loads import TimeRules
from planner.costmodel.memory import MemoryRules
from planner.costmodel.objective import ObjectiveTerms
from planner.costmodel.options import OptionRules
from planner.costmodel.overlap import OverlapRules
from planner.costmodel.ranks import RankRules
from planner.formats import IO_BLOCK_BYTES, HardwareSpec, io_requests
from planner.formats.enums import paced_possible


def device_budget(gpu_bytes: int, hw: HardwareSpec, margin_bytes: int = 0) -> int:
    """The device bytes a plan may use under ``--gpu-mem`` = ``gpu_bytes``: the budget less
    ``margin_bytes`` (the MILP's, ``planner.solve.config.MARGIN_BYTES``; 0 for the simulator),
    less the spec's reserve (what no profile counts stays free), never below 0. The one place
    the reserve is taken off."""
    return max(0, max(0, gpu_bytes - margin_bytes) - int(hw.reserved_bytes))


@dataclass(frozen=True, eq=False)
class CostModel(OptionRules, MemoryRules, TimeRules, OverlapRules, RankRules, ObjectiveTerms):
    """Everything about one profile on one spec under one set of budgets that the MILP and the
    simulator must agree on. Frozen: a variant (other budgets, depth, homes allowed) is
    ``dataclasses.replace(cm, field=value)``, which derives the rest again.

    The fields are the inputs; ``__post_init__`` derives what the rules read (``U``, ``L``,
    ``K``, ``budget``, the per-unit figures ``A X W P G O M N f b``, ``homes``, ``choices``,
    ``windows``, ``shared``, and under a sharded engine the per-rank figures). After the build
    ``windows`` holds the windows in use, so a variant keeps them. The derived lists and the
    ``budget`` dict are read, never changed."""

    units: list = field(repr=False)   # the profile's units (UnitRecord), in order
    hw: HardwareSpec                  # the spec the plan runs on
    _: KW_ONLY
    gpu_bytes: int                    # --gpu-mem: the device budget as given (reserve included)
    cpu_bytes: int                    # --cpu-mem: the host budget of the node
    nvme_bytes: int                   # --nvme-mem: the NVMe budget of the node
    micro_batches: int = 1            # K: forward/backward passes per optimizer step
    optimizer_s: float = 0.0          # the profile's device optimizer step, seconds
    optimizer_workspace_bytes: int = 0  # what the device optimizer step allocates on top
    allow_offload: bool = True        # activations may go to the host / NVMe (not remat-only)
    allow_streaming: bool = True      # homes off the device may be chosen (not --stream off)
    windows: Windows | None = None    # transfer windows; None: data-sized (``_default_windows``)
    optimizer_depth: int = 3          # units in flight in the optimizer phase: 1 or 3
    cache_bytes: int = 0              # a key/value cache the blocks fill, held for the step
    world_size: int = 1               # ranks training together
    ranks_per_node: int = 1           # ranks sharing a node's host and NVMe budgets
    engine: str = "none"              # none, fsdp2 or ddp
    shard_homes: str = "all"          # fsdp2: "runnable" (what the runtime executes) or "all"
    chain_breaks: frozenset = frozenset()  # blocks whose input is not the previous block's output
    not_replayable: frozenset = frozenset()  # blocks that cannot be recomputed (a cache written)
    margin_bytes: int = 0             # kept free below the device budget besides the reserve
    optimizer_overlap: str = "after-backward"  # or "overlapped", "paced" (``OverlapRules``)
    clip: str = "global"              # the loop clips by the global norm ("global") or not
    prefetch_bytes: int = 0           # clip global, overlapped: state read ahead and held
    micro_batch_order: str = "batch-major"  # or "layer-major": K micro-batches per unit stage
    state_up_homes: str = "auto"      # the state-up home: "auto" (where the static state is over
    #                                   the device budget) or "all" (a given plan's check)
    moot_homes: str = "drop"          # homes placing a class of no bytes off the device: "drop"
    #                                   or "keep" (a given plan's check; ``home_is_moot``)

    def __post_init__(self):
        put = partial(object.__setattr__, self)
        hw, cpu_bytes, nvme_bytes = self.hw, self.cpu_bytes, self.nvme_bytes
        allow_streaming, optimizer_depth = self.allow_streaming, self.optimizer_depth
        put("units", list(self.units))
        # the profile's model.chain_breaks (blocks whose input is not the previous block's
        # output: no segment continues into them, no checkpoint 'none') and not_replayable
        # (a cache tensor written in place: never recomputed, no segment through them)
        put("chain_breaks", frozenset(self.chain_breaks or ()))
        put("not_replayable", frozenset(self.not_replayable or ()))
        put("U", len(self.units))
        put("L", Layout(self.U))
        put("K", max(1, int(self.micro_batches)))
        # batch-major: the stages run K times (K passes); layer-major: once, each unit's
        # stage running all K micro-batches while its weights are on the device
        if self.micro_batch_order not in ("batch-major", "layer-major"):
            raise ValueError(f"micro_batch_order {self.micro_batch_order!r}")
        layer_major = self.micro_batch_order == "layer-major"
        put("passes", 1 if layer_major else self.K)
        per = self.K if layer_major else 1          # micro-batches in one stage
        put("unified", bool(hw.unified_memory))
        # Every host byte the runtime holds is pinned (CUDA): the pinned limit caps the budget.
        cpu_cap = cpu_bytes if self.unified or not hw.pinned_limit else min(cpu_bytes, hw.pinned_limit)
        # the bytes each tier may hold (the device's less the spec's reserve and the margin);
        # a sharded engine's ranks share the node's host and NVMe budgets (``_ranks``)
        put("budget", {"gpu": device_budget(self.gpu_bytes, hw, self.margin_bytes),
                       "cpu": cpu_cap, "nvme": nvme_bytes})
        u = self.units
        # layer-major: a stage holds K micro-batches' saved bytes (A1: one's) and checkpoints
        put("A", [per * x.activation_bytes for x in u])
        put("A1", [x.activation_bytes for x in u])
        put("X", [per * x.input_bytes for x in u])
        put("W", [x.workspace_bytes for x in u])
        put("P", [x.param_bytes for x in u])
        put("G", [x.grad_bytes for x in u])
        put("O", [x.optimizer_bytes for x in u])
        put("M", [x.master_bytes for x in u])
        put("N", [x.param_count for x in u])
        put("f", [per * float(x.fwd_s) for x in u])
        put("b", [per * float(x.bwd_s) for x in u])
        put("opt_ws", int(self.optimizer_workspace_bytes))
        # a sharded engine (FSDP2, DDP): per-rank static state, budgets and optimizer step
        optimizer_s = self._ranks(self.world_size, self.ranks_per_node, self.engine,
                                  self.optimizer_s)
        if self.engine == "ddp":
            # DDP replicates every tensor on every rank: homes off the device are not planned
            # there (docs/distributed.md, "Homes per rank"); under FSDP2 a rank's shards may go
            allow_streaming = False
        # units in flight in the optimizer phase: 1 steps them one after the other (read, step,
        # write back), 3 reads the next and writes the previous back while one steps
        if optimizer_depth not in (1, 3):
            raise ValueError(f"optimizer_depth {optimizer_depth}: use 1 or 3")
        self._check_schedule_family()
        put("opt_depth", optimizer_depth)
        # a key/value cache the blocks fill (Hugging Face use_cache): the model's output holds
        # it, and a loop may keep that output until the next forward replaces it, so it is
        # counted for the whole step
        put("cache", per * int(self.cache_bytes))
        static = [self.P[i] + self.G[i] + self.O[i] for i in range(self.U)]
        total = sum(static)
        # The device optimizer step of each unit: the profile's figure, shared by static bytes.
        put("t_dev_opt", [float(optimizer_s) * s / total if total else 0.0 for s in static])
        put("has_cpu", (not self.unified) and cpu_bytes > 0)
        put("has_nvme", nvme_bytes > 0 and hw.nvme_read_bandwidth > 0 and hw.nvme_write_bandwidth > 0)
        put("windows", self.windows or self._default_windows())
        for k, n in zip(("staging_cap", "n_staging", "staging_pad"), self._staging(hw)):
            put(k, n)
        put("homes", [self._homes(i, allow_streaming) for i in range(self.U)])
        put("choices", [self._choices(i) for i in range(self.U)])
        put("shared", [per * n for n in self._shared_memory()])
        for s, n in enumerate(self._tied_grad_buffers()):
            self.shared[s] += per * n        # layer-major: each micro-batch's part, held
        if self.distributed:
            # what the engine holds per stage whatever the decisions (gathered weights, unsharded
            # gradients) joins the shared tensors: both are constants of the stage
            put("engine_mem", self._engine_memory())
            put("shared", [a + b for a, b in zip(self.shared, self.engine_mem)])
            put("net_s", self._net_seconds())

    def _check_schedule_family(self) -> None:
        """The family's fields are known values, and a paced one is possible: each unit's step
        right after its backward needs its gradient complete there (one pass per step), no clip
        by the global norm, and the plan's own path stepping it (no engine)."""
        if self.optimizer_overlap not in ("after-backward", "overlapped", "paced") or \
                self.clip not in ("global", "none") or self.state_up_homes not in ("auto", "all") \
                or self.moot_homes not in ("drop", "keep"):
            raise ValueError(f"{self.optimizer_overlap!r}, {self.clip!r}, {self.state_up_homes!r}, "
                             f"{self.moot_homes!r}")
        if self.optimizer_overlap == "paced" and not paced_possible(
                self.clip, self.engine, self.K, self.micro_batch_order):
            raise ValueError(f"paced needs clip none, one pass and no engine: {self.clip!r}, "
                             f"{self.passes} passes, engine {self.engine!r}")

    def _staging(self, hw: HardwareSpec) -> tuple[int, int, int]:
        """The staging pool NVMe traffic goes through: (each buffer's cap, buffers, bytes a
        buffer may need beyond its transfer). CUDA's pinned pool; on a CPU device, whose
        runtime reads and writes the tensors' own memory, the disk requests' bounce buffers,
        whose requests may spill into a partial block at each end (runtime/disk.py)."""
        if self.unified or hw.device == "cpu":
            req, n = io_requests(True, hw.nvme_drives)
            return req, n, 2 * IO_BLOCK_BYTES
        return int(hw.staging_buffer_bytes), int(hw.staging_buffers), 0

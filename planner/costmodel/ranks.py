"""A sharded engine (FSDP2, DDP): per-rank static state and budgets, the engine's collectives
and their ring cost, and what the engine holds on the device per stage (``RankRules``, a part
of ``CostModel``). docs/distributed.md documents each rule and its source."""
from __future__ import annotations

import dataclasses
from functools import partial

from planner.errors import UserError
from planner.formats import UnitKind


class RankRules:
    """FSDP2 and DDP rules of a ``CostModel`` (which holds the data they read)."""

    # -- ranks: FSDP2 and DDP ----------------------------------------------------------------
    # Only a sharded engine (``engine`` fsdp2 or ddp) reaches this section; world_size 1 with
    # engine none builds exactly the single-process model above. docs/distributed.md documents
    # each rule and its source.

    def _ranks(self, world_size: int, ranks_per_node: int, engine: str, optimizer_s: float) -> float:
        """Per-rank figures of a sharded engine; returns the per-rank optimizer step time.

        The profile is one rank's (its batch is the per-rank batch). FSDP2 shards every unit's
        weights, gradients and optimizer state 1/N (P_i, G_i, O_i, M_i become ceil(x/N); the
        full P_i, G_i are kept as ``Pfull``, ``Gfull`` for what is gathered), so the optimizer
        steps 1/N of the state. DDP replicates them. --cpu-mem and --nvme-mem are per node: each
        rank gets 1/R of them (R ranks per node).
        NB: FSDP2 pads each parameter's first dimension to a multiple of N; ceil(P_i/N) leaves
        out that padding (at most N-1 rows per parameter).
        NB: segment recompute (checkpoint ``none``) is not offered under FSDP2: a unit rebuilt
        at a later unit's backward would need its weights gathered a second time, so every
        recompute runs in the unit's own backward, when FSDP2 has gathered them anyway.
        """
        put = partial(object.__setattr__, self)     # called while the frozen model is built
        put("world", int(world_size))
        put("rpn", int(ranks_per_node))
        put("engine", str(engine))
        if self.engine not in ("none", "fsdp2", "ddp"):
            raise ValueError(f"engine {engine!r}: use none, fsdp2 or ddp")
        if self.world < 1 or not 1 <= self.rpn <= self.world:
            raise ValueError(f"world_size {world_size}, ranks_per_node {ranks_per_node}: need "
                             "1 <= ranks_per_node <= world_size")
        if self.engine == "none" and self.world > 1:
            raise ValueError(f"world_size {world_size} needs an engine (fsdp2 or ddp)")
        put("distributed", self.engine != "none")
        put("nodes", -(-self.world // self.rpn))
        put("Pfull", list(self.P))
        put("Gfull", list(self.G))
        put("engine_static", 0)
        if not self.distributed:
            return optimizer_s
        N = self.world
        for k in ("cpu", "nvme"):
            self.budget[k] //= self.rpn
        put("hw", rank_share(node_spec(self.hw), self.rpn))
        if self.engine == "fsdp2":
            put("Nfull", list(self.N))
            for name in ("P", "G", "O", "M", "N"):
                put(name, [-(-x // N) for x in getattr(self, name)])
            return optimizer_s / N
        # DDP copies gradients into its buckets (gradient_as_bucket_view=False, its default):
        # one more copy of every gradient, allocated once and held for good
        put("engine_static", sum(self.G))
        return optimizer_s

    def net_bandwidth(self) -> float:
        """Bus bandwidth of one rank's ring: the intra-node link on one node; across nodes the
        slower of it and the inter-node link (a ring crosses every node boundary)."""
        hw = self.hw
        bw = float(hw.intra_node_bandwidth)
        if self.nodes > 1:
            bw = min(bw, float(hw.inter_node_bandwidth))
        return bw

    def ring_seconds(self, op: str, nbytes: int) -> float:
        """Ring cost of a collective on a tensor of ``nbytes`` (the unsharded size) across N
        ranks: all-gather and reduce-scatter move (N-1)/N of it through each rank, all-reduce
        twice that (NVIDIA nccl-tests doc/PERFORMANCE.md, bus bandwidth; Thakur, Rabenseifner
        and Gropp 2005). NB: the per-step latency (N-1) alpha is left out: these are megabytes."""
        N = self.world
        if N <= 1 or not nbytes:
            return 0.0
        bw = self.net_bandwidth()
        if bw <= 0:
            field = "intra_node_bandwidth" if self.nodes == 1 else "inter_node_bandwidth"
            raise UserError(f"hardware spec {self.hw.name!r} gives no {field}, which {N} ranks "
                            f"on {self.nodes} node(s) need; add it (bytes/s of one rank's ring, "
                            "see profiles/hardware/h100-80g.yaml)")
        factor = 2.0 if op == "all-reduce" else 1.0
        return factor * (N - 1) / N * nbytes / bw

    def collectives(self) -> list[tuple]:
        """(op, cls, unit, stage, bytes) of every collective of a pass, on the ``net`` stream;
        they depend on no decision (the engine issues them), each overlapping the compute of
        its stage.

        FSDP2 (``fully_shard`` on each block, then on the root, which holds the embedding and
        the head): the root's weights are gathered in the prologue and kept to the end of the
        backward (FSDP2 does not reshard the root after forward); block i's weights are
        gathered one stage before its forward and one before its backward (FSDP2's prefetch),
        and its gradients reduce-scattered in the stage after its backward; the root's at the
        last backward stage. DDP: each unit's gradients all-reduced in the stage after its
        backward (the last stage for the embedding).
        """
        if not self.distributed or self.world <= 1:
            return []
        L, U = self.L, self.U
        last = 2 * U
        out = []
        blocks = [i for i, x in enumerate(self.units) if x.kind == UnitKind.BLOCK.value]
        root = [i for i in range(U) if i not in blocks]
        if self.engine == "ddp":
            for i in range(U):
                out.append(("all-reduce", "grad", i, min(L.bwd(i) + 1, last), self.Gfull[i]))
            return out
        for i in root:
            out.append(("all-gather", "weight", i, 0, self.Pfull[i]))
            out.append(("reduce-scatter", "grad", i, last, self.Gfull[i]))
        for i in blocks:
            out.append(("all-gather", "weight", i, L.fwd(i) - 1, self.Pfull[i]))
            out.append(("all-gather", "weight", i, L.bwd(i) - 1, self.Pfull[i]))
            out.append(("reduce-scatter", "grad", i, min(L.bwd(i) + 1, last), self.Gfull[i]))
        return [c for c in out if c[4] > 0]

    def _net_seconds(self) -> list[float]:
        """Seconds of the net stream per pass stage (the ring cost of its collectives)."""
        out = [0.0] * (2 * self.U + 1)
        for op, _, _, s, n in self.collectives():
            out[s] += self.ring_seconds(op, n)
        return out

    def _engine_memory(self) -> list[int]:
        """Device bytes per pass stage that the engine holds whatever the decisions.

        FSDP2: the root's gathered weights from the prologue to the last backward stage, and
        its unsharded gradients from the head's backward on; block i's gathered weights in its
        forward and backward stages and, prefetched, in the stage before each; its unsharded
        gradients in its backward stage and the next (reduce-scattered then). Two blocks'
        weights at most at once: the one computing and the one prefetched.
        NB: on a CPU device gloo runs the collectives synchronously, so the forward holds one
        block's gathered weights, not two, and a reduce-scatter ends inside its backward: the
        model over-counts there by one block's weights or gradients.
        DDP: nothing per stage (its buckets are in ``base``).
        """
        L, U = self.L, self.U
        out = [0] * (2 * U + 1)
        if self.engine != "fsdp2":
            return out
        blocks = [i for i, x in enumerate(self.units) if x.kind == UnitKind.BLOCK.value]
        root = [i for i in range(U) if i not in blocks]
        rw = sum(self.Pfull[i] for i in root)
        rg = sum(self.Gfull[i] for i in root)
        for s in range(0, 2 * U + 1):
            out[s] += rw
        for s in range(L.bwd(U - 1), 2 * U + 1):
            out[s] += rg
        for i in blocks:
            for s in (L.fwd(i) - 1, L.fwd(i), L.bwd(i) - 1, L.bwd(i)):
                out[s] += self.Pfull[i]
            for s in (L.bwd(i), min(L.bwd(i) + 1, 2 * U)):
                out[s] += self.Gfull[i]
        return out


def node_spec(hw):
    """The node's spec behind ``hw``: a rank's share (``rank_share``) remembers it, so a cost
    model rebuilt from one (``dataclasses.replace``) shares again from the node's figures and
    a plan records the spec as given."""
    return getattr(hw, "_node_spec", hw)


def rank_share(hw, R: int):
    """The spec as one rank of R on a node sees it: the node's NVMe array, its host memory
    bandwidth and the CPU cores of the host optimizer step are shared by its R ranks, so each
    rank gets 1/R of ``nvme_read/write_bandwidth``, ``host_memory_bandwidth`` and
    ``cpu_adam_params_per_s``. The PCIe links (``h2d``, ``d2h``, ``duplex``) are per GPU on
    the shipped specs (one x16 link per GPU on DGX/HGX nodes) and stay as they are.
    NB: R ranks streaming at once through one root complex or socket may get less than their
    links' sum; that is not modelled."""
    if R <= 1:
        return hw
    out = dataclasses.replace(
        hw, nvme_read_bandwidth=hw.nvme_read_bandwidth / R,
        nvme_write_bandwidth=hw.nvme_write_bandwidth / R,
        host_memory_bandwidth=hw.host_memory_bandwidth / R,
        cpu_adam_params_per_s=hw.cpu_adam_params_per_s / R)
    object.__setattr__(out, "_node_spec", hw)
    return out

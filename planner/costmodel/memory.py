"""Memory: what each home holds on each tier, the optimizer step's bytes, the shared tensors and
tied gradients that are constants of a stage, and per pass stage what is allocated, freed and
held transiently, plus the pinned staging pool (``MemoryRules``, a part of ``CostModel``)."""
from __future__ import annotations

import math
from functools import cached_property

import networkx as nx

from planner.costmodel.layout import KINDS, REC, TIERS, View
from planner.costmodel.options import state_class_bytes
from planner.formats import Home, Tier

# The piece sizes the plan's shares and transients refer to (the runtime steps and accumulates
# in them) are part of the plan's meaning: planner/formats/executor.py defines them.
from planner.formats.executor import (ACC_CHUNK_BYTES, STEP_PIECE_ALIGN,  # noqa: E402,F401
                                      STEP_PIECE_BYTES)



class MemoryRules:
    """Bytes per tier of a ``CostModel`` (which holds the data they read)."""

    # -- per home: bytes and optimizer work -------------------------------------------------

    def opt_copy(self, i: int, h: Home) -> int:
        """Bytes of unit i's optimizer-state class: master and moments, plus, where the step
        runs on the host, has no fp32 master and the weights stay on the device, the host's
        own copy of the weights the step updates."""
        return state_class_bytes(self.O[i], self.P[i], self.M[i], h)

    def resident(self, i: int, h: Home) -> dict:
        """Bytes unit i holds on each tier for the whole step under home h (on a spec without
        a host tier, 'gpu' is the device's memory and there is no 'cpu')."""
        out = {"gpu": 0, "cpu": 0, "nvme": 0}
        out[h.weights.value] += self.P[i]
        out[h.grads.value] += self.G[i]
        out[h.optimizer.value] += self.opt_copy(i, h)
        return out

    def state_up(self, i: int, h: Home) -> bool:
        """Whether unit i's optimizer state lives off a discrete device but is stepped on it:
        the state comes up over H2D for the step and goes back over D2H (from and to NVMe
        through host memory when it lives there), piece by piece."""
        return (not self.unified and h.step is Tier.GPU and h.optimizer is not Tier.GPU)

    def step_reads(self, i: int, h: Home) -> dict:
        """What unit i's optimizer step needs brought to where it runs, per link: nvme -> the
        step's memory; d2h: gradients kept on the device, stepped on the host; h2d: state off
        a discrete device, stepped on it (``state_up``)."""
        nv = 0
        if h.optimizer is Tier.NVME:
            nv += self.opt_copy(i, h)
        if h.weights is Tier.NVME and self.M[i] == 0:
            nv += self.P[i]          # no master: the weights are what the step updates
        if h.grads is Tier.NVME:
            nv += self.G[i]
        d2h = self.G[i] if (h.step is Tier.CPU and h.grads is Tier.GPU) else 0
        h2d = self.opt_copy(i, h) if self.state_up(i, h) else 0
        return {"nvme": nv, "d2h": d2h, "h2d": h2d}

    def step_writes(self, i: int, h: Home) -> dict:
        """What the step sends back, per link: nvme (state and weights homed there), h2d (the
        weights a host step updated, homed on the device), d2h (state stepped on the device,
        homed off it)."""
        nv = (self.opt_copy(i, h) if h.optimizer is Tier.NVME else 0) + \
             (self.P[i] if h.weights is Tier.NVME else 0)
        h2d = self.P[i] if (h.step is Tier.CPU and h.weights is Tier.GPU) else 0
        d2h = self.opt_copy(i, h) if self.state_up(i, h) else 0
        return {"nvme": nv, "h2d": h2d, "d2h": d2h}

    def in_pieces(self, h: Home) -> bool:
        """Whether a step runs piece by piece (``STEP_PIECE_BYTES``): its state is not where
        it runs (on NVMe; or off a device that steps it)."""
        return h.optimizer is Tier.NVME or (h.step is Tier.GPU and h.optimizer is not Tier.GPU)

    def state_held(self, i: int, h: Home) -> int:
        """Bytes of unit i's optimizer state its step holds at once when that state lives on
        NVMe: one piece (see STEP_PIECE_BYTES), taking the state as even over its elements."""
        full = self.opt_copy(i, h)
        per_element = full / max(1, self.N[i])
        return min(full, math.ceil(max(STEP_PIECE_BYTES, STEP_PIECE_ALIGN * per_element)))

    def step_transient(self, i: int, h: Home) -> int:
        """Bytes held where the step runs, from its read stage to its write stage: what it
        reads (of a state on NVMe, one piece at a time) and the weights it writes."""
        r = self.step_reads(i, h)
        held = r["nvme"] + r["d2h"]
        if self.in_pieces(h):
            # the state, one piece at a time (from NVMe through the host's staging pool, or
            # from host memory, when it comes up to a device that steps it)
            held -= (self.opt_copy(i, h) if h.optimizer is Tier.NVME else 0) - \
                self.state_held(i, h)
        return held + self._written_only(i, h)

    def _written_only(self, i: int, h: Home) -> int:
        """Bytes unit i's step writes without reading them: weights homed on NVMe, updated from
        the fp32 master."""
        return self.P[i] if (h.weights is Tier.NVME and self.M[i] > 0) else 0

    def step_tier(self, h: Home) -> str:
        """Where a step under home h runs, as a memory tier (on a unified device: the device)."""
        return "gpu" if (self.unified or h.step is Tier.GPU) else "cpu"

    def paced_held(self, i: int, h: Home) -> tuple[str, int]:
        """Paced: (tier, bytes) unit i's step holds from its read's stage to the end of its
        write's (``paced_part_stage``). Its parts are in separate stages, so all it reads
        (its state from NVMe or up to the device, its gradient's copy on the host, weights a
        step without a master updates) waits for the update, and what it writes for the write:
        the whole of it, not one piece (``step_transient``'s phase pipeline)."""
        r = self.step_reads(i, h)
        return self.step_tier(h), r["nvme"] + r["d2h"] + r["h2d"] + self._written_only(i, h)

    def _paced_memory(self, s: int, v: View, out: dict, freed: bool) -> None:
        """Paced: what the step parts of stage s allocate at its start (a read: what its step
        holds to its write; an update: its workspace) or, ``freed``, free at its end (an
        update: the unit's gradient and its workspace; a write: what the step held), added to
        ``out`` (tier -> Lin)."""
        for j, k, part in self.paced_at.get(s, ()):
            h = self.homes[j][k]
            got = []
            if part == "step":
                got.append(self.step_workspace(j, h))
                if freed:
                    got.append(("gpu", self.G[j]))
            elif part == ("write" if freed else "read"):
                got.append(self.paced_held(j, h))
            for t, nb in got:
                if nb:
                    out[t].append((v.h(j, k), float(nb)))


    # -- constant memory: shared tensors -----------------------------------------------------

    def _shared_memory(self) -> list[int]:
        """Bytes of shared tensors alive in each pass stage, from the unit graph: a tensor one
        unit makes and later units read (rotary tables, masks, an encoder's output) lives from
        its producer's forward to the backward of its last reader, wherever that reader sits in
        the list; its size is the largest any reader reports. A shared tensor without a named
        producer is taken to come from the first unit; one a unit's own prologue made lives
        from that unit's forward to the backward of its last reader."""
        L = self.L
        idx = {x.name: i for i, x in enumerate(self.units)}
        g = nx.DiGraph()
        g.add_nodes_from(idx)
        for x in self.units:
            if x.shared_saved_bytes > 0:
                # p may be x itself (its prologue made them): alive from its own forward to
                # its backward, a self-loop, counted like any other edge
                p = x.shared_from if x.shared_from is not None else self.units[0].name
                old = g.edges[p, x.name]["bytes"] if g.has_edge(p, x.name) else 0
                g.add_edge(p, x.name, bytes=max(old, x.shared_saved_bytes))
        out = [0] * (2 * self.U + 1)
        for p in g.nodes:
            readers = list(g.successors(p))
            if not readers:
                continue
            size = max(g.edges[p, r]["bytes"] for r in readers)
            last = max(idx[r] for r in readers)
            for s in range(L.fwd(idx[p]), L.bwd(last) + 1):
                out[s] += size
        return out

    def _tied_grad_buffers(self) -> list[int]:
        """Bytes autograd holds for tied parameters' gradients in each pass stage: a parameter
        two units use gets its gradient in parts, and the engine keeps the first part (from the
        later unit's backward) until the earlier unit's backward adds the second and hands the
        sum to ``.grad``. The part is counted from that later backward to the earlier one,
        both included (there it is summed with the earlier unit's part, which ``alloc``
        counts with K = 1; with K > 1 the resident gradient exists beside both). Under FSDP2
        with K = 1 the root's unsharded gradients (``_engine_memory``) already hold it from
        the head's backward on."""
        out = [0] * (2 * self.U + 1)
        if self.passes == 1 and self.engine == "fsdp2":
            return out
        idx = {x.name: i for i, x in enumerate(self.units)}
        for j, x in enumerate(self.units):
            if not x.tied_grad_bytes:
                continue
            span = [idx[t] for t in x.tied_to if t in idx] + [j]
            for s in range(self.L.bwd(max(span)), self.L.bwd(min(span)) + 1):
                out[s] += int(x.tied_grad_bytes)
        return out

    # -- memory ----------------------------------------------------------------------------

    def grads_from_backward(self) -> bool:
        """With one pass per step (K = 1) a gradient kept on the device exists from its
        unit's backward to the end of the optimizer step: ``opt.zero_grad()`` sets every
        ``.grad`` to None (PyTorch's default since 2.0), so the next forward runs without them
        (the runtime warns when a step starts with gradients present). With K > 1 they carry
        from pass to pass and count for the whole step (layer-major: one pass, so from B:i)."""
        return self.passes == 1

    def base(self, v: View, optimizer_phase: bool = False) -> dict:
        """Lin per tier: what every home holds for the whole step (a key/value cache, and a
        sharded engine's own resident bytes: DDP's gradient buckets). Gradients on the device
        with K = 1 count from their backward (``alloc``): here only in the optimizer phase."""
        out = {t: [] for t in TIERS}
        if self.engine_static:
            out["gpu"].append((1, float(self.engine_static)))
        late = self.grads_from_backward() and not optimizer_phase
        for i in range(self.U):
            for k, h in enumerate(self.homes[i]):
                # paced: a gradient updated in a backward stage is gone by the phase
                gone = late or (optimizer_phase and not self.in_phase(i, h))
                for t, n in self.resident(i, h).items():
                    if gone and t == "gpu" and h.grads is Tier.GPU:
                        n -= self.G[i]
                    if n:
                        out[t].append((v.h(i, k), float(n)))
                if optimizer_phase and not self.in_phase(i, h, "read") and \
                        self.in_phase(i, h, "write"):
                    # paced: read in the backward, written in the phase: held into it
                    t, n = self.paced_held(i, h)
                    if n:
                        out[t].append((v.h(i, k), float(n)))
        if self.cache:
            out["gpu"].append((1, float(self.cache)))
        return out

    def staging_needs(self, v: View) -> list:
        """Lin terms each of which the staging pool must cover (pool >= each): for each NVMe
        transfer, what ``_staged`` says it holds there."""
        if not self.n_staging or not self.has_nvme:
            return []
        out = []
        for i in range(self.U):
            for c, n in (("nvme", self.A[i]), ("rn", self.X[i])):
                if c in self.choices[i]:
                    out.append([(v.x(i, c), float(self._staged(n)))])
            for k, h in enumerate(self.homes[i]):
                n = max([self.P[i] if h.weights is Tier.NVME else 0,
                         self.G[i] if h.grads is Tier.NVME else 0,
                         self.opt_copy(i, h) if h.optimizer is Tier.NVME else 0])
                if n:
                    out.append([(v.h(i, k), float(self._staged(n)))])
        return out

    def _staged(self, n: int) -> int:
        """Staging bytes an NVMe transfer of ``n`` bytes holds. CUDA's pinned pool:
        ``n_staging`` buffers of it, each capped. A CPU device's bounce buffers for direct
        I/O (``staging_pad`` > 0: a request may spill into a partial block at each end): one
        request where the transfer fits one, else one buffer per request in flight, which its
        store's one I/O thread issues one transfer at a time (runtime/disk.py)."""
        cap, nb, pad = self.staging_cap, self.n_staging, self.staging_pad
        if not pad:
            return nb * min(n, cap)
        if n + pad <= cap:
            return n + pad
        return min(nb, -(-n // cap) + 1) * cap

    def alloc(self, s: int, v: View, rest: bool) -> dict:
        """Lin per tier: bytes allocated at the start of pass stage s."""
        L, U = self.L, self.U
        g, c, n = [], [], []
        out = {"gpu": g, "cpu": c, "nvme": n}
        # a gradient accumulator read back from NVMe (passes after the first) is summed where
        # the host's role is played: the device on unified memory, host memory on CUDA
        dev = g if self.unified else c
        if 1 <= s <= U:                      # F:i
            i = s - 1
            g.append((1, float(self.A[i])))
            g += self._one_at_a_time(i, [(v.x(i, ch), -1.0) for ch in REC
                                         if ch in self.choices[i]])
            g += self._input_held(i, v)
        if 2 <= s <= U + 1:                  # the checkpoint of unit s-2, kept after its forward
            i = s - 2
            for ch in ("rg", "rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
            for ch, tier in (("rc", c), ("rn", n)):
                if ch in self.choices[i]:
                    tier.append((v.x(i, ch), float(self.X[i])))
        if U + 1 <= s <= 2 * U:              # B:i: its recompute materialises the segment
            i = 2 * U - s
            if any(ch in self.choices[i] for ch in REC):
                g.append((v.e(i), float(self.A1[i])))
            for k in v.recomputed_at(i):
                g.append((v.q(k, i), float(self.A[k])))
            if self.G[i]:
                # the new gradient exists from B:i: one homed elsewhere leaves from here (its
                # shares free it); with K = 1 one kept on the device is made here and stays
                late = self.grads_from_backward()
                g += [(v.h(i, k), float(self.G[i])) for k, h in enumerate(self.homes[i])
                      if late or h.grads is not Tier.GPU]
        self._paced_memory(s, v, out, freed=False)
        for kind, i in v.at(s):              # transfers arriving in stage s
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            # only activations take room where they go: a gradient is added into its home
            # copy, which is resident (``base``)
            if K.dst == "gpu":
                g.append((sh, nb))
            elif K.cls == "act":
                (c if K.dst == "cpu" else n).append((sh, nb))
            if rest and kind == "gdn":       # reading a gradient accumulator back, by parts
                dev += self._readback(v, i, nb)
        for k, e, ch in v.ck_returns(s):
            g.append((v.y(ch, k, e), float(self.X[k])))
        return out

    def _input_held(self, i: int, v: View) -> list:
        """Layer-major: the K micro-batches' inputs of unit i (i >= 1), held on the device from
        its forward to the end of the backward of the unit below, under every choice that does
        not count them there already. runtime/layer_major.py cuts the graph at each unit's
        input (a detached leaf of the same storage, whose gradient the piece below waits for),
        so that storage stays even where the unit's saved tensors or its checkpoint went to
        the host or NVMe, or it is rebuilt from an earlier checkpoint ('keep' counts it among
        its saved bytes, 'rg' as its checkpoint). Measured (docs/benchmarks.md, "Peaks per
        stage"): the built-in LLaMA's forward of its last block 3.3 MiB above the prediction,
        its ten blocks before offloaded, 2 x 0.125 MiB of input each."""
        if self.micro_batch_order != "layer-major" or i < 1 or not self.X[i]:
            return []
        return [(v.x(i, ch), float(self.X[i])) for ch in ("cpu", "nvme", "rc", "rn", "rz")
                if ch in self.choices[i]]

    def _one_at_a_time(self, i: int, terms) -> list:
        """``terms`` scaled by what unit i's saved bytes of one micro-batch are short of its
        stage's (layer-major: A_i - A1_i; batch-major: nothing): where it holds only one
        micro-batch's at a time, that much less is allocated, and freed."""
        d = float(self.A[i] - self.A1[i])
        return [(x, c * d) for x, c in terms] if d else []

    def _readback(self, v: View, i: int, nb: float) -> list:
        """Lin of what reading unit i's gradient accumulator back holds during a stage its
        share moves in: one part (ACC_CHUNK_BYTES) under a home whose gradients are on NVMe.
        Counted in every stage the share may move in (the MILP's window; the simulator's
        stages with a share), freed at the stage's end."""
        part = float(min(nb, ACC_CHUNK_BYTES))
        return [(v.h(i, k), part) for k, h in enumerate(self.homes[i]) if h.grads is Tier.NVME]

    def free(self, s: int, v: View, rest: bool) -> dict:
        """Lin per tier: bytes freed at the end of pass stage s."""
        L, U = self.L, self.U
        g, c, n = [], [], []
        out = {"gpu": g, "cpu": c, "nvme": n}
        if 1 <= s <= U:                      # end of F:i: a recomputed unit drops its bytes
            i = s - 1
            for ch in REC:
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.A1[i])))
        if 2 <= s <= U + 1:                  # an offloaded checkpoint has left the device
            i = s - 2
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
        if U + 1 < s <= 2 * U:               # end of B:i-1: unit i's input leaves go
            g += self._input_held(2 * U - s + 1, v)
        if U + 1 <= s <= 2 * U:              # end of B:i: everything of unit i goes
            i = 2 * U - s
            g.append((1, float(self.A[i])))
            if any(ch in self.choices[i] for ch in REC):
                g += self._one_at_a_time(i, [(v.e(i), -1.0)])
            for ch in ("rg", "rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
        for kind, i in v.at(s):              # transfers leaving in stage s
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            # a weight fetched from its home is copied, not moved: the home copy stays
            if K.src == "gpu":
                g.append((sh, nb))
            elif K.cls == "act":
                (c if K.src == "cpu" else n).append((sh, nb))
            if rest and kind == "gdn":
                (g if self.unified else c).extend(self._readback(v, i, nb))
        for k, e, ch in v.ck_returns(s):     # a checkpoint's copy was read back
            (c if ch == "rc" else n).append((v.y(ch, k, e), float(self.X[k])))
        # paced: a unit's gradient (kept on the device, made at its backward) goes with its
        # update in this stage, what its step held with its write
        self._paced_memory(s, v, out, freed=True)
        # streamed weights: the forward copy goes when the forward ends (the last unit's stays
        # for its backward in the next stage), the backward copy when the backward ends
        for i in self._weight_frees().get(s, ()):
            g += [(v.h(i, k), float(self.P[i])) for k, h in enumerate(self.homes[i])
                  if h.streams_weights]
        return out

    def _weight_frees(self) -> dict:
        """Stage -> units whose streamed weights are freed at its end (see ``free``)."""
        return self._weight_free_stages

    @cached_property
    def _weight_free_stages(self) -> dict:
        """``_weight_frees``, built once per model: scanning every unit at every stage would
        make ``free`` O(U^2)."""
        L, U = self.L, self.U
        got = {}
        for i in range(U):
            if not any(h.streams_weights for h in self.homes[i]):
                continue
            got.setdefault(L.bwd(i) if i == U - 1 else L.fwd(i), []).append(i)
            if i != U - 1:
                got.setdefault(L.bwd(i), []).append(i)
        return got

    def transient(self, s: int, v: View) -> list:
        """GPU Lins of which the largest is held on top of the carried bytes during pass stage
        s: the running unit's workspace; during a segment's recompute, the largest workspace
        of the segment's forwards. In the passes after the first (K > 1), a backward also
        holds its unit's new gradient beside the resident one it is added into."""
        U = self.U
        if s == 0:
            return [[]]
        if s <= U:
            return [[(1, float(self.W[s - 1]) + self._outputs_made(s - 1))]]
        i = 2 * U - s
        acc = []
        if self.K > 1 and self.G[i]:
            # layer-major: a gradient homed off the device is also summed on it over the K
            # micro-batches of its stage before it leaves
            every = self.passes == 1
            acc = [(v.h(i, k), float(self.G[i])) for k, h in enumerate(self.homes[i])
                   if every or h.grads is Tier.GPU]
        out = [[(1, float(self.W[i])), *acc]]
        alts = self._layer_major_backward(i, v, acc) if self.K > 1 else None
        if alts:
            out = alts
        for k in v.recomputed_at(i):
            if self.W[k] > self.W[i]:
                # a rebuilt unit's larger workspace, beside what each moment holds besides W_i
                out += [[(v.q(k, i), float(self.W[k])), *a[1:]] for a in alts] if alts else \
                    [[(v.q(k, i), float(self.W[k])), *acc]]
        return out

    def _outputs_made(self, i: int) -> float:
        """Layer-major, F:i: the outputs micro-batches 1..K-1 made before the last one runs,
        held by the cut as the unit above's inputs, which count them from F:i+1 on
        (``_input_held``, its saved bytes), or as its checkpoint ('rg') from F:i+2: in its own
        forward one micro-batch's saved bytes (``_one_at_a_time``) stand for them (the forward
        stages of recomputed blocks were measured below their prediction in every plan of
        docs/benchmarks.md). The last unit's pieces end in the loss.
        Measured (docs/benchmarks.md, "Layer-major backward stages of recomputed units"): the
        embedding's forward, whose saved bytes leave no slack to cover them, 0.8-1.8 MiB above
        its prediction before."""
        if self.micro_batch_order != "layer-major" or self.K < 2 or i == self.U - 1:
            return 0.0
        return float((self.K - 1) * self.units[i].output_bytes)

    def _layer_major_backward(self, i: int, v: View, acc: list) -> list | None:
        """Layer-major (K > 1), B:i: the transient's alternatives at micro-batch 1's backward,
        at micro-batch 2's and at micro-batch K's, or None (another order). runtime/layer_major.py
        runs the K micro-batches' pieces of unit i one after the other, each backward freeing
        its graph, so micro-batch k holds the output gradients of micro-batches k..K (handed
        down by B:i+1) and the input gradients of 1..k (waiting for B:i-1), and from k = 2 on
        adds its gradient (``acc``) into micro-batch 1's; beside them the unit's outputs of
        micro-batches k..K (``_roots``). Linear in k from micro-batch 2 on, so micro-batches 2
        and K bound it. A kept or offloaded unit's saved bytes of micro-batches 1..k-1 are gone
        by then (a kept unit's with its graph, an offloaded one's read-back copy with the views
        autograd drops, runtime/offload.py), however late a transfer finishes, but their
        inputs, whose storage the piece below holds to the end of B:i-1. A recomputed unit's
        saved bytes are one micro-batch's already (``_one_at_a_time``). Measured per piece
        (docs/benchmarks.md, "Layer-major backward stages of recomputed units")."""
        if self.micro_batch_order != "layer-major":
            return None
        u = self.units[i]
        gone = max(float(self.A1[i] - u.input_bytes), 0.0)
        kept = [v.x(i, c) for c in ("keep", "cpu", "nvme") if c in self.choices[i]]
        rec = [v.x(i, c) for c in REC if c in self.choices[i]]
        if not kept and not rec:
            return None
        outp, K, W = float(u.output_bytes), self.K, float(self.W[i])
        if i == self.U - 1:      # the last unit's pieces end in the loss: no gradient handed down
            outp = 0.0
        # the first unit's input (token ids) has no gradient: nothing below waits for one
        inp = float(u.input_bytes) if i > 0 else 0.0

        def at(k: int, lost: float) -> float:   # micro-batch k >= 2, ``lost`` gone per earlier
            return (K - k + 1) * outp + k * inp - (k - 1) * lost
        out = [[(1, W), *acc, *[(x, at(k, gone)) for x in kept],
                *[(x, at(k, 0.0)) for x in rec], *self._roots(i, v, k, outp)]
               for k in sorted({2, K})]
        return out + [[(1, W), *[(x, K * outp + inp) for x in kept + rec],
                       *self._roots(i, v, 1, outp)]]

    def _roots(self, i: int, v: View, k: int, outp: float) -> list:
        """Layer-major B:i, micro-batch k's piece: unit i's outputs of micro-batches k..K, each
        held by its piece until the piece ends, where the carried bytes no longer count them:
        the unit above's 'keep' (its inputs among its saved bytes) and 'rg' (they are its
        checkpoint) free them at the end of B:i+1. Its other choices hold all K to the end of
        B:i (``_input_held``): nothing more, though k - 1 are gone by then (taking them off
        would need the product of two units' choices)."""
        j = i + 1
        if j >= self.U or not outp:
            return []
        return [(v.x(j, c), (self.K - k + 1) * outp) for c in ("keep", "rg")
                if c in self.choices[j]]

    def step_workspace(self, i: int, h: Home) -> tuple[str, int]:
        """(tier, bytes): the temporaries unit i's step allocates where it runs. The profile's
        figure (``optimizer_workspace_bytes``: two fp32 temporaries of the model's largest
        tensor) is what a step of whole tensors may need; a step never needs more than 8 bytes
        (two fp32) per element it steps at once: a piece where the runtime steps by pieces
        (state on NVMe; on a unified device, any state off it: ``STEP_PIECE_BYTES``), else the
        unit's own parameters."""
        where = self.step_tier(h)
        if not self.opt_ws or not self.G[i]:
            return where, 0
        n = self.N[i]
        if not n:                        # a profile without parameter counts: the whole figure
            return where, int(self.opt_ws)
        if self.in_pieces(h):
            per_element = self.opt_copy(i, h) / n
            if per_element:
                n = min(n, math.ceil(self.state_held(i, h) / per_element))
        return where, int(min(self.opt_ws, 8 * n))

    def opt_workspaces(self, v: View) -> dict:
        """Per tier, one Lin per unit: its step's workspace (``step_workspace``); the phase
        holds the largest (one step runs at a time where it runs)."""
        out = {t: [] for t in TIERS}
        for j in range(self.U):
            per = {t: [] for t in TIERS}
            for k, h in enumerate(self.homes[j]):
                where, n = self.step_workspace(j, h)
                if n:
                    per[where].append((v.h(j, k), float(n)))
            for t in TIERS:
                if per[t]:
                    out[t].append(per[t])
        return out

    def opt_transients(self, v: View) -> dict:
        """Per tier, one Lin per unit: what the unit's step holds where it runs, from its read
        to its write. The optimizer phase holds at most ``opt_depth`` units' at once (with 3:
        one read ahead, one stepping, one written behind): that many times the largest."""
        out = {t: [] for t in TIERS}
        for j in range(self.U):
            per = {t: [] for t in TIERS}
            for k, h in enumerate(self.homes[j]):
                n = self.step_transient(j, h)
                if n:
                    per[self.step_tier(h)].append((v.h(j, k), float(n)))
            for t in TIERS:
                if per[t]:
                    out[t].append(per[t])
        return out


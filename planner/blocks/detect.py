"""Finding the blocks of a model: runs of same-class module calls, each fed by the one before,
at any depth, from one traced forward (``detect_blocks``), or named by ``--blocks``; and the
legacy rule that binds plans made before exact block names were recorded (``find_blocks``).

Imports torch lazily: the module is importable without it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import re

from planner.blocks.trace import Call, trace_calls
from planner.errors import UserError


# A stack of blocks is "nothing but" its inner runs when they hold at least this share of its
# FLOPs: a T5 stack's blocks hold 100% (its embedding lookup, final norm and dropout count no
# FLOPs), a ResNet stage's residual blocks 100%; a decoder layer whose feed-forward experts form
# a run holds its attention apart, and experts are not a chain anyway.
STACK_SHARE = 0.9
# Runs holding less than this share of the heaviest run's FLOPs are not blocks (a pair of
# Linear layers in a classifier head, a run of parameterless Dropouts).
MIN_RUN_SHARE = 0.05
# Items of another class between two runs of one container's items join them when each is fed
# by the one before and holds at least this share of the lightest member's weight (Jamba: an
# attention layer after every seven Mamba layers, all in model.layers; a norm does not).
BRIDGE_SHARE = 0.2
# Items of one class that occur at least twice in a container, outside every run, are members
# of a stack to bridge when each holds at least this share of the container's heaviest item
# (Zamba2 with a hybrid layer after every Mamba layer: a Mamba layer holds 19% of a hybrid's
# FLOPs at hidden 64); a norm or an activation holds well under 1%.
REPEAT_SHARE = 0.05
# A run whose members each hold a chain of their own list items (each item computed from the
# one before) is replaced by those chains when they hold at least this share of each member,
# even under STACK_SHARE: the rest is code between layers (ConvNeXt's downsampling before a
# stage's layers, 10% of its last stage at hidden 128; a U-Net up block's upsampler). A
# decoder layer's experts are no chain, nor its own list items, so this does not split it.
STAGE_SHARE = 0.5


def _nn():
    import torch.nn as nn
    return nn


def _container_types():
    nn = _nn()
    return (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclasses.dataclass
class BlockSet:
    """The blocks of a model, in the order they run."""

    names: list                     # exact qualified module names
    modules: list
    paths: str                      # the containers they sit in, comma-separated (for people)

    def pairs(self):
        return list(zip(self.names, self.modules))


def _container_of(model, name: str) -> str | None:
    """The name of the ModuleList/Sequential/ModuleDict holding module ``name``, or None."""
    if not name:
        return None
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    return parent if isinstance(model.get_submodule(parent), _container_types()) else None


class _Detector:
    def __init__(self, model, calls: list[Call]):
        self.model = model
        self.calls = calls
        self.counts: dict = {}
        for c in calls:
            self.counts[id(c.module)] = self.counts.get(id(c.module), 0) + 1
        total = calls[0].flops if calls else 0
        self.by_flops = total > 0
        self.container = {c.idx: _container_of(model, c.name) for c in calls}

    def weight(self, idx: int) -> int:
        c = self.calls[idx]
        if self.by_flops:
            return c.flops
        return sum(p.numel() for p in c.module.parameters())

    def _fed(self, a: Call, b: Call) -> bool:
        """``b``'s hidden state is ``a``'s output or was computed from it (a U-Net up block
        concatenates a skip connection to it before each ResNet block)."""
        return b.hin is not None and a.hout is not None and (
            b.hin == a.hout or (a.end > 0 and a.end in b.hin_from))

    def _siblings(self, ca: str | None, cb: str | None) -> bool:
        """Containers ``ca`` and ``cb`` are one, or lists side by side in one module (a U-Net
        tower's ``resnets`` and ``attentions``, whose items it calls in turn)."""
        if ca is None or cb is None:
            return False
        return ca == cb or ca.rpartition(".")[0] == cb.rpartition(".")[0]

    def _link(self, a: Call, b: Call, strong: bool, any_class: bool = False) -> bool:
        """``b`` continues a run ending with ``a``: same class (unless ``any_class``), distinct
        modules, (strong: in the same container,) and ``b`` is fed by ``a`` — its hidden state
        is ``a``'s output or computed from it, or at least not ``a``'s input (parallel
        projections such as q/k/v share their input) and has the shape of ``a``'s output.
        Strong, items of sibling lists link too, where ``b`` is computed from ``a``'s
        output."""
        if (type(a.module) is not type(b.module) and not any_class) or a.module is b.module:
            return False
        ca, cb = self.container[a.idx], self.container[b.idx]
        if strong and (ca is None or ca != cb):
            return self._siblings(ca, cb) and self._fed(a, b)
        if b.hin is None or a.hout is None:
            return False
        if self._fed(a, b):
            return True
        return b.hin != a.hin and b.hin[2] == a.hout[2]

    def runs(self, kids: list[int], strong: bool) -> list[list[int]]:
        out, cur = [], kids[:1]
        for a, b in zip(kids, kids[1:]):
            ca, cb = self.calls[a], self.calls[b]
            if self._link(ca, cb, strong) and all(self.calls[x].module is not cb.module
                                                  for x in cur):
                cur.append(b)
                continue
            if len(cur) >= 2:
                out.append(cur)
            cur = [b]
        if len(cur) >= 2:
            out.append(cur)
        return self._bridge(kids, out) if strong else out

    def _bridge(self, kids: list[int], runs: list[list[int]]) -> list[list[int]]:
        """Runs of one container's items with items of other classes between them are one
        stack: what lies between joins them when each item there is of the same container,
        in no other run, not itself a container (a stage of blocks is expanded, not bridged
        over), fed by the one before (``_link`` with any class), and holds at least
        ``BRIDGE_SHARE`` of the lightest member of the runs. Why: Jamba's model.layers holds
        Mamba layers with an attention layer after every seven; unbridged, the attention
        layers would be prologues between the runs, neither recomputed nor offloaded. A lone item of
        a run's class joins the same way, and so do the items of a class repeated in the
        container (``_repeated``), where classes alternate and there is no run to bridge.
        Runs of containers are left as they are: torchvision's Swin lists Sequential stages
        with a PatchMerging between each two, and bridged they would be one run that
        ``_expand`` cannot split (a few coarse units where each stage's blocks should be)."""
        pos = {k: i for i, k in enumerate(kids)}
        bridging = [r for r in runs
                    if not isinstance(self.calls[r[0]].module, _container_types())]
        fixed = [r for r in runs if not any(r is b for b in bridging)]
        kinds = {(self.container[r[0]], type(self.calls[r[0]].module)) for r in bridging}
        inside = {x for r in runs for x in r}
        kinds |= self._repeated(kids, inside)
        if not kinds:
            return runs
        # a lone item of a run's class in the run's container (a Mamba layer after the
        # attention layer that follows a run)
        lone = [[k] for k in kids if k not in inside
                and (self.container[k], type(self.calls[k].module)) in kinds]
        members = {x for r in bridging + lone for x in r}
        cands = sorted(bridging + lone, key=lambda r: pos[r[0]])
        out = cands[:1]
        for r in cands[1:]:
            prev = out[-1]
            between = kids[pos[prev[-1]] + 1:pos[r[0]]]
            chain = [prev[-1], *between, r[0]]
            light = min(self.weight(x) for x in prev + r if x in members)
            merged = prev + between + r
            if (light > 0 and not inside.intersection(between)
                    and all(self._siblings(self.container[x], self.container[prev[-1]])
                            for x in between)
                    and not any(isinstance(self.calls[x].module, _container_types())
                                for x in between)
                    and all(self._link(self.calls[a], self.calls[b], True, any_class=True)
                            for a, b in zip(chain, chain[1:]))
                    and all(self.weight(x) >= BRIDGE_SHARE * light for x in between)
                    and len({id(self.calls[x].module) for x in merged}) == len(merged)):
                out[-1] = merged
            else:
                out.append(r)
        return sorted([r for r in out if len(r) >= 2] + fixed, key=lambda r: pos[r[0]])

    def _repeated(self, kids: list[int], inside: set) -> set:
        """(container, class) of items outside every run that occur at least twice in one
        container, each holding at least ``REPEAT_SHARE`` of that container's heaviest item:
        a stack whose classes alternate has no run of one class to bridge (Zamba2 with a
        hybrid layer after every Mamba layer, whose blocks would otherwise be the LoRA
        adapters inside the shared transformer). A norm or activation between Linears is too light to count."""
        items: dict = {}
        for k in kids:
            if self.container[k] is not None and \
                    not isinstance(self.calls[k].module, _container_types()):
                items.setdefault(self.container[k], []).append(k)
        out = set()
        for cont, ks in items.items():
            heavy = max(self.weight(k) for k in ks)
            by_class: dict = {}
            for k in ks:
                if k not in inside:
                    by_class.setdefault(type(self.calls[k].module), []).append(k)
            out |= {(cont, cls) for cls, got in by_class.items() if len(got) >= 2 and heavy > 0
                    and all(self.weight(k) >= REPEAT_SHARE * heavy for k in got)}
        return out

    def select(self, kids: list[int], strong: bool) -> list[list[int]]:
        """Runs of blocks among the calls ``kids`` (siblings, in order) and below them."""
        runs = self.runs(kids, strong)
        first = {r[0]: r for r in runs}
        inside = {x for r in runs for x in r}
        out: list[list[int]] = []
        for k in kids:
            if k in first:
                out.extend(self._expand(first[k], strong))
            elif k not in inside:
                out.extend(self.select(self.calls[k].children, strong))
        return out

    def _expand(self, run: list[int], strong: bool) -> list[list[int]]:
        """A run whose members are each nothing but a stack of blocks (their inner runs, items
        of a ModuleList/Sequential, hold at least STACK_SHARE of them) becomes those inner
        runs. Only list items count: inside a small block, its own two Linears may hold all
        its FLOPs and still not be blocks."""
        inner = [self.select(self.calls[m].children, True) for m in run]
        for m, sub in zip(run, inner):
            got = sum(self.weight(x) for r in sub for x in r)
            w = self.weight(m)
            if not sub or w == 0 or (got < STACK_SHARE * w
                                     and not (got >= STAGE_SHARE * w and self._stage(m, sub))):
                return [run]
        return [r for sub in inner for r in sub]

    def _stage(self, m: int, sub: list[list[int]]) -> bool:
        """The runs ``sub`` found inside call ``m`` are chains of ``m``'s own list items (of
        ``m`` itself, a called Sequential, or of lists that are its attributes), each item
        computed from the one before: ``m`` is a stage of layers."""
        name = self.calls[m].name
        for r in sub:
            for x in r:
                cont = self.container[x]
                if cont is None or (cont != name and cont.rpartition(".")[0] != name):
                    return False
            if not all(self._fed(self.calls[a], self.calls[b]) for a, b in zip(r, r[1:])):
                return False
        return True

    def choose(self, kids: list[int]) -> list[int]:
        runs = self.select(kids, strong=True)
        if not runs:
            runs = self._singletons(kids)
        if not runs:
            runs = self.select(kids, strong=False)
        if not runs:
            return []
        heaviest = max(sum(self.weight(x) for x in r) for r in runs)
        keep = [r for r in runs if sum(self.weight(x) for x in r) >= MIN_RUN_SHARE * heaviest]
        return sorted(x for r in keep for x in r)

    def _singletons(self, kids: list[int]) -> list[list[int]]:
        """No run anywhere (a one-layer model): the called items of the heaviest container,
        those of the class of its heaviest item."""
        below = set()
        todo = list(kids)
        while todo:
            k = todo.pop()
            below.add(k)
            todo.extend(self.calls[k].children)
        groups: dict = {}
        for k in sorted(below):
            cont = self.container[k]
            if cont is not None:
                groups.setdefault(cont, []).append(k)
        if not groups:
            return []
        best = max(groups.values(), key=lambda g: sum(self.weight(x) for x in g))
        cls = type(self.calls[max(best, key=self.weight)].module)
        items = [x for x in best if type(self.calls[x].module) is cls]
        return [[x] for x in items] if sum(self.weight(x) for x in items) > 0 else []


def _split_patterns(spec) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, (list, tuple)):
        spec = ",".join(spec)
    return [p for p in re.split(r"[,\s]+", str(spec).strip()) if p]


def _match(pattern: str, name: str) -> bool:
    """Glob-like match of dotted names: ``*``, ``?`` and ``[...]`` within one component,
    ``**`` for any number of components (``encoder.block.*``, ``**.layers.*``)."""
    def rec(ps, ns):
        if not ps:
            return not ns
        if ps[0] == "**":
            return any(rec(ps[1:], ns[i:]) for i in range(len(ns) + 1))
        return bool(ns) and fnmatch.fnmatchcase(ns[0], ps[0]) and rec(ps[1:], ns[1:])
    return rec(pattern.split("."), name.split(".") if name else [])


def _paths(names: list[str]) -> str:
    seen = []
    for n in names:
        p = n.rsplit(".", 1)[0] if "." in n else ""
        if p not in seen:
            seen.append(p)
    return ",".join(seen)


def detect_blocks(model, run, blocks=None) -> BlockSet:
    """The blocks of ``model``: found from one traced forward (``run()``), or named by
    ``blocks`` (``--blocks``: comma/space separated qualified names or glob patterns; a single
    match that is a ModuleList/Sequential/ModuleDict means "the blocks are in there").
    Raises ``UserError`` with one line when there are none or a named one cannot be a block."""
    calls = trace_calls(model, run)
    det = _Detector(model, calls)
    called = {id(c.module) for c in calls}
    first_call = {}
    for c in calls:
        first_call.setdefault(id(c.module), c.idx)
    names = {id(m): n for n, m in model.named_modules()}
    patterns = _split_patterns(blocks)
    what = f"--blocks '{blocks if isinstance(blocks, str) else ','.join(patterns)}'"

    if patterns:
        modules = {n: m for n, m in model.named_modules() if n}
        matched: dict = {}
        for pat in patterns:
            hits = [n for n in modules if _match(pat, n)]
            if not hits:
                raise UserError(f"{what}: '{pat}' names no module of the model; give qualified "
                                "names such as 'transformer.h' or patterns such as "
                                "'encoder.block.*'")
            for n in hits:
                matched.setdefault(n, modules[n])
        if len(matched) == 1 and isinstance(next(iter(matched.values())), _container_types()):
            prefix = next(iter(matched)) + "."
            top = [c.idx for c in calls if c.name.startswith(prefix)
                   and (c.parent is None or not calls[c.parent].name.startswith(prefix))]
            idx = det.choose(top) or top
            if not idx:
                raise UserError(f"{what}: no module inside '{prefix[:-1]}' runs in the "
                                "forward; name the modules that do")
        else:
            for n, m in matched.items():
                if id(m) not in called:
                    raise UserError(f"{what}: '{n}' never runs in the forward, so it cannot be "
                                    "a block; name modules that run (the items of a ModuleList, "
                                    "not the list)")
            for n in matched:
                for other in matched:
                    if other != n and n.startswith(other + "."):
                        raise UserError(f"{what}: '{n}' is inside '{other}'; a block cannot "
                                        "contain another, name one of them")
            idx = sorted(first_call[id(m)] for m in matched.values())
    else:
        idx = det.choose(calls[0].children if calls else [])
        if not idx:
            raise UserError("found no repeated blocks in the model's forward (no run of "
                            "same-class modules each fed by the one before); name them with "
                            "--blocks, e.g. --blocks 'encoder.layers.*'")
    mods = [calls[i].module for i in idx]
    for m in mods:
        if det.counts.get(id(m), 0) > 1:
            raise UserError(f"module '{names[id(m)]}' runs {det.counts[id(m)]} times in one "
                            "forward (shared weights); tierplan plans each block once: name "
                            "other blocks with --blocks, or unroll the shared layer")
    out = [names[id(m)] for m in mods]
    return BlockSet(names=out, modules=mods, paths=_paths(out))


def find_blocks(model, path: str | None = None):
    """The rule of profiles and plans made before exact block names were recorded: return
    ``(path, [(qualified_name, module), ...])``.

    With ``path`` (``transformer.h``), that attribute must be a ModuleList or Sequential and
    its children are the blocks. Without it, the blocks are the longest run of consecutive
    children of the same class inside any ModuleList/Sequential (ties: the first in module
    order). Only plans without ``model.blocks`` are bound this way.
    """
    names = {id(m): n for n, m in model.named_modules()}
    nn = _nn()
    if path:
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise UserError(f"blocks path '{path}': the model has no attribute '{part}'; "
                                "re-profile the model (profiles now name every block)")
            obj = getattr(obj, part)
        if not isinstance(obj, (nn.ModuleList, nn.Sequential)) or len(obj) == 0:
            raise UserError(f"blocks path '{path}' is a {type(obj).__name__}, not a non-empty "
                            "ModuleList/Sequential; re-profile the model")
        return path, [(f"{path}.{i}", m) for i, m in enumerate(obj)]

    best = None
    for cname, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        i = 0
        while i < len(children):
            j = i
            while j + 1 < len(children) and type(children[j + 1]) is type(children[i]):
                j += 1
            if best is None or j - i + 1 > best[0]:
                best = (j - i + 1, cname, children[i:j + 1])
            i = j + 1
    if best is None:
        raise UserError("found no ModuleList/Sequential of blocks in the model; re-profile it "
                        "(profiles now name every block)")
    return best[1], [(names[id(m)], m) for m in best[2]]

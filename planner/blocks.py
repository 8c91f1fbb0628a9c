"""Finding a model's repeated blocks, and the structure hash that ties a plan to a model.

Shared by the profiler and the runtime, so both agree on what a "block" is. Imports torch
lazily: the module is importable without it.
"""
from __future__ import annotations

import hashlib
import json

from .errors import UserError


def _container_types():
    import torch.nn as nn
    return (nn.ModuleList, nn.Sequential)


def find_blocks(model, path: str | None = None):
    """Return ``(path, [(qualified_name, module), ...])`` for the model's blocks.

    With ``path`` (``transformer.h``), that attribute must be a ModuleList or Sequential.
    Without it, the blocks are the longest run of consecutive children of the same class inside
    any ModuleList/Sequential of the model (ties: the first found in module order), which finds
    ``transformer.h`` in GPT-2 and ``model.layers`` in Llama.
    """
    names = {id(m): n for n, m in model.named_modules()}
    if path:
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise UserError(f"--blocks '{path}': the model has no attribute '{part}'; "
                                "name a ModuleList such as 'transformer.h' or 'model.layers'")
            obj = getattr(obj, part)
        if not isinstance(obj, _container_types()) or len(obj) == 0:
            raise UserError(f"--blocks '{path}' is a {type(obj).__name__}, not a non-empty "
                            "ModuleList/Sequential; name the list that holds the blocks")
        return path, [(f"{path}.{i}", m) for i, m in enumerate(obj)]

    best = None  # (length, container name, start, end)
    for cname, container in model.named_modules():
        if not isinstance(container, _container_types()):
            continue
        children = list(container.children())
        i = 0
        while i < len(children):
            j = i
            while j + 1 < len(children) and type(children[j + 1]) is type(children[i]):
                j += 1
            run = j - i + 1
            if best is None or run > best[0]:
                best = (run, cname, i, j, children[i:j + 1])
            i = j + 1
    if best is None or best[0] < 1:
        raise UserError("found no ModuleList/Sequential of blocks in the model; "
                        "name them with --blocks ATTR.PATH")
    run, cname, start, end, mods = best
    blocks = []
    for m in mods:
        blocks.append((names[id(m)], m))
    return cname, blocks


def structure_hash(blocks) -> str:
    """Hash of the block list: count, class names and parameter names/shapes (not dtypes).

    Two models with the same blocks in the same order get the same hash whatever their
    precision, so a bf16 plan is refused on a model of another depth or width, not on a cast.
    """
    desc = []
    for name, m in blocks:
        params = sorted((n, list(p.shape)) for n, p in m.named_parameters())
        desc.append([name, type(m).__name__, params])
    blob = json.dumps(desc, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]

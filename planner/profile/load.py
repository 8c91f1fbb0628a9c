"""Resolving MODEL (a built-in name, a model YAML or ``package.module:function``) into a module
and inputs on the profiling device (``resolve_model``), and checking ``--batch``/``--seq``.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from planner.errors import UserError
from planner.models import DTYPES, build_model, load_config, make_inputs

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _positive_int(value, what) -> int:
    try:
        v = int(str(value))
    except ValueError:
        raise UserError(f"--{what} '{value}' is not an integer; give a positive integer, "
                        f"e.g. --{what} 8") from None
    if v <= 0:
        raise UserError(f"--{what} {v}: must be a positive integer, e.g. --{what} 8")
    if v > MAX_DIM:
        # torch takes tensor sizes as int64
        raise UserError(f"--{what} {v}: at most {MAX_DIM:,}")
    return v


MAX_DIM = 2**31 - 1           # one input dimension (batch or sequence length)
MAX_TOKENS = 2**40            # batch x seq: an activation of hidden 2^17 stays within int64


def _load_factory(spec: str):
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise UserError(f"model '{spec}': write package.module:function")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)          # as 'python -m' would: modules of the current folder
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:   # noqa: BLE001 -- any import failure is the user's module
        raise UserError(f"model '{spec}': cannot import module '{mod_name}' "
                        f"({type(e).__name__}: {e}); check the name and PYTHONPATH") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"model '{spec}': module '{mod_name}' has no function '{fn_name}'")
    return fn


def _move(model, device, dtype) -> None:
    """``model.to(device, dtype)`` keeping tied parameters tied.

    Moving to meta builds a new Parameter per module (no shallow copy across device types), which
    would untie a language model's head from its embedding; re-tie them afterwards.
    """
    refs: dict = {}
    for mod in model.modules():
        for n, p in mod._parameters.items():
            if p is not None:
                refs.setdefault(id(p), []).append((mod, n))
    if dtype is not None:
        model.to(dtype)
    model.to(device)
    for group in refs.values():
        first = group[0][0]._parameters[group[0][1]]
        for mod, n in group[1:]:
            mod._parameters[n] = first


def _move_input(t, device, dtype):
    """One leaf of a factory's inputs onto ``device``; floating-point tensors (hidden states,
    float masks) also to ``dtype`` so they match the cast model. Token ids, integer and bool
    masks keep their dtype: casting them would change their meaning."""
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is not None and t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device)


def resolve_model(model_spec: str, batch: int, seq: int, dtype: str | None, device: str):
    """MODEL -> (module on ``device``, inputs on ``device``, name, config, dtype name)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here; use --device meta "
                        "(estimated times) or --device cpu")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use bf16, fp16 or fp32")
    is_file = Path(model_spec).suffix in (".yaml", ".yml")
    if ":" in model_spec and not is_file:
        fn = _load_factory(model_spec)
        result = None
        if device == "meta":
            # built under the meta device, a model made the usual way takes no memory (the
            # defaults of transformers' MixtralConfig(), 46.7 B parameters, are 187 GB in
            # fp32: more than a host's memory). A factory that cannot run
            # there (it loads a checkpoint, say) runs again as it is.
            try:
                with torch.device("meta"):
                    result = fn(batch, seq)
            except Exception:    # noqa: BLE001 -- the factory is user code; retried below
                result = None
        if result is None:
            try:
                result = fn(batch, seq)
            except Exception as e:   # noqa: BLE001 -- the factory is user code
                raise UserError(f"model '{model_spec}': the factory raised "
                                f"{type(e).__name__}: {e}; fix it or check --batch/--seq") from None
        if not (isinstance(result, tuple) and len(result) == 2
                and isinstance(result[0], torch.nn.Module)):
            raise UserError(f"model '{model_spec}': the factory must return (module, inputs), "
                            f"got {type(result).__name__}")
        model, inputs = result
        cast = DTYPES[dtype] if dtype else None
        _move(model, device, cast)
        inputs = tree_map(lambda t: _move_input(t, device, cast), inputs)
        name = model_spec.split(":")[-1]
        config = {"factory": model_spec}
        if hasattr(model, "config") and hasattr(model.config, "to_dict"):
            config["model_config"] = {k: v for k, v in model.config.to_dict().items()
                                      if isinstance(v, (int, float, str, bool, type(None)))}
        dtype = dtype or _DTYPE_NAMES.get(next((p.dtype for p in model.parameters()
                                                if p.is_floating_point()), torch.float32), "fp32")
        return model, inputs, name, config, dtype
    cfg = load_config(model_spec)
    if seq > cfg["max_seq"]:
        raise UserError(f"--seq {seq} exceeds {cfg['name']}'s context of {cfg['max_seq']} "
                        "tokens; give --seq of at most that")
    dtype = dtype or cfg["dtype"]
    model = build_model(cfg, dtype=dtype, device=device)
    inputs = make_inputs(cfg, batch, seq, device=device)
    return model, inputs, cfg["name"], cfg, dtype


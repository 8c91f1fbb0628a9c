"""What a block is, how it is called, and what ties a plan to a model.

The profiler's (docs/models.md); the runtime binds by the names a plan records and never
detects blocks.
The package's modules, each one job:

- ``detect`` -- **finding blocks** (``detect_blocks``): runs of consecutive calls of the same
  class, inside the same caller, each fed by the one before (a chain, not parallel
  projections), at any nesting depth; a run whose members are themselves nothing but runs (a
  ResNet's stages, nested stage lists) is replaced by the runs inside. Containers never run,
  so they are never blocks; a module that runs more than once per forward (shared weights)
  cannot be one. Also ``find_blocks``, the rule of plans made before block names were recorded.
- ``trace`` -- the call tree of one forward that detection reads: who called whom, in what
  order, with which hidden state, and how many FLOPs each call did.
- re-exported from ``planner.formats`` (they define what a profile's and a plan's fields mean,
  and the runtime imports nothing of the planner but the formats): **calling blocks**
  (``planner.formats.calls``: ``hidden_location``, ``hidden_of``, ``StateSnapshot``: where a
  block's hidden state is among its arguments and in its output, and how to put back the
  mutable state objects a block updates, so that it can be run again as it first ran) and
  **binding** (``planner.formats.identity``: ``structure_hash``, ``param_table``,
  ``input_table``, ``identity_hash``: the exact names of the blocks, every unit's parameters
  and every model input's shape, which a plan carries and ``apply_plan`` checks).
- ``metaops`` -- running aten calls on ``meta`` (a Python number asked of a meta tensor, ops
  whose meta kernel refuses a dtype), for every dispatch mode that runs a forward there.
- ``flops`` -- the FLOPs of one aten call (``torch.utils.flop_counter``'s formulas plus those
  it lacks), counted by the call tracer and by the profiler's tracker.

Imports torch lazily (``flops`` aside, which nothing here imports at load time): the package
is importable without it.
"""
from __future__ import annotations

from planner.formats.calls import (StateSnapshot, hidden_location, hidden_of, output_items,
                                  same_tensor, state_tensor_bytes)
from planner.blocks.detect import BlockSet, detect_blocks, find_blocks
from planner.formats.identity import (check_param_table, dtype_name, identity_hash, input_table,
                                     param_table, structure_hash)
from planner.blocks.metaops import meta_scalar, run_op
from planner.blocks.trace import Call, trace_calls

__all__ = ["BlockSet", "Call", "StateSnapshot", "check_param_table", "detect_blocks",
           "dtype_name", "find_blocks", "hidden_location", "hidden_of", "identity_hash",
           "input_table", "meta_scalar", "output_items", "param_table", "run_op", "same_tensor",
           "state_tensor_bytes", "structure_hash", "trace_calls"]

"""``plan profile``: per-unit bytes, FLOPs and times of one training step of a model.

Units are ``embedding`` (everything before the first block), each block (by qualified name)
and ``head`` (everything after the last block, the loss included).

How one profile is taken (the same code on ``meta``, ``cpu`` and ``cuda``):

0. The blocks are found from one traced forward (``planner.blocks.detect_blocks``: runs of
   same-class modules each fed by the one before, at any depth, several stacks included), or
   named with ``--blocks``; the profile records their exact names in execution order.
1. One forward of the whole model runs under ``_Tracker``, a TorchDispatchMode that sees every
   aten call: it charges FLOPs (``torch.utils.flop_counter``'s formulas, plus ours in
   ``planner.blocks.flops``), allocations (each output storage once, freed when its last tensor
   dies, through ``weakref.finalize``) and parameter use to the unit running. A
   ``saved_tensors_hooks`` pair records every storage autograd saves, per unit. Code that runs
   between two blocks (T5's encoder final norm and decoder embedding) is the later block's
   prologue: charged to it, its saved bytes shared (the runtime keeps them by reference).
2. Each block is replaced for that forward by a wrapper. The first block of each kind (same
   class, parameters and input shapes) runs alone: its inputs are detached into fresh leaves
   (its hidden state copied, so an in-place write cannot reach the model's tensor), its
   forward and then its backward run at once under the tracker, so its saved bytes,
   workspace and backward FLOPs are its own. Later blocks of the same kind run under no_grad
   without instrumentation and reuse the record: depth costs one meta forward per block.
   A small autograd function (``_Bridge``) joins each block's output to its inputs in the main
   graph, so the backward of ``head``, the prologues and ``embedding`` runs for real afterwards.
3. On ``meta``, ``scaled_dot_product_attention`` would fall to the math kernel (O(s^2) saved
   bytes) whatever the target; ``_TargetAttention`` calls the aten kernel the target runs
   instead (flash/efficient on CUDA, what ``_fused_sdp_choice`` picks on CPU).
4. Times: estimated (on ``meta``, or with ``--timing estimate``) as the sum over aten calls of
   max(FLOPs / rate, bytes / bandwidth) with the hardware spec's rates; otherwise measured: a
   warm-up, then repeats until the spread is small (``_Repeats``), the median kept, the spread,
   the load of other processes and a backward/forward check recorded in ``timing_quality``.
   State objects a block updates (key/value caches) are put back before every repeat.

The package's modules, each one job:

- ``run`` -- ``profile_module`` and ``profile_model``: checks, then the instrumented step's
  stages (wrap the blocks, forward and backward, time, put the model back, assemble).
- ``step`` -- ``Settings`` (what one profile is taken with) and ``Step``, the state of the
  instrumented step and the blocks' wrappers that fill it; timing of the embedding, head and
  prologues in the full step.
- ``isolated`` -- one block on its own: instrumented forward and backward on fresh leaves,
  what custom autograd Functions hold as ctx attributes, its timed repeats.
- ``tracker`` -- the dispatch tracker and the per-unit records it fills; ``_Bridge``.
- ``sdpa`` -- the attention kernel the target runs.
- ``calling`` -- calling the user's model and blocks: kinds, signatures, bytes, the loss,
  errors as one line.
- ``timing`` -- timing statistics, the load meter, the ``timing_quality`` section.
- ``assemble`` -- the profile from the step's records: parameter charges, unit records, the
  model section, warnings.
- ``optimizer_bytes`` -- weight, gradient and optimizer-state bytes per parameter.
- ``load`` -- MODEL resolved into a module and inputs; ``--batch``/``--seq`` checks.
- ``cli`` -- the ``plan profile`` verb.
- ``calibrate`` -- ``plan calibrate``: a profile with a run's measured times.
"""
from __future__ import annotations

from planner.models import DTYPES
from planner.profile.cli import cli_profile, default_output
from planner.profile.load import MAX_DIM, MAX_TOKENS, resolve_model
from planner.profile.optimizer_bytes import (OPTIMIZERS, master_bytes_per_param,
                                             static_bytes_per_param)
from planner.profile.run import TIMINGS, WARNING_PREFIX, profile_model, profile_module
from planner.profile.tracker import EMBEDDING, HEAD

__all__ = ["DTYPES", "EMBEDDING", "HEAD", "MAX_DIM", "MAX_TOKENS", "OPTIMIZERS", "TIMINGS",
           "WARNING_PREFIX", "cli_profile", "default_output", "master_bytes_per_param",
           "profile_model", "profile_module", "resolve_model", "static_bytes_per_param"]

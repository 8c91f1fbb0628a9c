"""FLOP formulas that ``torch.utils.flop_counter`` lacks, registered in its table.

``FlopCounterMode`` counts the CUDA flash/efficient/cuDNN attention kernels but has no entry for
the CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``), which is what
``scaled_dot_product_attention`` runs on CPU without dropout: without these entries every
attention FLOP of a CPU profile would be silently dropped.

``op_flops(func, args, kwargs, out)`` is the lookup the profiler's dispatch mode and the call
tracer of block detection use; it applies exactly the formulas ``FlopCounterMode`` would.
"""
from __future__ import annotations

import math

import torch
from torch.utils import flop_counter as fc

aten = torch.ops.aten


def _register():
    cpu_fwd = aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if cpu_fwd not in fc.flop_registry:
        @fc.register_flop_formula(cpu_fwd)
        def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kw):
            # NB: causal masking is not discounted, as for the CUDA kernels in flop_counter.
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)
    if cpu_bwd not in fc.flop_registry:
        @fc.register_flop_formula(cpu_bwd)
        def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args,
                           out_shape=None, **kw):
            # The CPU flash backward recomputes the score matrix like the CUDA one, so it costs
            # the same five matmuls flop_counter charges the CUDA kernels.
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)
    # Without this a mixture of experts counted 0 FLOPs in its experts: Mixtral's block 47
    # GFLOP of 408 (its attention alone), so estimated times were far too short.
    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None and grouped not in fc.flop_registry:
        @fc.register_flop_formula(grouped)
        def _grouped_fwd(a_shape, b_shape, *args, out_shape=None, **kw):
            return _grouped_mm(a_shape, b_shape, out_shape)


_register()


def _grouped_mm(a, b, out) -> int:
    """FLOPs of a grouped matmul, from the shapes of its operands and output (how a mixture
    of experts runs its feed-forwards): tokens (T, K) x experts (G, K, N) -> (T, N), each
    token through one expert; batched (G, M, K) x (G, K, N); or (M, K) x (K, N) with K split
    into groups -> (G, M, N)."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out) * a[-1]


def _shape(t):
    return tuple(t.shape)


# transformers' own grouped matmul (where torch's cannot run) and its backward, by name: they
# exist only once transformers registers them, so they cannot join flop_counter's table here
_BY_NAME = {
    "transformers::grouped_mm_fallback":
        lambda args, out: _grouped_mm(_shape(args[0]), _shape(args[1]), _shape(out)),
    # (input, weight, offs, grad_output): the input's and the weights' gradients, two matmuls
    # of the forward's size (the forward's output is grad_output's)
    "transformers::grouped_mm_fallback_backward":
        lambda args, out: 2 * _grouped_mm(_shape(args[0]), _shape(args[1]), _shape(args[3])),
}


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten call, by the formulas of ``torch.utils.flop_counter`` (0 if none)."""
    formula = fc.flop_registry.get(func._overloadpacket)
    if formula is None:
        named = _BY_NAME.get(getattr(func._overloadpacket, "_qualified_op_name", ""))
        return 0 if named is None else int(named(args, out))
    return int(formula(*args, **(kwargs or {}), out_val=out))

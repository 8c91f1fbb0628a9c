"""Running one aten call on ``meta``: the Python number a model asks a meta tensor for
(``meta_scalar``) and ops whose meta kernel takes fewer dtypes than the real ones (``run_op``).
Used by every dispatch mode that runs a model's forward on meta: the call tracer of block
detection and the profiler's tracker.

Imports torch lazily: the module is importable without it.
"""
from __future__ import annotations


def meta_scalar(func, args):
    """The value a model gets when it asks a meta tensor for a Python number, or ``None`` for
    any other call.

    NB: a meta tensor has no value. Models ask for one to pick a code path, and their boolean
    questions are "is everything ordinary?" (Hugging Face's mask code asks whether all
    positions are unpacked, whether the padding mask is all ones): answer True, and 0 for
    numbers, the plain path a batch of full sequences takes.
    """
    import torch
    if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
        t = args[0]
        return True if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
    return None


def run_op(func, args, kwargs):
    """``func(*args, **kwargs)``, also where torch's meta kernel takes fewer dtypes than the
    real ones.

    NB: the meta kernel of ``aten._grouped_mm`` (how transformers runs a mixture of experts)
    takes bf16 only, as the CUDA kernel does, and 16-byte-aligned rows; the CPU kernel also
    takes fp32 and fp16, which a Mixtral built with ``from_config`` gives it (fp32). In another dtype on meta its output is made here, with the shape the
    meta kernel gives (``_grouped_mm_shape``) and the dtype asked for: a meta tensor has no
    values to compute.
    """
    import torch
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is not None and func is grouped.default and len(args) >= 2 \
            and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
        return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device="meta")
    return func(*args, **kwargs)


def _grouped_mm_shape(a, b, offs) -> list:
    """The output shape of ``aten._grouped_mm(a, b, offs)``: groups of rows of a 2D ``a``
    through a 3D ``b`` (one matrix per group), a batch of matrices, or a 2D-by-2D product per
    group of the shared dimension (torch/_meta_registrations.py,
    ``_create_grouped_mm_output_tensor``)."""
    if a.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    return [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]

"""``_TargetAttention``: routes ``F.scaled_dot_product_attention`` to the kernel the target
hardware runs (flash/efficient on CUDA, what ``_fused_sdp_choice`` picks on CPU), and records
which kernels it assumed. On ``meta`` PyTorch would fall to the math kernel (O(s^2) saved
bytes) whatever the target, so there the target's aten kernel is called explicitly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _sdpa_args(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _TargetAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the kernel the target hardware runs.

    With ``emulate`` (a meta profile) the target's aten kernel is called explicitly, since on
    meta PyTorch would decompose into the math kernel. Otherwise the call runs unchanged and only
    the kernel PyTorch picks is recorded. ``kernels`` collects what was assumed.
    """

    def __init__(self, target: str, emulate: bool):
        super().__init__()
        self.target, self.emulate = target, emulate
        self.kernels: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, p, causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if self.target == "cuda":
            kind = self._cuda_choice(q, k, v, mask)
        else:
            kind = self._cpu_choice(q, k, v, mask, p, causal, scale, gqa)
        self.kernels.add(kind)
        if not self.emulate:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return self._call(kind, q, k, v, mask, p, causal, scale, gqa)

    @staticmethod
    def _cuda_choice(q, k, v, mask) -> str:
        # FlashAttention-2 takes fp16/bf16, one head dim for query, key and value, up to 256
        # (multiples of 8), and no explicit mask; otherwise PyTorch uses the memory-efficient
        # kernel (xFormers), which takes fp32, additive masks and a value head dim of its own
        # (DeepSeek-V3: 192 for query and key, 128 for value, where flash would give a
        # 192-wide output). Both save O(s) bytes (output and log-sum-exp), never s^2.
        d = q.shape[-1]
        if (q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0
                and mask is None and k.shape[-1] == d and v.shape[-1] == d):
            return "flash"
        return "efficient"

    @staticmethod
    def _cpu_choice(q, k, v, mask, p, causal, scale, gqa) -> str:
        # Ask PyTorch's CPU selector with tiny CPU tensors of the same dtypes, heads and head
        # dims: its rules depend on those, on dropout, the mask and grad mode, not on lengths.
        def small(t):
            return torch.empty((1,) * (t.dim() - 3) + (t.shape[-3], 1, t.shape[-1]),
                               dtype=t.dtype, requires_grad=t.requires_grad)
        m = None
        if mask is not None:
            m = torch.empty((1,) * mask.dim(), dtype=mask.dtype)
        choice = torch._fused_sdp_choice(small(q), small(k), small(v), m, p, causal,
                                         scale=scale, enable_gqa=gqa)
        return "cpu-flash" if choice == 1 else "math"

    @staticmethod
    def _call(kind, q, k, v, mask, p, causal, scale, gqa):
        if kind == "cpu-flash":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, p, causal, attn_mask=mask, scale=scale)[0]
        if kind == "math":
            return aten._scaled_dot_product_attention_math(
                q, k, v, mask, p, causal, None, scale=scale, enable_gqa=gqa)[0]
        if kind == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False,
                                                            scale=scale)[0]
        if k.shape[-3] != q.shape[-3]:
            # NB: the efficient kernel takes no grouped KV heads; PyTorch expands them first.
            r = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, q.requires_grad or k.requires_grad, p, causal, scale=scale)[0]


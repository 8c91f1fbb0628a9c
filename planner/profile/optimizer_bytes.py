"""The static bytes each trainable parameter costs under each ``--optimizer``: weight, gradient
and optimizer state (``static_bytes_per_param``), and the fp32 master copy inside that state
(``master_bytes_per_param``).
"""
from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "adamw-pure", "sgd")


def static_bytes_per_param(param_dtype: torch.dtype, optimizer: str) -> tuple[int, int, int]:
    """(weight, grad, optimizer-state) bytes per trainable parameter.

    ``adamw``: mixed precision for 16-bit weights keeps an fp32 master copy (4 bytes) and two
    fp32 moments (8 bytes): 2 + 2 + 12 = 16 bytes per parameter (Rajbhandari et al. 2020, ZeRO,
    Sec. 3.1: "16 bytes of memory per parameter"). fp32 AdamW: 4 + 4 + 8. ``adamw-pure``:
    ``torch.optim.AdamW`` over the parameters as they are, moments in their dtype and no
    master: 2 + 2 + 4 for 16-bit weights (what a bf16 model trained with a plain AdamW holds;
    the ``adamw`` count would over-state its peak by 8 bytes per parameter), the same as
    ``adamw`` for fp32. SGD (no momentum): only the fp32 master for 16-bit weights.
    """
    w = torch.empty((), dtype=param_dtype).element_size()
    if optimizer == "adamw-pure":
        return w, w, 2 * w
    moments = 8 if optimizer == "adamw" else 0
    return w, w, master_bytes_per_param(param_dtype, optimizer) + moments


def master_bytes_per_param(param_dtype: torch.dtype, optimizer: str) -> int:
    """The fp32 master copy inside the optimizer state: 4 bytes for 16-bit floating weights
    under mixed precision, none for fp32 weights (their own master) or ``adamw-pure``."""
    w = torch.empty((), dtype=param_dtype).element_size()
    return 4 if w < 4 and param_dtype.is_floating_point and optimizer != "adamw-pure" else 0

"""The transfer engine: one backend interface for moving bytes between the device, pinned host
memory and files, whatever the device (docs/runtime.md, "The transfer engine").

``backend_for(device)`` is the backend the runtime uses for ``device``: the CPU one for a CPU
device (unified memory), the CUDA one for a CUDA device; ``using(backend)`` makes every runtime
built inside it use ``backend`` instead (the tests' recording backend)."""
from __future__ import annotations

import contextlib

from .backend import Backend, Slab, TransferError
from .bytestream import ByteStream

_override: list = []
_backends: dict = {}     # one backend per device, shared by every runtime in the process


def backend_for(device) -> Backend:
    if _override:
        return _override[-1]
    key = str(device)
    if key not in _backends:
        if device.type == "cpu":
            from .cpu import CpuBackend
            _backends[key] = CpuBackend(device)
        else:
            from .cuda import CudaBackend
            _backends[key] = CudaBackend(device)
    return _backends[key]


@contextlib.contextmanager
def using(backend: Backend):
    """Every ``apply_plan`` inside the block moves its bytes through ``backend``."""
    _override.append(backend)
    try:
        yield backend
    finally:
        _override.remove(backend)


__all__ = ["Backend", "ByteStream", "Slab", "TransferError", "backend_for", "using"]

"""Host memory for staging: buffers pinned for the CUDA driver at their exact size.

Pinned memory is taken by registering a buffer's own pages (``cudaHostRegister``), not from
PyTorch's pinned allocator, which rounds each block up to a power of two (a 180 MB tensor would
hold 256 MB): staging stays the size of the state. The RAM tier's slots, shared mappings of a
tmpfs file, are registered the same way (:func:`pin_region`). Where registering fails (``ulimit
-l``, no CUDA runtime) it is PyTorch's pinned allocator, and where that fails too, pageable memory
(copies are then synchronous; the save still works).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["host_buffer", "pin_region", "unpin_region"]


_PAGE = 4096


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown, no runtime: the process's end unpins it anyway
        pass


def pin_region(ptr: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for the CUDA driver (``cudaHostRegister``:
    device-to-host copies into it run at pinned speed, asynchronously); False where that fails
    (no CUDA runtime, ``ulimit -l``). :func:`unpin_region` before the memory goes away."""
    if not torch.cuda.is_available() or nbytes <= 0:
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0
    except Exception:
        return False


def unpin_region(ptr: int) -> None:
    _unregister(ptr)


def _registered_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """A host buffer whose own pages are pinned with cudaHostRegister (exact size: no rounding),
    or None where that fails. The pages are unpinned when the last view of them is gone."""
    nbytes = torch.empty((), dtype=dtype).element_size() * max(1, torch.Size(shape).numel())
    span = -(-nbytes // _PAGE) * _PAGE
    base = torch.empty(span + _PAGE, dtype=torch.uint8)
    off = (-base.data_ptr()) % _PAGE
    region = base[off : off + span]
    try:
        rc = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), span, 0)
    except Exception:
        return None
    if int(rc) != 0:
        return None
    weakref.finalize(base, _unregister, region.data_ptr())
    buf = region[:nbytes].view(dtype)[: torch.Size(shape).numel()].view(shape)
    # The buffer holds its base: the pages stay pinned while anything may copy into the buffer
    # (the stager drops a buffer only at a snapshot, after the previous save's copies are done).
    buf._smartckpt_base = base  # type: ignore[attr-defined]
    return buf


def host_buffer(shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer for one entry: pinned when ``pin`` and possible (module docstring)."""
    if pin:
        buf = _registered_empty(shape, dtype)
        if buf is not None:
            return buf
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError:  # pinning can fail (locked-memory limits): degrade to pageable
            pass
    return torch.empty(shape, dtype=dtype)

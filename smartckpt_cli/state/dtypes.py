"""Every dtype the installed torch has, as stored bytes: names, element sizes, finiteness.

A tensor is stored as its raw bytes plus its dtype's name (torch's own, without ``torch.``), so
any dtype whose tensors torch can create and view as bytes round-trips bit for bit: bool, every
int/uint width, fp16/bf16/fp32/fp64, complex32/64/128, every float8 and float4 variant, the
``bits*`` types. The table is discovered from the installed torch at import, so a dtype added by
a later torch is covered without editing this file, and a checkpoint naming a dtype this torch
lacks is refused with its name instead of misread.

Not storable, and refused at save time with the entry's path (``statetree.flatten``): quantized
tensors (``qint8``, ``quint8``, ``qint32``, ``quint4x2``, ``quint2x4``), whose value is their
bytes *and* a scale/zero point torch keeps outside them. The sub-byte ``int1``..``int7`` and
``uint1``..``uint7`` exist only as names: torch cannot create tensors of them.

Every per-tensor pass that looks at values (the health check here, precision reduction in
``codec``) decides by dtype through this module, never by calling an op that a dtype may not
implement: ``torch.isfinite`` raises ``NotImplementedError`` for float8, and a health check that
raises makes every save fail.
"""

from __future__ import annotations

import warnings
from functools import cache

import numpy as np
import torch

__all__ = ["DTYPES", "all_finite", "dtype_name", "lookup", "reducible"]


def _storable(dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():  # complex32 warns that it is experimental
            warnings.simplefilter("ignore")
            t = torch.empty(2, dtype=dtype)
            t.view(torch.uint8)
            t.clone()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
    if dt not in _QUANTIZED and _storable(dt)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def lookup(name: str) -> torch.dtype:
    """The dtype a manifest names; ValueError (one line) when this torch has no such dtype."""
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ValueError(
            f"dtype {name!r} is not known to torch {torch.__version__} (saved by a newer torch?)"
        )
    return dtype


def reducible(dtype: torch.dtype) -> bool:
    """Whether a precision transform (to bf16 or fp16, 2 bytes) may apply: real floating dtypes
    wider than the target only. Never integers, bool, complex, or floats of 2 bytes or fewer."""
    return dtype.is_floating_point and dtype.itemsize > 2


_NUMPY_FLOAT = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
_COMPLEX_PART = {
    torch.complex32: torch.float16,
    torch.complex64: torch.float32,
    torch.complex128: torch.float64,
}


@cache
def _byte_table(dtype: torch.dtype) -> np.ndarray:
    """For a 1-byte floating dtype: which of the 256 bit patterns are finite."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    try:
        finite = torch.isfinite(patterns.to(torch.float32))
    except (RuntimeError, NotImplementedError):
        # No conversion (float4_e2m1fn_x2 packs two 4-bit values): such formats have no
        # inf or NaN encoding at all.
        return np.ones(256, dtype=bool)
    return finite.numpy().astype(bool)


# Elements checked at a time: the check's temporaries stay small (a whole 1 GB tensor at once
# would allocate 250 MB of booleans beside the staged state, which the allocator then keeps).
_BLOCK = 1 << 20


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in a CPU tensor, for every dtype (integers and bool are always finite).

    numpy, single-threaded, where it can: a torch op here, in a background thread, would start
    an OpenMP team of its own and compete with the training's."""
    if t.numel() == 0:
        return True
    dtype = t.dtype
    if dtype.is_complex:
        # A complex number is finite when both parts are: view the pairs as their real dtype.
        return all_finite(t.contiguous().reshape(-1).view(_COMPLEX_PART[dtype]))
    if not dtype.is_floating_point:
        return True
    flat = t.contiguous().reshape(-1)
    if dtype in _NUMPY_FLOAT:
        arr = flat.numpy()
        return all(bool(np.isfinite(arr[i : i + _BLOCK]).all()) for i in range(0, arr.size, _BLOCK))
    if dtype == torch.bfloat16:
        # An all-ones exponent (bits 7..14) is inf or NaN.
        bits = flat.view(torch.int16).numpy()
        return not any(
            bool(((bits[i : i + _BLOCK] & 0x7F80) == 0x7F80).any()) for i in range(0, bits.size, _BLOCK)
        )
    if dtype.itemsize == 1:
        return bool(_byte_table(dtype)[flat.view(torch.uint8).numpy()].all())
    try:
        return bool(torch.isfinite(flat.to(torch.float64)).all())
    except (RuntimeError, NotImplementedError):
        return True  # a floating format this module does not know and torch cannot convert

"""Tensors as bytes, and reduced precisions that never lose a value.

The precision transforms (``reduce`` / ``expand``) turn an optimizer moment into a smaller stored
tensor plus an exact *patch*: the positions whose reduced value would be 0, subnormal or inf while
the original is not, kept at full precision. That is how the guarantee "a reduced precision never
turns a nonzero into 0 or inf" is kept: not by hoping the range fits, but by storing the values
that do not fit exactly. They apply only to real floats wider than the 2-byte target
(``dtypes.reducible``).

- ``bf16``: bfloat16 has float32's exponent range, so only true float32 subnormals and values
  rounding past the bf16 maximum are patched.
- ``sqrt_fp16`` (the ``fp16`` precision for ``exp_avg_sq``): a plain ``.half()`` zeroes most
  second moments (they live around 1e-12..1e-6, below fp16's 6e-8). We store ``sqrt(v)``, which
  halves the dynamic range in log terms and is the quantity Adam actually divides by, scaled by a
  power of two so the largest value sits near 2**15. Relative error of ``sqrt(v)`` stays within
  fp16's 2**-11 for every normal value; subnormal and zero-underflow values go to the patch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from smartckpt_cli.state.dtypes import reducible

__all__ = ["Reduced", "byte_view", "expand", "reduce", "tensor_bytes"]

_FP16_MIN_NORMAL = 2.0**-14
_SQRT_TARGET_EXP = 15  # largest scaled sqrt(v) lands in [2**14, 2**15): far below fp16's 65504


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    arr: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 numpy view of a contiguous CPU tensor (for decoding into it)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


@dataclass
class Reduced:
    """What gets stored for one tensor: ``stored`` plus an exact patch (see module docstring)."""

    stored: torch.Tensor
    transform: dict[str, Any]
    patch_index: torch.Tensor | None = None  # int64 flat indices
    patch_value: torch.Tensor | None = None  # original dtype


def _patch(orig: torch.Tensor, bad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    idx = torch.nonzero(bad.reshape(-1), as_tuple=False).reshape(-1)
    if idx.numel() == 0:
        return None, None
    return idx.to(torch.int64).contiguous(), orig.reshape(-1)[idx].contiguous()


def reduce(t: torch.Tensor, transform: str) -> Reduced:
    """Apply ``transform`` ("none", "bf16", "sqrt_fp16") to a CPU tensor."""
    if transform == "none" or not reducible(t.dtype):
        # Only real floats wider than the 2-byte target: a reduction never widens (float8), and
        # never touches integers, bool or complex.
        return Reduced(t.contiguous(), {"kind": "none"})
    if transform == "bf16":
        q = t.to(torch.bfloat16)
        bad = ((q == 0) & (t != 0)) | (torch.isinf(q) & torch.isfinite(t))
        bad |= (q.abs() < torch.finfo(torch.bfloat16).tiny) & (q != 0)
        idx, val = _patch(t, bad)
        return Reduced(q.contiguous(), {"kind": "bf16"}, idx, val)
    if transform == "sqrt_fp16":
        if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            return Reduced(t.contiguous(), {"kind": "none"})  # not a second moment: keep exact
        s = torch.sqrt(t.to(torch.float32))
        top = float(s.max())
        exp = 0 if top == 0 else _SQRT_TARGET_EXP - 1 - math.floor(math.log2(top))
        q = torch.ldexp(s, torch.tensor(float(exp))).to(torch.float16)
        bad = ((q.abs() < _FP16_MIN_NORMAL) & (t != 0)) | torch.isinf(q)
        idx, val = _patch(t, bad)
        return Reduced(q.contiguous(), {"kind": "sqrt_fp16", "scale_exp": exp}, idx, val)
    raise ValueError(f"unknown precision transform {transform!r}")


def expand(
    stored: torch.Tensor,
    transform: dict[str, Any],
    dtype: torch.dtype,
    patch_index: torch.Tensor | None,
    patch_value: torch.Tensor | None,
) -> torch.Tensor:
    kind = transform.get("kind", "none")
    if kind == "none":
        out = stored
    elif kind == "bf16":
        out = stored.to(dtype)
    elif kind == "sqrt_fp16":
        s = torch.ldexp(stored.to(torch.float32), torch.tensor(-float(transform["scale_exp"])))
        out = (s * s).to(dtype)
    else:
        raise ValueError(f"unknown precision transform {kind!r}")
    if patch_index is not None and patch_value is not None and patch_index.numel():
        out = out.clone() if out.data_ptr() == stored.data_ptr() else out
        out.reshape(-1)[patch_index] = patch_value.to(dtype)
    return out

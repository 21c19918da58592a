"""Tensor <-> bytes, with no I/O.

Two layers:

* **Precision transforms** (``reduce`` / ``expand``) turn an optimizer moment into a smaller
  stored tensor plus an exact *patch*: the positions whose reduced value would be 0, subnormal or
  inf while the original is not, kept at full precision. That is how the guarantee "a reduced
  precision never turns a nonzero into 0 or inf" is kept: not by hoping the range fits, but by
  storing the values that do not fit exactly.

  - ``bf16``: bfloat16 has float32's exponent range, so only true float32 subnormals and values
    rounding past the bf16 maximum are patched.
  - ``sqrt_fp16`` (the ``fp16`` precision for ``exp_avg_sq``): a plain ``.half()`` zeroes most
    second moments (they live around 1e-12..1e-6, below fp16's 6e-8). We store ``sqrt(v)``, which
    halves the dynamic range in log terms and is the quantity Adam actually divides by, scaled by a
    power of two so the largest value sits near 2**15. Relative error of ``sqrt(v)`` stays within
    fp16's 2**-11 for every normal value; subnormal and zero-underflow values go to the patch.

* **Chunk codecs**: tensors of 2-, 4- and 8-byte elements are split into byte planes (the top
  byte, holding sign and exponent, then the next, then the low bytes) and each plane is
  zstd-compressed when that pays; tiny chunks and planes that do not shrink are stored raw, so
  decoding them costs nothing.
"""

from __future__ import annotations

import math
import mmap
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

__all__ = [
    "DTYPES",
    "Reduced",
    "blob_id",
    "byte_view",
    "decode_into",
    "encode_chunk",
    "encode_chunk_parts",
    "expand",
    "parts_id",
    "raw_hash",
    "reduce",
    "tensor_bytes",
]

ReadableBuffer = bytes | bytearray | memoryview | mmap.mmap

TINY = 4096  # below this, compression is not worth a zstd frame
_FP16_MIN_NORMAL = 2.0**-14
_SQRT_TARGET_EXP = 15  # largest scaled sqrt(v) lands in [2**14, 2**15): far below fp16's 65504

DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def blob_id(data: ReadableBuffer) -> str:
    """A blob's name: xxh3-128 of its encoded bytes, so verifying a blob is re-hashing it."""
    return xxhash.xxh3_128_hexdigest(data)


def raw_hash(data: ReadableBuffer) -> str:
    return xxhash.xxh3_128_hexdigest(data)


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


# ---------------------------------------------------------------- precision transforms


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
    if transform == "none" or not t.is_floating_point() or t.dtype in (torch.float16, torch.bfloat16):
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


# ---------------------------------------------------------------- chunk codecs

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe; one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    if level not in cache:
        if level <= 3:
            # Byte planes of floats are low-entropy bytes with few long repeats. zstd's default
            # match finder spends its time looking for matches that are not there: on the
            # exponent plane of fp32 weights, level 1 runs at 0.16 GB/s for a 0.360 ratio. A tiny
            # hash table and the longest minimum match leave it to the entropy coder: 0.70 GB/s,
            # 0.324 ratio, and decoding 1.4 vs 0.6 GB/s (16 MiB exponent plane of a 4096x4096 fp32
            # Linear, on the 2-core development machine: python benchmarks/codec_params.py).
            params = zstandard.ZstdCompressionParameters.from_level(level, min_match=7, hash_log=6)
            cache[level] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "d"):
        _local.d = zstandard.ZstdDecompressor()
    dctx: zstandard.ZstdDecompressor = _local.d
    return dctx


# Byte planes per element size: (right shift in bits, plane width in bytes), most significant
# first. The top bytes (sign, exponent, leading mantissa bits) compress well; the low bytes of a
# float mantissa are close to random and are usually stored raw. Planes are cut and joined with
# integer shifts, which numpy vectorises (a strided byte transpose runs ~3x slower to decode).
PLANES: dict[int, tuple[tuple[int, int], ...]] = {
    2: ((8, 1), (0, 1)),
    4: ((24, 1), (16, 1), (0, 2)),
    8: ((56, 1), (48, 1), (32, 2), (0, 4)),
}
_UINT: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_PROBE = 1 << 16  # compress a sample first: skip zstd on planes that will not shrink
_HEADER = struct.Struct("<BQ")
_WORTH = 0.95


def split_planes(raw: memoryview, itemsize: int) -> list[np.ndarray]:
    u = np.frombuffer(raw, dtype=_UINT[itemsize])
    return [
        (u >> shift).astype(_UINT[width]) if shift else u.astype(_UINT[width])
        for shift, width in PLANES[itemsize]
    ]


_BLOCK = 1 << 18  # elements per join block: output (<= 2 MiB) still in cache when it is hashed


def join_planes(
    planes: list[np.ndarray], itemsize: int, out: np.ndarray, start: int = 0, stop: int | None = None
) -> None:
    """Write elements ``start:stop`` of the planes back into ``out`` (the chunk's bytes).

    The lowest plane is widened into the whole element (which also zeroes the upper bytes), then
    each higher plane is stored into its byte column: plain strided copies, ~1.5x faster than
    rebuilding the integers with shifts and ors. Byte columns follow the host's little-endian
    layout, as do the tensor bytes the format stores.
    """
    stop = planes[0].size if stop is None else stop
    upper = PLANES[itemsize][:-1]  # the last plane is the lowest, at shift 0
    out.view(_UINT[itemsize])[start:stop] = planes[-1][start:stop]
    for plane, (shift, width) in zip(planes, upper, strict=False):
        columns = out.view(_UINT[width]).reshape(-1, itemsize // width)
        columns[start:stop, shift // (8 * width)] = plane[start:stop]


def _bytes_of(arr: Any) -> memoryview:
    return memoryview(arr).cast("B")


def _squeeze(data: memoryview, level: int) -> tuple[int, bytes | memoryview]:
    """(1, zstd frame) when it pays, else (0, the bytes as they are)."""
    # A plane that shrinks by less than 5% is kept raw: decompressing it would cost more restore
    # time (~1 GB/s) than the bytes saved are worth.
    cctx = _compressor(level)
    if len(data) > 4 * _PROBE and len(cctx.compress(data[:_PROBE])) > _WORTH * _PROBE:
        return 0, data
    comp = cctx.compress(data)
    return (1, comp) if len(comp) < _WORTH * len(data) else (0, data)


def encode_chunk(raw: memoryview, itemsize: int, level: int) -> tuple[str, bytes | memoryview]:
    """Returns (codec name, encoded bytes). Codecs: ``raw``; ``zstd``; ``planes``: a count byte,
    then per plane (flag: 0 raw / 1 zstd, u64 length), then the plane payloads."""
    name, parts = encode_chunk_parts(raw, itemsize, level)
    if len(parts) == 1:
        return name, parts[0]
    return name, b"".join(parts)


def encode_chunk_parts(raw: memoryview, itemsize: int, level: int) -> tuple[str, list[bytes | memoryview]]:
    """:func:`encode_chunk` as the list of pieces whose concatenation is the encoded blob, so a
    writer can hash and write them without joining them first.

    The planes of a ``planes`` chunk live in buffers of the calling thread that the next call on
    this thread overwrites: write (or copy) the pieces before encoding the next chunk. Reusing
    them matters: a fresh ~chunk-sized allocation per chunk is fresh pages for the kernel to hand
    out, which on a virtual machine costs more than the encoding itself."""
    n = len(raw)
    if n < TINY or level < 0:
        return "raw", [raw]
    if itemsize in PLANES and n % itemsize == 0:
        frames = [_squeeze(_bytes_of(p), level) for p in _split_planes_scratch(raw, itemsize)]
        if sum(len(f) for _, f in frames) >= n * 0.98:
            return "raw", [raw]
        head = bytes([len(frames)]) + b"".join(_HEADER.pack(flag, len(f)) for flag, f in frames)
        return "planes", [head, *(f for _, f in frames)]
    flag, data = _squeeze(raw, level)
    return ("zstd", [data]) if flag else ("raw", [raw])


def parts_id(parts: Sequence[bytes | bytearray | memoryview]) -> str:
    """:func:`blob_id` of the concatenation of ``parts``."""
    if len(parts) == 1:
        return blob_id(parts[0])
    hasher = xxhash.xxh3_128()
    for part in parts:
        hasher.update(part)
    return hasher.hexdigest()


_scratch = threading.local()


def _scratch_array(key: str, count: int, dtype: Any) -> np.ndarray:
    arr: np.ndarray | None = getattr(_scratch, key, None)
    if arr is None or arr.size < count:
        arr = np.empty(count, dtype=dtype)
        setattr(_scratch, key, arr)
    return arr[:count]


def _split_planes_scratch(raw: memoryview, itemsize: int) -> list[np.ndarray]:
    """:func:`split_planes` into this thread's reusable buffers (see :func:`encode_chunk_parts`)."""
    u = np.frombuffer(raw, dtype=_UINT[itemsize])
    planes = []
    for i, (shift, width) in enumerate(PLANES[itemsize]):
        plane = _scratch_array(f"plane{itemsize}.{i}", u.size, _UINT[width])
        if shift:
            shifted = _scratch_array(f"shift{itemsize}", u.size, _UINT[itemsize])
            np.right_shift(u, shift, out=shifted)
            np.copyto(plane, shifted, casting="unsafe")
        else:
            np.copyto(plane, u, casting="unsafe")
        planes.append(plane)
    return planes


def _planes_from(data: ReadableBuffer, itemsize: int, count: int) -> list[np.ndarray]:
    n = data[0]
    if n != len(PLANES.get(itemsize, ())):
        raise ValueError(f"chunk has {n} planes, expected {len(PLANES.get(itemsize, ()))}")
    pos = 1 + n * _HEADER.size
    planes = []
    for i, (_, width) in enumerate(PLANES[itemsize]):
        flag, length = _HEADER.unpack_from(data, 1 + i * _HEADER.size)
        payload = memoryview(data)[pos : pos + length]
        pos += length
        want = count * width
        body = _decompressor().decompress(payload, max_output_size=want) if flag else payload
        if len(body) != want:
            raise ValueError(f"plane {i} decodes to {len(body)} bytes, expected {want}")
        planes.append(np.frombuffer(body, dtype=_UINT[width]))
    if pos != len(data):
        raise ValueError("trailing bytes after the last plane")
    return planes


def decode_into(codec: str, data: ReadableBuffer, out: np.ndarray, itemsize: int) -> str:
    """Decode one chunk into ``out`` (a uint8 array of exactly the chunk's raw length) and return
    the raw hash of what was decoded. Planes are joined and hashed block by block, so each block
    is hashed while it is still in cache: one pass over memory instead of two."""
    raw_len = out.size
    if codec == "planes":
        if itemsize not in PLANES or raw_len % itemsize:
            raise ValueError(f"planes codec with item size {itemsize}")
        count = raw_len // itemsize
        planes = _planes_from(data, itemsize, count)
        hasher = xxhash.xxh3_128()
        for start in range(0, count, _BLOCK):
            stop = min(count, start + _BLOCK)
            join_planes(planes, itemsize, out, start, stop)
            hasher.update(out[start * itemsize : stop * itemsize].data)
        return hasher.hexdigest()
    view = memoryview(data)
    if codec == "raw":
        src: bytes | memoryview = view
    elif codec == "zstd":
        src = _decompressor().decompress(view, max_output_size=raw_len)
    else:
        raise ValueError(f"unknown chunk codec {codec!r}")
    if len(src) != raw_len:
        raise ValueError(f"chunk decodes to {len(src)} bytes, manifest says {raw_len}")
    out[:] = np.frombuffer(src, dtype=np.uint8)
    return raw_hash(out.data)

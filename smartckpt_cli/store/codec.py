"""Bytes <-> encoded chunks, and the hashes that name them. No I/O, no torch.

Chunk codecs: buffers of 2-, 4- and 8-byte elements are split into byte planes (the top byte,
holding sign and exponent, then the next, then the low bytes) and each plane is zstd-compressed
when that pays; tiny chunks and planes that do not shrink are stored raw, so decoding them costs
nothing. Everything here works on bytes and numpy arrays, so the control plane (``smartckpt
verify``, the remote tier's checks) decodes and re-hashes chunks without importing torch; turning
tensors into bytes and reduced precisions live in ``precision.py``.
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections.abc import Sequence
from typing import IO, Any, cast

import numpy as np
import xxhash
import zstandard

__all__ = [
    "ITEMSIZE",
    "blob_id",
    "decode_into",
    "encode_chunk",
    "encode_chunk_parts",
    "itemsize",
    "parts_id",
    "raw_hash",
]

ReadableBuffer = bytes | bytearray | memoryview | mmap.mmap

# Bytes per element of every dtype name a manifest can hold, without asking torch (the control
# plane does not import it). tests/test_dtypes.py checks it against the installed torch's table,
# so a dtype a later torch adds fails there until it is added here.
ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "bits8": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "bits16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8,
    "complex128": 16,
}  # fmt: skip


def itemsize(dtype_name: str) -> int:
    """Bytes per element of a manifest's dtype name; ValueError (one line) for an unknown one."""
    size = ITEMSIZE.get(dtype_name)
    if size is None:
        raise ValueError(f"unknown dtype {dtype_name!r} (written by a newer smartckpt or torch?)")
    return size


TINY = 4096  # below this, compression is not worth a zstd frame


def blob_id(data: ReadableBuffer) -> str:
    """A blob's name: xxh3-128 of its encoded bytes, so verifying a blob is re-hashing it."""
    return xxhash.xxh3_128_hexdigest(data)


def raw_hash(data: ReadableBuffer) -> str:
    return xxhash.xxh3_128_hexdigest(data)


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


def _squeeze(data: memoryview, level: int, slot: int = 0) -> tuple[int, bytes | memoryview]:
    """(1, zstd frame) when it pays, else (0, the bytes as they are). The frame lives in this
    thread's output buffer ``slot`` (:func:`_compress_scratch`): write it before the next call."""
    # A plane that shrinks by less than 5% is kept raw: decompressing it would cost more restore
    # time (~1 GB/s) than the bytes saved are worth.
    cctx = _compressor(level)
    if len(data) > 4 * _PROBE and len(cctx.compress(data[:_PROBE])) > _WORTH * _PROBE:
        return 0, data
    comp = _compress_scratch(cctx, data, slot)
    return (1, comp) if len(comp) < _WORTH * len(data) else (0, data)


class _Sink:
    """A growing output buffer of this thread that zstd streams a frame into."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.n = 0

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data).cast("B")
        end = self.n + len(view)
        if end > len(self.buf):  # a new buffer, not a resize: the last frame's views stay valid
            grown = bytearray(max(end, len(self.buf) * 3 // 2))
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : end] = view
        self.n = end
        return len(view)


def _compress_scratch(cctx: zstandard.ZstdCompressor, data: memoryview, slot: int) -> memoryview:
    """One zstd frame of ``data`` (its size in the header, as ``compress`` writes it) in buffer
    ``slot`` of this thread, overwritten by the next call with that slot: a fresh output object
    per chunk is a chunk-sized allocation freed right after, which the allocator keeps (about a
    fifth of a small state held beside the staging copy, measured)."""
    sinks: dict[int, _Sink] = _scratch.__dict__.setdefault("sinks", {})
    sink = sinks.get(slot)
    if sink is None:
        sink = sinks[slot] = _Sink()
    sink.n = 0
    with cctx.stream_writer(cast("IO[bytes]", sink), size=len(data), closefd=False) as w:
        w.write(data)
    return memoryview(sink.buf)[: sink.n]


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
        planes = _split_planes_scratch(raw, itemsize)
        frames = [_squeeze(_bytes_of(p), level, i) for i, p in enumerate(planes)]
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
